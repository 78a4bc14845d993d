"""Streaming and packed documents for the Tensor Memory layer (:mod:`tmcore.layer`).

A stream is a sequence fed to the layer in pieces of any lengths, one token at a
time included; the state between pieces (:class:`StreamState`) carries what an
unfinished chunk needs, so the pieces give the outputs and the state of one long
call. Packed documents (``doc_starts``, per-token boundaries) restart the state
and the chunk grid at every document start, so each document's outputs equal
running it alone.

- :class:`StreamState`, :func:`stream_state` -- the state and its checks;
- :func:`check_doc_starts`, :func:`doc_starts_from_offsets` -- the packing mask;
- :func:`forward_stream` -- :meth:`tmcore.layer.Layer.forward_stream`: plans each
  row's chunk grid, gathers the chunks, runs the heads over all of them at once,
  scans (cut where a row restarts or stops) and reads out.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from tmcore.layer.config import LayerConfig
from tmcore.layer.heads import chunk, unchunk
from tmcore.layer.params import Params
from tmcore.layer.state import (
    check_state,
    check_tokens,
    device_of,
    require_bool_array,
    reset_state,
    zero_state,
)
from tmcore.ops.sample import trilinear_sample
from tmcore.runtime import sizes as _sizes
from tmcore.runtime.validate import validation_enabled

if TYPE_CHECKING:
    from tmcore.layer.layer import Layer, Scan

__all__ = ["StreamState", "check_doc_starts", "doc_starts_from_offsets", "forward_stream",
           "stream_state"]


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
        ``[0, L)`` (an array's values are checked in validate mode only).
    TypeError
        If ``h`` or ``c`` is not an array, a field's dtype is not real floating,
        or an array ``count`` is not of an integer dtype.
    """
    return _stream_state(xp, state, x, config)[0]


def _stream_state(xp: Any, state: Any, x: Any,
                  config: LayerConfig) -> tuple[StreamState, tuple[int, ...] | None]:
    """:func:`stream_state` and the counts as Python ints where they are known without
    reading an array (``None``, a pair, Python-int counts), else ``None``."""
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
        h, c = check_state(xp, state, batch, config)
        return StreamState(h, c, empty, _count_array(xp, zeros, device),
                           xp.zeros((batch, config.memory_channels), dtype=h.dtype,
                                    device=device)), zeros
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
    """``state.count``: ``B`` ints in ``[0, L)``: an integer array ``(B,)`` (its values
    are checked when concrete in validate mode) or Python / NumPy ints (checked)."""
    expected = f"{batch} ints in [0, {length}) (tokens of each row's unfinished chunk)"
    if hasattr(count, "shape") and hasattr(count, "dtype"):
        if tuple(count.shape) != (batch,):
            raise ValueError(f"state.count: expected an integer array of shape (B,) = "
                             f"({batch},), got {tuple(count.shape)}")
        if not xp.isdtype(count.dtype, "integral"):
            raise TypeError(f"state.count: expected an integer array ({expected}), got "
                            f"dtype {count.dtype}")
        if not _is_traced(count) and not _sizes.compiling() and validation_enabled():
            values = [int(v) for v in _host_list(count, "state.count", "")]
            if not all(0 <= k < length for k in values):
                raise ValueError(f"state.count: expected {expected}, got {values}")
        return xp.astype(count, getattr(xp, COUNT_DTYPE)), None
    try:
        known = tuple(operator.index(k) for k in count) if not isinstance(count, bool) \
            and all(not isinstance(k, bool) for k in count) else None
    except TypeError:
        known = None
    if known is None or len(known) != batch or not all(0 <= k < length for k in known):
        raise ValueError(f"state.count: expected {expected}, got {count!r}")
    return _count_array(xp, known, device), known


def _host_list(value: Any, name: str, why: str) -> Any:
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
    return [_host_list(value[i, ...], name, why) for i in range(value.shape[0])]


