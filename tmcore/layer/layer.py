"""The Tensor Memory layer's ONE call: check once -> state -> plan -> heads -> scan -> read-out.

:class:`Layer` runs one layer over a parameter pytree ``{group: {leaf: array}}`` with the
adapter's differentiable ``scan`` (:class:`Scan`). Sizes: ``d`` embed_dim, ``C``
channels, ``S`` the grid (``n`` axes), ``L`` chunk_size, ``B`` batch, ``N`` tokens,
``T`` chunks.

Per chunk ``t`` (docs/LAYER.md): ``read_coord = tanh(coord_net(first token))``;
``summary = write_proj(the chunk's L tokens, position-major)``; ``write_coord =
tanh(coord_net(summary))`` (tied head); ``content = content_net(summary)``; ``sigma =
(softplus(sigma_net(summary)) + 1e-4) * sigma_scale``; the scan reads the state before
the chunk's write; ``out_proj(read_t)`` goes to every token of chunk ``t``. The heads and
the read-out run once over all ``B*T`` chunks (the operations a call dispatches do not
grow with the sequence); only the scan steps through them, with per-step masks
(:mod:`tmcore.layer.plan`) where rows differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tmcore.layer.config import LayerConfig
from tmcore.layer.params import WARP_GROUP, Params
from tmcore.layer.plan import plan_steps, plan_stream, take_rows, zero_slot
from tmcore.layer.state import (
    State,
    StreamState,
    check_forward,
    check_mask,
    check_state,
    check_tokens,
    reset_stream,
    stream_state,
    where_rows,
    zero_state,
)
from tmcore.ops.addressing import MIN_SIGMA
from tmcore.ops.common import softplus
from tmcore.ops.sample import trilinear_sample
from tmcore.runtime.validate import check_int
from tmcore.types import StepInputs, WarpInputs, device_of, host_values, traced

__all__ = ["Layer", "Linear", "Scan", "chunk", "linear", "split", "unchunk"]


class Scan(Protocol):
    """The scan a layer runs: ``(reads (B, T, C), h_T, c_T)`` of the chunk steps
    ``inputs`` (``(B, T, ...)`` fields) from ``(h, c)``, under the per-step row masks
    ``reset, active`` (bool ``(B, T)`` or ``None``; :func:`tmcore.memory_scan`)."""

    def __call__(self, h: Any, c: Any, inputs: Any, *, reset: Any = None,
                 active: Any = None) -> tuple[Any, Any, Any]: ...


Linear = Callable[[Any, Mapping[str, Any], Any], Any]


def linear(xp: Any, p: Mapping[str, Any], x: Any) -> Any:
    """``x (..., in) @ weight.T + bias``: a linear map in torch's layout (``p``:
    ``{"weight": (out, in), "bias": (out,)}``)."""
    return xp.matmul(x, xp.matrix_transpose(p["weight"])) + p["bias"]


def split(xp: Any, x: Any, sizes: Sequence[int]) -> tuple[Any, ...]:
    """``x (..., sum(sizes))`` cut along its last axis into consecutive pieces."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(x[..., start:start + size])
        start += size
    return tuple(pieces)


