"""The torch conv: depthwise 3-tap passes and the pointwise mix, forward and VJP.

Each depthwise pass works on the free reshape ``(B, C, pre, S_a, post)``: one grouped
``conv3d`` on CUDA (TF32 off, to match the generic path), three fused ``addcmul`` over
slices on the CPU (oneDNN's grouped conv measured slower); option ``depthwise`` forces one.
The VJP is the same pass with flipped taps plus sliced products for the taps (no
``convolution_backward``, whose CUDA weight gradient may be nondeterministic). On the fused
CPU path all depthwise passes are one C kernel call each way, the pointwise product a
``baddbmm``, the temporaries the scan's workspace's.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tmcore.backends.fused import check_state, expect_shape
from tmcore.backends.native.calls import call, kernels_for, plain, ptr, shape_arg
from tmcore.types import ConvParams

from . import memory

__all__ = ["conv_fwd", "conv_bwd"]


class _NativeConvResiduals(NamedTuple):
    """Conv residuals of the fused path: the input and the depthwise output."""

    x: torch.Tensor
    y: torch.Tensor


def _check_conv(x: torch.Tensor, params: ConvParams) -> None:
    """Shapes the depthwise kernels rely on: ``x (B, C_in, *S)``, taps ``(n, C_in, 3)``,
    biases ``(n, C_in)``."""
    check_state("x", x)
    n, c_in = x.ndim - 2, x.shape[1]
    expect_shape("params.depthwise_weight", params.depthwise_weight, (n, c_in, 3),
                  "(n, C_in, 3)")
    expect_shape("params.depthwise_bias", params.depthwise_bias, (n, c_in), "(n, C_in)")


def _no_tf32(x: torch.Tensor):
    if x.is_cuda:
        return torch.backends.cudnn.flags(enabled=True, allow_tf32=False)
    return contextlib.nullcontext()


def _view5(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """Spatial ``shape`` seen as ``(prod before axis, S_axis, prod after axis)``."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def _grouped(x: torch.Tensor, kernel: str) -> bool:
    """Whether the passes over ``x`` use grouped ``conv3d`` (``kernel``: option ``depthwise``)."""
    return kernel == "grouped" or (kernel == "auto" and x.is_cuda)


def _depthwise(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
               axis: int, grouped: bool) -> torch.Tensor:
    """Depthwise 3-tap cross-correlation of ``x (B,C,*S)`` along spatial ``axis``:
    ``y[i] = t0 x[i-1] + t1 x[i] + t2 x[i+1] (+ bias)``, zero padded; ``grouped``:
    one grouped ``conv3d``, else three products over shifted slices."""
    batch, channels = x.shape[:2]
    x5 = x.reshape(batch, channels, *_view5(tuple(x.shape[2:]), axis))
    if grouped:
        with _no_tf32(x):
            y = F.conv3d(x5, taps.reshape(channels, 1, 1, 3, 1), bias, padding=(0, 1, 0),
                         groups=channels)
        return y.reshape(x.shape)
    w = taps.reshape(1, channels, 1, 1, 1, 3)
    if bias is None:
        y = x5 * w[..., 1]
    else:
        y = torch.addcmul(bias.reshape(1, channels, 1, 1, 1), x5, w[..., 1])
    # y is a fresh tensor: updating its slices in place is safe (and autograd-aware)
    y[:, :, :, 1:].addcmul_(x5[:, :, :, :-1], w[..., 0])
    y[:, :, :, :-1].addcmul_(x5[:, :, :, 1:], w[..., 2])
    return y.reshape(x.shape)


def _depthwise_stages(x: torch.Tensor, params: ConvParams,
                      kernel: str = "auto") -> list[torch.Tensor]:
    """``[x, after axis 0, ..., after the last axis]`` with the torch ops."""
    stages = [x]
    grouped = _grouped(x, kernel)
    for axis in range(x.ndim - 2):
        stages.append(_depthwise(stages[-1], params.depthwise_weight[axis],
                                 params.depthwise_bias[axis], axis, grouped))
    return stages


def _native_depthwise(kernels, x: torch.Tensor, params: ConvParams) -> torch.Tensor:
    """All depthwise passes of ``x (B, C_in, *S)`` in one fused kernel call."""
    _check_conv(x, params)
    x = plain(x)
    taps = plain(params.depthwise_weight)
    biases = plain(params.depthwise_bias)
    y = memory.scratch("depthwise", tuple(x.shape), x)
    spatial = tuple(x.shape[2:])
    call(kernels, "dw_fwd", ptr(x), ptr(y), ptr(taps), ptr(biases), x.shape[0],
         x.shape[1], len(spatial), shape_arg(spatial))
    return y


def _pointwise(y: torch.Tensor, params: ConvParams, scratch: bool = False) -> torch.Tensor:
    """``z = W y + b`` per batch; ``scratch``: into the workspace's buffer (fused path)."""
    batch = y.shape[0]
    y_flat = y.reshape(batch, y.shape[1], -1)
    c_out = params.pointwise_weight.shape[0]
    # One baddbmm over an expanded (stride-0) weight: no transposed copies of y or z,
    # which a broadcast 2-D @ 3-D matmul makes, and the bias add fused in.
    args = (params.pointwise_bias[None, :, None].expand(batch, c_out, y_flat.shape[2]),
            params.pointwise_weight.expand(batch, *params.pointwise_weight.shape), y_flat)
    if scratch:
        z = torch.baddbmm(*args, out=memory.scratch("z", (batch, c_out, y_flat.shape[2]), y))
    else:
        z = torch.baddbmm(*args)
    return z.reshape(batch, c_out, *y.shape[2:])


