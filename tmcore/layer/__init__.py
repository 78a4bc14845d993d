"""The Tensor Memory layer, defined once against the array API (no framework).

The PyTorch and JAX adapters instantiate what is here and add only what their framework
needs (parameters as framework objects, the scan registered with autograd /
``custom_vjp``, modules). A variant of the layer subclasses :class:`Layer` and overrides
:meth:`Layer.heads` or :meth:`Layer.read_out` instead of copying it.

One module per concept:

- :mod:`~tmcore.layer.config` -- :class:`LayerConfig`, :func:`layer_config`;
- :mod:`~tmcore.layer.params` -- the parameter plan (:func:`param_specs`,
  :func:`init_params`), pytree checks and the stored-grid check;
- :mod:`~tmcore.layer.heads` -- the heads, the read-out, chunking;
- :mod:`~tmcore.layer.state` -- the zero state, checks, reset, masks;
- :mod:`~tmcore.layer.stream` -- :class:`StreamState`, streaming and packed documents;
- :mod:`~tmcore.layer.stack` -- the multi-layer modes;
- :mod:`~tmcore.layer.sizes` -- the size gates made before allocating;
- :mod:`~tmcore.layer.layer` -- :class:`Layer`, the layer call.
"""

from tmcore.layer.config import DYNAMICS, UPDATES, LayerConfig, layer_config
from tmcore.layer.heads import Linear, chunk, heads, linear, num_chunks, read_out, split, unchunk
from tmcore.layer.layer import Layer, Scan
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
from tmcore.layer.state import State, check_state, check_tokens, reset_state, zero_state
from tmcore.layer.stream import (
    StreamState,
    check_doc_starts,
    doc_starts_from_offsets,
    stream_state,
)

__all__ = [
    "DYNAMICS", "FLOW_GROUP", "GATE_SHAPE", "GROUPS", "Layer", "LayerConfig", "Linear",
    "MODES", "ParamSpec", "Params", "Scan", "State", "StreamState", "UPDATES", "WARP_GROUP",
    "cell_params", "check_doc_starts", "check_mode", "check_param_bytes", "check_params",
    "check_state", "check_tokens", "chunk", "doc_starts_from_offsets", "final_state",
    "heads", "init_params", "layer_config", "linear", "num_chunks",
    "param_groups", "param_specs", "read_out", "reset_state", "segment_states",
    "sizes_from_params", "split", "start_state", "stored_grid_error", "stream_state",
    "unchunk", "zero_state",
]
