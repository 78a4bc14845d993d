"""The chunk recurrence: read, write, update, T times, with a lean backward.

- :mod:`~tmcore.scan.base` -- the ONE loop over a :class:`Step` (checkpoints and replay,
  or a per-step log), forward and backward;
- :mod:`~tmcore.scan.dense` -- the paper's step (:func:`memory_scan` and its VJP);
- :mod:`~tmcore.scan.local` -- ``update="local"`` (a window around each write);
- :mod:`~tmcore.scan.warped` -- ``dynamics="warp"`` (the state resampled before each
  update);
- :mod:`~tmcore.scan.options` -- the layer's options as a step (:func:`step_for`).
"""

from tmcore.scan.base import Step
from tmcore.scan.dense import (
    add_params,
    memory_scan,
    memory_scan_bwd,
    memory_scan_fwd,
    memory_scan_vjp,
    step_bwd,
    step_fwd,
    validate_scan_inputs,
)
from tmcore.scan.local import (
    local_memory_scan,
    local_memory_scan_vjp,
    local_scan_bwd,
    local_scan_fwd,
)
from tmcore.scan.options import (
    ScanOptions,
    dynamic_memory_scan,
    dynamic_memory_scan_vjp,
    scan_options,
    step_for,
)
from tmcore.types import Residuals, ScanGrads, StepInputs, WarpInputs, WarpParams

__all__ = [
    "Residuals", "ScanGrads", "ScanOptions", "Step", "StepInputs", "WarpInputs", "WarpParams",
    "add_params", "step_for",
    "dynamic_memory_scan", "dynamic_memory_scan_vjp", "local_memory_scan",
    "local_memory_scan_vjp", "local_scan_bwd", "local_scan_fwd", "memory_scan",
    "memory_scan_bwd", "memory_scan_fwd", "memory_scan_vjp", "scan_options", "step_bwd",
    "step_fwd", "validate_scan_inputs",
]