def _check_dtypes(x: torch.Tensor, params: ConvParams) -> None:
    for name, p in zip(ConvParams._fields, params, strict=True):
        if p.dtype != x.dtype:
            raise TypeError(f"params.{name}: expected the dtype of the conv input "
                            f"({x.dtype}; in a cell, of x and h promoted), got {p.dtype}")


def conv_fwd(xp: Any, x: torch.Tensor, params: ConvParams, kernel: str = "auto"):
    """Factorized conv forward. Residuals: the stage inputs ``[x, ...]``, or
    :class:`_NativeConvResiduals` on the fused path (``kernel="auto"``); a parameter of another
    dtype than ``x`` is a ``TypeError`` naming it (torch's products do not promote)."""
    _check_dtypes(x, params)
    kernels = kernels_for(x, *params) if kernel == "auto" else None
    if kernels is not None and x.ndim <= 6:
        y = _native_depthwise(kernels, x, params)
        return _pointwise(y, params, scratch=True), _NativeConvResiduals(x, y)
    stages = _depthwise_stages(x, params, kernel)
    return _pointwise(stages[-1], params), stages


def conv_bwd(xp: Any, stages, params: ConvParams, g: torch.Tensor, kernel: str = "auto"):
    """VJP: flipped-tap grouped conv for the input, sliced products for the taps (or
    the fused kernel, for residuals of the fused forward)."""
    if isinstance(stages, _NativeConvResiduals):
        kernels = kernels_for(stages.x, g, *params)
        if kernels is not None:
            return _native_conv_bwd(kernels, stages, params, g)
        stages = _depthwise_stages(stages.x, params, kernel)  # e.g. g now recorded by autograd
    n = len(stages) - 1
    y = stages[-1]
    batch, c_in = y.shape[:2]
    d_y, d_pointwise, d_pointwise_bias = _pointwise_bwd(y, params, g)
    d_taps, d_biases = [None] * n, [None] * n
    dims = (0, 2, 3, 4)
    grouped = _grouped(y, kernel)
    for axis in reversed(range(n)):
        view = (batch, c_in, *_view5(tuple(y.shape[2:]), axis))
        x5 = stages[axis].reshape(view)
        d5 = d_y.reshape(view)
        d_taps[axis] = torch.stack([
            (d5[:, :, :, 1:] * x5[:, :, :, :-1]).sum(dims),
            (d5 * x5).sum(dims),
            (d5[:, :, :, :-1] * x5[:, :, :, 1:]).sum(dims),
        ], dim=-1)
        d_biases[axis] = d5.sum(dims)
        d_y = _depthwise(d_y, params.depthwise_weight[axis].flip(-1), None, axis, grouped)
    return d_y, ConvParams(torch.stack(d_taps), torch.stack(d_biases), d_pointwise,
                           d_pointwise_bias)


def _pointwise_bwd(y: torch.Tensor, params: ConvParams, g: torch.Tensor, scratch: bool = False):
    """``(d_y, d_pointwise_weight, d_pointwise_bias)`` of :func:`_pointwise`;
    ``scratch``: ``d_y`` into the workspace's buffer (fused path)."""
    batch, c_in = y.shape[:2]
    y_flat = y.reshape(batch, c_in, -1)
    g_flat = g.reshape(batch, g.shape[1], -1)
    d_pointwise = torch.matmul(g_flat, y_flat.transpose(1, 2)).sum(0)
    d_pointwise_bias = g_flat.sum((0, 2))
    weight_t = params.pointwise_weight.T.expand(batch, c_in, g.shape[1])
    if scratch:
        d_y = torch.bmm(weight_t, g_flat, out=memory.scratch("d_y", tuple(y_flat.shape), y))
    else:
        d_y = torch.bmm(weight_t, g_flat)
    return d_y.reshape(y.shape), d_pointwise, d_pointwise_bias


def _native_conv_bwd(kernels, residuals: _NativeConvResiduals, params: ConvParams,
                     g: torch.Tensor):
    x, y = residuals
    _check_conv(x, params)
    expect_shape("y", y, tuple(x.shape), "(B, C_in, *S) like x")
    g = plain(g)
    if g.ndim != x.ndim or g.shape[0] != x.shape[0] or tuple(g.shape[2:]) != tuple(x.shape[2:]):
        raise ValueError(f"g: expected shape (B, C_out, *S) with B, *S of x {tuple(x.shape)}, "
                         f"got {tuple(g.shape)}")
    d_y, d_pointwise, d_pointwise_bias = _pointwise_bwd(y, params, g, scratch=True)
    d_y = plain(d_y)
    expect_shape("d_y", d_y, tuple(x.shape), "(B, C_in, *S) like x")
    x = plain(x)
    taps = plain(params.depthwise_weight)
    biases = plain(params.depthwise_bias)
    d_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    d_taps = torch.empty_like(taps, memory_format=torch.contiguous_format)
    d_biases = torch.empty_like(biases, memory_format=torch.contiguous_format)
    spatial = tuple(x.shape[2:])
    call(kernels, "dw_bwd", ptr(x), ptr(d_y), ptr(d_x), ptr(d_taps), ptr(d_biases),
         ptr(taps), ptr(biases), x.shape[0], x.shape[1], len(spatial), shape_arg(spatial))
    return d_x, ConvParams(d_taps, d_biases, d_pointwise, d_pointwise_bias)
