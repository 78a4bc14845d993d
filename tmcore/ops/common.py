"""What several primitives share: overflow-free activations, separable profiles, boxes.

Reads, writes and their gradients are dense contractions over :func:`outer_product` of 1-D
profiles (no scatter, no atomics: deterministic). A *box* is, per batch row ``b``, the cells
``start[b, a] <= i_a < start[b, a] + size[a]`` of a ``(B, K, *S)`` array, inside the grid;
:func:`gather_box` and :func:`set_box` touch only its cells, ``O(B K prod(size))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import array_api_compat

from tmcore.types import device_of

__all__ = ["box_index", "gather_box", "grid_size", "index_dtype", "outer_product", "set_box",
           "sigmoid", "sigmoid_grad_from_output", "softplus", "tanh_grad_from_output",
           "to_index"]


def sigmoid(xp: Any, x: Any) -> Any:
    """``1 / (1 + exp(-x))`` as ``0.5 * tanh(0.5 x) + 0.5``: exact, never overflows, and three
    elementwise passes where the ``exp(-|x|)`` / ``where`` form takes seven (the gates are hot)."""
    return 0.5 * xp.tanh(0.5 * x) + 0.5


def softplus(xp: Any, x: Any) -> Any:
    """``log(1 + exp(x))`` as ``max(x, 0) + log1p(exp(-|x|))`` (never overflows)."""
    return xp.maximum(x, xp.zeros_like(x)) + xp.log1p(xp.exp(-xp.abs(x)))


def sigmoid_grad_from_output(s: Any) -> Any:
    """Derivative of the sigmoid given its output ``s``."""
    return s * (1.0 - s)


def tanh_grad_from_output(t: Any) -> Any:
    """Derivative of tanh given its output ``t``."""
    return 1.0 - t * t


def grid_size(shape: Sequence[int]) -> int:
    """Number of cells ``prod(shape)``."""
    size = 1
    for s in shape:
        size *= int(s)
    return size


def outer_product(xp: Any, profiles: Sequence[Any], replace: dict[int, Any] | None = None) -> Any:
    """Flattened outer product ``(B, Q, prod(S))`` (C order) of n profiles ``(B, Q, S_a)`` in
    spatial-axis order; ``replace``: ``{axis: (B, Q, S_axis)}`` used instead (a derivative)."""
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
    """Flat indices ``(B * K * prod(size),)`` of the box at ``start (B, n)`` in a ``(B, K, *shape)``
    array, C order over ``(B, K, *size)``."""
    n = len(shape)
    device = device_of(start)
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
    """The box ``(B, K, *size)`` of ``x (B, K, *S)`` at ``start (B, n)`` (``index``: its
    :func:`box_index`, if made)."""
    batch, channels = x.shape[:2]
    if index is None:
        index = box_index(xp, start, size, batch, channels, tuple(x.shape[2:]))
    return xp.reshape(xp.take(xp.reshape(x, (-1,)), index), (batch, channels, *size))


def set_box(xp: Any, x: Any, start: Any, values: Any, index: Any = None) -> Any:
    """``x (B, K, *S)`` with the box at ``start (B, n)`` set to ``values (B, K, *size)``, in place
    where the namespace allows it: pass an array nothing else reads, and use the result."""
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
