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
  document start, planned on the host from the masks' values.

:func:`execute` runs any of them: the heads once over all ``B*T`` chunks, the scan in
segments between the plan's cuts, the read-out once, and the gathers back to tokens.

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
from tmcore.layer.state import device_of

if TYPE_CHECKING:
    from tmcore.layer.layer import Layer, Scan
    from tmcore.layer.stream import StreamState

__all__ = ["Plan", "array_plan", "contiguous_plan", "execute", "host_plan"]


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


def _rows(xp: Any, mask: Any, a: Any, b: Any) -> Any:
    """``a`` in the rows where the bool array ``mask (B,)`` is True, else ``b``."""
    return xp.where(xp.reshape(mask, (mask.shape[0],) + (1,) * (a.ndim - 1)), a, b)


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
    if valid is None:
        new = xp.full((batch,), tokens, dtype=index, device=device)
        rank = xp.broadcast_to(xp.arange(tokens, dtype=index, device=device)[None, :],
                               (batch, tokens))
        compact = x
        valid_counts = (tokens, tokens)
    else:  # the valid tokens first, in order
        ones = xp.astype(valid, index)
        new = xp.sum(ones, axis=1)
        rank = xp.cumulative_sum(ones, axis=1) - 1
        order = xp.argsort(1 - ones, axis=1, stable=True)
        compact = _take_rows(xp, x, order)
        valid_counts = valid_counts or (0, tokens)
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
        entering, parts = [], []  # the state entering each cut (sizes are not hashed)
        cond = getattr(scan, "cond", None)
        for t0, t1 in zip(plan.cuts, plan.cuts[1:], strict=False):
            if plan.resets and t0 in plan.resets:
                keep = ~plan.resets[t0]
                h, c = _rows(xp, keep, h, xp.zeros_like(h)), _rows(xp, keep, c, xp.zeros_like(c))
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
        if plan.carried is not None:  # a continued unfinished chunk's read is the state's
            first = _rows(xp, plan.carried, st.read, reads[:, 0, :])
            reads = (xp.concat([first[:, None, :], reads[:, 1:, :]], axis=1) if steps > 1
                     else first[:, None, :])
        def state_at(t: Any) -> tuple[Any, Any]:
            return entering[next(i for i, cut in enumerate(plan.cuts) if cut is t or cut == t)]

        h, c = state_at(plan.capture[0])
        for t in plan.capture[1:]:
            pick = plan.taken == t
            h_t, c_t = state_at(t)
            h, c = _rows(xp, pick, h_t, h), _rows(xp, pick, c_t, c)
    if plan.forget is not None:
        keep = ~plan.forget
        h, c = _rows(xp, keep, h, xp.zeros_like(h)), _rows(xp, keep, c, xp.zeros_like(c))
    if reads is None:  # no row has a token or an unfinished chunk
        out = xp.zeros_like(x)
    else:
        out_rows = layer.read_out(xp, params, reads)           # (B, T, d)
        out = (unchunk(xp, out_rows, tokens, length) if plan.out_index is None else
               _take_rows(xp, _zero_slot(xp, out_rows), plan.out_index))
    if plan.count is None:  # the non-streaming call: the plain state
        return out, (h, c)
    return out, _unfinished(xp, x, st, plan, reads, h, c, length)


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