def _host_bools(mask: Any, name: str = "mask", why: str = "") -> list:
    """A bool array's values as nested Python lists (on the host)."""
    return _host_list(mask, name, why)


_PACKED_WHY = ("; packed documents (doc_starts) are planned on the host: pass doc_starts as "
               "a concrete (NumPy) array closed over by the jitted function or as a static "
               "argument, run the packed call outside jit, or pass the documents as separate "
               "rows (with valid= masking their padding), which traces")


def check_doc_starts(xp: Any, doc_starts: Any, batch: int, tokens: int) -> list[list[bool]]:
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
    return [[bool(v) for v in row] for row in _host_bools(doc_starts, "doc_starts",
                                                          _PACKED_WHY)]


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
    rows = offsets if offsets and isinstance(offsets[0], (list, tuple)) else [offsets]
    mask = []
    for index, row in enumerate(rows):
        starts = [operator.index(int(o)) for o in row]
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)) or any(
                o < 0 or o > tokens for o in starts):
            raise ValueError(f"offsets[{index}]: expected increasing offsets in [0, {tokens}], "
                             f"got {list(row)}")
        line = [False] * tokens
        for o in starts:
            if o < tokens:
                line[o] = True
        mask.append(line)
    return xp.asarray(mask, dtype=xp.bool, device=device)


class _Plan(NamedTuple):
    """The chunk grid of one streamed call, decided on the host (see ``_plan``)."""

    steps: int                          # T: chunks per row after padding
    gather: list[int]                   # (B*T*L,) flat token index per chunk slot (-1: zero)
    resets: list[list[bool]]            # (B, T): zero the state before this chunk
    capture: list[int]                  # (B,): the returned state is the one entering chunk k
    token_step: list[int]               # (B*N,): flat (b*T + t) chunk of each token (-1: none)
    pending: list[list[int]]            # (B,): flat indices of the unfinished chunk's tokens
    count: tuple[int, ...]
    forget: list[bool]                  # (B,): the row ends with an empty document


def _plan(counts: Sequence[int], tokens: int, starts: list[list[bool]], length: int,
          valid: list[list[bool]] | None = None) -> _Plan:
    """Chunk each row's stream (unfinished chunk + its valid new tokens), restarting the
    grid at each document start (each document is chunked as if it were alone). A
    document start on a skipped token (``valid`` False) starts the document at the row's
    next valid token; after its last valid token it leaves the row empty (``forget``)."""
    width = length + tokens  # row stride of the concatenation [pending, x]
    rows = []
    for b, count in enumerate(counts):
        keep = list(range(tokens)) if valid is None else [
            n for n in range(tokens) if valid[b][n]]
        row_starts, carried = [], False
        for n in range(tokens):
            carried = carried or starts[b][n]
            if valid is None or valid[b][n]:
                row_starts.append(carried)
                carried = False
        new = len(keep)

        def flat(p: int, b: int = b, count: int = count, keep: list = keep) -> int:
            return b * width + (p if p < count else length + keep[p - count])
        cuts = [i for i in range(new) if row_starts[i]]
        if not cuts or cuts[0] != 0:   # the first document continues the carried state
            segments = [(0, False)]
        else:                          # the unfinished chunk's document has ended
            segments = []
        segments += [(count + i, True) for i in cuts]
        ends = [s for s, _ in segments[1:]] + [count + new]
        chunks, resets, step_of = [], [], []
        for (begin, reset), end in zip(segments, ends, strict=True):
            for a in range(begin, end, length):
                chunks.append([flat(p) for p in range(a, min(a + length, end))])
                resets.append(reset and a == begin)
                step_of += [len(chunks) - 1] * sum(1 for p in range(a, min(a + length, end))
                                                   if p >= count)
        token_step = [-1] * tokens
        for n, t in zip(keep, step_of, strict=True):
            token_step[n] = t
        unfinished = bool(chunks) and len(chunks[-1]) < length
        rows.append((chunks, resets, token_step,
                     len(chunks) - 1 if unfinished else len(chunks),
                     chunks[-1] if unfinished and not carried else [], carried))
    steps = max(len(r[0]) for r in rows)
    gather, resets, capture, token_step, pending, forget = [], [], [], [], [], []
    for b, (chunks, reset, tok, cap, pend, gone) in enumerate(rows):
        chunks = chunks + [[]] * (steps - len(chunks))
        for ch in chunks:
            gather += ch + [-1] * (length - len(ch))
        resets.append(reset + [False] * (steps - len(reset)))
        capture.append(cap)
        token_step += [b * steps + t if t >= 0 else -1 for t in tok]
        pending.append(pend)
        forget.append(gone)
    return _Plan(steps, gather, resets, capture, token_step, pending,
                 tuple(len(p) for p in pending), forget)


