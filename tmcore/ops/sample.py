"""N-linear sampling of the memory grid (the read), and its VJP.

The semantics are ``grid_sample``'s with border padding (docs/guides/conventions.md); at an
interior cell centre the coordinate derivative is the right-sided one (the lower corner is
``floor(u)``). Non-finite coordinates: docs/guides/errors-and-cache.md ("Edge values").
"""

from __future__ import annotations

from typing import Any

from tmcore.ops.addressing import axis_of_component
from tmcore.ops.common import outer_product
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import (
    check_dim,
    check_nonempty,
    check_rank,
    namespace_of,
    require_array,
)
from tmcore.types import device_of

__all__ = ["trilinear_sample", "trilinear_sample_vjp", "tent_profiles",
           "validate_sample_inputs"]


def tent_profiles(xp: Any, coords: Any, shape: tuple[int, ...]) -> tuple[list[Any], list[Any]]:
    """Per-axis read weights and their slopes (d weight / d coordinate, 0 where clamped) for
    ``coords (B, Q, n)``: two lists of n ``(B, Q, S_a)`` arrays, in spatial-axis order."""
    n = len(shape)
    device = device_of(coords)
    weights, slopes = [], []
    for axis in range(n):
        size = shape[axis]
        x = coords[..., axis_of_component(axis, n)]
        half_extent = (size - 1) / 2.0
        # Clamp the coordinate, not only the voxel position: an infinite coordinate
        # then reads the border like any far one (on a size-1 axis inf * 0 would be
        # NaN), as grid_sample does. NaN stays NaN.
        u = (xp.clip(x, -1.0, 1.0) + 1.0) * half_extent
        clamped = xp.clip(u, 0.0, float(size - 1))
        lower = xp.floor(clamped)
        frac = (clamped - lower)[..., None]
        index = xp.arange(size, dtype=coords.dtype, device=device)
        is_lower = xp.astype(index == lower[..., None], coords.dtype)
        is_upper = xp.astype(index == (lower + 1.0)[..., None], coords.dtype)
        weights.append(is_lower * (1.0 - frac) + is_upper * frac)
        # u * 0: NaN for a NaN coordinate (so its gradient is NaN too), else 0
        inside = xp.astype((u > 0.0) & (u < float(size - 1)), coords.dtype) + u * 0.0
        slopes.append((is_upper - is_lower) * (inside * half_extent)[..., None])
    return weights, slopes


def _flatten_grid(xp: Any, volume: Any) -> Any:
    """``(B, C, *S) -> (B, C, P)``."""
    return xp.reshape(volume, (volume.shape[0], volume.shape[1], -1))


def sample_fwd(xp: Any, volume: Any, coords: Any) -> Any:
    """``(B, C, *S), (B, Q, n) -> (B, Q, C)`` without validation."""
    weights, _ = tent_profiles(xp, coords, tuple(volume.shape[2:]))
    dense = outer_product(xp, weights)  # (B, Q, P)
    return xp.matmul(dense, xp.matrix_transpose(_flatten_grid(xp, volume)))


def sample_bwd(xp: Any, volume: Any, coords: Any, g: Any) -> tuple[Any, Any]:
    """VJP of :func:`sample_fwd` for cotangent ``g (B, Q, C)``; no validation."""
    shape = tuple(volume.shape[2:])
    n = len(shape)
    weights, slopes = tent_profiles(xp, coords, shape)
    dense = outer_product(xp, weights)
    d_volume = xp.reshape(xp.matmul(xp.matrix_transpose(g), dense), volume.shape)
    # g . volume at every cell: (B, Q, C) @ (B, C, P) -> (B, Q, P)
    g_dot_volume = xp.matmul(g, _flatten_grid(xp, volume))
    components = [None] * n
    for axis in range(n):
        slope_weight = outer_product(xp, weights, replace={axis: slopes[axis]})
        components[axis_of_component(axis, n)] = xp.sum(g_dot_volume * slope_weight, axis=-1)
    return d_volume, xp.stack(components, axis=-1)


