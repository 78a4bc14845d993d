"""The chunk recurrence: read, write, update, T times, with a lean backward.

- :mod:`~tmcore.scan.dense` -- the paper's step (:func:`memory_scan` and its VJP);
- :mod:`~tmcore.scan.local` -- ``update="local"`` (a window around each write);
- :mod:`~tmcore.scan.warped` -- ``dynamics="warp"`` (the state resampled before each
  update) and the dispatch of the layer's options to the right scan.
"""

from tmcore.scan.dense import (
    ScanGrads,
    StepInputs,
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
from tmcore.scan.warped import (
    ScanOptions,
    WarpInputs,
    dynamic_memory_scan,
    dynamic_memory_scan_vjp,
    scan_options,
)

__all__ = [
    "ScanGrads", "ScanOptions", "StepInputs", "WarpInputs", "add_params",
    "dynamic_memory_scan", "dynamic_memory_scan_vjp", "local_memory_scan",
    "local_memory_scan_vjp", "local_scan_bwd", "local_scan_fwd", "memory_scan",
    "memory_scan_bwd", "memory_scan_fwd", "memory_scan_vjp", "scan_options", "step_bwd",
    "step_fwd", "validate_scan_inputs",
]
