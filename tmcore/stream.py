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
from collections.abc import Sequence
from typing import Any, NamedTuple

from tmcore.scan import StepInputs

__all__ = ["StreamState", "check_doc_starts", "doc_starts_from_offsets", "forward_stream",
           "stream_state"]


class StreamState(NamedTuple):
    """A layer's state between streamed calls, valid at ANY token (not only at chunk ends).

    - ``h``, ``c`` ``(B, C, *S)``: the state entering the unfinished chunk (after the
      last complete chunk);
    - ``pending`` ``(B, L, d)``: the unfinished chunk's tokens so far (its head inputs;
      the write needs all ``L`` of them), zeros after ``count[b]``;
    - ``count``: per row, how many tokens the unfinished chunk holds (``0 .. L-1``; a
      tuple of Python ints, because the chunk grid is decided on the host);
    - ``read`` ``(B, C)``: the unfinished chunk's read (fixed by its first token and
      ``h``: the read happens before the chunk's write), zeros where ``count`` is 0.

    Feeding a sequence in pieces of any lengths, carrying this state, equals one long
    call (:meth:`Layer.forward_stream`). A plain ``(h, c)`` pair is the state at a
    chunk boundary (``count`` all 0) and is accepted wherever a ``StreamState`` is.
    """

    h: Any
    c: Any
    pending: Any
    count: tuple[int, ...]
    read: Any


def stream_state(xp: Any, state: Any, x: Any, config: LayerConfig) -> StreamState:
    """``state`` (``None``, an ``(h, c)`` pair or a :class:`StreamState`) for tokens
    ``x (B, N, d)`` as a checked :class:`StreamState` (zeros / an empty unfinished chunk
    where the state does not say otherwise)."""
    batch = x.shape[0]
    device = _device(x)
    empty = xp.zeros((batch, config.chunk_size, config.embed_dim), dtype=x.dtype, device=device)
    if state is None:
        h, c = zero_state(xp, config, batch, dtype=x.dtype, device=device)
        return StreamState(h, c, empty, (0,) * batch,
                           xp.zeros((batch, config.memory_channels), dtype=x.dtype,
                                    device=device))
    if not isinstance(state, StreamState):
        h, c = check_state(xp, state, batch, config)
        return StreamState(h, c, empty, (0,) * batch, xp.zeros((batch, config.memory_channels),
                                                  dtype=h.dtype, device=device))
    h, c = check_state(xp, (state.h, state.c), batch, config)
    expected = (batch, config.chunk_size, config.embed_dim)
    if not hasattr(state.pending, "shape") or tuple(state.pending.shape) != expected:
        raise ValueError(f"state.pending: expected shape (B, L, d) = {expected}, got "
                         f"{getattr(state.pending, 'shape', type(state.pending).__name__)}")
    if not hasattr(state.read, "shape") or \
            tuple(state.read.shape) != (batch, config.memory_channels):
        raise ValueError(f"state.read: expected shape (B, C) = "
                         f"{(batch, config.memory_channels)}, got "
                         f"{getattr(state.read, 'shape', type(state.read).__name__)}")
    count = state.count
    try:  # Python or NumPy ints, or concrete 0-d integer arrays
        count = tuple(operator.index(k) for k in count) if not isinstance(count, bool) \
            and all(not isinstance(k, bool) for k in count) else None
    except TypeError as error:
        if "Tracer" in type(error).__name__ or "tracer" in str(error).lower():
            raise TypeError("state.count: must be concrete Python ints (the chunk grid is "
                            "planned on the host); under jax.jit close over the state or "
                            "stream outside jit") from error
        count = None
    if count is None or len(count) != batch or not all(
            0 <= k < config.chunk_size for k in count):
        raise ValueError(f"state.count: expected {batch} ints in [0, {config.chunk_size}) "
                         f"(tokens of each row's unfinished chunk), got {state.count!r}")
    return StreamState(h, c, state.pending, count, state.read)


def _host_bools(mask: Any) -> list:
    """A bool array's values as nested Python lists (on the host)."""
    if hasattr(mask, "tolist"):
        try:
            return mask.tolist()
        except Exception:  # e.g. array-api-strict arrays have no tolist
            pass
    # element by element through 0-d arrays: slow, but only namespaces without tolist get here
    if mask.ndim == 0:
        return bool(mask)
    return [_host_bools(mask[i, ...]) for i in range(mask.shape[0])]


def check_doc_starts(xp: Any, doc_starts: Any, batch: int, tokens: int) -> list[list[bool]]:
    """``doc_starts``: a bool array ``(B, N)``, True at every token that starts a new
    document (the layer forgets everything before it); returned as host lists."""
    _require_bool_array(xp, doc_starts, "doc_starts", "(B, N)", (batch, tokens))
    return [[bool(v) for v in row] for row in _host_bools(doc_starts)]


