"""The torch backend: the :class:`~tmcore.runtime.dispatch.Ops` table for torch tensors.

Imported only when torch tensors reach tmcore (torch is then in ``sys.modules``).

- Read (n = 1, 2, 3): ``grid_sample`` and its ``grid_sampler`` backward
  (:mod:`~tmcore.backends.torch.sample`; deterministic on CUDA by default).
- Factorized conv (option ``depthwise``): grouped ``conv3d`` on CUDA, ``addcmul``
  over slices on the CPU (:mod:`~tmcore.backends.torch.conv`).
- Gates: ``torch.sigmoid`` over the three sigmoid quarters at once and ``addcmul``
  (:mod:`~tmcore.backends.torch.gates`).
- Fused CPU cell (:mod:`tmcore.backends.native`): on the CPU, for float32 /
  float64 tensors outside autograd and functorch transforms, the depthwise
  passes and the gates (forward and VJP) are C kernels compiled on first use;
  the pointwise product stays a torch ``baddbmm``. Anything else, or a machine
  without a C compiler, takes the torch ops above (same results).
  ``tmcore.options(native=False)`` (or ``TMCORE_NATIVE=0``) turns them off, and a
  forced ``depthwise`` kernel skips the fused conv. Every call checks the
  shapes the kernels index by (``ValueError``, never an out-of-bounds access),
  hands them plain contiguous memory (negative / conjugate views resolved,
  ZeroTensors materialized) and turns a failed scratch allocation into
  ``MemoryError``. Their per-step temporaries are reused while the scan's
  ``workspace`` is open (:mod:`~tmcore.backends.torch.memory`).
- Fused scans (``scan_fwd`` / ``scan_bwd``, ``local_scan_fwd`` / ``local_scan_bwd``):
  the fused CPU scans over the C kernels (:mod:`~tmcore.backends.torch.scan`,
  :mod:`~tmcore.backends.torch.local`), else the Triton ones
  (:mod:`tmcore.backends.triton`); each may decline with ``None``, and tmcore's
  per-step loop then runs.
- ``scatter_add``: ``index_add_``, deterministic on CUDA by default.
- float16 / bfloat16: computed in float32, returned in the input dtype
  (:mod:`tmcore.backends.mixed`).
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
