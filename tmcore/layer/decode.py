"""The one-token decode step: one token in, one output out, the stream's state updated.

Generation feeds the layer one token at a time. :func:`decode_step` is that call without
planning a chunk grid: the token joins its row's unfinished chunk; a row whose chunk
starts with it reads the state (before the chunk's write) at the chunk's read
coordinate; a row whose chunk it completes writes and updates the state (one scan
step, skipped when no row completes one). A constant number of array operations per
token, the same for every token; equal to :meth:`~tmcore.layer.Layer.forward_stream`
on the same token to rounding (the heads run over other rows).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tmcore.layer.params import Params
from tmcore.layer.state import keep_rows, where_rows
from tmcore.layer.stream import StreamState
from tmcore.runtime.sizes import compiling
from tmcore.types import device_of

if TYPE_CHECKING:
    from tmcore.layer.layer import Layer, Scan

__all__ = ["Produced", "decode_step", "next_counts"]


def _place(xp: Any, token: Any, pending: Any, count: Any, length: int,
           zeros: Any = None) -> Any:
    """Each row's unfinished chunk ``(B, L, d)`` with ``token (B, 1, d)`` at its ``count
    (B,)``: the chunk's tokens so far (``pending``), this one, and zeros after it (what a
    state holds past its count is never read, as in the planned call); ``zeros``: those
    zeros ``(B, 1, d)``, if made already."""
    slot = xp.reshape(xp.arange(length, dtype=count.dtype, device=device_of(token)),
                      (1, length, 1))
    at = xp.reshape(count, (-1, 1, 1))
    return xp.where(slot == at, token,
                    xp.where(slot < at, xp.astype(pending, token.dtype),
                             xp.zeros_like(token) if zeros is None else zeros))


def decode_step(layer: Layer, xp: Any, params: Params, x: Any, st: StreamState, scan: Scan,
                valid: Any = None, known: tuple[int, ...] | None = None
                ) -> tuple[Any, StreamState]:
    """One token of each row's stream: ``x (B, d)`` -> ``(out (B, d), state)``; unchecked.

    Parameters
    ----------
    layer : Layer
        The layer (its config, heads and read-out).
    xp : namespace
        The arrays' namespace.
    params : dict of dict of array
        The layer's parameter pytree.
    x : array, shape ``(B, d)``
        The next token of each row.
    st : StreamState
        The stream's state (``count`` in ``[0, L)``).
    scan : callable
        The layer's ``scan(h, c, inputs)``; one with a ``cond`` attribute (JAX:
        ``lax.cond``) runs the update only when some row completes a chunk.
    valid : bool array, shape ``(B,)``, optional
        False for rows whose token is skipped (padding): their state is kept and their
        output is zeros.
    known : tuple of int, optional
        ``st.count`` as Python ints, when the caller read it on the host (eager): the
        heads then run only when some row starts or completes a chunk (only the read
        coordinates, :meth:`~tmcore.layer.Layer.read_coords`, when none completes one),
        the read only when some row starts one, the update only when some row completes
        one (``scan.write(h, c, inputs) -> (h', c')`` when the scan has it: the update
        without the scan's read), and no further host read is made.

    Returns
    -------
    out : array, shape ``(B, d)``
        The token's output: its chunk's read, read out.
    state : StreamState
        The state after the token.
    """
    length = layer.config.chunk_size
    if known is not None and valid is None:
        return _decode_known(layer, xp, params, x[:, None, :], st, scan, known)
    count = st.count
    pending = _place(xp, x[:, None, :], st.pending, count, length,
                     xp.zeros_like(x[:, None, :]))                   # (B, L, d)
    inputs = layer.heads(xp, params, pending[:, None, ...])          # (B, 1, ...) each
    starts = count == 0
    read = where_rows(xp, starts, layer.sample(st.h, inputs.read_coords)[:, 0, :], st.read)
    complete = count == length - 1
    if valid is not None:
        complete = complete & valid
    h, c = st.h, st.c

    def update() -> tuple[Any, Any]:
        _, h_new, c_new = scan(h, c, inputs)
        return where_rows(xp, complete, h_new, h), where_rows(xp, complete, c_new, c)

    cond = getattr(scan, "cond", None)
    if cond is not None:
        h, c = cond(xp.any(complete), update, lambda: (h, c))
    elif compiling() or bool(xp.any(complete)):  # (a host read: eager only)
        h, c = update()
    count = xp.where(complete, xp.zeros_like(count), count + 1)
    keep = ~complete
    pending, read_kept = keep_rows(xp, keep, pending, read)
    out = layer.read_out(xp, params, read)
    if valid is not None:  # a skipped token changes nothing
        count = xp.where(valid, count, st.count)
        pending = where_rows(xp, valid, pending, xp.astype(st.pending, x.dtype))
        read_kept = where_rows(xp, valid, read_kept, st.read)
        out = where_rows(xp, valid, out, xp.zeros_like(out))
    return out, StreamState(h, c, pending, count, read_kept)


def _pick(xp: Any, flags: list[bool], mask: Callable[[], Any], a: Any, b: Any) -> Any:
    """``a`` where ``flags`` (the host copy of the bool array ``mask()``, made only when
    needed) is True, else ``b``: no operation when every row agrees."""
    if all(flags):
        return a
    if not any(flags):
        return b
    return where_rows(xp, mask(), a, b)


def _decode_known(layer: Layer, xp: Any, params: Params, token: Any, st: StreamState,
                  scan: Scan, known: tuple[int, ...]) -> tuple[Any, StreamState]:
    """:func:`decode_step` with the counts known on the host, of ``token (B, 1, d)`` (the
    layer's own call shape: no reshape of the token): each part runs only where some row
    needs it (in generation every row is at the same count, so a token that neither
    starts nor completes a chunk costs its read-out and the bookkeeping); ``out (B, d)``."""
    length = layer.config.chunk_size
    starts = [k == 0 for k in known]
    complete = [k == length - 1 for k in known]
    count = st.count
    batch, _, d = token.shape
    if length == 1:
        pending = token
    elif all(k == known[0] for k in known):  # one slot for every row: a concat of views
        k = known[0]
        head = st.pending[:, :k, :]
        parts = ([head if head.dtype == token.dtype else xp.astype(head, token.dtype)]
                 if k else []) + [token] \
            + ([xp.broadcast_to(xp.zeros_like(token), (batch, length - k - 1, d))]
               if k < length - 1 else [])
        pending = parts[0] if len(parts) == 1 else xp.concat(parts, axis=1)
    else:
        pending = _place(xp, token, st.pending, count, length)      # (B, L, d)
    # a token that starts a chunk and completes none needs the read coordinates alone
    # (of the chunk's first token): no write head, no summary product
    # (None: a layer whose heads make them otherwise runs its heads)
    coords = (layer.read_coords(xp, params, pending[:, 0, :])
              if any(starts) and not any(complete) else None)
    inputs = (layer.heads(xp, params, pending[:, None, ...])
              if coords is None and (any(starts) or any(complete)) else None)
    read = st.read
    if any(starts):
        where = inputs.read_coords if coords is None else coords[:, None, :]
        fresh = layer.sample(st.h, where)[:, 0, :]
        read = _pick(xp, starts, lambda: count == 0, fresh, st.read)
    h, c = st.h, st.c
    if any(complete):
        def done() -> Any:
            return count == length - 1

        # the update alone where the scan offers it (its read is the chunk's first
        # token's, already made): ``scan.write(h, c, inputs) -> (h', c')``
        write = getattr(scan, "write", None)
        if write is not None:
            h_new, c_new = write(h, c, inputs)
        else:
            _, h_new, c_new = scan(h, c, inputs)
        h, c = _pick(xp, complete, done, h_new, h), _pick(xp, complete, done, c_new, c)
    # read out every token: reusing the last token's output where no row starts a chunk
    # saves one product but is stale after edits no check sees (``p.data -= ...``)
    out = layer.read_out(xp, params, read)
    keep = [not f for f in complete]
    if any(complete):
        def kept() -> Any:
            return count != length - 1

        pending = _pick(xp, keep, kept, pending, xp.zeros_like(pending))
        read = _pick(xp, keep, kept, read, xp.zeros_like(read))
    # the next counts on the device (no host-to-device copy): one op when rows agree
    if not any(complete):
        # rows at one count (generation): a fill, cheaper than an add of a Python int
        new = (xp.full_like(count, known[0] + 1) if all(k == known[0] for k in known)
               else count + 1)
    elif all(complete):
        new = xp.zeros_like(count)
    else:
        new = xp.where(kept(), count + 1, xp.zeros_like(count))
    return out, StreamState(h, c, pending, new, read)


def next_counts(known: tuple[int, ...], length: int) -> tuple[int, ...]:
    """The counts after a decode step from ``known`` (a full chunk starts over)."""
    return tuple(0 if k == length - 1 else k + 1 for k in known)


def _versions(st: StreamState) -> tuple[int, ...] | None:
    """The version counters of a state's five arrays (bumped by every in-place change),
    or ``None`` where an array has none (NumPy, JAX, a torch inference-mode tensor)."""
    h, c, pending, count, read = st
    try:
        return h._version, c._version, pending._version, count._version, read._version
    except (AttributeError, RuntimeError):
        return None


class Produced:
    """The state a layer's last decode step produced, so that the next token may take it
    as it is (a fast path keyed on identity, made only where the arrays carry version
    counters: torch).

    Held by weak references (it keeps nothing alive) with each array's version counter
    and the counts on the host, the tokens' batch, dtype and device. :meth:`counts`
    gives those counts for a state whose five fields are these very arrays, unchanged
    since (no in-place edit), with tokens of the same kind; anything else (a state the
    caller built, copied, edited or loaded) gives ``None`` and is checked as usual.
    """

    __slots__ = ("refs", "versions", "known", "batch", "dtype", "device")

    def __init__(self, st: StreamState, versions: tuple[int, ...], known: tuple[int, ...],
                 x: Any):
        ref = weakref.ref
        h, c, pending, count, read = st
        self.refs = ref(h), ref(c), ref(pending), ref(count), ref(read)
        self.versions, self.known = versions, known
        self.batch, self.dtype, self.device = x.shape[0], x.dtype, x.device

    @classmethod
    def record(cls, st: StreamState, known: tuple[int, ...], x: Any) -> Produced | None:
        """A record of ``st`` (counts ``known``, made for tokens ``x (B, 1, d)``), or
        ``None`` where its arrays carry no version counters."""
        versions = _versions(st)
        if versions is None:
            return None
        try:
            return cls(st, versions, known, x)
        except (TypeError, AttributeError, RuntimeError):  # no weak references, ...
            return None

    def counts(self, state: Any, x: Any) -> tuple[int, ...] | None:
        """``state``'s counts when it is the recorded state, untouched, and ``x`` tokens
        of the recorded batch, dtype and device; else ``None``."""
        if type(state) is not StreamState:
            return None
        h, c, pending, count, read = self.refs
        if h() is not state.h or c() is not state.c or pending() is not state.pending \
                or count() is not state.count or read() is not state.read:
            return None
        if _versions(state) != self.versions or x.shape[0] != self.batch \
                or x.dtype != self.dtype or x.device != self.device:
            return None
        return self.known