def _where_rows(xp: Any, rows: list[bool], a: Any, b: Any) -> Any:
    """``a`` in the rows where ``rows`` is True, else ``b`` (``(B, ...)`` arrays)."""
    if all(rows):
        return a
    mask = xp.asarray(rows, dtype=xp.bool, device=device_of(a))
    return xp.where(xp.reshape(mask, (len(rows),) + (1,) * (a.ndim - 1)), a, b)


def forward_stream(layer: Layer, xp: Any, params: Params, x: Any, state: Any, *, scan: Scan,
                   reset: Any = None, doc_starts: Any = None, valid: Any = None,
                   check: Callable[..., None] | None = None) -> tuple[Any, StreamState]:
    """:meth:`tmcore.layer.Layer.forward_stream` (see there) of ``layer``.

    Without ``doc_starts`` the chunk grid is computed from the arrays (``count``,
    ``valid``, ``reset`` may be traced: ``_array_stream``); with ``doc_starts`` it is
    planned on the host (``_host_stream``), which reads the masks and the counts.

    Parameters
    ----------
    layer : Layer
        The layer whose configuration, heads and read-out run.
    xp, params, x, state, scan, reset, doc_starts, valid, check : see Layer.forward_stream
        The arguments of :meth:`Layer.forward_stream`.

    Returns
    -------
    out : array, shape ``(B, N, d)``
        The outputs (zeros at tokens where ``valid`` is False).
    state : StreamState
        The state after the last token.

    Raises
    ------
    TypeError, ValueError
        As :meth:`Layer.forward_stream`, for the argument they name.
    """
    config = layer.config
    check_tokens(xp, x, config)
    batch, tokens, _ = x.shape
    if doc_starts is None and valid is None and tokens and batch \
            and not isinstance(state, StreamState):
        # from a chunk boundary (no state, or a pair): the chunk grid of Layer.forward,
        # without first building an empty unfinished chunk (the same outputs and state)
        pair = None if state is None else check_state(xp, state, batch, config)
        if check is not None:
            check(x, pair, reset=reset)
        h, c = (zero_state(xp, config, batch, dtype=x.dtype, device=device_of(x))
                if pair is None else pair)
        if reset is not None:
            h, c = reset_state(xp, (h, c), reset)
        return _boundary_stream(layer, xp, params, x, h, c, scan)
    st, known = _stream_state(xp, state, x, config)
    if check is not None:
        check(x, None if state is None else st if isinstance(state, StreamState)
              else (st.h, st.c), reset=reset, doc_starts=doc_starts, valid=valid)
    if valid is not None:
        require_bool_array(xp, valid, "valid", "(B, N)", (batch, tokens))
    if reset is not None:
        reset_state(xp, (st.h, st.c), reset)  # validated like the pair path's reset
    if doc_starts is not None:
        return _host_stream(layer, xp, params, x, st, known, scan, reset, doc_starts, valid)
    return _array_stream(layer, xp, params, x, st, known, scan, reset, valid)


def check_valid(xp: Any, valid: Any, batch: int, tokens: int) -> list[list[bool]]:
    """``valid``: a bool array ``(B, N)``, False at tokens the stream skips (padding);
    returned as host lists."""
    require_bool_array(xp, valid, "valid", "(B, N)", (batch, tokens))
    return [[bool(v) for v in row] for row in _host_bools(valid, "valid", _PACKED_WHY)]


