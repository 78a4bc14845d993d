"""Continuous addressing: normalized coordinates, voxel positions, cell centres.

Conventions (README, docs/LAYER.md): coordinates live in ``[-1, 1]``; ``coords[..., k]``
addresses spatial axis ``n - 1 - k`` (grid_sample order: x = last axis);
cell centres are ``linspace(-1, 1, S_a)`` (align_corners=True), so the voxel
position along axis ``a`` is ``u_a = (x + 1) / 2 * (S_a - 1)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import array_api_compat

from tmcore._math import sigmoid, softplus, tanh_grad_from_output
from tmcore._validate import (
    check_dim,
    check_grid_shape,
    check_positive_scalar,
    namespace_of,
)

__all__ = [
    "axis_of_component",
    "cell_centers",
    "normalized_to_voxel",
    "voxel_to_normalized",
    "squash_coords",
    "squash_coords_vjp",
    "sigma_from_logit",
    "sigma_from_logit_vjp",
    "MIN_SIGMA",
]

#: Floor added to the softplus of the sigma logit (docs/LAYER.md: ``softplus(.) + 1e-4``).
MIN_SIGMA = 1e-4


def axis_of_component(k: int, ndim: int) -> int:
    """Spatial axis addressed by coordinate component ``k`` (``n - 1 - k``)."""
    return ndim - 1 - k


def cell_centers(
    shape: Sequence[int], *, xp: Any, dtype: Any = None, device: Any = None
) -> list[Any]:
    """Normalized cell-centre positions, one 1-D array ``(S_a,)`` per spatial axis.

    Returned in spatial-axis order (first axis first), not coordinate order.
    A size-1 axis has its single centre at -1 (``linspace(-1, 1, 1)``).
    """
    dims = check_grid_shape("shape", shape)
    return [xp.linspace(-1.0, 1.0, s, dtype=dtype, device=device) for s in dims]


def _scale_per_component(xp: Any, coords: Any, shape: tuple[int, ...]) -> Any:
    """``(S_{n-1-k} - 1) / 2`` for each component ``k``, shape ``(n,)``."""
    n = len(shape)
    half_extent = [(shape[axis_of_component(k, n)] - 1) / 2.0 for k in range(n)]
    return xp.asarray(half_extent, dtype=coords.dtype, device=array_api_compat.device(coords))


def normalized_to_voxel(coords: Any, shape: Sequence[int]) -> Any:
    """Map normalized coordinates ``(..., n)`` to voxel positions ``(..., n)``.

    Component ``k`` of the result is the (unclamped) position along spatial
    axis ``n - 1 - k``, i.e. the output keeps the coordinate order.
    """
    dims = check_grid_shape("shape", shape)
    xp = namespace_of(coords=coords)
    if coords.ndim < 1:
        raise ValueError("coords: expected shape (..., n) (at least 1 dim), got shape ()")
    check_dim("coords", coords, -1, len(dims), "(..., n)", "n = len(shape)")
    return (coords + 1.0) * _scale_per_component(xp, coords, dims)


def voxel_to_normalized(voxel: Any, shape: Sequence[int]) -> Any:
    """Inverse of :func:`normalized_to_voxel` (every axis needs ``S_a > 1``)."""
    dims = check_grid_shape("shape", shape)
    if min(dims) < 2:
        raise ValueError(f"shape: expected every size >= 2 (a size-1 axis has no voxel "
                         f"scale to invert), got {tuple(shape)!r}")
    xp = namespace_of(voxel=voxel)
    if voxel.ndim < 1:
        raise ValueError("voxel: expected shape (..., n) (at least 1 dim), got shape ()")
    check_dim("voxel", voxel, -1, len(dims), "(..., n)", "n = len(shape)")
    return voxel / _scale_per_component(xp, voxel, dims) - 1.0


def _same_shape(name: str, x: Any, ref_name: str, ref: Any) -> None:
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: expected the shape of {ref_name} {tuple(ref.shape)}, "
                         f"got {tuple(x.shape)}")


def squash_coords(logits: Any) -> Any:
    """The tied coordinate head's squashing: ``tanh`` into ``(-1, 1)``."""
    xp = namespace_of(logits=logits)
    return xp.tanh(logits)


def squash_coords_vjp(logits: Any, g: Any) -> Any:
    """VJP of :func:`squash_coords`: ``g * (1 - tanh(logits)^2)``."""
    xp = namespace_of(logits=logits, g=g)
    _same_shape("g", g, "logits", logits)
    return g * tanh_grad_from_output(xp.tanh(logits))


def sigma_from_logit(logit: Any, sigma_scale: float = 1.0) -> Any:
    """Write spread ``(softplus(logit) + 1e-4) * sigma_scale`` (always > 0)."""
    xp = namespace_of(logit=logit)
    check_positive_scalar("sigma_scale", sigma_scale)
    return (softplus(xp, logit) + MIN_SIGMA) * sigma_scale


def sigma_from_logit_vjp(logit: Any, g: Any, sigma_scale: float = 1.0) -> Any:
    """VJP of :func:`sigma_from_logit`: ``g * sigmoid(logit) * sigma_scale``."""
    xp = namespace_of(logit=logit, g=g)
    _same_shape("g", g, "logit", logit)
    check_positive_scalar("sigma_scale", sigma_scale)
    return g * sigmoid(xp, logit) * sigma_scale
