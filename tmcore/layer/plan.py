"""The chunk grid of a streamed layer call, as data made by array operations (traceable).

Row ``b``'s stream is its ``count[b]`` pending tokens (its unfinished chunk) followed by
its kept new tokens (``valid`` False: skipped); a document start (``starts``) drops what
came before it. The stream is chunked document by document into ``T`` chunks, the same
``T`` for every row (rows with fewer chunks run padding chunks). :class:`Plan` says which
tokens form each chunk, where a row's state is zeroed (``reset``), up to which chunk each
row keeps the updates (``active``: it returns the state entering its new unfinished
chunk), where each token's output comes from, and what the new unfinished chunk holds.
The layer runs ONE scan over it with these per-step masks.

Every gather is per row (along axis 1 of a ``(B, R, k)`` table whose last slot is zeros):
an index never crosses the batch axis, so a batch-sharded call reads only its own rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import array_api_compat

from tmcore.types import device_of

__all__ = ["Plan", "plan_steps", "plan_stream", "take_rows", "zero_slot"]


class Plan(NamedTuple):
    """One streamed call's chunk grid: ``T`` chunks per row of the token table
    ``[pending (L), kept tokens (N), 0]`` (slot ``L + N`` is zeros).

    Parameters
    ----------
    steps : int
        ``T``.
    table : array, shape ``(B, L + N + 1, d)``
        The token table.
    gather : int array, shape ``(B, T L)``
        The table slot of every chunk slot.
    reset, active : bool array, shape ``(B, T)``, or None
        The scan's per-step masks (:class:`tmcore.scan.base.Masks`).
    carried : bool array, shape ``(B,)``
        Rows whose chunk 0 continues the unfinished chunk: its read is the state's.
    out_index : int array, shape ``(B, N)``
        Each token's chunk (``T``: none, its output is zeros).
    pending_index : int array, shape ``(B, L)``
        The new unfinished chunk's table slots.
    count : int array, shape ``(B,)``
        Its tokens.
    read_pick : int array, shape ``(B,)``
        The chunk whose read it keeps (``T``: zeros).
    forget : bool array, shape ``(B,)``, or None
        Rows whose stream ends with an empty document: their state is zeroed.
    """

    steps: int
    table: Any
    gather: Any
    reset: Any
    active: Any
    carried: Any
    out_index: Any
    pending_index: Any
    count: Any
    read_pick: Any
    forget: Any


def zero_slot(xp: Any, *parts: Any) -> Any:
    """``parts (B, R_i, k)`` along axis 1, then a zero slot. The zeros derive from a part,
    so they keep its sharding (a JAX Explicit mesh refuses to join a batch-sharded array
    and a fresh one)."""
    return xp.concat([*parts, xp.zeros_like(parts[-1][:, :1, ...])], axis=1)


def take_rows(xp: Any, table: Any, index: Any) -> Any:
    """``table (B, R[, k])`` at each row's own slots ``index (B, K)`` (in ``[0, R)``)."""
    if table.ndim == 2:
        if array_api_compat.is_torch_namespace(xp):
            return table.gather(1, index)
        return xp.take_along_axis(table, index, axis=1)
    if array_api_compat.is_torch_namespace(xp):
        # one gather: the namespace's take_along_axis also wraps negative indices and
        # broadcasts the table (four more dispatched ops per gather); these are >= 0
        return table.gather(1, xp.broadcast_to(index[:, :, None], (*index.shape,
                                                                    table.shape[2])))
    return xp.take_along_axis(table, index[:, :, None], axis=1)