def validate_sample_inputs(volume: Any, coords: Any, g: Any = None) -> Any:
    """The checks of :func:`trilinear_sample` and its VJP (the torch op's too); the namespace."""
    xp = namespace_of(volume=volume, coords=coords, g=g)
    check_rank("volume", volume, (3, 4, 5, 6), "(B, C, *S) with 1 to 4 spatial axes")
    check_nonempty("volume", volume, "(B, C, *S)")
    n = volume.ndim - 2
    check_rank("coords", coords, 3, "(B, Q, n)")
    check_dim("coords", coords, 0, volume.shape[0], "(B, Q, n)", "B = volume.shape[0]")
    check_dim("coords", coords, 2, n, "(B, Q, n)", "n = number of spatial axes of volume")
    if g is not None:
        expected = (volume.shape[0], coords.shape[1], volume.shape[1])
        if tuple(g.shape) != expected:
            raise ValueError(f"g: expected shape (B, Q, C) = {expected}, got {tuple(g.shape)}")
    return xp




def trilinear_sample(volume: Any, coords: Any) -> Any:
    """Read ``volume`` at continuous coordinates by n-linear interpolation.

    Trilinear for ``n = 3`` (the paper's name), bilinear for 2, ...; equal in value and gradient
    to ``grid_sample(mode="bilinear", padding_mode="border", align_corners=True)``.

    Parameters
    ----------
    volume : array, shape ``(B, C, *S)``
        The grid, with 1 to 4 spatial axes, of a real floating dtype.
    coords : array, shape ``(B, Q, n)``
        ``Q`` positions per batch element, normalized to ``[-1, 1]``; ``coords[..., k]``
        addresses spatial axis ``n - 1 - k``. Values beyond ``[-1, 1]`` read the border.

    Returns
    -------
    array, shape ``(B, Q, C)``
        The interpolated values, in the inputs' namespace, device and dtype.

    Raises
    ------
    TypeError
        If an argument is not a real floating array, or the arrays mix namespaces.
    ValueError
        If ``volume`` does not have 1 to 4 spatial axes or has a zero-size axis, ``coords`` is
        not ``(B, Q, n)`` with ``volume``'s ``B`` and ``n``, the arrays lie on different
        devices, or (validate mode only) an array holds NaN or inf.

    Examples
    --------
    A 1-D grid of three cells read at its centre, halfway to the right, and past the border:

    >>> import numpy as np
    >>> import tmcore
    >>> volume = np.array([0.0, 1.0, 4.0]).reshape(1, 1, 3)       # (B, C, S)
    >>> coords = np.array([[[0.0], [0.5], [2.0]]])                # (B, Q, 1)
    >>> tmcore.trilinear_sample(volume, coords)[..., 0]
    array([[1. , 2.5, 4. ]])
    """
    xp = validate_sample_inputs(volume, coords)
    return ops_for(xp).sample_fwd(xp, volume, coords)


def trilinear_sample_vjp(volume: Any, coords: Any, g: Any) -> tuple[Any, Any]:
    """Give the gradients of :func:`trilinear_sample` for the cotangent ``g``.

    Parameters
    ----------
    volume, coords : array
        As in :func:`trilinear_sample`.
    g : array, shape ``(B, Q, C)``
        The cotangent of the read.

    Returns
    -------
    d_volume : array, shape ``(B, C, *S)``
        The gradient for ``volume``: a dense contraction (no scatter, deterministic).
    d_coords : array, shape ``(B, Q, n)``
        The gradient for ``coords``; zero for a component at or beyond the border.

    Raises
    ------
    TypeError, ValueError
        As :func:`trilinear_sample`; also if ``g`` is not an array of shape ``(B, Q, C)``.
    """
    require_array("g", g)
    xp = validate_sample_inputs(volume, coords, g)
    return ops_for(xp).sample_bwd(xp, volume, coords, g)
