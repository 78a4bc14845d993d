"""The Tensor Memory layer's ONE call: check once -> state -> plan -> heads -> scan -> read-out.

:class:`Layer` runs one layer over a parameter pytree ``{group: {leaf: array}}`` with
a ``scan`` callable (the adapter's differentiable scan): :meth:`Layer.forward` (the
non-streaming call: a ragged last chunk is zero-padded and written) and
:meth:`Layer.forward_stream` (the default of both adapters: pieces of any lengths equal
one long call; padding masks and packed documents) check their inputs once, complete
the state, make the call's chunk grid (:mod:`tmcore.layer.plan`) and run it
(:func:`tmcore.layer.plan.execute`). A variant of the layer subclasses :class:`Layer` and
overrides :meth:`Layer.heads` or :meth:`Layer.read_out` instead of copying it.

Sizes: ``d`` = embed_dim, ``C`` = memory_channels, ``S`` = memory_shape (``n = len(S)``,
1 to 4 axes), ``L`` = chunk_size, ``B`` batch, ``N`` tokens, ``T = ceil(N / L)`` chunks.

Per chunk ``t`` (docs/LAYER.md, "Per-chunk math"): ``read_coord = tanh(coord_net(first
token))``; ``summary = write_proj(the chunk's L tokens, position-major)``; ``write_coord
= tanh(coord_net(summary))`` (tied head); ``content = content_net(summary)``; ``sigma =
(softplus(sigma_net(summary)) + 1e-4) * sigma_scale``; the scan reads the state before
the chunk's write; ``out_proj(read_t)`` is broadcast to every token of chunk ``t``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tmcore.layer.config import LayerConfig
from tmcore.layer.decode import Produced, _decode_known, decode_step, next_counts
from tmcore.layer.heads import Linear, heads, linear, read_coords, read_out, split
from tmcore.layer.params import Params
from tmcore.layer.plan import array_plan, contiguous_plan, execute, host_plan, packed_plan
from tmcore.layer.sizes import check_forward
from tmcore.layer.state import (
    State,
    check_state,
    check_tokens,
    require_bool_array,
    reset_state,
    zero_state,
)
from tmcore.layer.stream import (
    PACKED_HOST_WHY,
    PACKED_WHY,
    StreamState,
    check_doc_starts,
    check_document_bound,
    check_max_documents,
    check_valid,
    complete_state,
    forget_row,
    host_list,
    maybe_host,
    reset_stream,
)
from tmcore.ops.common import softplus
from tmcore.ops.sample import trilinear_sample
from tmcore.runtime.sizes import compiling
from tmcore.types import StepInputs, device_of

__all__ = ["Layer", "Scan"]


Scan = Callable[[Any, Any, StepInputs], tuple[Any, Any, Any]]


class Layer:
    """One Tensor Memory layer over a parameter pytree ``{group: {leaf: array}}``.

    Adapters build one per module; a variant overrides :meth:`heads` (e.g. untied
    coordinate heads) or :meth:`read_out`. :meth:`forward` needs a ``scan``:
    ``scan(h0, c0, inputs) -> (reads (B, T, C), h_T, c_T)`` with ``inputs`` a
    :class:`tmcore.StepInputs` of ``(B, T, ...)`` arrays (the adapter's
    differentiable :func:`tmcore.memory_scan`, or any variant of it).

    Parameters
    ----------
    config : LayerConfig
        The layer's hyperparameters (from :func:`layer_config`).

    Raises
    ------
    TypeError
        If ``config`` is not a :class:`LayerConfig`.
    """

    #: the linear map of every head (see :func:`heads`); a subclass may replace it
    linear: Linear = staticmethod(linear)
    #: the sigma head's softplus (see :func:`heads`); a subclass may replace it
    softplus: Callable[[Any, Any], Any] = staticmethod(softplus)
    #: the cut of the fused heads' output (see :func:`heads`); a subclass may replace it
    split: Callable[[Any, Any, Sequence[int]], tuple[Any, ...]] = staticmethod(split)
    #: whether the heads' products take 2-D operands (see :func:`heads`)
    flat_rows: bool = False
    #: ``sample(h (B, C, *S), coords (B, Q, n)) -> (B, Q, C)``, a read outside the scan
    #: (a decode step's, a skipped update's); an adapter may pass its framework's op
    sample: Callable[[Any, Any], Any] = staticmethod(trilinear_sample)

    def __init__(self, config: LayerConfig):
        if not isinstance(config, LayerConfig):
            raise TypeError(f"config: expected a LayerConfig (from layer_config), "
                            f"got {type(config).__name__}")
        self.config = config

    def heads(self, xp: Any, params: Params, chunk: Any) -> StepInputs:
        """The layer's heads (:func:`heads` with this layer's config, linear and softplus).

        Parameters
        ----------
        xp, params, chunk : see heads
            As in :func:`heads`: the namespace, the parameter pytree and the
            chunks ``(..., L, d)``.

        Returns
        -------
        StepInputs
            The step inputs of the chunks (leading axes ``...``), as
            :func:`heads` gives them.
        """
        return heads(xp, params, chunk, self.config, linear=self.linear,
                     softplus=self.softplus, split=self.split, flat_rows=self.flat_rows)

    heads.first_token_reads = True  # read_coords may skip them (coord_net of the first token)

    def read_coords(self, xp: Any, params: Params, first: Any) -> Any:
        """The read coordinates of chunks from their first tokens (:func:`read_coords`).

        A decode step that starts a chunk calls this instead of :meth:`heads`. A
        subclass that replaces :meth:`heads` replaces this too, or the decode runs its
        heads: this gives ``None`` unless the class's ``heads`` carries
        ``first_token_reads = True`` (its read coordinates are ``coord_net`` of the
        chunk's first token, as :func:`heads` makes them).

        Parameters
        ----------
        xp, params : namespace, dict of dict of array
            As in :meth:`heads`.
        first : array, shape ``(B, d)``
            Each row's chunk's first token.

        Returns
        -------
        array, shape ``(B, n)``, or None
            The read coordinates, as :meth:`heads`' ``read_coords[:, 0]`` (to
            rounding); ``None``: run :meth:`heads`.
        """
        if getattr(type(self).heads, "first_token_reads", False):
            return read_coords(xp, params, first, linear=self.linear)
        return None

    def read_out(self, xp: Any, params: Params, reads: Any) -> Any:
        """The layer's read-out (:func:`read_out` with this layer's linear map).

        Parameters
        ----------
        xp, params, reads : see read_out
            As in :func:`read_out`: the namespace, the parameter pytree and the
            reads ``(..., C)``.

        Returns
        -------
        array, shape ``(..., d)``
            The layer's output per read.
        """
        return read_out(xp, params, reads, linear=self.linear)

    def forward(self, xp: Any, params: Params, x: Any, state: State | None, *, scan: Scan,
                reset: Any = None, check: Callable[..., None] | None = None,
                checked: bool = False) -> tuple[Any, State]:
        """The layer on a whole sequence: ``x (B, N, d)`` -> ``(out (B, N, d), (h, c))``.

        Checks ``x``, ``state`` and ``reset`` (:func:`check_tokens`,
        :func:`check_state`, :func:`reset_state`); the heads and the read-out
        run once over all chunks (``(B, T, ...)``), the scan steps through them.
        A ragged last chunk is zero-padded and written.
        ``N = 0`` or ``B = 0`` returns zeros and the (reset) state.

        Parameters
        ----------
        xp : namespace
            The array namespace of the arrays.
        params : dict of dict of array
            The layer's parameter pytree ``{group: {leaf: array}}``.
        x : array, shape ``(B, N, d)``
            The tokens.
        state : pair of arrays, shape ``(B, C, *S)`` each, or None
            The state ``(h, c)`` entering the sequence; ``None``: zeros.
        scan : callable
            ``scan(h0, c0, inputs) -> (reads (B, T, C), h_T, c_T)``, e.g. the
            adapter's differentiable :func:`tmcore.memory_scan`.
        reset : bool array, shape ``(B,)``, optional
            True for the rows whose state is zeroed first.
        check : callable, optional
            An adapter's own checks (devices, dtypes against the parameters),
            called as ``check(x, state, reset=reset)`` once ``x`` and ``state``
            passed the generic ones (``state``: the checked pair, or ``None``)
            and before ``reset``'s, so that every input is checked once per call.
        checked : bool, default False
            True when the caller has already checked ``x`` (:func:`check_tokens`
            and the size gate :func:`tmcore.layer.sizes.check_forward`) and
            ``state`` (``None`` or the pair :func:`check_state` returned): they
            are not checked again (an adapter that reads them before the call,
            e.g. to promote dtypes, checks each input once). ``reset`` is
            checked either way.

        Returns
        -------
        out : array, shape ``(B, N, d)``
            Each token's output: its chunk's read, read out.
        state : pair of arrays, shape ``(B, C, *S)`` each
            ``(h, c)`` after the last chunk.

        Raises
        ------
        TypeError
            If ``x``, ``state`` or ``reset`` is not an array of the right kind
            or dtype (each error names the argument).
        ValueError
            If ``x``, ``state`` or ``reset`` has the wrong shape.
        ValueError or MemoryError
            With ``state=None``, if the zero state cannot be indexed or does not
            fit the device (:func:`zero_state`).
        """
        config = self.config
        if not checked:
            check_tokens(xp, x, config)
            check_forward(xp, config, x)  # the call fits, before anything is allocated
        batch, tokens, _ = x.shape
        if state is not None and not checked:
            state = check_state(xp, state, batch, config)
        if check is not None:
            check(x, state, reset=reset)
        return self._from_boundary(xp, params, x, state, scan, reset, stream=False)

    def forward_stream(self, xp: Any, params: Params, x: Any, state: Any, *, scan: Scan,
                       reset: Any = None, doc_starts: Any = None, valid: Any = None,
                       check: Callable[..., None] | None = None, checked: bool = False,
                       max_documents: int | None = None) -> tuple[Any, StreamState]:
        """Streaming and packed documents: ``x (B, N, d)`` -> ``(out (B, N, d), StreamState)``.

        ``state``: ``None`` (zeros), an ``(h, c)`` pair (a chunk boundary) or the
        :class:`StreamState` a previous call returned. The call continues each row's
        unfinished chunk, so feeding a sequence in pieces of ANY lengths (one token at
        a time included) gives the outputs and the state of one long call. A chunk's
        output is known from its first token (its read); its write happens when its
        ``L``-th token arrives.

        ``doc_starts``: optional bool ``(B, N)``, True where a new document starts
        (packed documents, see :func:`doc_starts_from_offsets`): the state and the
        unfinished chunk are dropped there and the chunk grid restarts, so each
        document's outputs equal running it alone. ``reset (B,)`` is a document start
        at the first token of the row. The grid is decided on the host (the masks are
        read there), and the scan is cut only where some row starts a document or
        ends with an unfinished chunk; with ``max_documents`` and a scan taking per-step
        masks (``scan.masks``, the JAX adapter's) it is computed by array operations
        instead (:func:`tmcore.layer.plan.packed_plan`: traceable, ONE uncut scan of
        ``T = ceil((L - 1 + N) / L) + min(max_documents, N)`` chunks per row).

        ``valid``: optional bool ``(B, N)``, False at tokens to skip (padding, e.g. a
        Hugging Face attention mask, left or right): they never enter the state nor the
        chunk grid, their outputs are zeros, and each row's stream is its valid tokens
        only (the returned state is the one running them alone gives).

        Parameters
        ----------
        xp, params : namespace, dict of dict of array
            The array namespace and the layer's parameter pytree, as in
            :meth:`forward`.
        x : array, shape ``(B, N, d)``
            The next piece of each row's stream (``N`` may be 0).
        state : None, pair of arrays or StreamState
            ``None`` (zeros), an ``(h, c)`` pair ``(B, C, *S)`` or the
            :class:`StreamState` a previous call returned.
        scan : callable
            ``scan(h0, c0, inputs) -> (reads (B, T, C), h_T, c_T)``; one with a
            ``cond(pred, true_fn, false_fn)`` attribute (JAX: ``lax.cond``) lets
            a step that completes no chunk skip the update; one with a true
            ``masks`` attribute (JAX) also takes ``reset=`` and ``active=``, bool
            ``(B, T)`` per-step masks, which ``max_documents`` uses.
        reset : bool array, shape ``(B,)``, optional
            A document start at the first token of the marked rows.
        doc_starts : bool array, shape ``(B, N)``, optional
            True where a new document starts (read on the host unless
            ``max_documents`` is given to a scan taking masks).
        valid : bool array, shape ``(B, N)``, optional
            False at tokens to skip.
        check : callable, optional
            An adapter's own checks, called as ``check(x, state, reset=reset,
            doc_starts=doc_starts, valid=valid)`` once ``x`` and ``state`` passed
            the generic ones (``state``: ``None``, the checked pair or the checked
            :class:`StreamState`, as given) and before the masks'.
        checked : bool, default False
            True when the caller has already checked ``x`` (as in :meth:`forward`)
            and ``state`` (``None``, the pair :func:`check_state` returned, or the
            :class:`StreamState` :func:`stream_state` returned, its ``count`` an
            int32 array): they are not checked again. The masks are checked
            either way.
        max_documents : int, optional
            ``D``, a static bound: at least the document starts of any row in this
            call (its True entries of ``doc_starts``, plus one for a ``reset`` row
            whose ``doc_starts`` is False at token 0). With a scan taking masks it
            plans the packed grid with arrays (``doc_starts``, ``reset``, ``valid``
            and the state may be traced). A row with more starts: concrete masks are
            checked (``ValueError``); traced ones cannot be, and the row's starts
            after its ``D``-th (counted after a start on a skipped token moves to
            the next valid one) are ignored: its later documents continue the state
            of the one before, so its outputs and state are wrong from there.
            Ignored without ``doc_starts``.

        Returns
        -------
        out : array, shape ``(B, N, d)``
            Each token's output (zeros where ``valid`` is False).
        state : StreamState
            The state after the last token, to pass to the next call.

        Raises
        ------
        TypeError
            If an argument is not an array of the right kind or dtype, or
            ``doc_starts`` (or, with it, ``state.count``, ``reset`` or ``valid``)
            is traced without ``max_documents`` (or with a scan taking no masks):
            packed documents are then planned on the host.
        ValueError
            If an argument has the wrong shape, ``state.count`` is not ``B``
            ints in ``[0, L)``, ``max_documents`` is not a positive int, or a
            concrete ``doc_starts`` has a row with more than ``max_documents``
            starts.
        """
        config = self.config
        documents = check_max_documents(max_documents)
        if not checked:
            check_tokens(xp, x, config)
            check_forward(xp, config, x)  # the call fits, before anything is allocated
        batch, tokens, _ = x.shape
        if tokens == 1 and reset is None and doc_starts is None and valid is None:
            fast = self.decode_produced(xp, params, x, state, scan, checked=True)
            if fast is not None:  # this layer's last decode step made it: taken as it is
                return fast
        if doc_starts is None and valid is None and tokens > 1 and batch \
                and not isinstance(state, StreamState):
            # from a chunk boundary (no state, or a pair): x chunked as it is, without
            # first building an empty unfinished chunk (the same outputs and state)
            pair = None if state is None else tuple(state) if checked else check_state(
                xp, state, batch, config)
            if check is not None:
                check(x, pair, reset=reset)
            return self._from_boundary(xp, params, x, pair, scan, reset, stream=True)
        st, known = complete_state(xp, state, x, config, checked=checked)
        if check is not None:
            check(x, None if state is None else st if isinstance(state, StreamState)
                  else (st.h, st.c), reset=reset, doc_starts=doc_starts, valid=valid)
        if valid is not None:
            require_bool_array(xp, valid, "valid", "(B, N)", (batch, tokens))
        if reset is not None:
            require_bool_array(xp, reset, "reset", "(B,)", (batch,),
                               hint=" (compare explicitly, e.g. mask > 0.5)")
        if doc_starts is not None and documents is not None and getattr(scan, "masks", False):
            return self._packed_arrays(xp, params, x, st, known, scan, reset, doc_starts,
                                       valid, documents)
        if doc_starts is not None:
            if documents is not None:
                check_document_bound(doc_starts, reset, documents)
            return self._packed(xp, params, x, st, known, scan, reset, doc_starts, valid,
                                "" if documents is None else PACKED_HOST_WHY)
        st, known = reset_stream(xp, st, known, reset)
        if tokens == 0 or batch == 0:
            return xp.zeros_like(x), st
        if tokens == 1 and known is not None and valid is None:  # a decode step (eager)
            return self._decode(xp, params, x, st, scan, known)
        if tokens == 1:  # a decode step: no chunk grid to plan
            out, st = decode_step(self, xp, params, x[:, 0, :], st, scan,
                                  None if valid is None else valid[:, 0], known)
            return out[:, None, :], st
        if known is not None and not any(known) and valid is None:  # a chunk boundary
            return execute(self, xp, params, x, st,
                           contiguous_plan(tokens, config.chunk_size, stream=True), scan)
        host = None if valid is None else maybe_host(valid)
        valid_counts = None if host is None else (min(sum(r) for r in host),
                                                  max(sum(r) for r in host))
        plan = array_plan(xp, x, xp.astype(st.count, xp.asarray(0).dtype), known, valid,
                          xp.astype(st.pending, x.dtype), config.chunk_size, valid_counts)
        return execute(self, xp, params, x, st, plan, scan)

    def _from_boundary(self, xp: Any, params: Params, x: Any, state: State | None,
                       scan: Scan, reset: Any, stream: bool) -> tuple[Any, Any]:
        """A call from a chunk boundary, the checked pair ``state`` (``None``: zeros) reset
        where ``reset`` says: ``x`` chunked as it is (:func:`contiguous_plan`)."""
        batch, tokens, _ = x.shape
        if state is None:
            state = zero_state(xp, self.config, batch, dtype=x.dtype, device=device_of(x))
        if reset is not None:
            state = reset_state(xp, state, reset)
        if tokens == 0 or batch == 0:  # nothing to scan (the scan refuses empty arrays)
            return xp.zeros_like(x), state
        return execute(self, xp, params, x, StreamState(*state, None, None, None),
                       contiguous_plan(tokens, self.config.chunk_size, stream=stream), scan)

    def decode_produced(self, xp: Any, params: Params, x: Any, state: Any, scan: Scan, *,
                        checked: bool = False) -> tuple[Any, StreamState] | None:
        """One decode step from the state this layer's last decode step produced.

        The state is taken as it is (no state check, no host read of its counts):
        :meth:`forward_stream` of one token, or ``None`` where that does not apply
        (another state, another kind of tokens, a trace). The record holds the batch,
        dtype and device of the last step's (checked) tokens and refuses others, so an
        adapter may call this before its own checks of ``x`` when it knows ``x`` is an
        array of its framework with ``d = embed_dim`` on the parameters' device and
        dtype.

        Parameters
        ----------
        xp, params : namespace, dict of dict of array
            The array namespace and the layer's parameter pytree.
        x : array, shape ``(B, 1, d)``
            The next token of each row.
        state : Any
            The state to continue (a :class:`StreamState` this layer produced, else the
            call declines).
        scan : callable
            The layer's scan, as in :meth:`forward_stream`.
        checked : bool, default False
            True when the caller has checked that the call fits
            (:func:`~tmcore.layer.sizes.check_forward`); else it is checked here.

        Returns
        -------
        tuple of (array, StreamState) or None
            ``(out (B, 1, d), state)``, or ``None`` (the caller runs its usual path).
        """
        record = getattr(self, "_produced", None)
        if record is None or x.ndim != 3 or x.shape[1] != 1 or not x.shape[0] \
                or compiling():
            return None
        known = record.counts(state, x)
        if known is None:
            return None
        if not checked:
            check_forward(xp, self.config, x)
        return self._decode(xp, params, x, state, scan, known)

    def _decode(self, xp: Any, params: Params, x: Any, st: StreamState, scan: Scan,
                known: tuple[int, ...]) -> tuple[Any, StreamState]:
        """A decode step with the counts known on the host; the state it makes is recorded
        (:class:`~tmcore.layer.decode.Produced`), so that the next token's call takes it
        without checking it again nor reading its counts back from the device."""
        # the token as the call gives it (B, 1, d): no reshape of it
        out, st = _decode_known(self, xp, params, x, st, scan, known)
        self._produced = Produced.record(st, next_counts(known, self.config.chunk_size), x)
        return out[:, None, :], st

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_produced", None)  # weak references to arrays: not copied nor pickled
        return state

    def _packed_arrays(self, xp: Any, params: Params, x: Any, st: StreamState,
                       known: tuple[int, ...] | None, scan: Scan, reset: Any,
                       doc_starts: Any, valid: Any, documents: int
                       ) -> tuple[Any, StreamState]:
        """Packed documents with at most ``documents`` starts per row: the grid from
        arrays (:func:`packed_plan`), one scan with per-step masks (traceable)."""
        batch, tokens, _ = x.shape
        require_bool_array(xp, doc_starts, "doc_starts", "(B, N)", (batch, tokens))
        check_document_bound(doc_starts, reset, documents)  # concrete masks only
        if tokens == 0 or batch == 0:  # a reset row with no token to start at: emptied
            return xp.zeros_like(x), reset_stream(xp, st, known, reset)[0]
        index = xp.asarray(0, device=device_of(x)).dtype
        plan = packed_plan(xp, x, xp.astype(st.count, index), doc_starts, valid, reset,
                           xp.astype(st.pending, x.dtype), self.config.chunk_size, documents)
        return execute(self, xp, params, x, st, plan, scan)

    def _packed(self, xp: Any, params: Params, x: Any, st: StreamState,
                known: tuple[int, ...] | None, scan: Scan, reset: Any, doc_starts: Any,
                valid: Any, why: str = "") -> tuple[Any, StreamState]:
        """Packed documents: the grid planned on the host (:func:`host_plan`); ``why``
        replaces the refusal's hint for traced masks when given."""
        batch, tokens, _ = x.shape
        why = why or PACKED_WHY
        starts = check_doc_starts(xp, doc_starts, batch, tokens, why=why)
        keep = check_valid(xp, valid, batch, tokens, why=why) if valid is not None else None
        counts = list(known) if known is not None else [
            int(k) for k in host_list(st.count, "state.count", why)]
        if reset is not None:
            for b, r in enumerate(host_list(reset, "reset", why)):
                if r and tokens:
                    starts[b][0] = True
                elif r:  # no token to start at: forget the state now
                    st, counts[b] = forget_row(xp, st, b), 0
        if tokens == 0 or batch == 0:
            return xp.zeros_like(x), st._replace(count=xp.asarray(
                counts, dtype=xp.int32, device=device_of(x)))
        plan = host_plan(xp, x, st.pending, counts, starts, self.config.chunk_size, keep)
        return execute(self, xp, params, x, st, plan, scan)
