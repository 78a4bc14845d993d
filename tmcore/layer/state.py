"""The layer's state and the checks of a call's inputs, made before anything is allocated.

A stream is a sequence fed to the layer in pieces of any lengths, one token at a time
included; :class:`StreamState` carries what an unfinished chunk needs between pieces, so
the pieces give the outputs and the state of one long call. A plain ``(h, c)`` pair is the
state at a chunk boundary. Sizes: ``d`` embed_dim, ``C`` channels, ``S`` the grid, ``L``
chunk_size, ``B`` batch, ``N`` tokens.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

from tmcore.layer.config import LayerConfig
from tmcore.runtime import validate
from tmcore.runtime.options import memory_limit
from tmcore.runtime.validate import check_bool_mask, check_flag, check_floating, check_int
from tmcore.types import device_of, host_values, traced

__all__ = ["State", "StreamState", "check_forward", "check_mask", "check_state",
           "check_stream_call", "check_tokens",
           "doc_starts_from_offsets", "reset_stream", "stream_state", "where_rows",
           "zero_state"]

State = tuple[Any, Any]


class StreamState(NamedTuple):
    """A layer's state between streamed calls, valid at ANY token.

    A pytree: it passes through ``jax.jit``, ``lax.scan`` and ``vmap``.

    Parameters
    ----------
    h, c : array, shape ``(B, C, *S)``
        The state entering the unfinished chunk (after the last complete one).
    pending : array, shape ``(B, L, d)``
        The unfinished chunk's tokens so far, zeros after ``count[b]``.
    count : int32 array, shape ``(B,)``
        Per row, the tokens the unfinished chunk holds (``0 .. L-1``).
    read : array, shape ``(B, C)``
        The unfinished chunk's read (made at its first token, before its write), zeros
        where ``count`` is 0.
    """

    h: Any
    c: Any
    pending: Any
    count: Any
    read: Any


# --------------------------------------------------------------------------- size gates


def forward_bytes(config: LayerConfig, batch: int, tokens: int, item: int) -> int:
    """Bytes one layer call on ``(B, N, d)`` tokens certainly holds without a backward:
    the scan's working set (with its one kept state, so that this gate covers the scan's
    own, which a layer's no-grad scan then skips), the output and the padded chunks."""
    state = batch * config.memory_channels * math.prod(config.memory_shape)
    steps = -(-tokens // config.chunk_size)
    working = (validate.warp_states(len(config.memory_shape), config.flow)
               if config.dynamics == "warp" else 0)
    padded = batch * steps * config.chunk_size * config.embed_dim
    return validate.scan_bytes(state, batch, config.memory_channels, steps, 1, item) \
        + item * (batch * tokens * config.embed_dim + padded + working * state)


def _state_shape(config: LayerConfig, batch: int) -> tuple[int, ...]:
    return (batch, config.memory_channels, *config.memory_shape)


def check_forward(xp: Any, config: LayerConfig, x: Any, dtype: Any = None) -> None:
    """Before a layer call on ``x (B, N, d)`` allocates: the state and the call's working
    set fit the device (``ValueError`` / ``MemoryError`` naming ``memory_shape``), in
    ``dtype`` (default ``x``'s: the dtype the call computes in)."""
    sizes_known = _ints(x.shape[:2])
    if sizes_known is None:  # symbolic sizes: checked eagerly, or by the ops
        return
    batch, tokens = sizes_known
    nbytes = _call_bytes(config, batch, tokens, validate.itemsize(xp, dtype or x.dtype))
    limit = memory_limit()  # (read each call: the bound may change between calls)
    if nbytes < validate.SMALL and (limit is None or nbytes <= limit):
        return  # what check_bytes would decide, without building its message per token
    validate.check_bytes("memory_shape", nbytes, f"a layer call on x {tuple(x.shape)} with a "
                      f"state (B, C, *S) = {_state_shape(config, batch)}", xp, device_of(x))


@functools.lru_cache(maxsize=256)
def _call_bytes(config: LayerConfig, batch: int, tokens: int, item: int) -> int:
    """:func:`forward_bytes` once the state's element count is checked (cached per call
    shape: a decode step makes the same call every token; a refusal is not cached)."""
    validate.check_count("memory_shape", _state_shape(config, batch), "(B, C, *S)",
                      "the state h (and c)")
    return forward_bytes(config, batch, tokens, item)


def _ints(sizes: Any) -> tuple[int, ...] | None:
    """``sizes`` as Python ints, or ``None`` where they may be symbolic (``torch.compile``,
    ``jax.export``): reading one would specialize it."""
    if traced():
        return None
    try:
        return tuple(operator.index(s) for s in sizes)
    except TypeError:
        return None


# --------------------------------------------------------------------------- the state


def zero_state(xp: Any, config: LayerConfig, batch: int, *, dtype: Any = None,
               device: Any = None) -> State:
    """The zero state ``(h, c)``, each ``(B, C, *S)``.

    Checked first: it (and one scan step over it) can be indexed and fits the device
    (``ValueError`` / ``MemoryError`` naming ``memory_shape``).

    Parameters
    ----------
    xp : namespace
        Where to create it.
    config : LayerConfig
        The layer (``C`` and ``S``).
    batch : int
        ``B``.
    dtype, device : optional
        The state's (default: the namespace's defaults).

    Returns
    -------
    h, c : array, shape ``(B, C, *S)``
        Zeros.
    """
    shape = _state_shape(config, batch)
    if _ints(shape) is not None:
        count = validate.check_count("memory_shape", shape, "(B, C, *S)", "the state h (and c)")
        nbytes = validate.scan_bytes(count, shape[0], shape[1], 1, 0, validate.itemsize(xp, dtype))
        validate.check_bytes("memory_shape", nbytes, f"the state (h, c) of shape (B, C, *S) = "
                          f"{shape} and one scan step over it", xp, device)
    return (xp.zeros(shape, dtype=dtype, device=device),
            xp.zeros(shape, dtype=dtype, device=device))


def check_tokens(xp: Any, x: Any, config: LayerConfig) -> None:
    """``TypeError`` / ``ValueError`` unless ``x`` is a real floating ``(B, N, d)`` array
    with ``d = embed_dim``."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x: expected an array of shape (B, N, d), got {type(x).__name__}")
    if x.ndim != 3:
        raise ValueError(f"x: expected shape (B, N, d) (3 dims), got {tuple(x.shape)}")
    if x.shape[-1] != config.embed_dim:
        raise ValueError(f"x: expected shape (B, N, d) with d = {config.embed_dim} "
                         f"(embed_dim = {config.embed_dim}), got {tuple(x.shape)}")
    check_floating(xp, "x", x)


def check_state(xp: Any, state: Any, batch: int, config: LayerConfig) -> State:
    """A state pair ``(h, c)`` (tuple or list) checked: each a real floating ``(B, C, *S)``
    array (``ValueError`` / ``TypeError`` naming the field); returned as a tuple."""
    expected = _state_shape(config, batch)
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


def stream_state(xp: Any, state: Any, x: Any, config: LayerConfig, *, checked: bool = False
                 ) -> tuple[StreamState, tuple[int, ...] | None]:
    """Check a streamed call's ``state`` and complete it to a :class:`StreamState`.

    ``state``: ``None`` (zeros), an ``(h, c)`` pair (a chunk boundary) or a
    :class:`StreamState` (its ``count`` an integer array or Python ints). ``x (B, N, d)``
    fixes the batch, dtype and device of what is filled in. Returns the state (``count``
    an int32 array) and its counts as Python ints, read on the host once (``None`` when
    traced: an out-of-range traced count is taken as 0, an empty unfinished chunk, so
    that no row ever reads another's). ``checked``: ``state`` was checked already (a
    StreamState's ``count`` an int32 array).
    """
    batch = x.shape[0]
    device = device_of(x)
    if not isinstance(state, StreamState):
        h, c = (zero_state(xp, config, batch, dtype=x.dtype, device=device) if state is None
                else tuple(state) if checked else check_state(xp, state, batch, config))
        zeros = None if _ints((batch,)) is None else (0,) * batch  # (a symbolic batch)
        return StreamState(
            h, c, xp.zeros((batch, config.chunk_size, config.embed_dim), dtype=x.dtype,
                           device=device),
            xp.zeros((batch,), dtype=xp.int32, device=device),
            xp.zeros((batch, config.memory_channels), dtype=h.dtype, device=device)), zeros
    if checked:
        values = host_values(state.count)
        return state, None if values is None else tuple(int(k) for k in values)
    h, c = check_state(xp, (state.h, state.c), batch, config)
    for name, value, axes, shape in (
            ("pending", state.pending, "(B, L, d)",
             (batch, config.chunk_size, config.embed_dim)),
            ("read", state.read, "(B, C)", (batch, config.memory_channels))):
        if tuple(getattr(value, "shape", ())) != shape or not hasattr(value, "dtype"):
            raise ValueError(f"state.{name}: expected shape {axes} = {shape}, got "
                             f"{getattr(value, 'shape', type(value).__name__)}")
        if not validate.is_kind(xp, value.dtype, "real floating"):
            raise TypeError(f"state.{name}: expected a real floating dtype (like state.h), "
                            f"got {value.dtype}")
    count, known = _check_count(xp, state.count, batch, config.chunk_size, device)
    return StreamState(h, c, state.pending, count, state.read), known


def _check_count(xp: Any, count: Any, batch: int, length: int,
                 device: Any) -> tuple[Any, tuple[int, ...] | None]:
    """``state.count`` as an int32 array and, read on the host, as Python ints."""
    expected = f"{batch} ints in [0, {length}) (tokens of each row's unfinished chunk)"
    if hasattr(count, "shape") and hasattr(count, "dtype"):
        if tuple(count.shape) != (batch,):
            raise ValueError(f"state.count: expected an integer array of shape (B,) = "
                             f"({batch},), got {tuple(count.shape)}")
        if not validate.is_kind(xp, count.dtype, "integral"):
            raise TypeError(f"state.count: expected an integer array ({expected}), got "
                            f"dtype {count.dtype}")
        values = host_values(count)
        if values is None:  # traced: compared before the cast, so no value wraps into range
            inside = (count >= 0) & (count < length)
            return xp.astype(xp.where(inside, count, xp.zeros_like(count)), xp.int32), None
        known = tuple(values)
        if not (0 <= min(known, default=0) and max(known, default=0) < length):
            raise ValueError(f"state.count: expected {expected}, got {list(values)}")
        return count if count.dtype == xp.int32 else xp.astype(count, xp.int32), known
    try:
        known = None if isinstance(count, bool) or any(isinstance(k, bool) for k in count) \
            else tuple(operator.index(k) for k in count)
    except TypeError:
        known = None
    if known is None or len(known) != batch or not all(0 <= k < length for k in known):
        raise ValueError(f"state.count: expected {expected}, got {count!r}")
    return xp.asarray(known, dtype=xp.int32, device=device), known


def reset_stream(xp: Any, st: StreamState, known: tuple[int, ...] | None, reset: Any
                 ) -> tuple[StreamState, tuple[int, ...] | None]:
    """``st`` with the rows where ``reset (B,)`` is True emptied (zero state, no unfinished
    chunk): a document starting at the call's first token. The counts stay known on the
    host where ``reset`` can be read."""
    if reset is None:
        return st, known
    keep = ~reset
    h, c, pending, read = (where_rows(xp, keep, v, xp.zeros_like(v))
                           for v in (st.h, st.c, st.pending, st.read))
    count = xp.where(keep, st.count, xp.zeros_like(st.count))
    flags = None if known is None else host_values(reset)
    known = None if flags is None else tuple(0 if r else k
                                             for r, k in zip(flags, known, strict=True))
    return StreamState(h, c, pending, count, read), known


def where_rows(xp: Any, mask: Any, a: Any, b: Any) -> Any:
    """``a`` in the rows where the bool array ``mask (B,)`` is True, else ``b``."""
    return xp.where(xp.reshape(mask, (mask.shape[0],) + (1,) * (a.ndim - 1)), a, b)


def check_stream_call(stream: Any, state: Any, doc_starts: Any, valid: Any) -> bool:
    """``stream`` as a bool, refusing what only a streamed call takes with ``stream=False``
    (a :class:`StreamState`, ``doc_starts``, ``valid``): both adapters' calls."""
    if check_flag("stream", stream):
        return True
    for name, value in (("doc_starts", doc_starts), ("valid", valid)):
        if value is not None:
            raise ValueError(f"{name}: packed documents and skipped tokens need "
                             f"stream=True (the default), got stream=False")
    if isinstance(state, StreamState):
        raise ValueError("state: a StreamState continues a stream; pass stream=True "
                         "(the default)")
    return False


# --------------------------------------------------------------------------- masks


def check_mask(xp: Any, mask: Any, name: str, shape: tuple[int, ...]) -> None:
    """``mask``: a bool array of ``shape`` (``(B,)`` or ``(B, N)``), named in errors."""
    check_bool_mask(xp, mask, name, "(B,)" if len(shape) == 1 else "(B, N)", shape,
                    hint=" (compare explicitly, e.g. mask > 0.5)")


def doc_starts_from_offsets(xp: Any, offsets: Sequence[Any], tokens: int, *,
                            device: Any = None) -> Any:
    """``cu_seqlens``-style offsets to the per-token mask the layer's ``doc_starts`` takes.

    Parameters
    ----------
    xp : namespace
        Where to create the mask.
    offsets : sequence of int, or sequence of sequences of int
        One row's increasing document starts (e.g. ``[0, 5, 12]``, optionally ending
        with ``tokens``), or one such list per row.
    tokens : int
        ``N``, the tokens per row.
    device : device, optional
        Where to create the mask.

    Returns
    -------
    bool array, shape ``(B, tokens)``
        True at each document start (``B = 1`` for a single row).

    Raises
    ------
    ValueError
        If a row's offsets are not strictly increasing or not in ``[0, tokens]``.
    """
    tokens = check_int("tokens", tokens, 0)
    rows = offsets if offsets and isinstance(offsets[0], (list, tuple)) else [offsets]
    starts = []
    for index, row in enumerate(rows):
        line = [check_int(f"offsets[{index}]", o, 0, tokens) for o in row]
        if any(b <= a for a, b in zip(line, line[1:], strict=False)):
            raise ValueError(f"offsets[{index}]: expected increasing offsets in [0, {tokens}], "
                             f"got {list(row)}")
        starts.append([o for o in line if o < tokens])
    validate.check_bytes("tokens", len(rows) * tokens, f"the document-start mask ({len(rows)}, "
                      f"{tokens}) of bools", xp, device)
    positions = xp.arange(tokens, device=device)
    lines = [xp.any(positions[None, :] == xp.asarray(line, device=device)[:, None], axis=0)
             if line else xp.zeros((tokens,), dtype=xp.bool, device=device)
             for line in starts]
    return xp.stack(lines, axis=0)
