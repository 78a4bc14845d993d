"""The layer's state ``(h, c)``: the zero state, the tokens' and the state's checks,
the per-sequence reset, and the bool masks.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from tmcore.layer import sizes as _layer_sizes
from tmcore.layer.config import LayerConfig
from tmcore.runtime.validate import check_floating, check_namespace

__all__ = ["State", "check_state", "check_tokens", "require_bool_array",
           "reset_state", "zero_state"]

State = tuple[Any, Any]


def zero_state(xp: Any, config: LayerConfig, batch: int, *, dtype: Any = None,
               device: Any = None) -> State:
    """The zero state of a layer.

    Parameters
    ----------
    xp : namespace
        The array namespace to create the state in.
    config : LayerConfig
        The layer's sizes (``C`` and ``S``).
    batch : int
        ``B``, the number of sequences.
    dtype : dtype, optional
        The state's dtype (default: the namespace's default floating dtype).
    device : device, optional
        Where to create the state (default: the namespace's default device).

    Returns
    -------
    h, c : array, shape ``(B, C, *S)``
        Two zero arrays.

    Raises
    ------
    ValueError, MemoryError
        If the state (and one scan step over it) cannot be indexed or does not
        fit the device; the error names ``memory_shape``.
    """
    _layer_sizes.check_state(xp, config, batch, dtype, device)  # sizes before allocating
    shape = config.state_shape(batch)
    return xp.zeros(shape, dtype=dtype, device=device), xp.zeros(shape, dtype=dtype,
                                                                 device=device)


def check_tokens(xp: Any, x: Any, config: LayerConfig) -> None:
    """Check a layer's tokens.

    Parameters
    ----------
    xp : namespace
        The array namespace of the layer's call.
    x : array, shape ``(B, N, d)``
        The tokens: a real floating array with ``d = embed_dim``.
    config : LayerConfig
        The layer (its ``embed_dim``).

    Raises
    ------
    TypeError
        If ``x`` is not an array or not of a real floating dtype.
    ValueError
        If ``x`` is not 3-D or its last axis is not ``embed_dim``.
    """
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x: expected an array of shape (B, N, d), got {type(x).__name__}")
    if x.ndim != 3:
        raise ValueError(f"x: expected shape (B, N, d) (3 dims), got {tuple(x.shape)}")
    if x.shape[-1] != config.embed_dim:
        raise ValueError(f"x: expected shape (B, N, d) with d = {config.embed_dim} "
                         f"(embed_dim = {config.embed_dim}), got {tuple(x.shape)}")
    check_floating(xp, "x", x)


def check_state(xp: Any, state: Any, batch: int, config: LayerConfig) -> State:
    """Check a layer state ``(h, c)``.

    Parameters
    ----------
    xp : namespace
        The array namespace of the layer's call.
    state : pair of arrays
        ``(h, c)``, each of shape ``(B, C, *S)`` and a real floating dtype (a
        tuple or a list).
    batch : int
        The expected ``B``.
    config : LayerConfig
        The layer's sizes (``C`` and ``S``).

    Returns
    -------
    h, c : array, shape ``(B, C, *S)``
        The state as a tuple.

    Raises
    ------
    ValueError
        If ``state`` is not a pair, or ``h`` or ``c`` has another shape.
    TypeError
        If ``h`` or ``c`` is not an array or not of a real floating dtype.
    """
    expected = config.state_shape(batch)
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise ValueError(f"state: expected a pair (h, c) of shape (B, C, *S) = {expected} "
                         f"or None, got {type(state).__name__}")
    for name, value in zip(("h", "c"), state, strict=True):
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise TypeError(f"state.{name}: expected an array of shape (B, C, *S) = "
                            f"{expected}, got {type(value).__name__}")
        if tuple(value.shape) != expected:
            raise ValueError(f"state.{name}: expected shape (B, C, *S) = {expected}, "
                             f"got {tuple(value.shape)}")
        check_floating(xp, f"state.{name}", value)
    return state[0], state[1]


def where_rows(xp: Any, mask: Any, a: Any, b: Any) -> Any:
    """``a`` in the rows where the bool array ``mask (B,)`` is True, else ``b``."""
    return xp.where(xp.reshape(mask, (mask.shape[0],) + (1,) * (a.ndim - 1)), a, b)


def keep_rows(xp: Any, keep: Any, *arrays: Any) -> tuple[Any, ...]:
    """``arrays`` (each ``(B, ...)``) zeroed in the rows where ``keep (B,)`` is False."""
    return tuple(where_rows(xp, keep, a, xp.zeros_like(a)) for a in arrays)


def reset_state(xp: Any, state: State, mask: Any) -> State:
    """Zero ``(h, c)`` of the sequences where the bool ``mask (B,)`` is True.

    Parameters
    ----------
    xp : namespace
        The array namespace of the state.
    state : pair of arrays, shape ``(B, C, *S)`` each
        The state ``(h, c)``.
    mask : bool array, shape ``(B,)``
        True for the sequences to reset (named ``reset`` in errors).

    Returns
    -------
    h, c : array, shape ``(B, C, *S)``
        The state with the masked rows zeroed.

    Raises
    ------
    TypeError
        If ``mask`` is not an array of ``xp``'s kind or not of dtype bool (a
        float mask would silently mean "anything non-zero"; compare
        explicitly, e.g. ``mask > 0.5``).
    ValueError
        If ``mask`` does not have shape ``(B,)``.
    """
    h, c = state
    batch = h.shape[0]
    require_bool_array(xp, mask, "reset", "(B,)", (batch,),
                        hint=" (compare explicitly, e.g. mask > 0.5)")
    where = xp.reshape(mask, (batch,) + (1,) * (h.ndim - 1))
    return (xp.where(where, xp.zeros_like(h), h), xp.where(where, xp.zeros_like(c), c))


def require_bool_array(xp: Any, value: Any, name: str, axes: str,
                        shape: tuple[int, ...], hint: str = "") -> None:
    """Raise unless ``value`` is a bool array of ``shape`` (named ``axes``, e.g. ``"(B,)"``):
    ``TypeError`` for a non-array or another dtype, ``ValueError`` for another shape."""
    expected = f"of shape {axes} = ({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"
    if not array_api_compat.is_array_api_obj(value):
        raise TypeError(f"{name}: expected a bool array {expected}, got {type(value).__name__}")
    check_namespace(xp, name, value, f"a bool array {expected}")
    if not xp.isdtype(value.dtype, "bool"):
        raise TypeError(f"{name}: expected a bool mask {expected}, got dtype {value.dtype}{hint}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected a bool mask {expected}, got {tuple(value.shape)}")
