"""The torch LSTM gates, forward and VJP.

``torch.sigmoid`` over the three sigmoid quarters at once (native, one pass; the
generic overflow-free ``0.5 tanh(x/2) + 0.5`` is three, and this CPU build's ``tanh``
is ~4x slower than its ``sigmoid``) and ``addcmul`` for the cell update; the VJP
shares one ``s (1 - s)`` pass for the three gates. On the fused CPU path
(:func:`tmcore.backends.native.calls.kernels_for`) both are C kernels, the VJP
recomputing the gates from ``z``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from tmcore.backends.fused import check_state, expect_shape
from tmcore.backends.native.calls import call, kernels_for, plain, ptr

from . import memory

__all__ = ["gates_fwd", "gates_bwd", "gates_residuals"]


class _NativeGateResiduals(NamedTuple):
    """Gate residuals of the fused path: the VJP recomputes the gates from ``z``."""

    z: torch.Tensor
    c: torch.Tensor


def _check_gates(z: torch.Tensor, c: torch.Tensor, *cotangents: torch.Tensor) -> None:
    """Shapes the gate kernels rely on: ``c (B, C, *S)``, ``z (B, 4C, *S)``, cotangents
    shaped like ``c``."""
    check_state("c", c)
    batch, channels, *spatial = c.shape
    expect_shape("z", z, (batch, 4 * channels, *spatial), "(B, 4C, *S)")
    for name, g in zip(("g_h", "g_c"), cotangents, strict=False):
        expect_shape(name, g, tuple(c.shape), "(B, C, *S) like c")


def gates_fwd(xp: Any, z: torch.Tensor, c: torch.Tensor):
    """LSTM gates: one ``sigmoid`` over the three sigmoid quarters. Residuals: ``(c, sigmoids
    (B,3C,*S), tanh(g), tanh(c'))``; on the fused path :class:`_NativeGateResiduals`."""
    kernels = kernels_for(z, c)
    if kernels is not None:
        _check_gates(z, c)
        z, c = plain(z), plain(c)
        h_new = torch.empty_like(c, memory_format=torch.contiguous_format)
        c_new = torch.empty_like(c, memory_format=torch.contiguous_format)
        batch, channels = c.shape[:2]
        call(kernels, "gates_fwd", ptr(z), ptr(c), ptr(h_new), ptr(c_new), batch,
             channels, math.prod(c.shape[2:]))
        return h_new, c_new, _NativeGateResiduals(z, c)
    return _torch_gates(z, c)


def _torch_gates(z: torch.Tensor, c: torch.Tensor):
    channels = c.shape[1]
    sig = torch.sigmoid(z[:, : 3 * channels])
    i, f, o = sig[:, :channels], sig[:, channels : 2 * channels], sig[:, 2 * channels :]
    g = torch.tanh(z[:, 3 * channels :])
    c_new = torch.addcmul(f * c, i, g)
    tanh_c_new = torch.tanh(c_new)
    return o * tanh_c_new, c_new, (c, sig, g, tanh_c_new)


def gates_residuals(xp: Any, z: torch.Tensor, c: torch.Tensor):
    """Residuals for :func:`gates_bwd`: ``(z, c)`` on the fused path (its VJP recomputes
    the gates, so nothing is computed here), else those of :func:`gates_fwd`."""
    if kernels_for(z, c) is not None:
        _check_gates(z, c)
        return _NativeGateResiduals(plain(z), plain(c))
    return _torch_gates(z, c)[2]


def gates_bwd(xp: Any, residuals: tuple, g_h: torch.Tensor, g_c: torch.Tensor):
    """VJP of :func:`gates_fwd`: the three sigmoid derivatives in one pass."""
    if isinstance(residuals, _NativeGateResiduals):
        z, c = residuals
        kernels = kernels_for(z, c, g_h, g_c)
        if kernels is not None:
            _check_gates(z, c, g_h, g_c)
            z, c, g_h, g_c = plain(z), plain(c), plain(g_h), plain(g_c)
            d_z = memory.scratch("d_z", tuple(z.shape), z)
            d_c = torch.empty_like(c, memory_format=torch.contiguous_format)
            batch, channels = c.shape[:2]
            call(kernels, "gates_bwd", ptr(z), ptr(c), ptr(g_h), ptr(g_c), ptr(d_z),
                 ptr(d_c), batch, channels, math.prod(c.shape[2:]))
            return d_z, d_c
        residuals = _torch_gates(z, c)[2]  # e.g. the cotangents now recorded by autograd
    c, sig, g, tanh_c_new = residuals
    channels = c.shape[1]
    i, f, o = sig[:, :channels], sig[:, channels : 2 * channels], sig[:, 2 * channels :]
    d_c_new = torch.addcmul(g_c, g_h * o, 1.0 - tanh_c_new.square())
    d_sig = sig - sig.square()  # s (1 - s)
    d_z = torch.cat([
        d_c_new * g * d_sig[:, :channels],
        d_c_new * c * d_sig[:, channels : 2 * channels],
        g_h * tanh_c_new * d_sig[:, 2 * channels :],
        d_c_new * i * (1.0 - g.square()),
    ], dim=1)
    return d_z, d_c_new * f
