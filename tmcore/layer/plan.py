"""The chunk grid of a layer call as data (:class:`Plan`), its planners, and its ONE executor.

A call's tokens ``x (B, N, d)`` continue each row's unfinished chunk (``state.count[b]``
tokens in ``state.pending``); the grid says which tokens form each of the ``T`` chunks
the scan steps through, where a row's state is zeroed (a document start), which state
each row returns (the one entering its new unfinished chunk), where each token's output
comes from, and what the new unfinished chunk holds. Three planners make it:

- :func:`contiguous_plan` -- from a chunk boundary, without padding masks or documents:
  the chunks are ``x`` itself, zero-padded (:func:`tmcore.layer.chunk`); the
  non-streaming call writes the ragged last chunk, the streaming one keeps it;
- :func:`array_plan` -- streaming and padding (``valid``): the grid computed by array
  operations (traceable: ``count``, ``reset`` and ``valid`` may be traced), the scan cut
  at every value a row's chunk count can take, each row picking its own state;
- :func:`host_plan` -- packed documents (``doc_starts``): the grid restarts at every
  document start, planned on the host from the masks' values;
- :func:`packed_plan` -- packed documents with a caller-given bound on the documents
  starting per row (``max_documents``): the same grid computed by array operations
  (traceable), padded to a fixed ``T``; the scan is not cut: its per-step masks zero a
  row's state where its document starts and freeze it from the chunk whose entering
  state the row returns (a scan taking masks, e.g. the JAX adapter's).

:func:`execute` runs any of them: the heads once over all ``B*T`` chunks, the scan in
segments between the plan's cuts (or, with per-step masks, once), the read-out once, and
the gathers back to tokens.

Every gather is per row (``take_along_axis`` along axis 1 of a ``(B, R, k)`` table whose
last slot is zeros): an index never crosses the batch axis, so a batch-sharded call
(a JAX mesh, under ``jit`` or ``shard_map``) reads only its own rows and nothing is
all-gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import array_api_compat

from tmcore.layer.heads import chunk, unchunk
from tmcore.layer.params import Params
from tmcore.layer.state import keep_rows, where_rows
from tmcore.types import device_of

if TYPE_CHECKING:
    from tmcore.layer.layer import Layer, Scan
    from tmcore.layer.stream import StreamState

__all__ = ["Plan", "array_plan", "contiguous_plan", "execute", "host_plan", "packed_plan",
           "packed_steps"]


class Plan(NamedTuple):
    """One call's chunk grid (``T`` chunks per row); ``B`` rows, ``N`` tokens, ``L`` the
    chunk size. The token table is ``[pending, x, 0]`` per row: ``L + N`` tokens and a
    zero slot (index ``L + N``); every index is a position within its own row.

    Parameters
    ----------
    steps : int
        ``T``, the chunks every row is scanned through.
    table : array, shape ``(B, L + N + 1, d)``, or None
        The token table (``None``: the chunks are ``x`` itself, zero-padded).
    gather : int array, shape ``(B, T L)``, or None
        The table slot of every chunk slot of the row.
    cuts : tuple of int
        Where the scan is cut (``0`` and ``T`` included).
    resets : dict of int to bool array ``(B,)``
        Before chunk ``t``, zero the state of the marked rows.
    capture : tuple of int
        The cuts whose entering state some row returns.
    taken : int array, shape ``(B,)``, or None
        Each row's returned state: the one entering chunk ``taken[b]`` (``None``: the
        one capture).
    skip_after : int or None
        A one-step segment ending after this chunk may skip its update when no row
        takes its state (a scan with a ``cond``).
    carried : bool array, shape ``(B,)``, or None
        Rows whose chunk 0 is the continued unfinished one: its read is the state's.
    carried_only : bool
        Every row's only chunk is its carried one: nothing to scan.
    out_index : int array, shape ``(B, N)``, or None
        Each token's slot of its row's ``(T + 1, d)`` outputs (``T``: zeros);
        ``None``: chunk ``t``'s output on its own tokens (:func:`tmcore.layer.unchunk`).
    pending_index : int array, shape ``(B, L)``, or None
        The new unfinished chunk's table slots (``None`` in a contiguous plan).
    count : int array, shape ``(B,)``, or int, or None
        The new unfinished chunk's tokens (an int: every row's; ``None``: a
        non-streaming call, which returns ``(h, c)``).
    read_pick : int array, shape ``(B,)``, or None
        Each row's read of the new unfinished chunk: its slot of the row's ``(T + 1, C)``
        reads (``T``: zeros).
    forget : bool array, shape ``(B,)``, or None
        Rows whose stream ends with an empty document: their state is zeroed.
    step_resets : bool array, shape ``(B, T)``, or None
        Per-step masks for ONE uncut scan (a scan taking ``reset=`` / ``active=``):
        zero row ``b``'s state entering chunk ``t`` where True; row ``b`` is active
        (updates its state) at the chunks before ``taken[b]`` only, so the scan's final
        state is each row's returned one. ``None``: the cuts and ``resets`` say it.
    """

    steps: int
    table: Any
    gather: Any
    cuts: tuple[int, ...]
    resets: dict
    capture: tuple[int, ...]
    taken: Any
    skip_after: int | None
    carried: Any
    carried_only: bool
    out_index: Any
    pending_index: Any
    count: Any
    read_pick: Any
    forget: Any
    step_resets: Any = None


def _zero_slot(xp: Any, *parts: Any) -> Any:
    """The per-row table ``(B, R + 1, k)``: ``parts (B, R_i, k)`` along axis 1, then a
    zero slot (index ``R``). The zeros are derived from a part, so they keep its
    sharding (a JAX Explicit mesh refuses to join a batch-sharded array and a fresh one)."""
    last = parts[-1]
    return xp.concat([*parts, xp.zeros_like(last[:, :1, :])], axis=1)


def _take_rows(xp: Any, table: Any, index: Any) -> Any:
    """``table (B, R, k)`` at each row's own slots ``index (B, K)`` (in ``[0, R)``):
    ``(B, K, k)``.

    A gather along axis 1 only (never across rows): a batch-sharded table is read
    where it lies."""
    if array_api_compat.is_torch_namespace(xp):
        # one gather: the namespace's take_along_axis also wraps negative indices and
        # broadcasts the table (four more dispatched ops per gather); these are >= 0
        shape = (index.shape[0], index.shape[1], table.shape[2])
        return table.gather(1, xp.broadcast_to(index[:, :, None], shape))
    return xp.take_along_axis(table, index[:, :, None], axis=1)


def _compact(xp: Any, x: Any, valid: Any, index: Any, j: Any = None
             ) -> tuple[Any, Any, Any, Any]:
    """The valid tokens of ``x (B, N, d)`` first, in order: ``(new (B,), rank (B, N),
    compact x, order (B, N) or None)`` (``valid`` None: every token; ``j``: the token
    positions ``(1, N)``, if made already). ``index``: the integer dtype."""
    batch, tokens, _ = x.shape
    if valid is None:
        device = device_of(x)
        new = xp.full((batch,), tokens, dtype=index, device=device)
        j = xp.arange(tokens, dtype=index, device=device)[None, :] if j is None else j
        return new, xp.broadcast_to(j, (batch, tokens)), x, None
    ones = xp.astype(valid, index)
    new = xp.sum(ones, axis=1)
    rank = xp.cumulative_sum(ones, axis=1) - 1
    order = xp.argsort(1 - ones, axis=1, stable=True)
    return new, rank, _take_rows(xp, x, order), order


# --------------------------------------------------------------------------- planners


def contiguous_plan(tokens: int, length: int, stream: bool) -> Plan:
    """The grid from a chunk boundary: ``x`` chunked as it is. ``stream``: keep a ragged
    last chunk as the unfinished one (else it is zero-padded and written)."""
    # (no divmod, sets or dicts of sizes: torch.compile traces them as symbols, which
    # must not be hashed or they specialize to one length)
    steps = -(-tokens // length)
    full = tokens // length
    left = tokens - full * length
    ragged = stream and left
    cuts = ((0, full, steps) if full else (0, steps)) if ragged else (0, steps)
    return Plan(steps, None, None, cuts, {}, (full if ragged else steps,), None, None, None,
                False, None, None, left if stream else None, None, None)


def array_plan(xp: Any, x: Any, count: Any, known: tuple[int, ...] | None, valid: Any,
               pending: Any, length: int, valid_counts: tuple[int, int] | None) -> Plan:
    """The streaming grid computed from arrays (fixed shapes for a fixed ``N``).

    Row ``b``'s stream is its ``count[b]`` pending tokens followed by its valid new
    tokens (``valid`` False: skipped); chunk ``j`` is stream positions
    ``[jL, (j+1)L)``. Every row runs ``T = ceil((max count + N) / L)`` chunks and returns
    the state after its ``m[b] = (count[b] + new[b]) // L`` complete ones, so the scan is
    cut at every value ``m`` can take. ``known``: the counts as Python ints, when known
    without reading an array; ``valid_counts``: the fewest and most valid tokens of a
    row, when known.
    """
    batch, tokens, d = x.shape
    device = device_of(x)
    index = xp.asarray(0, device=device).dtype                  # the default integer dtype
    new, rank, compact, _ = _compact(xp, x, valid, index)
    valid_counts = (tokens, tokens) if valid is None else valid_counts or (0, tokens)
    k_lo, k_hi = (0, length - 1) if known is None else (min(known), max(known))
    m_lo = (k_lo + valid_counts[0]) // length
    steps = -(-(k_hi + valid_counts[1]) // length)             # T: chunks holding a token
    m_hi = min((k_hi + valid_counts[1]) // length, steps)
    table = _zero_slot(xp, pending, compact)                   # (B, L + N + 1, d)

    def source(p: Any) -> Any:
        """Table slot of stream position ``p (B, P)`` (``L + N``, the zero slot: none)."""
        k = count[:, None]
        at = xp.where(p < k, p, length + p - k)
        return xp.where(p < k + new[:, None], at, xp.full_like(at, length + tokens))

    m = (count + new) // length                                # complete chunks per row
    left = count + new - m * length                            # the new unfinished chunk
    positions = xp.arange(steps * length, dtype=index, device=device)[None, :]
    out_index = (count[:, None] + rank) // length
    if valid is not None:
        out_index = xp.where(valid, out_index, xp.full_like(out_index, steps))
    last = xp.full_like(m, max(steps - 1, 0))  # (not minimum(m, int): torch.compile traces it)
    read_pick = xp.where(left > 0, xp.where(m < last, m, last), xp.full_like(m, steps))
    slots = m[:, None] * length + xp.arange(length, dtype=index, device=device)[None, :]
    capture = tuple(range(m_lo, m_hi + 1))
    return Plan(steps, table, source(positions), tuple(sorted({0, steps, *capture})), {},
                capture, m if len(capture) > 1 else None, m_lo, count > 0, False,
                out_index, source(slots), left, read_pick, None)


def host_plan(xp: Any, x: Any, pending: Any, counts: Sequence[int],
              starts: list[list[bool]], length: int, valid: list[list[bool]] | None) -> Plan:
    """The packed-documents grid, planned on the host: each row's stream (unfinished chunk
    + its valid new tokens) is chunked document by document, so the grid restarts at
    every document start. A start on a skipped token starts the document at the row's
    next valid token; after its last valid token it leaves the row empty (``forget``)."""
    batch, tokens, d = x.shape
    zero = length + tokens  # the zero slot of each row of the table [pending, x, 0]
    rows = []
    for b, count in enumerate(counts):
        keep = [n for n in range(tokens) if valid is None or valid[b][n]]
        row_starts, carried = [], False
        for n in range(tokens):
            carried = carried or starts[b][n]
            if valid is None or valid[b][n]:
                row_starts.append(carried)
                carried = False
        new = len(keep)

        def slot(p: int, count: int = count, keep: list = keep) -> int:
            return p if p < count else length + keep[p - count]

        cuts = [i for i in range(new) if row_starts[i]]
        # the first document continues the carried state unless the row starts one at once
        segments = [] if cuts and cuts[0] == 0 else [(0, False)]
        segments += [(count + i, True) for i in cuts]
        ends = [s for s, _ in segments[1:]] + [count + new]
        chunks, resets, step_of = [], [], []
        for (begin, reset), end in zip(segments, ends, strict=True):
            for a in range(begin, end, length):
                chunks.append([slot(p) for p in range(a, min(a + length, end))])
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
    gather, resets, capture, token_step, pending_rows, forget = [], [], [], [], [], []
    for chunks, reset, tok, cap, pend, gone in rows:
        chunks = chunks + [[]] * (steps - len(chunks))
        gather.append([i for ch in chunks for i in ch + [zero] * (length - len(ch))])
        resets.append(reset + [False] * (steps - len(reset)))
        capture.append(cap)
        token_step.append([t if t >= 0 else steps for t in tok])
        pending_rows.append(pend + [zero] * (length - len(pend)))
        forget.append(gone)
    device = device_of(x)

    def ints(values: list) -> Any:
        return xp.asarray(values, device=device)  # the default integer dtype

    def bools(values: list[bool]) -> Any:
        return xp.asarray(values, dtype=xp.bool, device=device)

    at_reset = {t: bools([resets[b][t] for b in range(batch)]) for t in range(steps)
                if any(resets[b][t] for b in range(batch))}
    kept = tuple(sorted(set(capture)))
    carried = [counts[b] > 0 and not (steps and resets[b][0]) for b in range(batch)]
    table = _zero_slot(xp, xp.astype(pending, x.dtype), x)      # (B, L + N + 1, d)
    new_counts = [sum(1 for i in p if i != zero) for p in pending_rows]
    return Plan(steps, table, ints(gather), tuple(sorted({0, steps, *kept, *at_reset})),
                at_reset, kept, ints(capture) if len(kept) > 1 else None, None, bools(carried),
                steps == 1 and kept == (0,) and all(carried), ints(token_step),
                ints(pending_rows), ints(new_counts),
                ints([capture[b] if new_counts[b] else steps for b in range(batch)]),
                bools(forget) if any(forget) else None)


def packed_steps(tokens: int, length: int, documents: int) -> int:
    """``T`` of :func:`packed_plan`: the most chunks a row's stream can take.

    A row's stream (``k <= L - 1`` pending tokens and at most ``N`` new ones) cut into
    ``S + 1`` documents (``S <= min(D, N)`` starts) takes at most
    ``sum_i ceil(n_i / L) <= ceil(sum_i n_i / L) + S`` chunks (each cut adds at most one
    ragged chunk), so ``T = ceil((L - 1 + N) / L) + min(D, N)``.
    """
    return -(-(length - 1 + tokens) // length) + min(documents, tokens)


def _take_index(xp: Any, table: Any, index: Any) -> Any:
    """The integer table ``(B, R)`` at each row's own slots ``index (B, K)``: ``(B, K)``."""
    if array_api_compat.is_torch_namespace(xp):
        return table.gather(1, index)
    return xp.take_along_axis(table, index, axis=1)