def _rows(xp: Any, mask: Any, a: Any, b: Any) -> Any:
    """``a`` in the rows where the bool array ``mask (B,)`` is True, else ``b``."""
    return xp.where(xp.reshape(mask, (mask.shape[0],) + (1,) * (a.ndim - 1)), a, b)


def _maybe_host(value: Any) -> Any:
    """``value``'s host lists when it can be read without tracing (else ``None``)."""
    if _is_traced(value):
        return None
    try:
        return _host_list(value, "", "")
    except TypeError:
        return None


def _array_stream(layer: Layer, xp: Any, params: Params, x: Any, st: StreamState,
                  known: tuple[int, ...] | None, scan: Scan, reset: Any,
                  valid: Any) -> tuple[Any, StreamState]:
    """The stream with its chunk grid computed from arrays (no host reads of traced
    values, fixed shapes for fixed ``N``): row ``b``'s stream is its ``count[b]`` pending
    tokens followed by its (valid) new tokens; chunk ``j`` is stream positions
    ``[jL, (j+1)L)``, gathered from ``[pending, x]`` by per-row indices. The scan runs
    ``T = ceil((max count + N) / L)`` chunks for every row; a row's returned state is
    the one after its ``m[b] = (count[b] + new[b]) // L`` complete chunks, so the scan is
    cut at every value ``m`` can take (two neighbouring values without ``valid``) and
    each row selects its own. A ``scan`` with a ``cond(pred, true_fn, false_fn)``
    attribute (JAX: ``lax.cond``) skips the update of a one-step segment whose state no
    row keeps (a decode step that completes no chunk): only its read is computed.
    Every read is the one of the state entering its chunk (chunks ``<= m[b]`` all
    advance the state), so the outputs are exact."""
    config = layer.config
    batch, tokens, d = x.shape
    length, channels = config.chunk_size, config.memory_channels
    device = device_of(x)
    index = xp.asarray(0, device=device).dtype                  # the default integer dtype
    h, c, pending, read = st.h, st.c, xp.astype(st.pending, x.dtype), st.read
    count = xp.astype(st.count, index)
    if reset is not None:
        h, c, pending, read = (_rows(xp, reset, xp.zeros_like(v), v)
                               for v in (h, c, pending, read))
        count = xp.where(reset, xp.zeros_like(count), count)
        flags = None if known is None or not any(known) else _maybe_host(reset)
        known = None if known is None else (
            known if not any(known) else None if flags is None else
            tuple(0 if r else k for r, k in zip(flags, known, strict=True)))
    if tokens == 0 or batch == 0:
        return xp.zeros_like(x), StreamState(h, c, pending, xp.astype(count, xp.int32), read)
    if known is not None and not any(known) and valid is None:
        return _boundary_stream(layer, xp, params, x, h, c, scan)
    # per row: the new tokens, compacted (valid ones first, in order), and how many
    rows = xp.arange(batch, dtype=index, device=device)[:, None]
    if valid is None:
        new = xp.full((batch,), tokens, dtype=index, device=device)
        rank = xp.broadcast_to(xp.arange(tokens, dtype=index, device=device)[None, :],
                               (batch, tokens))
        compact = x
        counts_new = (tokens, tokens)
    else:
        ones = xp.astype(valid, index)
        new = xp.sum(ones, axis=1)
        rank = xp.cumulative_sum(ones, axis=1) - 1
        order = xp.argsort(1 - ones, axis=1, stable=True)
        compact = xp.reshape(xp.take(xp.reshape(x, (batch * tokens, d)),
                                     xp.reshape(rows * tokens + order, (-1,)), axis=0),
                             (batch, tokens, d))
        host = _maybe_host(valid)
        counts_new = ((0, tokens) if host is None else
                      (min(sum(r) for r in host), max(sum(r) for r in host)))
    k_lo, k_hi = (0, length - 1) if known is None else (min(known), max(known))
    m_lo, m_hi = (k_lo + counts_new[0]) // length, (k_hi + counts_new[1]) // length
    steps = -(-(k_hi + counts_new[1]) // length)              # T: chunks holding a token
    width = length + tokens
    table = xp.concat([xp.reshape(xp.concat([pending, compact], axis=1), (batch * width, d)),
                       xp.zeros_like(x[0, :1, :])], axis=0)    # + a zero row

    def source(p: Any) -> Any:
        """Flat row of ``table`` holding stream position ``p (B, P)`` (zero row: none)."""
        k = count[:, None]
        inside = p < k + new[:, None]
        at = rows * width + xp.where(p < k, p, length + p - k)
        return xp.reshape(xp.where(inside, at, xp.full_like(at, batch * width)), (-1,))

    m = (count + new) // length                                # complete chunks per row
    left = count + new - m * length                            # the new unfinished chunk
    if steps:
        positions = xp.arange(steps * length, dtype=index, device=device)[None, :]
        chunks = xp.reshape(xp.take(table, source(positions), axis=0),
                            (batch, steps, length, d))
        inputs = layer.heads(xp, params, chunks)               # once over all B*T chunks
        cuts = sorted({0, steps, *range(m_lo, min(m_hi, steps) + 1)})
        states = {0: (h, c)}
        parts = []
        cond = getattr(scan, "cond", None)
        for t0, t1 in zip(cuts, cuts[1:], strict=False):
            segment = type(inputs)(*(v[:, t0:t1, ...] for v in inputs))
            if cond is not None and t1 == t0 + 1 and t1 > m_lo:
                # the state after this one step serves only rows with m >= t1: where no
                # row has one (a decode step that completes no chunk), skip the update
                # and read the state as it is (a framework's lax.cond-like `scan.cond`)
                def update(h=h, c=c, segment=segment):
                    return scan(h, c, segment)

                def read_only(h=h, c=c, segment=segment):
                    return trilinear_sample(h, segment.read_coords), h, c

                part, h, c = cond(xp.any(m >= t1), update, read_only)
            else:
                part, h, c = scan(h, c, segment)
            parts.append(part)
            states[t1] = (h, c)
        reads = parts[0] if len(parts) == 1 else xp.concat(parts, axis=1)   # (B, T, C)
        # a continued unfinished chunk's read is the one the state carries
        first = _rows(xp, count > 0, read, reads[:, 0, :])
        reads = xp.concat([first[:, None, :], reads[:, 1:, :]], axis=1) if steps > 1 \
            else first[:, None, :]
        h, c = states[m_lo]
        for t in range(m_lo + 1, min(m_hi, steps) + 1):
            pick = m == t
            h = _rows(xp, pick, states[t][0], h)
            c = _rows(xp, pick, states[t][1], c)
        out_table = xp.concat([xp.reshape(layer.read_out(xp, params, reads),
                                          (batch * steps, d)),
                               xp.zeros_like(x[0, :1, :])], axis=0)
        at = rows * steps + (count[:, None] + rank) // length
        if valid is not None:
            at = xp.where(valid, at, xp.full_like(at, batch * steps))
        out = xp.reshape(xp.take(out_table, xp.reshape(at, (-1,)), axis=0), (batch, tokens, d))
        read_table = xp.concat([xp.reshape(reads, (batch * steps, channels)),
                                xp.zeros_like(read[:1, :])], axis=0)
        last = xp.full_like(m, steps - 1)  # (not minimum(m, int): torch.compile traces this)
        pick = xp.where(left > 0, rows[:, 0] * steps + xp.where(m < last, m, last),
                        xp.full_like(m, batch * steps))
        read = xp.take(read_table, pick, axis=0)
    else:  # no row has a token (all padding) nor an unfinished chunk
        out = xp.zeros_like(x)
    # the new unfinished chunk: stream positions m L .. m L + L - 1 (zeros after the stream)
    slots = m[:, None] * length + xp.arange(length, dtype=index, device=device)[None, :]
    pending = xp.reshape(xp.take(table, source(slots), axis=0), (batch, length, d))
    return out, StreamState(h, c, pending, xp.astype(left, xp.int32), read)


def _boundary_stream(layer: Layer, xp: Any, params: Params, x: Any, h: Any, c: Any,
                     scan: Scan) -> tuple[Any, StreamState]:
    """:func:`_array_stream` from a chunk boundary (every count 0, no ``valid``): the chunk
    grid is the one of :meth:`Layer.forward` (slices and zero padding, nothing gathered
    across rows), the scan cut after the ``N // L`` complete chunks when the last one is
    ragged; the ragged chunk is kept as the unfinished one."""
    config = layer.config
    batch, tokens, d = x.shape
    length = config.chunk_size
    full, left = divmod(tokens, length)
    device = device_of(x)
    inputs = layer.heads(xp, params, chunk(xp, x, length))      # (B, T, ...) each
    if full:
        reads, h, c = scan(h, c, type(inputs)(*(v[:, :full, ...] for v in inputs))
                           if left else inputs)
    if left:
        last, _, _ = scan(h, c, type(inputs)(*(v[:, full:, ...] for v in inputs)))
        reads = xp.concat([reads, last], axis=1) if full else last
        # the padding derived from x keeps x's sharding (a JAX Explicit mesh refuses
        # to concatenate a batch-sharded array with a fresh, replicated one)
        pending = xp.concat([x[:, full * length:, :],
                             xp.broadcast_to(xp.zeros_like(x[:, :1, :]),
                                             (batch, length - left, d))], axis=1)
        read = last[:, 0, :]
    else:
        pending = xp.zeros((batch, length, d), dtype=x.dtype, device=device)
        read = xp.zeros((batch, config.memory_channels), dtype=reads.dtype, device=device)
    count = xp.full((batch,), left, dtype=getattr(xp, COUNT_DTYPE), device=device)
    out = unchunk(xp, layer.read_out(xp, params, reads), tokens, length)
    return out, StreamState(h, c, pending, count, read)


def _host_stream(layer: Layer, xp: Any, params: Params, x: Any, st: StreamState,
                 known: tuple[int, ...] | None, scan: Scan, reset: Any, doc_starts: Any,
                 valid: Any) -> tuple[Any, StreamState]:
    """The stream with its chunk grid planned on the host (packed documents: the grid
    restarts at every document start, ``_plan``)."""
    config = layer.config
    batch, tokens, d = x.shape
    length = config.chunk_size
    starts = check_doc_starts(xp, doc_starts, batch, tokens)
    keep = check_valid(xp, valid, batch, tokens) if valid is not None else None
    counts = list(known) if known is not None else [
        int(k) for k in _host_list(st.count, "state.count", _PACKED_WHY)]
    if reset is not None:
        for b, r in enumerate(_host_bools(reset, "reset", _PACKED_WHY)):
            if r:
                if tokens:
                    starts[b][0] = True
                else:  # no token to start at: forget the state now
                    st, counts[b] = _forget_rows(xp, st, b), 0
    st = st._replace(count=counts)
    if tokens == 0 or batch == 0:
        return xp.zeros_like(x), st._replace(count=_count_array(xp, counts, device_of(x)))
    plan = _plan(counts, tokens, starts, length, keep)
    device = device_of(x)
    both = xp.concat([xp.astype(st.pending, x.dtype), x], axis=1)      # (B, L + N, d)
    flat = xp.concat([xp.reshape(both, (batch * (length + tokens), d)),
                      xp.zeros_like(x[0, :1, :])], axis=0)              # + a zero row (-1)
    def take(table: Any, index: list[int]) -> Any:
        return xp.take(table, xp.asarray(index, device=device), axis=0)  # default int dtype
    # the continued unfinished chunk whose read is already known: nothing to scan
    only_pending = plan.steps == 1 and all(
        0 < k and not r[0] and cap == 0
        for k, r, cap in zip(counts, plan.resets, plan.capture, strict=True))
    if plan.steps == 0:  # no row has a token or an unfinished chunk
        reads = xp.zeros((batch, 0, config.memory_channels), dtype=x.dtype, device=device)
        h, c = st.h, st.c
    elif only_pending:
        reads = st.read[:, None, :]
        h, c = st.h, st.c
    else:
        chunks = xp.reshape(take(flat, plan.gather), (batch, plan.steps, length, d))
        reads, h, c = _segmented_scan(layer, xp, params, chunks, st, plan, scan)
    if plan.steps:
        out_rows = layer.read_out(xp, params, reads)                    # (B, T, d)
        out_table = xp.concat([xp.reshape(out_rows, (batch * plan.steps, d)),
                               xp.zeros_like(out_rows[0, :1, :])], axis=0)
        out = xp.reshape(take(out_table, plan.token_step), (batch, tokens, d))
    else:
        out = xp.zeros_like(x)
    pending = xp.reshape(take(flat, [i for p in plan.pending
                                     for i in p + [-1] * (length - len(p))]),
                         (batch, length, d))
    channels = config.memory_channels
    read_table = xp.concat([xp.reshape(reads, (batch * plan.steps, channels)),
                            xp.zeros_like(st.read[:1, :])], axis=0)
    read = take(read_table, [b * plan.steps + k if plan.count[b] else -1
                             for b, k in enumerate(plan.capture)])
    if any(plan.forget):
        keep_rows = [not f for f in plan.forget]
        h = _where_rows(xp, keep_rows, h, xp.zeros_like(h))
        c = _where_rows(xp, keep_rows, c, xp.zeros_like(c))
    return out, StreamState(h, c, pending, _count_array(xp, plan.count, device), read)


def _forget_rows(xp: Any, st: StreamState, row: int) -> StreamState:
    rows = [b != row for b in range(st.h.shape[0])]
    h, c, pending, read = (_where_rows(xp, rows, v, xp.zeros_like(v))
                           for v in (st.h, st.c, st.pending, st.read))
    return st._replace(h=h, c=c, pending=pending, read=read)


def _segmented_scan(layer: Layer, xp: Any, params: Params, chunks: Any, st: StreamState,
                    plan: _Plan, scan: Scan) -> tuple[Any, Any, Any]:
    """Scan the planned chunks; the scan is cut where a row resets (document start) or
    where a row's returned state is taken, so each row gets exactly the state entering
    its unfinished chunk (or after its last chunk). The heads run once over all the
    ``(B, T)`` chunks; each segment scans its slice of them."""
    batch = chunks.shape[0]
    inputs = layer.heads(xp, params, chunks)                   # (B, T, ...) each
    cuts = {0, plan.steps, *plan.capture}
    cuts |= {t for row in plan.resets for t, r in enumerate(row) if r}
    cuts_sorted = sorted(cuts)
    h, c = st.h, st.c
    final_h = final_c = None
    reads = []
    for t0, t1 in zip(cuts_sorted, cuts_sorted[1:] + [None], strict=True):
        if t0 < plan.steps:
            rows = [plan.resets[b][t0] for b in range(batch)]
            if any(rows):
                keep = [not r for r in rows]
                h = _where_rows(xp, keep, h, xp.zeros_like(h))
                c = _where_rows(xp, keep, c, xp.zeros_like(c))
        taken = [plan.capture[b] == t0 for b in range(batch)]
        if any(taken):
            final_h = h if final_h is None else _where_rows(xp, taken, h, final_h)
            final_c = c if final_c is None else _where_rows(xp, taken, c, final_c)
        if t1 is None:
            break
        part, h, c = scan(h, c, type(inputs)(*(v[:, t0:t1, ...] for v in inputs)))
        reads.append(part)
    return xp.concat(reads, axis=1), final_h, final_c