def plan_steps(tokens: int, length: int, pending: int, documents: int) -> int:
    """``T``: the most chunks a row's stream of at most ``pending`` pending and ``N`` new
    tokens takes, cut into documents at up to ``D`` starts (each cut adds at most one
    ragged chunk): ``ceil((pending + N) / L) + min(D, N)``."""
    return -(-(pending + tokens) // length) + min(documents, tokens)


def plan_stream(xp: Any, x: Any, count: Any, pending: Any, valid: Any, starts: Any,
                length: int, steps: int, documents: int) -> Plan:
    """The grid of a streamed call: ``x (B, N, d)`` after ``count (B,)`` pending tokens
    ``pending (B, L, d)``; ``valid`` / ``starts``: bool ``(B, N)`` or None; ``steps``:
    ``T`` (:func:`plan_steps`); ``documents``: ``D``, the most starts a row keeps (its
    later ones continue the document before: the caller checks concrete masks)."""
    batch, tokens, _ = x.shape
    device = device_of(x)
    index = count.dtype
    j = xp.arange(tokens, dtype=index, device=device)[None, :]          # (1, N)
    t = xp.arange(steps, dtype=index, device=device)[None, :]           # (1, T)
    lane = xp.arange(length, dtype=index, device=device)
    if valid is None:
        new = xp.full((batch,), tokens, dtype=index, device=device)
        rank, compact, order = xp.broadcast_to(j, (batch, tokens)), x, None
    else:  # the kept tokens first, in order
        ones = xp.astype(valid, index)
        new = xp.sum(ones, axis=1)
        rank = xp.cumulative_sum(ones, axis=1) - 1
        order = xp.argsort(1 - ones, axis=1, stable=True)
        compact = take_rows(xp, x, order)
    end = count + new                                                   # stream length

    def source(p: Any) -> Any:
        """Table slot of stream positions ``p (B, ...)``."""
        k = xp.reshape(count, (batch,) + (1,) * (p.ndim - 1))
        return xp.where(p < k, p, length + p - k)

    forget = reset = None
    if starts is None:  # one document: chunk t is stream positions [tL, (t+1)L)
        total = (end + length - 1) // length
        begin = (end * 0)[:, None] + t * length  # (derived from a row array: its sharding)
        stop = xp.broadcast_to(end[:, None], (batch, steps))
        chunk_of = (count[:, None] + j) // length                       # by kept token
    else:
        begin, stop, total, chunk_of, reset, forget, first = _documents(
            xp, count, starts, valid, order, new, end, j, t, length, steps, documents)
    real = t < total[:, None]
    p = begin[:, :, None] + lane[None, None, :]                         # (B, T, L)
    inside = real[:, :, None] & (p < stop[:, :, None])
    zero = xp.full_like(p, length + tokens)
    gather = xp.reshape(xp.where(inside, source(p), zero), (batch, steps * length))
    if valid is None:
        out_index = chunk_of
    else:
        pick = xp.where(rank < 0, xp.zeros_like(rank), rank)
        out_index = xp.where(valid, take_rows(xp, chunk_of, pick), xp.full_like(rank, steps))
    # the returned state: the one entering the row's last chunk if it is unfinished
    last = xp.where(total > 0, total - 1, xp.zeros_like(total))[:, None]
    a_last = take_rows(xp, begin, last)[:, 0]
    e_last = take_rows(xp, stop, last)[:, 0]
    size = xp.where(total > 0, e_last - a_last, xp.zeros_like(total))
    unfinished = (size > 0) & (size < length)
    taken = xp.where(unfinished, total - 1, total)
    keep = unfinished if forget is None else unfinished & ~forget
    left = xp.where(keep, size, xp.zeros_like(size))
    q = a_last[:, None] + lane[None, :]
    pending_index = xp.where(keep[:, None] & (q < e_last[:, None]), source(q),
                             xp.full_like(q, length + tokens))
    carried = count > 0 if starts is None else (count > 0) & ~first
    return Plan(steps, zero_slot(xp, pending, compact), gather, reset, t < taken[:, None],
                carried, out_index, pending_index, left,
                xp.where(left > 0, taken, xp.full_like(taken, steps)), forget)


def _documents(xp: Any, count: Any, starts: Any, valid: Any, order: Any, new: Any, end: Any,
               j: Any, t: Any, length: int, steps: int, documents: int) -> tuple:
    """The chunks of streams cut at document starts: ``(begin, stop (B, T) stream
    positions, total (B,) chunks, chunk_of (B, N) by kept token, reset (B, T), forget (B,)
    or None, first (B,): a start at the first kept token drops the pending tokens)``."""
    index = count.dtype
    keep_starts = min(documents, starts.shape[1])
    marks = xp.cumulative_sum(xp.astype(starts, index), axis=1)       # starts at or before n
    forget = None
    if valid is None:
        at = marks
    else:  # a skipped token's start moves to the next kept token
        at = take_rows(xp, marks, order)                                # marks at kept token j
        last = take_rows(xp, at, xp.where(new > 0, new - 1, xp.zeros_like(new))[:, None])
        last = xp.where(new > 0, last[:, 0], xp.zeros_like(new))
        forget = marks[:, -1] > last                                    # a start after the last
    before = xp.concat([xp.zeros_like(at[:, :1]), at[:, :-1]], axis=1)
    first = (at > before) & (j < new[:, None])                          # kept token j starts one
    ones = xp.astype(first, index)
    # segment 0 continues the state (from stream position 0); segment s >= 1 starts at the
    # s-th kept start
    found = xp.argsort(1 - ones, axis=1, stable=True)[:, :keep_starts]
    kept = xp.arange(keep_starts, dtype=index, device=device_of(count))[None, :] \
        < xp.sum(ones, axis=1)[:, None]
    at_start = xp.where(kept, count[:, None] + found, xp.broadcast_to(end[:, None],
                                                                        kept.shape))
    begins = xp.concat([xp.zeros_like(at_start[:, :1]), at_start], axis=1)   # (B, D' + 1)
    ends = xp.concat([at_start, end[:, None]], axis=1)
    lengths = ends - begins
    # a start at the first new token drops the pending tokens: no segment 0
    lengths = xp.concat([xp.where(first[:, :1], xp.zeros_like(lengths[:, :1]),
                                  lengths[:, :1]), lengths[:, 1:]], axis=1)
    chunks = (lengths + length - 1) // length
    base = xp.cumulative_sum(chunks, axis=1) - chunks                 # each segment's first chunk
    total = xp.sum(chunks, axis=1)
    segment = xp.sum(xp.astype(base[:, None, :] <= t[:, :, None], index), axis=2) - 1
    first_chunk = take_rows(xp, base, segment)                        # (B, T)
    begin = take_rows(xp, begins, segment) + (t - first_chunk) * length
    stop = take_rows(xp, ends, segment)
    reset = (t < total[:, None]) & (t == first_chunk) & (segment >= 1)
    # each kept token's chunk: its segment's first chunk + its offset in it // L
    seg_of = xp.cumulative_sum(ones, axis=1)
    seg_of = xp.where(seg_of > keep_starts, xp.full_like(seg_of, keep_starts), seg_of)
    where_in = count[:, None] + j - take_rows(xp, begins, seg_of)
    chunk_of = take_rows(xp, base, seg_of) + where_in // length
    return begin, stop, total, chunk_of, reset, forget, first[:, 0]