def packed_plan(xp: Any, x: Any, count: Any, starts: Any, valid: Any, reset: Any,
                pending: Any, length: int, documents: int) -> Plan:
    """The packed-documents grid of :func:`host_plan`, computed from arrays (traceable)
    with at most ``documents`` (``D``) document starts per row.

    Every row runs ``T = packed_steps(N, L, D)`` chunks: its own (its stream chunked
    document by document, as in :func:`host_plan`), then padding chunks (zero tokens,
    no reset, inactive: they leave the state as it was). Nothing is cut: the plan's
    ``step_resets (B, T)`` and ``taken (B,)`` are the one scan's per-step masks
    (:attr:`Plan.step_resets`). A row with more than ``D`` starts keeps its first ``D``:
    the later documents continue the state of the one before (no error: the arrays
    may be traced; the caller checks concrete ones).

    Parameters
    ----------
    xp : namespace
        The arrays' namespace.
    x : array, shape ``(B, N, d)``
        The tokens (``N >= 1``).
    count : int array, shape ``(B,)``
        The pending tokens of each row (``[0, L)``), the default integer dtype.
    starts : bool array, shape ``(B, N)``
        The document starts (a start on a skipped token moves to the row's next valid
        token; after its last one the row ends empty: ``forget``).
    valid, reset : bool array ``(B, N)`` / ``(B,)``, or None
        The tokens to keep; a start at token 0 of the marked rows.
    pending : array, shape ``(B, L, d)``
        The unfinished chunks, in ``x``'s dtype.
    length, documents : int
        ``L`` and ``D`` (``>= 1``).
    """
    batch, tokens, _ = x.shape
    device = device_of(x)
    index = xp.asarray(0, device=device).dtype                  # the default integer dtype
    keep_starts = min(documents, tokens)                         # no more starts than tokens
    steps = packed_steps(tokens, length, documents)
    zero = length + tokens                                       # the table's zero slot
    j = xp.arange(tokens, dtype=index, device=device)[None, :]   # (1, N)
    if reset is not None:
        starts = starts | (reset[:, None] & (j == 0))
    marks = xp.cumulative_sum(xp.astype(starts, index), axis=1)  # starts at or before n
    forget = None
    new, rank, compact, order = _compact(xp, x, valid, index, j)
    if valid is None:
        at = marks
    else:  # a skipped token's start moves to the next valid token
        at = _take_index(xp, marks, order)                      # marks at valid token j
        last = _take_index(xp, at, xp.where(new > 0, new - 1, xp.zeros_like(new))[:, None])
        last = xp.where(new > 0, last[:, 0], xp.zeros_like(new))
        forget = marks[:, -1] > last                             # a start after the last
    before = xp.concat([xp.zeros_like(at[:, :1]), at[:, :-1]], axis=1)
    first = (at > before) & (j < new[:, None])                   # compact token j starts one
    ones = xp.astype(first, index)

    # the segments: 0 continues the state (from stream position 0), s >= 1 starts at the
    # s-th kept start; stream positions p: [0, k) pending, [k, k + new) the new tokens
    found = xp.argsort(1 - ones, axis=1, stable=True)[:, :keep_starts]
    kept = xp.arange(keep_starts, dtype=index, device=device)[None, :] < xp.sum(
        ones, axis=1)[:, None]
    end = count + new
    at_start = xp.where(kept, count[:, None] + found, xp.broadcast_to(end[:, None],
                                                                        kept.shape))
    begins = xp.concat([xp.zeros_like(at_start[:, :1]), at_start], axis=1)   # (B, D' + 1)
    ends = xp.concat([at_start, end[:, None]], axis=1)
    lengths = ends - begins
    # a start at the first new token drops the pending tokens: no segment 0
    lengths = xp.concat([xp.where(first[:, :1], xp.zeros_like(lengths[:, :1]),
                                  lengths[:, :1]), lengths[:, 1:]], axis=1)
    chunks = (lengths + length - 1) // length
    base = xp.cumulative_sum(chunks, axis=1) - chunks            # each segment's first chunk
    total = xp.sum(chunks, axis=1)                               # (B,) chunks of the row

    def source(p: Any) -> Any:
        """Table slot of stream position ``p`` (``[pending, compact x, 0]``)."""
        return xp.where(p < count.reshape((batch,) + (1,) * (p.ndim - 1)), p,
                        length + p - count.reshape((batch,) + (1,) * (p.ndim - 1)))

    t = xp.arange(steps, dtype=index, device=device)[None, :]   # (1, T)
    segment = xp.sum(xp.astype(base[:, None, :] <= t[:, :, None], index), axis=2) - 1
    first_chunk = _take_index(xp, base, segment)                 # (B, T)
    begin = _take_index(xp, begins, segment) + (t - first_chunk) * length
    stop = _take_index(xp, ends, segment)
    real = t < total[:, None]
    step_resets = real & (t == first_chunk) & (segment >= 1)
    lane = xp.arange(length, dtype=index, device=device)
    p = begin[:, :, None] + lane[None, None, :]                  # (B, T, L)
    inside = real[:, :, None] & (p < stop[:, :, None])
    gather = xp.reshape(xp.where(inside, source(p), xp.full_like(p, zero)),
                        (batch, steps * length))

    # each token's chunk: its segment's first chunk + its offset in it // L
    seg_of = xp.cumulative_sum(ones, axis=1)
    seg_of = xp.where(seg_of > keep_starts, xp.full_like(seg_of, keep_starts), seg_of)
    where_in = count[:, None] + j - _take_index(xp, begins, seg_of)
    chunk_of = _take_index(xp, base, seg_of) + where_in // length  # (B, N) by compact j
    if valid is None:
        out_index = chunk_of
    else:
        pick = xp.where(rank < 0, xp.zeros_like(rank), rank)
        out_index = xp.where(valid, _take_index(xp, chunk_of, pick),
                             xp.full_like(rank, steps))

    # the returned state: the one entering the row's last chunk if it is unfinished
    last = xp.where(total > 0, total - 1, xp.zeros_like(total))[:, None]
    a_last = _take_index(xp, begin, last)[:, 0]
    e_last = _take_index(xp, stop, last)[:, 0]
    size = xp.where(total > 0, e_last - a_last, xp.zeros_like(total))
    unfinished = (size > 0) & (size < length)
    taken = xp.where(unfinished, total - 1, total)
    keep = unfinished if forget is None else unfinished & ~forget
    left = xp.where(keep, size, xp.zeros_like(size))
    q = a_last[:, None] + lane[None, :]
    pending_index = xp.where(keep[:, None] & (q < e_last[:, None]), source(q),
                             xp.full_like(q, zero))
    read_pick = xp.where(left > 0, taken, xp.full_like(taken, steps))
    table = _zero_slot(xp, pending, compact)                     # (B, L + N + 1, d)
    return Plan(steps, table, gather, (0, steps), {}, (), taken, None,
                (count > 0) & ~step_resets[:, 0], False, out_index, pending_index, left,
                read_pick, forget, step_resets)


