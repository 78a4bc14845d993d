"""The chunk recurrence: ONE loop (:mod:`~tmcore.scan.base`) over a :class:`Step`, the dense,
local or warped chunk step (:mod:`~tmcore.scan.options` picks one), with a lean backward.
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
