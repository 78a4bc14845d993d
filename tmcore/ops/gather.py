"""Boxes of a grid by index arithmetic: gather with ``take``, write back without a dense pass.

A *box* is, per batch element ``b``, the cells ``start[b, a] <= i_a < start[b, a] + size[a]``
of a ``(B, K, *S)`` array (``start`` in spatial-axis order, every box inside the grid).
:func:`gather_box` reads it with one ``take`` over the flattened array (array API, every
namespace); :func:`set_box` writes a box back and touches only its cells:

- NumPy, PyTorch, CuPy: integer-array assignment into the given array (in place; the
  caller passes an array it owns);
- JAX: ``x.at[index].set(values)`` (functional; in place under ``jit`` when the input is
  donated);
- any other namespace: one basic-slice assignment per batch element (the box start is
  read back to the host, ``B * n`` integers; in place).

Both cost ``O(B K prod(size))``, independent of the grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import array_api_compat

from tmcore.ops.separable import grid_size

__all__ = ["index_dtype", "box_index", "gather_box", "set_box", "to_index"]


def index_dtype(xp: Any, device: Any = None) -> Any:
    """The namespace's default indexing dtype (``int64`` where it cannot say)."""
    try:
        return xp.__array_namespace_info__().default_dtypes(device=device)["indexing"]
    except (AttributeError, TypeError, KeyError):
        return xp.int64


def to_index(xp: Any, values: Any, dtype: Any) -> Any:
    """Integer-valued floats ``values`` as ``dtype``; NaN becomes 0 (never an invalid index)."""
    return xp.astype(xp.where(values == values, values, xp.zeros_like(values)), dtype)


def box_index(xp: Any, start: Any, size: Sequence[int], batch: int, channels: int,
              shape: Sequence[int]) -> Any:
    """Flat indices ``(B * K * prod(size),)`` of the box cells in a ``(B, K, *shape)`` array.

    ``start`` is ``(B, n)`` integers (spatial-axis order); the order of the result is
    C order over ``(B, K, *size)``.
    """
    n = len(shape)
    device = array_api_compat.device(start)
    dtype = start.dtype
    cells = grid_size(shape)
    stride = 1
    cell = None
    for axis in reversed(range(n)):
        view = [1] * n
        view[axis] = size[axis]
        pos = start[:, axis : axis + 1] + xp.arange(size[axis], dtype=dtype, device=device)
        term = xp.reshape(pos * stride, (batch, 1, *view))
        cell = term if cell is None else cell + term
        stride *= int(shape[axis])
    rows = xp.arange(batch * channels, dtype=dtype, device=device) * cells
    rows = xp.reshape(rows, (batch, channels, *([1] * n)))
    return xp.reshape(rows + cell, (-1,))


def gather_box(xp: Any, x: Any, start: Any, size: Sequence[int], index: Any = None) -> Any:
    """The box ``(B, K, *size)`` of ``x (B, K, *S)`` at ``start (B, n)``.

    ``index``: :func:`box_index` of the same box, if already made.
    """
    batch, channels = x.shape[:2]
    if index is None:
        index = box_index(xp, start, size, batch, channels, tuple(x.shape[2:]))
    return xp.reshape(xp.take(xp.reshape(x, (-1,)), index), (batch, channels, *size))


def set_box(xp: Any, x: Any, start: Any, values: Any, index: Any = None) -> Any:
    """``x (B, K, *S)`` with the box at ``start (B, n)`` replaced by ``values (B, K, *size)``.

    In place where the namespace allows it (see the module docstring): pass an array
    that nothing else reads. Returns the updated array (use it, not ``x``).
    """
    batch, channels = x.shape[:2]
    shape = tuple(x.shape[2:])
    size = tuple(values.shape[2:])
    if array_api_compat.is_jax_namespace(xp) or (
            array_api_compat.is_numpy_namespace(xp) or array_api_compat.is_torch_namespace(xp)
            or array_api_compat.is_cupy_namespace(xp)):
        if index is None:
            index = box_index(xp, start, size, batch, channels, shape)
        flat = xp.reshape(x, (-1,))
        flat_values = xp.reshape(values, (-1,))
        if array_api_compat.is_jax_namespace(xp):
            flat = flat.at[index].set(flat_values)
        else:
            flat[index] = flat_values
        return xp.reshape(flat, x.shape)
    starts = [[int(v) for v in row] for row in _host_rows(xp, start)]
    for b in range(batch):
        box = tuple(slice(s, s + k) for s, k in zip(starts[b], size, strict=True))
        x[(b, slice(None), *box)] = values[b, ...]
    return x


def _host_rows(xp: Any, start: Any) -> list[list[Any]]:
    batch, n = start.shape
    return [[start[b, a] for a in range(n)] for b in range(batch)]