def chunk(xp: Any, x: Any, length: int) -> Any:
    """Tokens ``(B, N, d)`` as chunks ``(B, T, L, d)``, the last one zero-padded."""
    batch, tokens, d = x.shape
    pad = -(-tokens // length) * length - tokens
    if pad:
        # zeros like x (dtype, device, sharding), without asking for a device
        x = xp.concat([x, xp.broadcast_to(xp.zeros_like(x[:, :1, :]), (batch, pad, d))], axis=1)
    return xp.reshape(x, (batch, -1, length, d))  # (-1: no symbolic ceil under compile)


def unchunk(xp: Any, per_chunk: Any, tokens: int, length: int) -> Any:
    """One row per chunk ``(B, T, d)`` on each of its chunk's tokens: ``(B, N, d)``."""
    batch, steps, d = per_chunk.shape
    out = xp.reshape(xp.broadcast_to(per_chunk[:, :, None, :], (batch, steps, length, d)),
                     (batch, steps * length, d))
    return out if tokens == steps * length else out[:, :tokens, :]


class Layer:
    """One Tensor Memory layer over a parameter pytree ``{group: {leaf: array}}``.

    Adapters build one per module. A variant subclasses it and overrides a piece:
    :meth:`heads`, :meth:`read_out`, or the primitives they use (``linear``, ``sample``,
    ``softplus``, ``split``: a framework's fused kernels, e.g. torch's ``F.linear``).

    Parameters
    ----------
    config : LayerConfig
        The layer's hyperparameters (:func:`tmcore.layer.layer_config`).
    """

    linear: Linear = staticmethod(linear)
    #: ``sample(h (B, C, *S), coords (B, Q, n)) -> (B, Q, C)``: a decode step's read
    sample: Callable[[Any, Any], Any] = staticmethod(trilinear_sample)
    softplus: Callable[[Any, Any], Any] = staticmethod(softplus)
    split: Callable[[Any, Any, Sequence[int]], tuple[Any, ...]] = staticmethod(split)
    #: give the heads' products 2-D operands (one row per chunk): what a framework's
    #: linear map that flattens the leading axes itself does anyway, without the reshapes
    flat_rows: bool = False

    def __init__(self, config: LayerConfig):
        if not isinstance(config, LayerConfig):
            raise TypeError(f"config: expected a LayerConfig (from layer_config), "
                            f"got {type(config).__name__}")
        self.config = config

    # ----------------------------------------------------------------- heads

    def heads(self, xp: Any, params: Params, chunks: Any) -> StepInputs:
        """The chunks ``(..., L, d)`` as the scan's step inputs (leading axes ``...``).

        The three heads that read a ``d``-vector (``coord_net``, tied between the read
        query and the write summary, ``content_net``, ``sigma_net``) run as ONE product
        over the stacked rows ``[first token, summary]`` (the content and sigma columns of
        the first-token row are unused). Streamed pieces equal one call to rounding, not
        bit for bit: a product over ``B*T`` rows may block its sums differently.

        Parameters
        ----------
        xp : namespace
            The arrays' namespace.
        params : dict of dict of array
            The parameter pytree.
        chunks : array, shape ``(..., L, d)``
            The chunks.

        Returns
        -------
        StepInputs
            ``read_coords, write_coords (..., n)`` in ``(-1, 1)``, ``write_sigma (...)``
            > 0, ``write_content (..., C)``; with ``dynamics="warp"`` a
            :class:`tmcore.types.WarpInputs` (plus ``shift (..., n)``).
        """
        config, linear = self.config, self.linear
        lead = tuple(chunks.shape[:-2])
        length, d = chunks.shape[-2:]
        n, c = len(config.memory_shape), config.memory_channels
        k = n + c + 1
        fused = {key: xp.concat([params[g][key] for g in ("coord_net", "content_net",
                                                          "sigma_net")], axis=0)
                 for key in ("weight", "bias")}
        if self.flat_rows:  # 2-D operands, one row per chunk: no reshape around each product
            rows = math.prod(lead)
            flat = xp.reshape(chunks, (rows, length * d))
            summary = linear(xp, params["write_proj"], flat)                  # (M, d)
            pairs = xp.reshape(xp.stack([flat[:, :d], summary], axis=1), (2 * rows, d))
        else:
            summary = linear(xp, params["write_proj"], xp.reshape(chunks, (*lead, length * d)))
            pairs = xp.stack([chunks[..., 0, :], summary], axis=-2)          # (..., 2, d)
        out = xp.reshape(linear(xp, fused, pairs), (*lead, 2 * k))
        # the first k + n columns: the read coordinates, the first-token row's unused
        # content and sigma columns (a zero gradient), the write coordinates
        coords, content, sigma = self.split(xp, out, (k + n, c, 1))
        read_coords, _, write_coords = self.split(xp, xp.tanh(coords), (n, k - n, n))
        sigma = self.softplus(xp, xp.reshape(sigma, lead)) + MIN_SIGMA
        if config.sigma_scale != 1.0:  # (a product by 1.0 is exact: skipped, same bits)
            sigma = sigma * config.sigma_scale
        inputs = StepInputs(read_coords, write_coords, sigma, content)
        if config.dynamics == "warp":  # the shift (..., n) from the summary
            shift = linear(xp, params[WARP_GROUP], summary)
            return WarpInputs(*inputs, shift=xp.reshape(shift, (*lead, n)))
        return inputs

    def read_coords(self, xp: Any, params: Params, first: Any) -> Any:
        """:meth:`heads`' ``read_coords`` from the chunks' first tokens alone.

        A decode step reads before the chunk's other tokens exist; a variant that makes
        the read coordinates otherwise overrides both methods.

        Parameters
        ----------
        xp, params : namespace, dict of dict of array
            As in :meth:`heads`.
        first : array, shape ``(..., d)``
            Each chunk's first token.

        Returns
        -------
        array, shape ``(..., n)``
            ``tanh(coord_net(first))``.
        """
        return xp.tanh(self.linear(xp, params["coord_net"], first))

    def read_out(self, xp: Any, params: Params, reads: Any) -> Any:
        """``out_proj`` on the reads.

        Parameters
        ----------
        xp, params : namespace, dict of dict of array
            As in :meth:`heads`.
        reads : array, shape ``(..., C)``
            What the scan read.

        Returns
        -------
        array, shape ``(..., d)``
            The layer's output per read.
        """
        return self.linear(xp, params["out_proj"], reads)

    # ----------------------------------------------------------------- the call

    def forward(self, xp: Any, params: Params, x: Any, state: State | None, *, scan: Scan,
                reset: Any = None, checked: bool = False) -> tuple[Any, State]:
        """The paper's call on a whole sequence: a ragged last chunk zero-padded and written.

        Parameters
        ----------
        xp, params : namespace, dict of dict of array
            The arrays' namespace and the parameter pytree.
        x : array, shape ``(B, N, d)``
            The tokens.
        state : pair of arrays ``(B, C, *S)``, or None
            ``(h, c)`` entering the sequence (``None``: zeros).
        scan : Scan
            The adapter's differentiable scan.
        reset : bool array, shape ``(B,)``, optional
            Rows whose state is zeroed first.
        checked : bool, default False
            The caller checked ``x`` (tokens, size gate) and ``state`` already.

        Returns
        -------
        out : array, shape ``(B, N, d)``
            Each token's chunk's read, read out.
        state : pair of arrays, shape ``(B, C, *S)``
            ``(h, c)`` after the last chunk.
        """
        batch, tokens = self._check(xp, x, checked)
        if state is not None and not checked:
            state = check_state(xp, state, batch, self.config)
        h, c = (zero_state(xp, self.config, batch, dtype=x.dtype, device=device_of(x))
                if state is None else state)
        if reset is not None:
            check_mask(xp, reset, "reset", (batch,))
            h, c = (where_rows(xp, ~reset, v, xp.zeros_like(v)) for v in (h, c))
        if not tokens or not batch:  # nothing to scan
            return xp.zeros_like(x), (h, c)
        reads, h, c = scan(h, c, self.heads(xp, params, chunk(xp, x, self.config.chunk_size)))
        return unchunk(xp, self.read_out(xp, params, reads), tokens,
                       self.config.chunk_size), (h, c)

    def forward_stream(self, xp: Any, params: Params, x: Any, state: Any, *, scan: Scan,
                       reset: Any = None, doc_starts: Any = None, valid: Any = None,
                       checked: bool = False, max_documents: int | None = None
                       ) -> tuple[Any, StreamState]:
        """Streaming, padding and packed documents: the default call of both adapters.

        The call continues each row's unfinished chunk, so feeding a sequence in pieces
        of ANY lengths (one token at a time included) gives the outputs and the state of
        one long call. A chunk's output is known from its first token (its read); its
        write happens when its ``L``-th token arrives.

        Parameters
        ----------
        xp, params : namespace, dict of dict of array
            The arrays' namespace and the parameter pytree.
        x : array, shape ``(B, N, d)``
            The next piece of each row's stream (``N`` may be 0).
        state : None, pair of arrays or StreamState
            ``None`` (zeros), ``(h, c)`` (a chunk boundary) or the state a previous call
            returned.
        scan : Scan
            The adapter's differentiable scan.
        reset : bool array, shape ``(B,)``, optional
            The marked rows start a new document at this call's first token.
        doc_starts : bool array, shape ``(B, N)``, optional
            True where a new document starts (packed documents, e.g. from
            :func:`tmcore.layer.doc_starts_from_offsets`): the state and the unfinished
            chunk are dropped there, so each document's outputs equal running it alone. A
            start on a skipped token moves to the next kept one.
        valid : bool array, shape ``(B, N)``, optional
            False at tokens to skip (padding, left or right): they never enter the state,
            their outputs are zeros.
        checked : bool, default False
            The caller checked ``x`` and ``state`` already (a StreamState's ``count`` an
            int32 array).
        max_documents : int, optional
            ``D``, a static bound on the document starts of any row in this call: needed
            when ``doc_starts`` cannot be read on the host (traced); concrete masks with
            more starts in a row are a ``ValueError``, traced ones' starts after a row's
            ``D``-th are ignored (its later documents continue the one before).

        Returns
        -------
        out : array, shape ``(B, N, d)``
            Each token's output (zeros where ``valid`` is False).
        state : StreamState
            The state after the last token.

        Raises
        ------
        TypeError
            If an argument is not an array of the right kind or dtype, or
            ``doc_starts`` is traced without ``max_documents``.
        ValueError
            If an argument has the wrong shape, ``state.count`` is not ``B`` ints in
            ``[0, L)``, or a concrete row has more than ``max_documents`` starts.
        """
        length = self.config.chunk_size
        batch, tokens = self._check(xp, x, checked)
        st, known = stream_state(xp, state, x, self.config, checked=checked)
        for name, mask, shape in (("reset", reset, (batch,)), ("valid", valid, (batch, tokens)),
                                  ("doc_starts", doc_starts, (batch, tokens))):
            if mask is not None:
                check_mask(xp, mask, name, shape)
        documents, doc_starts = _documents(doc_starts, max_documents)
        st, known = reset_stream(xp, st, known, reset)
        if not tokens or not batch:
            return xp.zeros_like(x), st
        if tokens == 1 and doc_starts is None:
            return self._decode(xp, params, x, st, known, valid, scan)
        if known is not None and not any(known) and valid is None and doc_starts is None \
                and not traced():  # (compiled: the grid, whose sizes stay symbolic)
            # from a chunk boundary: x chunked as it is; a ragged last chunk is read, kept
            # unfinished, and its update not taken
            steps, full = -(-tokens // length), tokens // length
            active = None if full == steps else xp.broadcast_to(
                xp.arange(steps, device=device_of(x))[None, :] < full, (batch, steps))
            reads, h, c = scan(st.h, st.c, self.heads(xp, params, chunk(xp, x, length)),
                               active=active)
            out = unchunk(xp, self.read_out(xp, params, reads), tokens, length)
            left = tokens - full * length
            if left:
                return out, StreamState(h, c, chunk(xp, x[:, full * length:, :], length)[:, 0],
                                        xp.full_like(st.count, left), reads[:, full, :])
            if isinstance(state, StreamState):  # (else: the empty chunk stream_state made)
                st = st._replace(pending=xp.zeros_like(st.pending),
                                 read=xp.zeros_like(st.read))
            return out, st._replace(h=h, c=c)
        kept = tokens if valid is None else _most(host_values(xp.sum(
            xp.astype(valid, st.count.dtype), axis=1)), tokens)
        steps = plan_steps(kept, length, length - 1 if known is None else max(known),
                           documents)
        plan = plan_stream(xp, x, xp.astype(st.count, xp.asarray(0, device=device_of(x)).dtype),
                           xp.astype(st.pending, x.dtype), valid, doc_starts, length, steps,
                           documents)
        chunks = xp.reshape(take_rows(xp, plan.table, plan.gather), (batch, steps, length, -1))
        reads, h, c = scan(st.h, st.c, self.heads(xp, params, chunks), reset=plan.reset,
                           active=plan.active)
        # a continued unfinished chunk's read was made at its first token: the state's
        first = where_rows(xp, plan.carried, xp.astype(st.read, reads.dtype), reads[:, 0, :])
        reads = xp.concat([first[:, None, :], reads[:, 1:, :]], axis=1)
        if plan.forget is not None:
            h, c = (where_rows(xp, ~plan.forget, v, xp.zeros_like(v)) for v in (h, c))
        out = take_rows(xp, zero_slot(xp, self.read_out(xp, params, reads)), plan.out_index)
        read = take_rows(xp, zero_slot(xp, reads), plan.read_pick[:, None])[:, 0, :]
        return out, StreamState(h, c, take_rows(xp, plan.table, plan.pending_index),
                                xp.astype(plan.count, xp.int32), read)

    def _check(self, xp: Any, x: Any, checked: bool) -> tuple[int, int]:
        if not checked:
            check_tokens(xp, x, self.config)
            check_forward(xp, self.config, x)  # the call fits, before anything is allocated
        return x.shape[0], x.shape[1]

    def _decode(self, xp: Any, params: Params, x: Any, st: StreamState,
                known: tuple[int, ...] | None, valid: Any, scan: Scan
                ) -> tuple[Any, StreamState]:
        """The one-token step, ``x (B, 1, d)``: the token joins its row's unfinished chunk;
        a row whose chunk starts with it reads the state, a row whose chunk it completes
        writes and updates it (one scan step, masked where rows differ). With the counts
        known on the host (eager) and the same in every row (generation), a token runs
        only what it needs: the read-out alone mid-chunk, the read coordinates and a read
        at a chunk's start, the heads and the update at its end."""
        length = self.config.chunk_size
        batch, _, d = x.shape
        h, c, read, count = st.h, st.c, st.read, st.count
        uniform = known is not None and valid is None and len(set(known)) == 1
        if uniform and length > 1:  # one slot for every row: a concat of views
            k = known[0]
            head = st.pending[:, :k, :]
            parts = ([head if head.dtype == x.dtype else xp.astype(head, x.dtype)] if k
                     else []) + [x] + ([xp.broadcast_to(xp.zeros_like(x), (batch, length - k - 1,
                                                                          d))]
                                       if k < length - 1 else [])
            pending = xp.concat(parts, axis=1) if len(parts) > 1 else x
        elif length == 1:
            pending = x
        else:
            slot = xp.reshape(xp.arange(length, dtype=count.dtype, device=device_of(x)),
                              (1, length, 1))
            at = xp.reshape(count, (-1, 1, 1))
            pending = xp.where(slot == at, x, xp.where(slot < at, xp.astype(st.pending, x.dtype),
                                                       xp.zeros_like(x)))
        if uniform:
            start, complete = known[0] == 0, known[0] == length - 1
            if complete:
                reads, h, c = scan(h, c, self.heads(xp, params, pending[:, None, ...]))
                read = reads[:, 0, :] if start else read
            elif start:
                coords = self.read_coords(xp, params, pending[:, 0, :])
                read = self.sample(h, coords[:, None, :])[:, 0, :]
            out = self.read_out(xp, params, read)
            if complete:
                zero = xp.zeros_like
                return out[:, None, :], StreamState(h, c, zero(pending), zero(count), zero(read))
            return out[:, None, :], StreamState(h, c, pending, xp.full_like(count, known[0] + 1),
                                                read)
        starts, completes = count == 0, count == length - 1
        if valid is not None:
            valid = valid[:, 0]
            starts, completes = starts & valid, completes & valid
        if known is None or 0 in known or length - 1 in known:
            reads, h, c = scan(h, c, self.heads(xp, params, pending[:, None, ...]),
                               active=completes[:, None])
            read = where_rows(xp, starts, reads[:, 0, :], xp.astype(read, reads.dtype))
        out = self.read_out(xp, params, read)
        pending, read = (where_rows(xp, completes, xp.zeros_like(v), v) for v in (pending, read))
        count = xp.where(completes, xp.zeros_like(count), count + 1)
        if valid is not None:  # a skipped token changes nothing
            count = xp.where(valid, count, st.count)
            pending = where_rows(xp, valid, pending, xp.astype(st.pending, x.dtype))
            read = where_rows(xp, valid, read, xp.astype(st.read, read.dtype))
            out = where_rows(xp, valid, out, xp.zeros_like(out))
        return out[:, None, :], StreamState(h, c, pending, count, read)


def _most(values: Any, default: int) -> int:
    """The largest of host ``values`` (``default`` when unknown or empty)."""
    return default if not values else max(int(v) for v in values)


def _documents(doc_starts: Any, max_documents: Any) -> tuple[int, Any]:
    """``(D, doc_starts)``: the bound on a row's document starts (``max_documents``, else
    read on the host) and the mask (``None`` where no row starts one)."""
    if doc_starts is None:
        return 0, None
    rows = host_values(doc_starts)
    most = None if rows is None else max((sum(map(bool, row)) for row in rows), default=0)
    if max_documents is None:
        if most is None:
            raise TypeError("doc_starts: traced (e.g. under jax.jit or torch.compile), so the "
                            "grid needs a static bound: pass max_documents=D (a Python int: at "
                            "least the document starts of any row in the call)")
        return most, doc_starts if most else None
    bound = check_int("max_documents", max_documents, 1)
    if most is not None and most > bound:
        row = next(b for b, r in enumerate(rows) if sum(map(bool, r)) == most)
        raise ValueError(f"max_documents: row {row} starts {most} documents in this call, more "
                         f"than max_documents={bound} (the chunk grid's bound); pass a larger "
                         f"max_documents")
    return bound, doc_starts
