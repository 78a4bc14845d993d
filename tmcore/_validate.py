"""Namespace inference and argument validation shared by every public function.

Errors name the argument, what was given and what was expected, so a user who
passes a wrong shape learns which one without reading tmcore's source.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import array_api_compat

__all__ = [
    "namespace_of",
    "check_rank",
    "check_dim",
    "check_floating",
    "check_grid_shape",
]

MAX_SPATIAL_RANK = 4


def namespace_of(**arrays: Any) -> Any:
    """Return the single array-API namespace shared by ``arrays`` (name -> array).

    ``None`` values are skipped. Raises ``TypeError`` naming the first argument
    that is not an array, that belongs to a different namespace than the first
    one, or that does not have a real floating dtype.
    """
    found = None
    first_name = None
    for name, value in arrays.items():
        if value is None:
            continue
        if not array_api_compat.is_array_api_obj(value):
            raise TypeError(f"{name}: expected an array, got {type(value).__name__}")
        ns = array_api_compat.array_namespace(value)
        if found is None:
            found, first_name = ns, name
        elif ns is not found:
            raise TypeError(
                f"{name}: all arrays must come from one namespace; {first_name} is "
                f"{found.__name__}, {name} is {ns.__name__}"
            )
        check_floating(ns, name, value)
    if found is None:
        raise TypeError("no array arguments were given")
    return found


def check_floating(xp: Any, name: str, x: Any) -> None:
    """Raise ``TypeError`` unless ``x`` has a real floating dtype."""
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name}: expected a real floating dtype, got {x.dtype}")


def check_rank(name: str, x: Any, rank: int | Sequence[int], layout: str) -> None:
    """Raise ``ValueError`` unless ``x.ndim`` is ``rank`` (or one of them)."""
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if x.ndim not in ranks:
        raise ValueError(
            f"{name}: expected shape {layout} ({' or '.join(map(str, ranks))} dims), "
            f"got shape {tuple(x.shape)}"
        )


def check_dim(name: str, x: Any, axis: int, expected: int, layout: str, what: str) -> None:
    """Raise ``ValueError`` unless ``x.shape[axis] == expected``."""
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name}: expected shape {layout} with {what} = {expected}, got shape {tuple(x.shape)}"
        )


def check_grid_shape(name: str, shape: Any) -> tuple[int, ...]:
    """Validate a spatial grid shape: 1..4 positive integers. Returns it as a tuple."""
    try:
        dims = tuple(int(s) for s in shape)
    except TypeError:
        message = f"{name}: expected a tuple of 1 to 4 positive ints, got {shape!r}"
        raise TypeError(message) from None
    if not 1 <= len(dims) <= MAX_SPATIAL_RANK or any(s < 1 for s in dims):
        raise ValueError(f"{name}: expected a tuple of 1 to 4 positive ints, got {shape!r}")
    if any(int(s) != s for s in shape):
        raise TypeError(f"{name}: expected integer sizes, got {shape!r}")
    return dims