def doc_starts_from_offsets(xp: Any, offsets: Sequence[Any], tokens: int, *,
                            device: Any = None) -> Any:
    """``cu_seqlens``-style offsets to the per-token mask :meth:`Layer.forward_stream` takes.

    ``offsets``: for one row, the increasing start offsets of its documents (e.g.
    ``[0, 5, 12]``, optionally ending with ``tokens``); or one such list per row.
    Returns a bool array ``(B, tokens)``, True at each document start.
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
    mask = xp.asarray(rows, dtype=xp.bool, device=_device(a))
    return xp.where(xp.reshape(mask, (len(rows),) + (1,) * (a.ndim - 1)), a, b)


def forward_stream(layer: Layer, xp: Any, params: Params, x: Any, state: Any, *, scan: Scan,
                   reset: Any = None, doc_starts: Any = None,
                   valid: Any = None) -> tuple[Any, StreamState]:
    """:meth:`tmcore.layer.Layer.forward_stream` (see there) of ``layer``."""
    config = layer.config
    check_tokens(xp, x, config)
    batch, tokens, d = x.shape
    length = config.chunk_size
    st = stream_state(xp, state, x, config)
    starts = (check_doc_starts(xp, doc_starts, batch, tokens) if doc_starts is not None
              else [[False] * tokens for _ in range(batch)])
    keep = check_valid(xp, valid, batch, tokens) if valid is not None else None
    if reset is not None:
        # validated like the pair path's reset; rows that reset start a new document here
        reset_state(xp, (st.h, st.c), reset)
        for b, r in enumerate(_host_bools(reset)):
            if r:
                if tokens:
                    starts[b][0] = True
                else:  # no token to start at: forget the state now
                    st = _forget_rows(xp, st, b)
    if tokens == 0 or batch == 0:
        return xp.zeros_like(x), st
    plan = _plan(st.count, tokens, starts, length, keep)
    device = _device(x)
    both = xp.concat([xp.astype(st.pending, x.dtype), x], axis=1)      # (B, L + N, d)
    flat = xp.concat([xp.reshape(both, (batch * (length + tokens), d)),
                      xp.zeros_like(x[0, :1, :])], axis=0)              # + a zero row (-1)
    def take(table: Any, index: list[int]) -> Any:
        return xp.take(table, xp.asarray(index, device=device), axis=0)  # default int dtype
    # the continued unfinished chunk whose read is already known: nothing to scan
    only_pending = plan.steps == 1 and all(
        0 < k and not r[0] and cap == 0
        for k, r, cap in zip(st.count, plan.resets, plan.capture, strict=True))
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
        out_rows = xp.stack([layer.read_out(xp, params, reads[:, t, ...])
                             for t in range(plan.steps)], axis=1)       # (B, T, d)
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
    return out, StreamState(h, c, pending, plan.count, read)


def check_valid(xp: Any, valid: Any, batch: int, tokens: int) -> list[list[bool]]:
    """``valid``: a bool array ``(B, N)``, False at tokens the stream skips (padding);
    returned as host lists."""
    _require_bool_array(xp, valid, "valid", "(B, N)", (batch, tokens))
    return [[bool(v) for v in row] for row in _host_bools(valid)]


def _forget_rows(xp: Any, st: StreamState, row: int) -> StreamState:
    rows = [b == row for b in range(len(st.count))]
    zero = [xp.zeros_like(v) for v in (st.h, st.c, st.pending, st.read)]
    h, c, pending, read = (_where_rows(xp, [not r for r in rows], v, z)
                           for v, z in zip((st.h, st.c, st.pending, st.read), zero,
                                           strict=True))
    return StreamState(h, c, pending, tuple(0 if r else k for r, k in zip(rows, st.count,
                                                                          strict=True)), read)


def _segmented_scan(layer: Layer, xp: Any, params: Params, chunks: Any, st: StreamState,
                    plan: _Plan, scan: Scan) -> tuple[Any, Any, Any]:
    """Scan the planned chunks; the scan is cut where a row resets (document start) or
    where a row's returned state is taken, so each row gets exactly the state entering
    its unfinished chunk (or after its last chunk)."""
    batch = chunks.shape[0]
    per_step = [layer.heads(xp, params, chunks[:, t, ...]) for t in range(plan.steps)]
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
        inputs = StepInputs(*(xp.stack(list(v), axis=1)
                              for v in zip(*per_step[t0:t1], strict=True)))
        part, h, c = scan(h, c, inputs)
        reads.append(part)
    return xp.concat(reads, axis=1), final_h, final_c


# tmcore.layer imports this module at its end (it re-exports the names above), so the
# layer's names are imported last here: either module may be imported first.
from tmcore.layer import (  # noqa: E402
    Layer,
    LayerConfig,
    Params,
    Scan,
    _device,
    _require_bool_array,
    check_state,
    check_tokens,
    reset_state,
    zero_state,
)
