"""A decode token of the torch module in the Triton launches of :mod:`.token_kernels`, on CUDA
(and on the CPU under Triton's interpreter, for the tests).
"""

from __future__ import annotations

from typing import Any

import torch

from tmcore.layer.config import LayerConfig
from tmcore.layer.state import StreamState

from . import launch
from .dense import _Geometry

__all__ = ["decode_token"]


def decode_token(x: torch.Tensor, state: StreamState, slots: list[int], config: LayerConfig,
                 weights: Any) -> tuple[torch.Tensor, StreamState] | None:
    """:func:`tmcore.backends.torch.token.decode_token`'s token in Triton launches, on what it
    checked (``state`` dense, ``slots`` its counts, ``weights`` its
    :class:`~tmcore.backends.torch.token.TokenWeights` on ``x``'s device); None where the
    grid has 4 axes or a kernel failed (warned once; the layer's path then)."""
    length = config.chunk_size
    h = state.h
    if len(config.memory_shape) > 3 \
            or config.memory_channels > launch.MAX_CHANNELS \
            or 8 * max(h.numel(), state.pending.numel()) >= 2**31:
        return None
    key = ("token", tuple(h.shape), length, x.dtype, x.device, weights.layer_norm,
           weights.residual, config.radius is not None)
    return launch.guarded("decode token", key, 3, h,
                          lambda: _launch(x, state, length - 1 in slots, config, weights))


def _launch(x: torch.Tensor, state: StreamState, complete: bool, config: LayerConfig,
            weights: Any) -> tuple[torch.Tensor, StreamState]:
    h, c, pending, count, read = state
    batch, _, d = x.shape
    length, channels, n = config.chunk_size, config.memory_channels, len(config.memory_shape)
    (norm_w, norm_b, coord_w, coord_b, content_w, content_b, sigma_w, sigma_b, proj_w, proj_b,
     out_w, out_b, gate, *cell) = weights.tensors
    norm_eps, eps, radius, sigma_scale, min_sigma, threshold = weights.scalars
    geo = _Geometry(h)
    s0, s1, s2 = geo.s3
    block = 1 << (d - 1).bit_length()
    tile = min(block, 64)
    like = {"dtype": x.dtype, "device": x.device}
    y = torch.empty((batch, 1, d), **like)
    pending_out = torch.empty((batch, length, d), **like)
    read_out = torch.empty((batch, channels), **like)
    count_out = torch.empty_like(count)
    u = torch.empty((batch, d), **like)
    active = torch.empty((batch,), dtype=torch.int8, device=x.device)
    kernels = launch.kernels("token_kernels")
    kernels.token_kernel[(batch,)](
        x, x.stride(0), pending, h, read, count, x if norm_w is None else norm_w,
        x if norm_b is None else norm_b, coord_w, coord_b, out_w, out_b,
        x if gate is None else gate, y, pending_out, read_out, count_out, u, active, d, channels,
        length, norm_eps, LAYER_NORM=weights.layer_norm, NORM_W=norm_w is not None,
        NORM_B=norm_b is not None, RESIDUAL=gate is not None, N=n, S0=s0, S1=s1, S2=s2,
        CB=geo.cb, BD=block, BT=tile, **geo.launch_kw())
    if not complete:
        return y, StreamState(h, c, pending_out, count_out, read_out)
    summary = torch.empty((batch, d), **like)
    outputs = min(block, 32)  # (a 32 x 64 weight tile: no spill at float64 on sm_90)
    kernels.summary_kernel[(batch, -(-d // outputs))](
        pending, u, proj_w, proj_b, summary, d, length, BO=outputs, BI=tile,
        **geo.launch_kw())
    write_coords = torch.empty((batch, 1, n), **like)
    write_sigma = torch.empty((batch, 1), **like)
    write_content = torch.empty((batch, 1, channels), **like)
    kernels.heads_kernel[(batch,)](
        summary, coord_w, coord_b, content_w, content_b, sigma_w, sigma_b, write_coords,
        write_sigma, write_content, d, channels, min_sigma, sigma_scale, threshold, N=n,
        CB=geo.cb, BD=block, BT=tile, **geo.launch_kw())
    h_out, c_out = torch.empty_like(h), torch.empty_like(c)
    launch.kernels("dense_kernels").step_fwd_kernel[geo.grid](
        h, c, h_out, c_out, write_content, write_coords, write_coords, write_sigma,
        write_content, *cell, active, 0, 1, channels, eps, max(radius, 0.0), WRITE_READ=False,
        PRECISION=launch.precision(h), HAS_ACTIVE=True, **geo.constexprs(radius >= 0),
        **geo.launch_kw(geo.fwd_warps))
    return y, StreamState(h_out, c_out, pending_out, count_out, read_out)
