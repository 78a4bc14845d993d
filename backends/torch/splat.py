"""One Gaussian write per row in a few torch ops: the decode step's write volume.

A decode step that completes a chunk writes one Gaussian per row. The generic splat
(:func:`tmcore.ops.splat.gaussian_profiles` and
:func:`tmcore.ops.common.outer_product`) makes each axis' profile by its own
``linspace``, slice, subtraction, square, division and ``exp`` (about 35 dispatched
ops for a 3-D grid). :func:`single_write` makes all axes' profiles at once, over the
concatenated cell centres of every axis (cached per grid, dtype and device), and
multiplies them out into a caller's buffer: about 15 ops. Every element goes through
the same arithmetic in the same order as the generic splat, so the volume is the
same bits (``eps > 0``; the degenerate ``eps <= 0`` case is left to the generic
splat: :func:`single_write` returns ``None`` there).
"""

from __future__ import annotations

import math

import torch

from tmcore.ops.addressing import axis_of_component

__all__ = ["single_write"]

#: (shape, dtype, device) -> (the centres of every axis, concatenated ``(sum S,)``; the
#: coordinate component each centre is compared with ``(sum S,)``)
_CENTRES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _centres(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    key = (shape, dtype, device)
    cached = _CENTRES.get(key)
    if cached is None:
        n = len(shape)
        # the generic splat's linspace per axis (the same values), side by side
        centres = torch.cat([torch.linspace(-1.0, 1.0, s, dtype=dtype, device=device)
                             for s in shape])
        components = torch.tensor([axis_of_component(a, n) for a in range(n)
                                   for _ in range(shape[a])], device=device)
        cached = _CENTRES[key] = (centres, components)
    return cached


def single_write(content: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor,
                 shape: tuple[int, ...], eps: float, radius: float | None,
                 out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The write volume of one Gaussian per row, flat: ``(B, C, prod(shape))``.

    Parameters
    ----------
    content : Tensor, shape ``(B, C)``
        What each row writes.
    mu : Tensor, shape ``(B, n)``
        The write centres in ``(-1, 1)`` (coordinate order).
    sigma : Tensor, shape ``(B,)``
        The spreads.
    shape : tuple of int
        The grid ``S`` (``n`` axes).
    eps, radius : float, float or None
        As in :func:`tmcore.ops.splat.gaussian_splat`.
    out : Tensor, shape ``(B, C, prod(shape))``, optional
        Where to write the volume (contiguous, of ``content``'s dtype).

    Returns
    -------
    Tensor or None
        The volume (``out`` when given): :func:`tmcore.ops.splat.splat_fwd` of the
        ``K = 1`` writes, flattened, the same bits; ``None`` where ``eps <= 0`` (the
        generic splat's degenerate-spread handling is not repeated here).
    """
    if eps <= 0.0:
        return None
    batch, channels = content.shape
    centres, components = _centres(tuple(shape), mu.dtype, mu.device)
    # offsets of every axis' centres from the matching centre component: (B, sum S)
    offset = centres - torch.index_select(mu, 1, components)
    square = offset * offset
    denom = (2.0 * sigma * sigma + eps)[:, None]                      # (B, 1)
    profile = torch.exp(-square / denom)                              # (B, sum S)
    if radius is not None:  # zero outside the box, NaN stays NaN (as the generic splat)
        inside = torch.abs(offset) <= radius * sigma[:, None]
        profile = torch.where(inside, profile, profile * 0.0)
    n = len(shape)
    dense = None
    for axis, piece in enumerate(torch.split(profile, list(shape), dim=1)):
        view = [1] * n
        view[axis] = shape[axis]
        piece = piece.view(batch, *view)
        dense = piece if dense is None else dense * piece              # (p_0 p_1) p_2 ...
    dense = dense.view(batch, 1, math.prod(shape))
    if out is None:
        return content[:, :, None] * dense
    return torch.mul(content[:, :, None], dense, out=out)
