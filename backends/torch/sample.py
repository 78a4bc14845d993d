"""The torch read: ``grid_sample`` forward, ``grid_sampler`` backward (n = 1, 2, 3); one query
per row on the CPU (a decode step's read) by the fused scan's C read kernel (n = 1..4).

``F.grid_sample(mode="bilinear", padding_mode="border", align_corners=True)`` (n = 1 as a
height-1 2-D sample); its VJP calls ``aten.grid_sampler_{2,3}d_backward`` directly. On CUDA
its volume gradient adds atomically, so by default the volume gradient there is the generic
dense contraction (``deterministic``). n = 4 and mixed dtypes take the generic path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tmcore.backends.fused import PLAIN, is_wrapped
from tmcore.backends.native.calls import Kernels, call, kernels_for, plain, ptr, shape_arg
from tmcore.ops.common import outer_product
from tmcore.ops.sample import tent_profiles
from tmcore.runtime.dispatch import Ops
from tmcore.runtime.options import get_options

__all__ = ["make_sample"]

_BILINEAR, _BORDER = 0, 1


def _grid_args(volume: torch.Tensor, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``volume (B,C,*S)``, ``coords (B,Q,n)`` -> grid_sample's input and grid (n <= 3)."""
    batch, queries, n = coords.shape
    if n == 1:
        zeros = torch.zeros_like(coords)
        return volume[:, :, None, :], torch.cat([coords, zeros], dim=-1)[:, None, :, :]
    if n == 2:
        return volume, coords[:, None, :, :]
    return volume, coords[:, None, None, :, :]


def _atomic_ok(volume: torch.Tensor) -> bool:
    """Whether ``grid_sampler``'s volume gradient may be used (deterministic or allowed)."""
    return not volume.is_cuda or (
        not get_options().deterministic
        and not torch.are_deterministic_algorithms_enabled()
    )


def _kernel_coords(coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coords fit for grid_sampler, NaN mask (B, Q, 1))``: NaN as 0 and every coordinate
    clamped to ``[-1, 1]`` (the backward reads out of bounds on NaN, and on inf along a size-1
    axis; the clamp changes no value or gradient), the NaN queries made NaN afterwards."""
    nan = torch.isnan(coords)
    # (one NaN test for both, and a fill without a scalar tensor: fewer ops per read)
    return coords.masked_fill(nan, 0.0).clamp(-1.0, 1.0), nan.any(dim=-1, keepdim=True)


def _may_hold_true(mask: torch.Tensor) -> bool:
    """``mask.any()`` where asking is free (a plain CPU tensor), else ``True``: on CUDA
    it would synchronize, and transformed or fake tensors cannot answer."""
    if mask.device.type != "cpu" or type(mask) not in PLAIN or is_wrapped(mask):
        return True
    try:
        return bool(mask.any())
    except RuntimeError:  # e.g. data-dependent control flow under a transform
        return True


def _native_read(kernels: Kernels, volume: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """One read per row, ``coords (B, 1, n)``, by the fused CPU scan's own read kernel: ``(B,
    1, C)`` (NaN where a coordinate is NaN, as on every path); one call, where ``grid_sample``
    needs eight ops."""
    volume, coords = plain(volume), plain(coords)
    batch, channels, *spatial = volume.shape
    out = torch.empty((batch, 1, channels), dtype=volume.dtype)
    call(kernels, "read_fwd", ptr(volume), ptr(coords), len(spatial), ptr(out), channels,
         batch, channels, len(spatial), shape_arg(spatial))
    return out


def make_sample(generic: Ops) -> tuple[Any, Any]:
    """``(sample_fwd, sample_bwd)`` over ``grid_sample``; ``generic``'s where it does not
    apply (n = 4, mixed dtypes); one query per row on the CPU: :func:`_native_read`."""

    def sample_fwd(xp, volume, coords):
        if coords.ndim == 3 and coords.shape[1] == 1 and 1 <= coords.shape[2] <= 4 \
                and volume.ndim == coords.shape[2] + 2:  # (the kernel's ranks)
            kernels = kernels_for(volume, coords)
            if kernels is not None:
                return _native_read(kernels, volume, coords)
        if volume.ndim > 5 or volume.dtype != coords.dtype:
            return generic.sample_fwd(xp, volume, coords)
        batch, channels = volume.shape[:2]
        safe, is_nan = _kernel_coords(coords)
        inp, grid = _grid_args(volume, safe)
        out = F.grid_sample(inp, grid, mode="bilinear", padding_mode="border",
                            align_corners=True)
        out = out.reshape(batch, channels, coords.shape[1]).transpose(1, 2)
        # A NaN coordinate reads NaN (as on the generic path): a bad coordinate is not
        # silently read as data.
        return out.masked_fill(is_nan, torch.nan).contiguous()

    def sample_bwd(xp, volume, coords, g):
        if volume.ndim > 5 or not volume.dtype == coords.dtype == g.dtype:
            return generic.sample_bwd(xp, volume, coords, g)
        batch, queries, n = coords.shape
        safe, is_nan = _kernel_coords(coords)
        inp, grid = _grid_args(volume, safe)
        grad_out = g.transpose(1, 2).reshape(batch, g.shape[2], *grid.shape[1:-1])
        atomic_ok = _atomic_ok(volume)
        backward = (torch.ops.aten.grid_sampler_3d_backward if n == 3
                    else torch.ops.aten.grid_sampler_2d_backward)
        d_inp, d_grid = backward(grad_out, inp, grid, _BILINEAR, _BORDER, True, [atomic_ok, True])
        if atomic_ok:
            d_volume = d_inp.reshape(volume.shape)
        else:
            weights, _ = tent_profiles(xp, safe, tuple(volume.shape[2:]))
            dense = outer_product(xp, weights)  # (B, Q, P)
            d_volume = torch.matmul(g.transpose(1, 2), dense).reshape(volume.shape)
        d_coords = d_grid.reshape(batch, queries, -1)[..., :n]
        if _may_hold_true(is_nan):
            # NaN as on the generic path: the NaN query's coordinate gradient, and the
            # volume gradient of its batch element (every cell's weight for it is NaN).
            d_coords = torch.where(is_nan, torch.nan, d_coords)
            batch_nan = is_nan.reshape(batch, -1).any(dim=1)
            d_volume = torch.where(batch_nan.reshape(batch, *[1] * (volume.ndim - 1)),
                                   torch.nan, d_volume)
        return d_volume, d_coords.contiguous()

    return sample_fwd, sample_bwd