# --------------------------------------------------------------------------- the executor


def execute(layer: Layer, xp: Any, params: Params, x: Any, st: StreamState, plan: Plan,
            scan: Scan) -> tuple[Any, Any]:
    """Run a layer call by its plan: ``(out (B, N, d), state)``.

    The heads and the read-out run once over all ``B*T`` chunk rows (the operations a
    call dispatches do not grow with the sequence); the scan steps through the chunks,
    cut at the plan's cuts. ``state``: ``(h, c)`` for a non-streaming plan, else the
    new :class:`~tmcore.layer.stream.StreamState` (``st``'s type).
    """
    length = layer.config.chunk_size
    batch, tokens, d = x.shape
    steps = plan.steps
    h, c = st.h, st.c
    reads = None
    if plan.carried_only:  # the continued unfinished chunk, whose read is known
        reads = st.read[:, None, :]
    elif steps:
        chunks = (chunk(xp, x, length) if plan.gather is None else
                  xp.reshape(_take_rows(xp, plan.table, plan.gather),
                             (batch, steps, length, d)))
        inputs = layer.heads(xp, params, chunks)               # (B, T, ...) each
    if steps and not plan.carried_only and plan.step_resets is not None:
        # one uncut scan: its masks reset rows where their documents start and freeze
        # each row from the chunk whose entering state it returns
        active = xp.arange(steps, dtype=plan.taken.dtype, device=device_of(x))[None, :] \
            < plan.taken[:, None]
        reads, h, c = scan(h, c, inputs, reset=plan.step_resets, active=active)
        reads = _carried_reads(xp, plan, st, reads, steps)
    elif steps and not plan.carried_only:
        entering, parts = [], []  # the state entering each cut (sizes are not hashed)
        cond = getattr(scan, "cond", None)
        for t0, t1 in zip(plan.cuts, plan.cuts[1:], strict=False):
            if plan.resets and t0 in plan.resets:
                h, c = keep_rows(xp, ~plan.resets[t0], h, c)
            entering.append((h, c))
            segment = inputs if (t0, t1) == (0, steps) else type(inputs)(
                *(v[:, t0:t1, ...] for v in inputs))
            if (cond is not None and plan.skip_after is not None and t1 == t0 + 1
                    and t1 > plan.skip_after):
                # the state after this one step serves only rows taking a later state:
                # where none does (a decode step that completes no chunk), read only
                def update(h=h, c=c, segment=segment):
                    return scan(h, c, segment)

                def read_only(h=h, c=c, segment=segment):
                    return layer.sample(h, segment.read_coords), h, c

                part, h, c = cond(xp.any(plan.taken >= t1) if plan.taken is not None
                                  else plan.capture[-1] >= t1, update, read_only)
            else:
                part, h, c = scan(h, c, segment)
            parts.append(part)
        entering.append((h, c))
        reads = parts[0] if len(parts) == 1 else xp.concat(parts, axis=1)   # (B, T, C)
        reads = _carried_reads(xp, plan, st, reads, steps)

        def state_at(t: Any) -> tuple[Any, Any]:
            return entering[next(i for i, cut in enumerate(plan.cuts) if cut is t or cut == t)]

        h, c = state_at(plan.capture[0])
        for t in plan.capture[1:]:
            pick = plan.taken == t
            h_t, c_t = state_at(t)
            h, c = where_rows(xp, pick, h_t, h), where_rows(xp, pick, c_t, c)
    if plan.forget is not None:
        h, c = keep_rows(xp, ~plan.forget, h, c)
    if reads is None:  # no row has a token or an unfinished chunk
        out = xp.zeros_like(x)
    else:
        out_rows = layer.read_out(xp, params, reads)           # (B, T, d)
        out = (unchunk(xp, out_rows, tokens, length) if plan.out_index is None else
               _take_rows(xp, _zero_slot(xp, out_rows), plan.out_index))
    if plan.count is None:  # the non-streaming call: the plain state
        return out, (h, c)
    return out, _unfinished(xp, x, st, plan, reads, h, c, length)


