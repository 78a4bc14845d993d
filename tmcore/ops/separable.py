"""Separable weights: a dense weight over the grid as a product of 1-D profiles.

Both the trilinear read (a tent per axis) and the Gaussian write (a Gaussian
per axis) factor this way, so reads, writes and their gradients become dense
contractions: deterministic, no scatter, no atomics, good on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["outer_product", "grid_size"]


def grid_size(shape: Sequence[int]) -> int:
    """Number of cells ``prod(shape)``."""
    size = 1
    for s in shape:
        size *= int(s)
    return size


def outer_product(xp: Any, profiles: Sequence[Any], replace: dict[int, Any] | None = None) -> Any:
    """Flattened outer product of per-axis profiles.

    Parameters
    ----------
    profiles : sequence of n arrays ``(B, Q, S_a)``, in spatial-axis order.
    replace : optional ``{axis: array (B, Q, S_axis)}`` used instead of
        ``profiles[axis]`` (e.g. a derivative profile).

    Returns
    -------
    ``(B, Q, prod(S))`` with the last spatial axis varying fastest (C order).
    """
    replace = replace or {}
    n = len(profiles)
    batch, queries = profiles[0].shape[:2]
    sizes = [p.shape[-1] for p in profiles]
    out = None
    for axis in range(n):
        factor = replace.get(axis, profiles[axis])
        view = [1] * n
        view[axis] = sizes[axis]
        factor = xp.reshape(factor, (batch, queries, *view))
        out = factor if out is None else out * factor
    return xp.reshape(out, (batch, queries, grid_size(sizes)))
