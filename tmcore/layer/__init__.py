"""The Tensor Memory layer, defined once against the array API (no framework).

The PyTorch and JAX adapters instantiate :class:`Layer` and add only what their framework
needs (parameters as framework objects, the scan registered with its autodiff, modules):
:mod:`~tmcore.layer.config` (the hyperparameters), :mod:`~tmcore.layer.params` (the
parameter plan), :mod:`~tmcore.layer.state` (the state and the input checks),
:mod:`~tmcore.layer.plan` (the chunk grid as data), :mod:`~tmcore.layer.layer` (the call)
and :mod:`~tmcore.layer.stack` (the multi-layer modes).
"""

from tmcore.layer.config import DYNAMICS, UPDATES, LayerConfig, layer_config
from tmcore.layer.layer import Layer
from tmcore.layer.params import (
    FLOW_GROUP,
    GATE_SHAPE,
    GROUPS,
    WARP_GROUP,
    Params,
    ParamSpec,
    cell_params,
    check_param_bytes,
    check_params,
    init_params,
    param_groups,
    param_specs,
    sizes_from_params,
    stored_grid_error,
)
from tmcore.layer.stack import MODES, check_mode, final_state, segment_states, start_state
from tmcore.layer.state import State, StreamState, doc_starts_from_offsets, zero_state

__all__ = [
    "DYNAMICS", "FLOW_GROUP", "GATE_SHAPE", "GROUPS", "Layer", "LayerConfig", "MODES",
    "ParamSpec", "Params", "State", "StreamState", "UPDATES", "WARP_GROUP", "cell_params",
    "check_mode", "check_param_bytes", "check_params", "doc_starts_from_offsets",
    "final_state", "init_params", "layer_config", "param_groups", "param_specs",
    "segment_states", "sizes_from_params", "start_state", "stored_grid_error", "zero_state",
]
