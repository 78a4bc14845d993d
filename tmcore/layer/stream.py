"""The streaming state and the masks of a streamed call.

A stream is a sequence fed to the layer in pieces of any lengths, one token at a
time included; the state between pieces (:class:`StreamState`) carries what an
unfinished chunk needs, so the pieces give the outputs and the state of one long
call (:meth:`tmcore.layer.Layer.forward_stream`). Packed documents (``doc_starts``,
per-token boundaries) restart the state and the chunk grid at every document start,
so each document's outputs equal running it alone.

- :class:`StreamState`, :func:`stream_state` -- the state and its checks;
- :func:`check_doc_starts`, :func:`doc_starts_from_offsets`, :func:`check_valid` --
  the masks; reading masks and counts on the host.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import array_api_compat

from tmcore.layer.config import LayerConfig
from tmcore.layer.state import check_state, keep_rows, require_bool_array, where_rows, zero_state
from tmcore.runtime import sizes as _sizes
from tmcore.runtime.validate import check_int
from tmcore.types import device_of

__all__ = ["StreamState", "check_doc_starts", "doc_starts_from_offsets", "stream_state"]


class StreamState(NamedTuple):
    """A layer's state between streamed calls, valid at ANY token (not only at chunk ends).

    Feeding a sequence in pieces of any lengths, carrying this state, equals one long
    call (:meth:`Layer.forward_stream`). A plain ``(h, c)`` pair is the state at a
    chunk boundary (``count`` all 0) and is accepted wherever a ``StreamState`` is, and
    so is a ``count`` of Python ints.

    Parameters
    ----------
    h, c : array, shape ``(B, C, *S)``
        The state entering the unfinished chunk (after the last complete chunk).
    pending : array, shape ``(B, L, d)``
        The unfinished chunk's tokens so far (its head inputs; the write needs
        all ``L`` of them), zeros after ``count[b]``.
    count : int32 array, shape ``(B,)``
        Per row, how many tokens the unfinished chunk holds (``0 .. L-1``). An
        array, not Python ints, so that the state is data: it passes through
        ``jax.jit``, ``lax.scan``, ``vmap`` and ``tree.map`` like the other
        fields.
    read : array, shape ``(B, C)``
        The unfinished chunk's read (fixed by its first token and ``h``: the
        read happens before the chunk's write), zeros where ``count`` is 0.
    """

    h: Any
    c: Any
    pending: Any
    count: Any
    read: Any


#: dtype name of :attr:`StreamState.count`
COUNT_DTYPE = "int32"


def _count_array(xp: Any, counts: Sequence[int], device: Any) -> Any:
    return xp.asarray(list(counts), dtype=getattr(xp, COUNT_DTYPE), device=device)


def _is_traced(value: Any) -> bool:
    """Whether ``value`` is an abstract value of a tracing framework (e.g. a JAX tracer)."""
    return any("Tracer" in cls.__name__ for cls in type(value).__mro__)


def _trace_error(error: BaseException) -> bool:
    text = type(error).__name__
    return "Tracer" in text or "Concretization" in text


def stream_state(xp: Any, state: Any, x: Any, config: LayerConfig) -> StreamState:
    """Check a streamed call's ``state`` and complete it to a :class:`StreamState`.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``x``.
    state : None, pair of arrays or StreamState
        ``None`` (zeros), an ``(h, c)`` pair of shape ``(B, C, *S)`` each (a
        chunk boundary) or a :class:`StreamState`.
    x : array, shape ``(B, N, d)``
        The call's tokens (they fix ``B``, the dtype and the device of what is
        filled in).
    config : LayerConfig
        The layer's sizes (``C``, ``S``, ``L``, ``d``).

    Returns
    -------
    StreamState
        The checked state, with ``count`` an int32 array ``(B,)``; what ``state``
        leaves out is zeros (an empty unfinished chunk).

    Raises
    ------
    ValueError
        If ``state`` is not ``None``, a pair or a :class:`StreamState`; if ``h``,
        ``c``, ``pending`` or ``read`` does not have its shape (``pending`` and
        ``read``: or is not an array); or if ``count`` is not ``B`` ints in
        ``[0, L)`` (a traced array's values cannot be read: out-of-range ones are
        taken as 0, an empty unfinished chunk).
    TypeError
        If ``h`` or ``c`` is not an array, a field's dtype is not real floating,
        or an array ``count`` is not of an integer dtype.
    """
    return complete_state(xp, state, x, config)[0]


def complete_state(xp: Any, state: Any, x: Any, config: LayerConfig, *,
                   checked: bool = False) -> tuple[StreamState, tuple[int, ...] | None]:
    """:func:`stream_state` and the counts as Python ints where they are known without
    reading an array (``None``, a pair, Python-int counts), else ``None``. ``checked``:
    the caller checked ``state`` already (a pair from :func:`check_state`, a
    :class:`StreamState` from :func:`stream_state`): it is completed, not checked again
    (a StreamState's counts are then not read: ``None``)."""
    batch = x.shape[0]
    device = device_of(x)
    zeros = (0,) * batch
    if not isinstance(state, StreamState):
        empty = xp.zeros((batch, config.chunk_size, config.embed_dim), dtype=x.dtype,
                         device=device)
    if state is None:
        h, c = zero_state(xp, config, batch, dtype=x.dtype, device=device)
        return StreamState(h, c, empty, _count_array(xp, zeros, device),
                           xp.zeros((batch, config.memory_channels), dtype=x.dtype,
                                    device=device)), zeros
    if not isinstance(state, StreamState):
        h, c = tuple(state) if checked else check_state(xp, state, batch, config)
        return StreamState(h, c, empty, _count_array(xp, zeros, device),
                           xp.zeros((batch, config.memory_channels), dtype=h.dtype,
                                    device=device)), zeros
    if checked:
        return state, None
    h, c = check_state(xp, (state.h, state.c), batch, config)
    for name, value, axes, shape in (
            ("pending", state.pending, "(B, L, d)",
             (batch, config.chunk_size, config.embed_dim)),
            ("read", state.read, "(B, C)", (batch, config.memory_channels))):
        if not hasattr(value, "shape") or not hasattr(value, "dtype") \
                or tuple(value.shape) != shape:
            raise ValueError(f"state.{name}: expected shape {axes} = {shape}, got "
                             f"{getattr(value, 'shape', type(value).__name__)}")
        if not xp.isdtype(value.dtype, "real floating"):
            raise TypeError(f"state.{name}: expected a real floating dtype (like state.h), "
                            f"got {value.dtype}")
    count, known = _check_count(xp, state.count, batch, config.chunk_size, device)
    return StreamState(h, c, state.pending, count, state.read), known


def _check_count(xp: Any, count: Any, batch: int, length: int,
                 device: Any) -> tuple[Any, tuple[int, ...] | None]:
    """``state.count``: ``B`` ints in ``[0, L)``: an integer array ``(B,)`` or Python /
    NumPy ints. A concrete array's values are read on the host and checked (one read,
    which also gives the counts as Python ints); a traced one's (``jax.jit``,
    ``torch.compile``) cannot be: an out-of-range value is taken as 0 there (an empty
    unfinished chunk: the row continues from its ``(h, c)``), compared before the cast
    to int32 so that no value wraps into range, and no row ever reads another's."""
    expected = f"{batch} ints in [0, {length}) (tokens of each row's unfinished chunk)"
    if hasattr(count, "shape") and hasattr(count, "dtype"):
        if tuple(count.shape) != (batch,):
            raise ValueError(f"state.count: expected an integer array of shape (B,) = "
                             f"({batch},), got {tuple(count.shape)}")
        if not xp.isdtype(count.dtype, "integral"):
            raise TypeError(f"state.count: expected an integer array ({expected}), got "
                            f"dtype {count.dtype}")
        if _is_traced(count) or _sizes.compiling():
            inside = (count >= 0) & (count < length)
            return xp.astype(xp.where(inside, count, xp.zeros_like(count)),
                             getattr(xp, COUNT_DTYPE)), None
        values = tuple(int(v) for v in host_list(count, "state.count", ""))
        if not all(0 <= k < length for k in values):
            raise ValueError(f"state.count: expected {expected}, got {list(values)}")
        if count.dtype != getattr(xp, COUNT_DTYPE):
            count = xp.astype(count, getattr(xp, COUNT_DTYPE))
        return count, values
    try:
        known = tuple(operator.index(k) for k in count) if not isinstance(count, bool) \
            and all(not isinstance(k, bool) for k in count) else None
    except TypeError:
        known = None
    if known is None or len(known) != batch or not all(0 <= k < length for k in known):
        raise ValueError(f"state.count: expected {expected}, got {count!r}")
    return _count_array(xp, known, device), known


def host_list(value: Any, name: str, why: str) -> Any:
    """An array's values as (nested) Python lists, read on the host; a traced array is
    tmcore's ``TypeError`` naming ``name`` (``why`` says what to do)."""
    if _is_traced(value):
        raise TypeError(f"{name}: must be a concrete array here (it is traced, e.g. under "
                        f"jax.jit){why}")
    try:
        if hasattr(value, "tolist"):
            return value.tolist()
    except Exception as error:  # e.g. array-api-strict arrays have no tolist
        if _trace_error(error):
            raise TypeError(f"{name}: must be a concrete array here{why}") from error
    if value.ndim == 0:  # element by element: slow, only namespaces without tolist
        try:
            return bool(value) if "bool" in str(value.dtype) else int(value)
        except Exception as error:
            if _trace_error(error):
                raise TypeError(f"{name}: must be a concrete array here{why}") from error
            raise
    return [host_list(value[i, ...], name, why) for i in range(value.shape[0])]


PACKED_WHY = ("; packed documents (doc_starts) are planned on the host unless "
              "max_documents=D (a Python int: at least the document starts of any row in "
              "the call) is given, which plans them with arrays, under jax.jit too (the JAX "
              "adapter); else pass doc_starts as a concrete (NumPy) array closed over by the "
              "jitted function or as a static argument, run the packed call outside jit, or "
              "pass the documents as separate rows (with valid= masking their padding)")

#: The refusal when the layer's scan takes no per-step masks (only the JAX adapter's does).
PACKED_HOST_WHY = ("; max_documents plans packed documents with arrays only with a scan "
                   "taking per-step masks (the JAX adapter's): here they are planned on the "
                   "host")


def check_max_documents(max_documents: Any) -> int | None:
    """``max_documents``: ``None`` or a positive Python (or NumPy) int, returned as int."""
    return None if max_documents is None else check_int("max_documents", max_documents, 1)


def check_document_bound(doc_starts: Any, reset: Any, max_documents: int) -> None:
    """``ValueError`` naming ``max_documents`` when a row of a concrete ``doc_starts``
    ``(B, N)`` starts more documents than it: its True entries, plus one where a concrete
    ``reset (B,)`` is True and ``doc_starts`` is not at token 0. Traced masks are not
    read (nothing can be checked under ``jit``)."""
    starts = maybe_host(doc_starts)
    if starts is None:
        return
    flags = None if reset is None else maybe_host(reset)
    for b, row in enumerate(starts):
        number = sum(1 for v in row if v) + int(bool(
            flags is not None and flags[b] and row and not row[0]))
        if number > max_documents:
            raise ValueError(
                f"max_documents: row {b} starts {number} documents in this call, more than "
                f"max_documents={max_documents} (the chunk grid's bound: under jit its "
                f"starts after its first {max_documents} would be ignored); pass a larger "
                f"max_documents")


def check_doc_starts(xp: Any, doc_starts: Any, batch: int, tokens: int, *,
                     why: str = PACKED_WHY) -> list[list[bool]]:
    """Check a packing mask and read it on the host.

    Parameters
    ----------
    xp : namespace
        The array namespace of the layer's call.
    doc_starts : bool array, shape ``(B, N)``
        True at every token that starts a new document (the layer forgets
        everything before it).
    batch, tokens : int
        The expected ``B`` and ``N``.
    why : str, optional
        What the refusal of a traced mask says to do.

    Returns
    -------
    list of list of bool
        ``doc_starts``' values, ``B`` rows of ``N``.

    Raises
    ------
    TypeError
        If ``doc_starts`` is not a bool array of ``xp``, or is traced (e.g.
        under ``jax.jit``: packed documents are planned on the host).
    ValueError
        If its shape is not ``(B, N)``.
    """
    require_bool_array(xp, doc_starts, "doc_starts", "(B, N)", (batch, tokens))
    return [[bool(v) for v in row] for row in host_list(doc_starts, "doc_starts", why)]


def doc_starts_from_offsets(xp: Any, offsets: Sequence[Any], tokens: int, *,
                            device: Any = None) -> Any:
    """``cu_seqlens``-style offsets to the per-token mask :meth:`Layer.forward_stream` takes.

    Parameters
    ----------
    xp : namespace
        The array namespace to create the mask in.
    offsets : sequence of int, or sequence of sequences of int
        For one row, the increasing start offsets of its documents (e.g.
        ``[0, 5, 12]``, optionally ending with ``tokens``); or one such list per
        row.
    tokens : int
        ``N``, the tokens per row.
    device : device, optional
        Where to create the mask (default: the namespace's default device).

    Returns
    -------
    bool array, shape ``(B, tokens)``
        True at each document start (``B = 1`` for a single row of offsets).

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
    _sizes.check_bytes("tokens", len(rows) * tokens, f"the document-start mask ({len(rows)}, "
                       f"{tokens}) of bools", xp, device)
    mask = xp.zeros((len(rows), tokens), dtype=xp.bool, device=device)
    return _mark(xp, mask, [b for b, line in enumerate(starts) for _ in line],
                 [o for line in starts for o in line])


def _mark(xp: Any, mask: Any, rows: list[int], cols: list[int]) -> Any:
    """``mask (B, N)`` with ``mask[rows[i], cols[i]]`` True: in place where the namespace
    assigns by integer arrays (NumPy, PyTorch, CuPy), functionally in JAX, else one
    comparison per row (``O(K N)`` for a row of ``K`` starts)."""
    if not rows:
        return mask
    device = device_of(mask)
    r, c = (xp.asarray(v, device=device) for v in (rows, cols))
    if array_api_compat.is_jax_namespace(xp):
        return mask.at[r, c].set(True)
    if any(check(xp) for check in (array_api_compat.is_numpy_namespace,
                                   array_api_compat.is_torch_namespace,
                                   array_api_compat.is_cupy_namespace)):
        mask[r, c] = True
        return mask
    positions = xp.arange(mask.shape[1], device=device)
    lines = [xp.any(positions[None, :] == xp.asarray([o for b, o in zip(rows, cols, strict=True)
                                                     if b == row], device=device)[:, None],
                    axis=0) if row in rows else mask[row, :] for row in range(mask.shape[0])]
    return xp.stack(lines, axis=0)


def check_valid(xp: Any, valid: Any, batch: int, tokens: int, *,
                why: str = PACKED_WHY) -> list[list[bool]]:
    """``valid``: a bool array ``(B, N)``, False at tokens the stream skips (padding);
    returned as host lists (``why``: as in :func:`check_doc_starts`)."""
    require_bool_array(xp, valid, "valid", "(B, N)", (batch, tokens))
    return [[bool(v) for v in row] for row in host_list(valid, "valid", why)]


def maybe_host(value: Any) -> Any:
    """``value``'s host lists when it can be read without tracing (else ``None``; also
    while torch.compile traces: a host read there is a graph break)."""
    if _is_traced(value) or _sizes.compiling():
        return None
    try:
        return host_list(value, "", "")
    except TypeError:
        return None

def reset_stream(xp: Any, st: StreamState, known: tuple[int, ...] | None,
                 reset: Any) -> tuple[StreamState, tuple[int, ...] | None]:
    """``st`` with the rows where ``reset (B,)`` is True emptied (zero state, no
    unfinished chunk), and the counts known on the host where they still are."""
    if reset is None:
        return st, known
    h, c, pending, read = (where_rows(xp, reset, xp.zeros_like(v), v)
                           for v in (st.h, st.c, st.pending, st.read))
    count = xp.where(reset, xp.zeros_like(st.count), st.count)
    if known is not None and any(known):
        flags = maybe_host(reset)
        known = None if flags is None else tuple(0 if r else k
                                                 for r, k in zip(flags, known, strict=True))
    return StreamState(h, c, pending, count, read), known


def forget_row(xp: Any, st: StreamState, row: int) -> StreamState:
    """``st`` with row ``row`` emptied (read on the host: packed documents)."""
    keep = xp.asarray([b != row for b in range(st.h.shape[0])], dtype=xp.bool,
                      device=device_of(st.h))
    h, c, pending, read = keep_rows(xp, keep, st.h, st.c, st.pending, st.read)
    return st._replace(h=h, c=c, pending=pending, read=read)
