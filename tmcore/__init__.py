"""tmcore: Tensor Memory's algebra, written once against the Python array API.

A fixed-size recurrent voxel state ``(h, c)`` of shape ``(B, C, *S)`` that tokens read by
n-linear sampling, write by Gaussian splatting and update with a factorized-conv ConvLSTM.
Every function takes arrays of any one array-API namespace (NumPy, PyTorch, JAX, CuPy, ...)
and returns that namespace's arrays; every forward has a hand-written VJP. ``import
tmcore`` imports no framework; every switch is one of :func:`tmcore.options`.
"""

from tmcore import (
    _installed,  # noqa: F401  (refuses a checkout that is not installed)
    backends,  # noqa: F401  (registers the built-in backends; imports no framework)
)
from tmcore.ops.addressing import (
    cell_centers,
    normalized_to_voxel,
    sigma_from_logit,
    sigma_from_logit_vjp,
    squash_coords,
    squash_coords_vjp,
    voxel_to_normalized,
)
from tmcore.ops.cell import convlstm_step, convlstm_step_vjp
from tmcore.ops.conv import (
    conv_params_from_pointwise,
    factorized_conv,
    factorized_conv_vjp,
    xavier_uniform_bound,
)
from tmcore.ops.sample import trilinear_sample, trilinear_sample_vjp
from tmcore.ops.splat import gaussian_splat, gaussian_splat_vjp
from tmcore.ops.warp import warp_state, warp_state_vjp
from tmcore.ops.window import local_update, local_update_vjp
from tmcore.runtime.options import Options, get_options, options
from tmcore.scan.dense import memory_scan, memory_scan_bwd, memory_scan_fwd, memory_scan_vjp
from tmcore.scan.local import local_memory_scan, local_memory_scan_vjp
from tmcore.types import ConvParams, ScanGrads, StepInputs

__version__ = "0.2.0"

__all__ = [
    "ConvParams",
    "Options",
    "ScanGrads",
    "StepInputs",
    "cell_centers",
    "conv_params_from_pointwise",
    "convlstm_step",
    "convlstm_step_vjp",
    "factorized_conv",
    "factorized_conv_vjp",
    "gaussian_splat",
    "gaussian_splat_vjp",
    "get_options",
    "memory_scan",
    "memory_scan_bwd",
    "memory_scan_fwd",
    "memory_scan_vjp",
    "normalized_to_voxel",
    "options",
    "sigma_from_logit",
    "sigma_from_logit_vjp",
    "squash_coords",
    "squash_coords_vjp",
    "trilinear_sample",
    "trilinear_sample_vjp",
    "voxel_to_normalized",
    "xavier_uniform_bound",
    "local_update", "local_update_vjp", "local_memory_scan", "local_memory_scan_vjp",
    "warp_state", "warp_state_vjp",
]
