"""Continuous addressing: normalized coordinates, voxel positions, cell centres, and the
coordinate and sigma squashes (conventions: docs/guides/conventions.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tmcore.ops.common import sigmoid, softplus, tanh_grad_from_output
from tmcore.runtime.validate import (
    check_dim,
    check_grid_shape,
    check_positive_scalar,
    namespace_of,
)
from tmcore.types import device_of

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
    """Give the normalized cell-centre positions, one 1-D array per spatial axis.

    Parameters
    ----------
    shape : sequence of int
        The spatial grid shape ``S``, 1 to 4 positive ints.
    xp : namespace
        The array namespace to create the arrays in.
    dtype, device : optional
        Their dtype and device (the namespace's defaults if None).

    Returns
    -------
    list of array
        ``linspace(-1, 1, S_a)`` of shape ``(S_a,)`` per axis, in spatial-axis order (not
        coordinate order); a size-1 axis has its centre at -1.

    Raises
    ------
    TypeError
        If ``shape`` is not a sequence of ints.
    ValueError
        If ``shape`` has no or more than 4 axes or a size < 1.
    """
    dims = check_grid_shape("shape", shape)
    return [xp.linspace(-1.0, 1.0, s, dtype=dtype, device=device) for s in dims]


def _scale_per_component(xp: Any, coords: Any, shape: tuple[int, ...]) -> Any:
    """``(S_{n-1-k} - 1) / 2`` for each component ``k``, shape ``(n,)``."""
    n = len(shape)
    half_extent = [(shape[axis_of_component(k, n)] - 1) / 2.0 for k in range(n)]
    return xp.asarray(half_extent, dtype=coords.dtype, device=device_of(coords))


def _points_namespace(name: str, points: Any, dims: tuple[int, ...]) -> Any:
    """The namespace of ``points (..., n)`` with ``n = len(dims)`` (named errors)."""
    xp = namespace_of(**{name: points})
    if points.ndim < 1:
        raise ValueError(f"{name}: expected shape (..., n) (at least 1 dim), got shape ()")
    check_dim(name, points, -1, len(dims), "(..., n)", "n = len(shape)")
    return xp


def normalized_to_voxel(coords: Any, shape: Sequence[int]) -> Any:
    """Map normalized coordinates to (unclamped) voxel positions, in coordinate order.

    Parameters
    ----------
    coords : array, shape ``(..., n)``
        Normalized coordinates.
    shape : sequence of int
        The spatial grid shape ``S`` of ``n`` axes.

    Returns
    -------
    array, shape ``(..., n)``
        ``u = (x + 1) / 2 * (S_a - 1)`` for the component ``x`` that addresses axis ``a``.

    Raises
    ------
    TypeError
        If ``coords`` is not an array or ``shape`` is not a sequence of ints.
    ValueError
        If ``shape`` is not 1 to 4 positive sizes or ``coords``'s last axis is not
        ``n = len(shape)``.

    Examples
    --------
    >>> import numpy as np
    >>> import tmcore
    >>> tmcore.normalized_to_voxel(np.array([-1.0, 0.0]), (5, 3))   # (x, y): axis 1, axis 0
    array([0., 2.])
    """
    dims = check_grid_shape("shape", shape)
    xp = _points_namespace("coords", coords, dims)
    return (coords + 1.0) * _scale_per_component(xp, coords, dims)


def voxel_to_normalized(voxel: Any, shape: Sequence[int]) -> Any:
    """Map voxel positions back to normalized coordinates (inverse of normalized_to_voxel).

    Parameters
    ----------
    voxel : array, shape ``(..., n)``
        Voxel positions, in coordinate order.
    shape : sequence of int
        The spatial grid shape ``S`` of ``n`` axes.

    Returns
    -------
    array, shape ``(..., n)``
        The normalized coordinates.

    Raises
    ------
    TypeError
        If ``voxel`` is not an array or ``shape`` is not a sequence of ints.
    ValueError
        If ``shape`` is not 1 to 4 sizes >= 2 (a size-1 axis has no scale to invert) or
        ``voxel``'s last axis is not ``n = len(shape)``.
    """
    dims = check_grid_shape("shape", shape)
    if min(dims) < 2:
        raise ValueError(f"shape: expected every size >= 2 (a size-1 axis has no voxel "
                         f"scale to invert), got {tuple(shape)!r}")
    xp = _points_namespace("voxel", voxel, dims)
    return voxel / _scale_per_component(xp, voxel, dims) - 1.0


def _same_shape(name: str, x: Any, ref_name: str, ref: Any) -> None:
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: expected the shape of {ref_name} {tuple(ref.shape)}, "
                         f"got {tuple(x.shape)}")


def squash_coords(logits: Any) -> Any:
    """Squash coordinate logits into ``(-1, 1)`` with ``tanh`` (the tied coordinate head).

    Parameters
    ----------
    logits : array, shape ``(...)``
        The coordinate head's outputs (``(B, T, n)`` in the layer).

    Returns
    -------
    array, shape ``(...)``
        ``tanh(logits)``.

    Raises
    ------
    TypeError
        If ``logits`` is not an array.
    """
    xp = namespace_of(logits=logits)
    return xp.tanh(logits)


def squash_coords_vjp(logits: Any, g: Any) -> Any:
    """Give the gradient of :func:`squash_coords`: ``g * (1 - tanh(logits)^2)``.

    Parameters
    ----------
    logits : array, shape ``(...)``
        As in :func:`squash_coords`.
    g : array, shape ``(...)``
        The cotangent of its output, shaped like ``logits``.

    Returns
    -------
    array, shape ``(...)``
        The gradient for ``logits``.

    Raises
    ------
    TypeError, ValueError
        If an argument is not an array, the two mix namespaces, or their shapes differ.
    """
    xp = namespace_of(logits=logits, g=g)
    _same_shape("g", g, "logits", logits)
    return g * tanh_grad_from_output(xp.tanh(logits))


def sigma_from_logit(logit: Any, sigma_scale: float = 1.0) -> Any:
    """Give the write spread ``(softplus(logit) + 1e-4) * sigma_scale``, always > 0.

    Parameters
    ----------
    logit : array, shape ``(...)``
        The sigma head's output (``(B, T)`` in the layer).
    sigma_scale : float, default 1.0
        A finite factor > 0.

    Returns
    -------
    array, shape ``(...)``
        The spreads, in normalized units.

    Raises
    ------
    TypeError
        If ``logit`` is not an array or ``sigma_scale`` is not a real number.
    ValueError
        If ``sigma_scale`` is not finite and > 0.
    """
    xp = namespace_of(logit=logit)
    check_positive_scalar("sigma_scale", sigma_scale)
    return (softplus(xp, logit) + MIN_SIGMA) * sigma_scale


def sigma_from_logit_vjp(logit: Any, g: Any, sigma_scale: float = 1.0) -> Any:
    """Give the gradient of :func:`sigma_from_logit`: ``g * sigmoid(logit) * sigma_scale``.

    Parameters
    ----------
    logit : array, shape ``(...)``
        As in :func:`sigma_from_logit`.
    g : array, shape ``(...)``
        The cotangent of the spreads, shaped like ``logit``.
    sigma_scale : float, default 1.0
        As in :func:`sigma_from_logit`.

    Returns
    -------
    array, shape ``(...)``
        The gradient for ``logit``.

    Raises
    ------
    TypeError, ValueError
        As :func:`sigma_from_logit`; also if ``g`` is not an array shaped like ``logit``.
    """
    xp = namespace_of(logit=logit, g=g)
    _same_shape("g", g, "logit", logit)
    check_positive_scalar("sigma_scale", sigma_scale)
    return g * sigmoid(xp, logit) * sigma_scale
