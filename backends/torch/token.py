"""A decode token of the torch module in one C call (``token_fwd``, backends/native/token.inc).

Generation feeds one token per call. On a plain CPU call without autograd the whole token
(norm, joining its row's chunk, the read where a chunk starts, the heads and the scan step
where one completes, read-out, gated residual) is one kernel call instead of some twenty
torch ops, whatever slot of its chunk each row is at (a padded batch's rows differ);
:func:`decode_token` returns ``None`` where it does not apply and the layer's own path runs
(the reference it is tested against).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from tmcore.backends.fused import untraced
from tmcore.backends.native.calls import call
from tmcore.layer.config import LayerConfig
from tmcore.layer.state import StreamState
from tmcore.runtime.options import get_options

from .scan import _centres, _small, scan_kernels

__all__ = ["decode_token"]

_INPUTS = 24


@functools.lru_cache(maxsize=64)
def _sizes(batch: int, d: int, length: int, channels: int, shape: tuple[int, ...],
           residual: bool, layer_norm: bool, row_stride: int) -> ctypes.Array:
    values = (batch, d, length, channels, len(shape), int(residual), int(layer_norm),
              row_stride, *shape)
    return (ctypes.c_int64 * len(values))(*values)


@functools.lru_cache(maxsize=64)
def _scalars(values: tuple[float, ...]) -> ctypes.Array:
    return (ctypes.c_double * len(values))(*values)


def decode_token(x: torch.Tensor, state: StreamState, config: LayerConfig,
                 weights: Sequence[torch.Tensor | None], cell: Sequence[torch.Tensor], *,
                 min_sigma: float, softplus_threshold: float, norm_eps: float | None,
                 residual: bool) -> tuple[torch.Tensor, StreamState] | None:
    """One token ``x (B, 1, d)`` of every row, or ``None`` to decline.

    Parameters
    ----------
    x : Tensor, shape ``(B, 1, d)``
        The token (the residual's input; the memory reads its norm).
    state : StreamState
        ``h, c (B, C, *S)``, ``pending (B, L, d)``, ``count (B,)`` int32, ``read (B, C)``.
    config : LayerConfig
        The layer's (the paper's dense update: no option of :mod:`tmcore.scan.options`).
    weights : sequence of Tensor or None
        The norm's weight and bias (``(d,)`` each, or None), the weight and bias of
        ``coord_net``, ``content_net``, ``sigma_net``, ``write_proj``, ``out_proj``, then the
        gate ``(1,)`` (read where ``residual``).
    cell : sequence of Tensor
        The cell's ``depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias``.
    min_sigma, softplus_threshold : float
        The heads' constants (the layer's).
    norm_eps : float or None
        The LayerNorm's eps, or None for no norm.
    residual : bool
        ``x + sigmoid(gate) * read_out`` (a MemoryResidual), else the read-out alone.

    Returns
    -------
    (out, state) or None
        ``out (B, 1, d)`` and the new :class:`StreamState`, as the layer's decode step gives
        them (to rounding); None where the kernel does not apply (autograd on, not a plain
        CPU float32 / float64 call of one dtype, a large grid, a state of other shapes or
        counts out of range).
    """
    h, c, pending, count, read = state
    batch, _, d = x.shape
    length, channels, shape = config.chunk_size, config.memory_channels, config.memory_shape
    if torch.is_grad_enabled() or not batch or not isinstance(count, torch.Tensor) \
            or count.dtype != torch.int32 or tuple(count.shape) != (batch,) \
            or tuple(h.shape) != (batch, channels, *shape) or c.shape != h.shape \
            or d != config.embed_dim or tuple(pending.shape) != (batch, length, d) \
            or tuple(read.shape) != (batch, channels):
        return None
    if x.stride(2) != 1:  # (its rows may lie apart: a slice of a longer sequence)
        return None
    inputs = [x, pending, h, c, read, *weights, *cell]  # the kernel's order
    kernels = scan_kernels(get_options(), *[t for t in inputs if t is not None])
    if kernels is None or not _small(h) or torch.is_autocast_enabled("cpu") \
            or not untraced((count,)) or not count.is_cpu or not count.is_contiguous():
        return None
    pointers: list[int | None] = []
    for t in inputs:  # (plain CPU tensors of one dtype: scan_kernels checked them)
        if t is None:
            pointers.append(None)
        elif t is not x and not t.is_contiguous():
            return None
        else:
            pointers.append(t.data_ptr())
    slots = count.tolist()
    if min(slots) < 0 or max(slots) >= length:
        return None
    complete, dtype = length - 1 in slots, x.dtype
    y = torch.empty((batch, 1, d), dtype=dtype)
    pending_out = torch.empty((batch, length, d), dtype=dtype)
    read_out = torch.empty((batch, channels), dtype=dtype) if complete or 0 in slots else read
    h_out, c_out = (torch.empty_like(h), torch.empty_like(c)) if complete else (h, c)
    count_out = torch.empty_like(count)
    in_ptrs = (ctypes.c_void_p * _INPUTS)(*pointers, _centres(shape, dtype, x.device)[0]
                                          .data_ptr(), count.data_ptr())
    out_ptrs = (ctypes.c_void_p * 6)(y.data_ptr(), pending_out.data_ptr(), read_out.data_ptr(),
                                     h_out.data_ptr(), c_out.data_ptr(), count_out.data_ptr())
    scalars = _scalars((0.0 if norm_eps is None else float(norm_eps), config.eps,
                        -1.0 if config.radius is None else float(config.radius),
                        config.sigma_scale, min_sigma, softplus_threshold))
    call(kernels, "token_fwd", in_ptrs, out_ptrs,
         _sizes(batch, d, length, channels, shape, residual, norm_eps is not None,
                x.stride(0)), scalars)
    return y, StreamState(h_out, c_out, pending_out, count_out, read_out)
