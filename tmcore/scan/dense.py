"""The chunk recurrence: read, write, update, T times, with a lean backward.

Per step ``t`` (the layer's order, docs/LAYER.md): read ``h_{t-1}`` at ``read_coords[:, t]``
BEFORE this step's write; splat ``write_content[:, t]`` around
``write_coords[:, t]`` with ``write_sigma[:, t]``; update ``(h, c)`` with the
ConvLSTM. The backward keeps only the states at every ``checkpoint_every``-th
step and recomputes the rest (and every step's gates) on the way back, so it
stores at most ``T + 1`` states, never per-step gate tensors.

A backend may run the whole loop in fused kernels instead: the optional
``scan_fwd`` / ``scan_bwd`` entries of its :class:`~tmcore.runtime.dispatch.Ops` table
(torch on CUDA: the Triton kernels of ``tmcore.backends._triton``; CuPy: the
same kernels through DLPack) are tried first, with the same arguments, results
and checkpoint layout, and return ``None`` to leave the loop below to run.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import array_api_compat

from tmcore.ops.cell import cell_bwd, cell_cache, cell_fwd, validate_state
from tmcore.ops.conv import ConvParams, as_conv_params, validate_conv_params
from tmcore.ops.splat import DEFAULT_EPS
from tmcore.runtime import sizes as _sizes
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import (
    check_eps,
    check_int,
    check_positive,
    check_radius,
    check_rank,
    namespace_of,
    require_array,
)

__all__ = [
    "StepInputs",
    "ScanGrads",
    "memory_scan",
    "memory_scan_vjp",
    "memory_scan_fwd",
    "memory_scan_bwd",
    "step_fwd",
    "step_bwd",
    "add_params",
    "validate_scan_inputs",
]


class StepInputs(NamedTuple):
    """One step's addressing and content, all batch-first.

    Parameters
    ----------
    read_coords : array, shape ``(B, n)``
        The normalized read position of the step.
    write_coords : array, shape ``(B, n)``
        The normalized write centre of the step.
    write_sigma : array, shape ``(B,)``
        The write spread of the step.
    write_content : array, shape ``(B, C)``
        The content vector written by the step.
    """

    read_coords: Any
    write_coords: Any
    write_sigma: Any
    write_content: Any


class ScanGrads(NamedTuple):
    """Gradients returned by :func:`memory_scan_vjp`, one per input, shaped like it.

    Parameters
    ----------
    h0 : array, shape ``(B, C, *S)``
        The gradient for the initial hidden state.
    c0 : array, shape ``(B, C, *S)``
        The gradient for the initial cell state.
    read_coords : array, shape ``(B, T, n)``
        The gradient for the read coordinates.
    write_coords : array, shape ``(B, T, n)``
        The gradient for the write centres.
    write_sigma : array, shape ``(B, T)``
        The gradient for the write spreads.
    write_content : array, shape ``(B, T, C)``
        The gradient for the written content.
    params : ConvParams
        The gradients for the gate conv's fields.
    """

    h0: Any
    c0: Any
    read_coords: Any
    write_coords: Any
    write_sigma: Any
    write_content: Any
    params: ConvParams


def add_params(a: ConvParams, b: ConvParams) -> ConvParams:
    """Field-wise sum of two :class:`ConvParams`."""
    return ConvParams(*(x + y for x, y in zip(a, b, strict=True)))


def step_fwd(
    xp: Any, h: Any, c: Any, inputs: StepInputs, params: ConvParams, eps: float,
    radius: float | None,
) -> tuple[Any, Any, Any]:
    """One chunk step; returns ``(read (B, C), h', c')``. No validation.

    Each primitive runs through ``ops_for(xp)`` (a backend fast path or the generic one).
    """
    written = ops_for(xp).splat_fwd(
        xp, inputs.write_content[:, None, :], inputs.write_coords[:, None, :],
        inputs.write_sigma[:, None], tuple(h.shape[2:]), eps, radius,
    )
    return _advance(xp, h, c, inputs.read_coords, written, params)


def _advance(xp: Any, h: Any, c: Any, read_coords: Any, written: Any,
             params: ConvParams) -> tuple[Any, Any, Any]:
    """A step given its written volume ``(B, C, *S)``: ``(read (B, C), h', c')``."""
    read = ops_for(xp).sample_fwd(xp, h, read_coords[:, None, :])[:, 0, :]
    h_new, c_new, _ = cell_fwd(xp, written, h, c, params)
    return read, h_new, c_new


def _advance_bwd(xp: Any, h: Any, c: Any, read_coords: Any, written: Any, params: ConvParams,
                 g_read: Any, g_h: Any, g_c: Any) -> tuple[Any, Any, Any, Any, ConvParams]:
    """VJP of :func:`_advance`: ``(d_h, d_c, d_read_coords (B, n), d_written, d_params)``."""
    cache = cell_cache(xp, written, h, c, params)
    d_written, d_h, d_c, d_params = cell_bwd(xp, cache, params, g_h, g_c)
    d_h_read, d_read_coords = ops_for(xp).sample_bwd(
        xp, h, read_coords[:, None, :], g_read[:, None, :]
    )
    return d_h + d_h_read, d_c, d_read_coords[:, 0, :], d_written, d_params


def step_bwd(
    xp: Any, h: Any, c: Any, inputs: StepInputs, params: ConvParams, g_read: Any, g_h: Any,
    g_c: Any, eps: float, radius: float | None,
) -> tuple[Any, Any, StepInputs, ConvParams]:
    """VJP of :func:`step_fwd` from the step's input state (recomputes the gates).

    Returns ``(d_h, d_c, d_inputs, d_params)``.
    """
    ops = ops_for(xp)
    shape = tuple(h.shape[2:])
    content = inputs.write_content[:, None, :]
    mu = inputs.write_coords[:, None, :]
    sigma = inputs.write_sigma[:, None]
    written = ops.splat_fwd(xp, content, mu, sigma, shape, eps, radius)
    d_h, d_c, d_read_coords, d_written, d_params = _advance_bwd(
        xp, h, c, inputs.read_coords, written, params, g_read, g_h, g_c)
    d_content, d_mu, d_sigma = ops.splat_bwd(xp, content, mu, sigma, shape, d_written, eps, radius)
    d_inputs = StepInputs(d_read_coords, d_mu[:, 0, :], d_sigma[:, 0], d_content[:, 0, :])
    return d_h, d_c, d_inputs, d_params


#: Steps whose write volumes are made, and differentiated, in one splat call. The
#: writes depend on the inputs only, not on the state, so they need not wait for the
#: recurrence; batching them saves ~20 small array calls per step. Memory: two
#: blocks of ``(B, C, *S)`` volumes at a time.
WRITE_BLOCK = 16


class _Writes:
    """The scan's write volumes, made a block of steps at a time, and their VJP.

    ``volume(t)`` is step ``t``'s written volume ``(B, C, *S)`` (the block holding
    ``t`` is made on demand; the two most recent blocks are kept). ``add_grad(t, g)``
    takes its cotangent; once every step of a block has one, the block's splat VJP
    runs in one call. :meth:`grads` returns ``(d_write_coords, d_write_sigma,
    d_write_content)`` over all steps once every step has been given a cotangent.
    """

    def __init__(self, xp: Any, write_coords: Any, write_sigma: Any, write_content: Any,
                 shape: tuple[int, ...], eps: float, radius: float | None,
                 block: int = WRITE_BLOCK) -> None:
        self.xp, self.shape, self.eps, self.radius, self.block = xp, shape, eps, radius, block
        self.coords, self.sigma, self.content = write_coords, write_sigma, write_content
        self.steps = write_coords.shape[1]
        self.volumes: dict[int, Any] = {}
        self.pending: dict[int, dict[int, Any]] = {}
        self.done: dict[int, tuple[Any, Any, Any]] = {}

    def _span(self, index: int) -> tuple[int, int]:
        return index * self.block, min((index + 1) * self.block, self.steps)

    def _inputs(self, index: int) -> tuple[Any, Any, Any]:
        """The block's splat inputs with the steps folded into the batch: ``(B L, 1, .)``."""
        xp = self.xp
        start, stop = self._span(index)
        rows = self.coords.shape[0] * (stop - start)
        return (xp.reshape(self.content[:, start:stop, ...], (rows, 1, self.content.shape[2])),
                xp.reshape(self.coords[:, start:stop, ...], (rows, 1, self.coords.shape[2])),
                xp.reshape(self.sigma[:, start:stop], (rows, 1)))

    def volume(self, t: int) -> Any:
        index = t // self.block
        if index not in self.volumes:
            if len(self.volumes) >= 2:
                self.volumes.pop(next(iter(self.volumes)))
            start, stop = self._span(index)
            written = ops_for(self.xp).splat_fwd(self.xp, *self._inputs(index), self.shape,
                                                 self.eps, self.radius)
            self.volumes[index] = self.xp.reshape(
                written, (self.coords.shape[0], stop - start, *written.shape[1:]))
        return self.volumes[index][:, t - index * self.block, ...]

    def add_grad(self, t: int, g: Any) -> None:
        index = t // self.block
        grads = self.pending.setdefault(index, {})
        grads[t] = g
        start, stop = self._span(index)
        if len(grads) < stop - start:
            return
        xp = self.xp
        stacked = xp.stack([grads[k] for k in range(start, stop)], axis=1)  # (B, L, C, *S)
        batch = stacked.shape[0]
        g_rows = xp.reshape(stacked, (batch * (stop - start), *stacked.shape[2:]))
        content, mu, sigma = self._inputs(index)
        d_content, d_mu, d_sigma = ops_for(xp).splat_bwd(xp, content, mu, sigma, self.shape,
                                                         g_rows, self.eps, self.radius)
        length = stop - start
        self.done[index] = (xp.reshape(d_mu, (batch, length, d_mu.shape[2])),
                            xp.reshape(d_sigma, (batch, length)),
                            xp.reshape(d_content, (batch, length, d_content.shape[2])))
        del self.pending[index]
        self.volumes.pop(index, None)

    def grads(self) -> tuple[Any, Any, Any]:
        blocks = [self.done[i] for i in sorted(self.done)]
        return tuple(self.xp.concat([b[k] for b in blocks], axis=1) for k in range(3))