def _carried_reads(xp: Any, plan: Plan, st: StreamState, reads: Any, steps: int) -> Any:
    """``reads (B, T, C)`` with the continued unfinished chunk's read (chunk 0 of the
    ``plan.carried`` rows) taken from the state."""
    if plan.carried is None:
        return reads
    first = where_rows(xp, plan.carried, st.read, reads[:, 0, :])
    return (xp.concat([first[:, None, :], reads[:, 1:, :]], axis=1) if steps > 1
            else first[:, None, :])


def _unfinished(xp: Any, x: Any, st: StreamState, plan: Plan, reads: Any, h: Any, c: Any,
                length: int) -> StreamState:
    """The returned :class:`StreamState`: the new unfinished chunk's tokens, count and read."""
    batch, tokens, d = x.shape
    if plan.pending_index is not None:
        pending = _take_rows(xp, plan.table, plan.pending_index)   # (B, L, d)
        read = (_take_rows(xp, _zero_slot(xp, reads), plan.read_pick[:, None])[:, 0, :]
                if reads is not None else xp.zeros_like(st.read))
        return type(st)(h, c, pending, xp.astype(plan.count, xp.int32), read)
    left = plan.count  # contiguous: every row keeps the ragged last chunk
    full = tokens // length
    if left:
        # the padding derived from x keeps x's sharding (a JAX Explicit mesh refuses to
        # concatenate a batch-sharded array with a fresh, replicated one)
        pending = xp.concat([x[:, full * length:, :],
                             xp.broadcast_to(xp.zeros_like(x[:, :1, :]),
                                             (batch, length - left, d))], axis=1)
        read = reads[:, full, :]
    else:
        pending = xp.zeros((batch, length, d), dtype=x.dtype, device=device_of(x))
        read = xp.zeros((batch, reads.shape[-1]), dtype=reads.dtype, device=device_of(x))
    count = xp.full((batch,), left, dtype=xp.int32, device=device_of(x))
    return type(st)(h, c, pending, count, read)
