"""The torch backend: the :class:`~tmcore.runtime.dispatch.Ops` table for torch tensors.

Imported only when torch tensors reach tmcore. The read is ``grid_sample`` (``sample``); the
conv and the gates are torch ops or, on the CPU, the fused C kernels (``conv``, ``gates``,
:mod:`tmcore.backends.native`); the fused scans run on those kernels (``scan``, ``local``),
else on Triton's (:mod:`tmcore.backends.triton`), or decline; float16 / bfloat16 compute in
float32 (:mod:`tmcore.backends.mixed`). What runs where: docs/guides/backends.md.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tmcore.backends.mixed import with_float32_compute
from tmcore.runtime.dispatch import Ops
from tmcore.runtime.options import Options, get_options

from . import local, scan
from .conv import conv_bwd, conv_fwd
from .gates import gates_bwd, gates_fwd, gates_residuals
from .memory import release_scan_buffers, workspace
from .sample import make_sample

__all__ = ["make_ops", "scatter_add", "release_scan_buffers"]


def scatter_add(xp: Any, out: torch.Tensor, index: torch.Tensor,
                values: torch.Tensor) -> torch.Tensor:
    """``out (N,)`` with ``values (M,)`` summed in at ``index (M,)``, in place (no
    autograd graph). ``index_add_`` on the CPU (sequential); on CUDA it adds atomically,
    so there the deterministic default takes ``index_put_(accumulate=True)`` (sorted)."""
    if out.is_cuda and (get_options().deterministic
                        or torch.are_deterministic_algorithms_enabled()):
        return out.index_put_((index,), values, accumulate=True)
    return out.index_add_(0, index, values)


def make_ops(generic: Ops, options: Options) -> Ops:
    """The torch table: fast read, conv and gates, generic splat, fused scans (C kernels,
    else Triton), float32 compute for halves; the depthwise kernel is
    ``options.depthwise`` (tables are cached per options)."""
    sample_fwd, sample_bwd = make_sample(generic)
    conv = functools.partial(conv_fwd, kernel=options.depthwise)
    conv_vjp = functools.partial(conv_bwd, kernel=options.depthwise)
    dense = {"generic": generic, "options": options}
    fast = Ops(sample_fwd, sample_bwd, generic.splat_fwd, generic.splat_bwd, conv, conv_vjp,
               gates_fwd, gates_bwd, gates_residuals, workspace,
               functools.partial(scan.scan_fwd, **dense),
               functools.partial(scan.scan_bwd, **dense), scatter_add,
               functools.partial(local.scan_fwd, options=options),
               functools.partial(local.scan_bwd, options=options))
    return with_float32_compute(fast)