def memory_scan_fwd(
    xp: Any, h0: Any, c0: Any, read_coords: Any, write_coords: Any, write_sigma: Any,
    write_content: Any, params: ConvParams, *, eps: float = DEFAULT_EPS,
    radius: float | None = None, checkpoint_every: int = 1,
) -> tuple[Any, Any, Any, Any, Any]:
    """Run the forward scan without validation, keeping the backward's checkpoints.

    The low-level half of :func:`memory_scan_vjp`, for adapters that register it
    with a framework's autodiff (and call it inside ``jit``, so it checks
    nothing: validate with :func:`memory_scan` first).

    Parameters
    ----------
    xp : namespace
        The array namespace of the arguments.
    h0 : array, shape ``(B, C, *S)``
        The initial hidden state.
    c0 : array, shape ``(B, C, *S)``
        The initial cell state.
    read_coords : array, shape ``(B, T, n)``
        The normalized read position of each step.
    write_coords : array, shape ``(B, T, n)``
        The normalized write centre of each step.
    write_sigma : array, shape ``(B, T)``
        The write spread of each step.
    write_content : array, shape ``(B, T, C)``
        The content written by each step.
    params : ConvParams
        The gate conv, ``C_in = 2C``, ``C_out = 4C``.
    eps : float, default 1e-6
        As in :func:`gaussian_splat`.
    radius : float or None, default None
        As in :func:`gaussian_splat`.
    checkpoint_every : int, default 1
        Keep the state entering every ``checkpoint_every``-th step.

    Returns
    -------
    reads : array, shape ``(B, T, C)``
        What each step read, from the state before its write.
    h_T : array, shape ``(B, C, *S)``
        The final hidden state.
    c_T : array, shape ``(B, C, *S)``
        The final cell state.
    h_checkpoints : array, shape ``(ceil(T / checkpoint_every), B, C, *S)``
        The hidden states entering steps ``0, k, 2k, ...``: all that
        :func:`memory_scan_bwd` needs.
    c_checkpoints : array, shape ``(ceil(T / checkpoint_every), B, C, *S)``
        The cell states entering the same steps.
    """
    fused = ops_for(xp).scan_fwd
    if fused is not None:  # a backend's whole-scan kernels (may decline: None)
        out = fused(xp, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
                    eps, radius, checkpoint_every)
        if out is not None:
            return out
    steps = read_coords.shape[1]
    writes = _Writes(xp, write_coords, write_sigma, write_content, tuple(h0.shape[2:]), eps,
                     radius)
    h_saved = _CheckpointStore(xp, h0, -(-steps // checkpoint_every))
    c_saved = _CheckpointStore(xp, c0, -(-steps // checkpoint_every))
    h, c = h0, c0
    reads = None
    with ops_for(xp).workspace(xp):
        for t in range(steps):
            if t % checkpoint_every == 0:
                h_saved.append(h)
                c_saved.append(c)
            read, h, c = _advance(xp, h, c, read_coords[:, t, ...], writes.volume(t), params)
            if reads is None:  # (B, T, C), preallocated once the reads' dtype is known
                reads = _CheckpointStore(xp, read, steps, axis=1)
            reads.append(read)
    return reads.result(), h, c, h_saved.result(), c_saved.result()


class _CheckpointStore:
    """Collects ``count`` arrays shaped like ``like`` into one array, stacked along
    ``axis``: the checkpoint states ``(B, C, *S)`` into ``(count, B, C, *S)``, the
    reads ``(B, C)`` into ``(B, T, C)`` (``axis=1``).

    Where arrays support item assignment (NumPy, PyTorch, CuPy, array-api-strict)
    each array is copied into a preallocated one as it arrives, so nothing is held
    twice; a list-then-``stack`` would hold every state in the list and in the
    stacked copy at once (twice the scan's memory at the peak), and ``T`` small
    reads interleaved with the steps' temporaries fragment the heap of a long
    ``no_grad`` scan. Immutable arrays (JAX) fall back to ``stack``.
    """

    def __init__(self, xp: Any, like: Any, count: int, axis: int = 0) -> None:
        self.xp, self.index, self.pending, self.axis = xp, 0, [], axis
        self.buffer = None
        if not array_api_compat.is_jax_namespace(xp):
            shape = (*like.shape[:axis], count, *like.shape[axis:])
            self.buffer = xp.empty(shape, dtype=like.dtype, device=array_api_compat.device(like))

    def _at(self, index: int) -> tuple:
        return (slice(None),) * self.axis + (index, ...)

    def append(self, state: Any) -> None:
        if self.buffer is not None and state.dtype == self.buffer.dtype:
            try:
                self.buffer[self._at(self.index)] = state
                self.index += 1
                return
            except (TypeError, RuntimeError):  # immutable, or a transform (vmap) refusing it
                pass
        if self.buffer is not None:  # from here on: a list (dtypes promote as in stack)
            self.pending = [self.buffer[self._at(i)] for i in range(self.index)]
            self.buffer = None
        self.pending.append(state)

    def result(self) -> Any:
        return self.buffer if self.buffer is not None else self.xp.stack(self.pending,
                                                                         axis=self.axis)


def memory_scan_bwd(
    xp: Any, read_coords: Any, write_coords: Any, write_sigma: Any, write_content: Any,
    params: ConvParams, h_checkpoints: Any, c_checkpoints: Any, g_reads: Any, g_h: Any,
    g_c: Any, *, eps: float = DEFAULT_EPS, radius: float | None = None,
    checkpoint_every: int = 1,
) -> ScanGrads:
    """Run the backward scan from the checkpoints of :func:`memory_scan_fwd`, unvalidated.

    Each segment of ``checkpoint_every`` steps is replayed from its checkpoint
    (storing that segment's states only), then differentiated step by step.

    Parameters
    ----------
    xp : namespace
        The array namespace of the arguments.
    read_coords : array, shape ``(B, T, n)``
        The read positions of the forward scan.
    write_coords : array, shape ``(B, T, n)``
        The write centres of the forward scan.
    write_sigma : array, shape ``(B, T)``
        The write spreads of the forward scan.
    write_content : array, shape ``(B, T, C)``
        The written content of the forward scan.
    params : ConvParams
        The gate conv of the forward scan.
    h_checkpoints : array, shape ``(ceil(T / checkpoint_every), B, C, *S)``
        The hidden-state checkpoints returned by :func:`memory_scan_fwd`.
    c_checkpoints : array, shape ``(ceil(T / checkpoint_every), B, C, *S)``
        The cell-state checkpoints returned by :func:`memory_scan_fwd`.
    g_reads : array, shape ``(B, T, C)``
        The cotangent of the reads.
    g_h : array, shape ``(B, C, *S)``
        The cotangent of the final hidden state.
    g_c : array, shape ``(B, C, *S)``
        The cotangent of the final cell state.
    eps : float, default 1e-6
        As in the forward scan.
    radius : float or None, default None
        As in the forward scan.
    checkpoint_every : int, default 1
        As in the forward scan that made the checkpoints.

    Returns
    -------
    ScanGrads
        The gradients for every input, shaped like it.
    """
    fused = ops_for(xp).scan_bwd
    if fused is not None:  # a backend's whole-scan kernels (may decline: None)
        out = fused(xp, read_coords, write_coords, write_sigma, write_content, params,
                    h_checkpoints, c_checkpoints, g_reads, g_h, g_c, eps, radius,
                    checkpoint_every)
        if out is not None:
            return out
    steps = read_coords.shape[1]
    writes = _Writes(xp, write_coords, write_sigma, write_content, tuple(g_h.shape[2:]), eps,
                     radius)
    d_read_coords: list[Any] = [None] * steps
    d_params = None
    with ops_for(xp).workspace(xp):
        for segment in reversed(range(h_checkpoints.shape[0])):
            start = segment * checkpoint_every
            stop = min(start + checkpoint_every, steps)
            states = [(h_checkpoints[segment, ...], c_checkpoints[segment, ...])]
            for t in range(start, stop - 1):
                _, h, c = _advance(xp, *states[-1], read_coords[:, t, ...], writes.volume(t),
                                   params)
                states.append((h, c))
            for t in reversed(range(start, stop)):
                h, c = states[t - start]
                g_h, g_c, d_read_coords[t], d_written, d_step_params = _advance_bwd(
                    xp, h, c, read_coords[:, t, ...], writes.volume(t), params, g_reads[:, t, ...],
                    g_h, g_c,
                )
                writes.add_grad(t, d_written)
                d_params = (d_step_params if d_params is None
                            else add_params(d_params, d_step_params))
    d_write_coords, d_write_sigma, d_write_content = writes.grads()
    return ScanGrads(g_h, g_c, xp.stack(d_read_coords, axis=1), d_write_coords, d_write_sigma,
                     d_write_content, d_params)


def validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma, write_content, params,
                         checkpoint_every, radius, g_reads=None, g_h=None, g_c=None,
                         eps=DEFAULT_EPS):
    """Check the arguments of :func:`memory_scan` / :func:`memory_scan_vjp`.

    Shapes, dtypes, namespaces, devices and Python scalars always (no device sync);
    in validate mode also finite values and ``write_sigma > 0`` (skipped for values
    that are not concrete: tracers, meta / fake tensors). Raises ``TypeError`` /
    ``ValueError`` naming the argument. Returns ``(xp, params as ConvParams)``.
    """
    params = as_conv_params(params)
    xp = namespace_of(
        h0=h0, c0=c0, read_coords=read_coords, write_coords=write_coords,
        write_sigma=write_sigma, write_content=write_content, g_reads=g_reads, g_h=g_h, g_c=g_c,
        **{f"params.{k}": v for k, v in params._asdict().items()},
    )
    validate_state(h0, c0, "h0", "c0")
    batch, channels = h0.shape[:2]
    n = h0.ndim - 2
    check_rank("read_coords", read_coords, 3, "(B, T, n)")
    steps = read_coords.shape[1]
    expected = {
        "read_coords": ((batch, steps, n), "(B, T, n)"),
        "write_coords": ((batch, steps, n), "(B, T, n)"),
        "write_sigma": ((batch, steps), "(B, T)"),
        "write_content": ((batch, steps, channels), "(B, T, C)"),
        "g_reads": ((batch, steps, channels), "(B, T, C)"),
        "g_h": (tuple(h0.shape), "(B, C, *S)"),
        "g_c": (tuple(h0.shape), "(B, C, *S)"),
    }
    given = {"read_coords": read_coords, "write_coords": write_coords,
             "write_sigma": write_sigma, "write_content": write_content,
             "g_reads": g_reads, "g_h": g_h, "g_c": g_c}
    for name, value in given.items():
        shape, layout = expected[name]
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name}: expected shape {layout} = {shape} (B, C, *S from h0, "
                             f"T from read_coords), got {tuple(value.shape)}")
    validate_conv_params(params, n, 2 * channels)
    if params.pointwise_weight.shape[0] != 4 * channels:
        raise ValueError(f"params.pointwise_weight: expected shape (4C, 2C) = "
                         f"{(4 * channels, 2 * channels)}, got "
                         f"{tuple(params.pointwise_weight.shape)}")
    check_int("checkpoint_every", checkpoint_every, 1)
    check_radius(radius)
    check_eps(eps)
    if steps < 1:
        raise ValueError(f"read_coords: expected at least one step (T >= 1), got shape "
                         f"{tuple(read_coords.shape)}")
    _sizes.check_scan(xp, h0, steps, checkpoint_every, g_reads is not None)  # before allocating
    check_positive(xp, "write_sigma", write_sigma)
    return xp, params


def memory_scan(
    h0: Any, c0: Any, read_coords: Any, write_coords: Any, write_sigma: Any, write_content: Any,
    params: ConvParams, *, eps: float = DEFAULT_EPS, radius: float | None = None,
    checkpoint_every: int = 1,
) -> tuple[Any, Any, Any]:
    """Run the chunk recurrence over ``T`` steps: read, then write, then update.

    Step ``t`` reads ``h`` at ``read_coords[:, t]`` from the state BEFORE its
    write, splats ``write_content[:, t]`` around ``write_coords[:, t]`` with
    spread ``write_sigma[:, t]``, and updates ``(h, c)`` with the ConvLSTM
    (:func:`convlstm_step`).

    Parameters
    ----------
    h0 : array, shape ``(B, C, *S)``
        The initial hidden state, with 1 to 4 spatial axes.
    c0 : array, shape ``(B, C, *S)``
        The initial cell state.
    read_coords : array, shape ``(B, T, n)``
        The normalized read position of each step (``coords[..., k]``
        addresses spatial axis ``n - 1 - k``).
    write_coords : array, shape ``(B, T, n)``
        The normalized write centre of each step.
    write_sigma : array, shape ``(B, T)``
        The write spread of each step, > 0 (checked in validate mode only).
    write_content : array, shape ``(B, T, C)``
        The content vector written by each step.
    params : ConvParams
        The ConvLSTM's gate conv, ``C_in = 2C``, ``C_out = 4C``.
    eps : float, default 1e-6
        As in :func:`gaussian_splat`.
    radius : float or None, default None
        As in :func:`gaussian_splat`.
    checkpoint_every : int, default 1
        Checked (an int >= 1) but without effect here: it only changes what
        :func:`memory_scan_vjp` stores, and is accepted so that both take the
        same keywords.

    Returns
    -------
    reads : array, shape ``(B, T, C)``
        What each step read.
    h_T : array, shape ``(B, C, *S)``
        The final hidden state.
    c_T : array, shape ``(B, C, *S)``
        The final cell state.

    Raises
    ------
    TypeError
        If ``params`` is not a 4-tuple, an argument is not an array, the arrays
        mix namespaces, or ``checkpoint_every`` is not an int.
    ValueError
        If a shape does not match the layouts above (``B, C, S`` from ``h0``,
        ``T`` from ``read_coords``), ``T`` is 0, ``checkpoint_every < 1``,
        ``eps`` or ``radius`` is out of range, or (validate mode only) an
        array holds NaN or inf or a sigma is not > 0.

    See Also
    --------
    memory_scan_vjp : The gradients of the scan.

    Examples
    --------
    Write one vector at the centre of a 1-D grid, then read it back there:

    >>> import numpy as np
    >>> import tmcore
    >>> B, C, T, S = 1, 2, 2, (5,)
    >>> h0 = c0 = np.zeros((B, C, *S))
    >>> coords = np.zeros((B, T, 1))                   # read and write at the centre
    >>> sigma = np.full((B, T), 0.3)
    >>> content = np.ones((B, T, C))
    >>> pointwise = np.zeros((4 * C, 2 * C))           # (4C, 2C), gates i, f, o, g
    >>> pointwise[3 * C:, :C] = np.eye(C)              # the candidate g is the write
    >>> params = tmcore.conv_params_from_pointwise(pointwise, ndim=1)
    >>> reads, h, c = tmcore.memory_scan(h0, c0, coords, coords, sigma, content, params)
    >>> reads.shape, h.shape
    ((1, 2, 2), (1, 2, 5))
    >>> reads[0, 0]                                    # step 0 reads the empty state
    array([0., 0.])
    >>> bool(np.all(reads[0, 1] > 0))                  # step 1 reads step 0's write
    True
    """
    xp, params = validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma,
                                      write_content, params, checkpoint_every, radius, eps=eps)
    reads, h, c, _, _ = memory_scan_fwd(
        xp, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
        eps=eps, radius=radius, checkpoint_every=read_coords.shape[1],
    )
    return reads, h, c


def memory_scan_vjp(
    h0: Any, c0: Any, read_coords: Any, write_coords: Any, write_sigma: Any, write_content: Any,
    params: ConvParams, g_reads: Any, g_h: Any = None, g_c: Any = None, *,
    eps: float = DEFAULT_EPS, radius: float | None = None, checkpoint_every: int = 1,
) -> ScanGrads:
    """Gradients of :func:`memory_scan` for the cotangents of its outputs.

    The forward is run again keeping only the state entering every
    ``checkpoint_every``-th step; each segment is replayed on the way back.
    With ``checkpoint_every = k`` the backward holds ``O(T/k + k)`` states for
    one extra forward pass, never per-step gate tensors; the gradients do not
    depend on ``k``.

    Parameters
    ----------
    h0 : array, shape ``(B, C, *S)``
        The initial hidden state.
    c0 : array, shape ``(B, C, *S)``
        The initial cell state.
    read_coords : array, shape ``(B, T, n)``
        The normalized read position of each step.
    write_coords : array, shape ``(B, T, n)``
        The normalized write centre of each step.
    write_sigma : array, shape ``(B, T)``
        The write spread of each step.
    write_content : array, shape ``(B, T, C)``
        The content vector written by each step.
    params : ConvParams
        The ConvLSTM's gate conv, ``C_in = 2C``, ``C_out = 4C``.
    g_reads : array, shape ``(B, T, C)``
        The cotangent of the reads.
    g_h : array, shape ``(B, C, *S)``, optional
        The cotangent of the final hidden state; None means zero.
    g_c : array, shape ``(B, C, *S)``, optional
        The cotangent of the final cell state; None means zero.
    eps : float, default 1e-6
        As in :func:`gaussian_splat`.
    radius : float or None, default None
        As in :func:`gaussian_splat`.
    checkpoint_every : int, default 1
        Keep the state entering every ``checkpoint_every``-th step and
        recompute the others.

    Returns
    -------
    ScanGrads
        ``(h0, c0, read_coords, write_coords, write_sigma, write_content,
        params)``: the gradient for each input, shaped like it.

    Raises
    ------
    TypeError
        As for :func:`memory_scan`; ``g_reads`` may not be None.
    ValueError
        As for :func:`memory_scan`, and if a cotangent is not shaped like its
        output.

    See Also
    --------
    memory_scan : The forward scan.
    """
    require_array("g_reads", g_reads)
    xp, params = validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma,
                                      write_content, params, checkpoint_every, radius, g_reads,
                                      g_h, g_c, eps=eps)
    _, _, _, h_ckpt, c_ckpt = memory_scan_fwd(
        xp, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
        eps=eps, radius=radius, checkpoint_every=checkpoint_every,
    )
    g_h = xp.zeros_like(h0) if g_h is None else g_h
    g_c = xp.zeros_like(c0) if g_c is None else g_c
    return memory_scan_bwd(
        xp, read_coords, write_coords, write_sigma, write_content, params, h_ckpt, c_ckpt,
        g_reads, g_h, g_c, eps=eps, radius=radius, checkpoint_every=checkpoint_every,
    )
