"""The paper's chunk step and its scan: read, write, update, T times, with a lean backward.

Per step ``t`` (the layer's order, docs/LAYER.md): read ``h_{t-1}`` at ``read_coords[:, t]``
BEFORE this step's write; splat ``write_content[:, t]`` around ``write_coords[:, t]``
with ``write_sigma[:, t]``; update ``(h, c)`` with the ConvLSTM. :class:`DenseStep` is
that step for the one scan loop (:mod:`tmcore.scan.base`): the backward keeps the state
entering every ``checkpoint_every``-th step and recomputes the rest (and every step's
gates) on the way back, so it stores at most ``T + 1`` states, never per-step gate
tensors.

A backend may run the whole loop in fused kernels (the ``scan_fwd`` / ``scan_bwd``
entries of its :class:`~tmcore.runtime.dispatch.Ops` table: torch's C kernels on the
CPU, the Triton kernels on CUDA and for CuPy), with the same arguments, results and
checkpoint layout, returning ``None`` to leave the loop to run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tmcore.ops.cell import cell_bwd, cell_cache, cell_fwd, validate_gate_conv, validate_state
from tmcore.ops.conv import as_conv_params
from tmcore.ops.splat import DEFAULT_EPS, splat_rows, splat_rows_vjp
from tmcore.runtime import sizes as _sizes
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import (
    check_bool_mask,
    check_eps,
    check_int,
    check_positive,
    check_radius,
    check_rank,
    namespace_of,
    require_array,
)
from tmcore.scan.base import (
    read_then_update,
    read_then_update_vjp,
    scan_backward,
    scan_forward,
    zero_if_none,
)
from tmcore.types import ConvParams, Residuals, ScanGrads, StepInputs

__all__ = [
    "DenseStep",
    "memory_scan",
    "memory_scan_vjp",
    "memory_scan_fwd",
    "memory_scan_bwd",
    "step_fwd",
    "step_bwd",
    "add_params",
    "validate_scan_inputs",
]


def add_params(a: ConvParams, b: ConvParams) -> ConvParams:
    """Field-wise sum of two :class:`ConvParams`."""
    return ConvParams(*(x + y for x, y in zip(a, b, strict=True)))




class DenseStep(NamedTuple):
    """The paper's chunk step (:class:`tmcore.scan.base.Step`): read, Gaussian write over
    the whole grid, ConvLSTM update. ``params``: the gate conv's :class:`ConvParams`;
    ``W``: the written volume ``(M, C, *S)``. Hashable (a static ``jit`` argument).

    Parameters
    ----------
    eps, radius : float, float or None
        The splat's offset and truncation (:func:`tmcore.gaussian_splat`).
    """

    eps: float = DEFAULT_EPS
    radius: float | None = None

    policy = "checkpoint"
    workspace = True

    def write(self, xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
        return splat_rows(xp, x, shape, self.eps, self.radius)

    def write_vjp(self, xp: Any, x: Any, W: Any, g_W: Any) -> tuple[Any, Any, Any]:
        return splat_rows_vjp(xp, x, tuple(W.shape[2:]), g_W, self.eps, self.radius)

    def update(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any
               ) -> tuple[Any, Any]:
        """The ConvLSTM update on the written volume ``W`` (no read)."""
        h_new, c_new, _ = cell_fwd(xp, W, h, c, params)
        return h_new, c_new

    def update_vjp(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any,
                   g_h: Any, g_c: Any) -> tuple[Any, Any, Any, ConvParams]:
        """VJP of :meth:`update`: ``(d_h, d_c, g_W, d_params)`` (recomputes the gates)."""
        d_written, d_h, d_c, d_params = cell_bwd(xp, cell_cache(xp, W, h, c, params), params,
                                                 g_h, g_c)
        return d_h, d_c, d_written, d_params

    def advance(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any):
        return read_then_update(self, xp, params, h, c, x, W)

    def advance_vjp(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any,
                    log: Any, g_read: Any, g_h: Any, g_c: Any):
        return read_then_update_vjp(self, xp, params, h, c, x, W, g_read, g_h, g_c)

    def own_state(self, xp: Any, h: Any, c: Any, overwrite: bool) -> tuple[Any, Any]:
        return h, c

    def own_cotangents(self, xp: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
        return g_h, g_c

    def fused(self, xp: Any) -> tuple[Callable, Callable] | None:
        ops = ops_for(xp)
        if ops.scan_fwd is None and ops.scan_bwd is None:
            return None
        eps, radius = self.eps, self.radius

        def forward(xp, params, h0, c0, xs, every, keep, overwrite, reset, active):
            if ops.scan_fwd is None:
                return None
            every = every if keep else xs.read_coords.shape[1]  # only h0 kept
            out = ops.scan_fwd(xp, h0, c0, *xs, params, eps, radius, every, reset=reset,
                               active=active)
            if out is None:
                return None
            reads, h, c, h_saved, c_saved = out
            return reads, h, c, Residuals(h_saved, c_saved, None) if keep else None

        def backward(xp, params, residuals, xs, g_reads, g_h, g_c, every, reset, active):
            if ops.scan_bwd is None:
                return None
            return fused_grads(ops.scan_bwd(xp, *xs, params, residuals.h, residuals.c, g_reads,
                                            g_h, g_c, eps, radius, every, reset=reset,
                                            active=active))

        return forward, backward


def fused_grads(out: Any) -> tuple[Any, Any, StepInputs, ConvParams] | None:
    """A backend's whole-scan backward's result (``None``: declined) as the loop's."""
    if out is None:
        return None
    return out.h0, out.c0, StepInputs(*out[2:6]), out.params


def step_fwd(
    xp: Any, h: Any, c: Any, inputs: StepInputs, params: ConvParams, eps: float,
    radius: float | None,
) -> tuple[Any, Any, Any]:
    """One chunk step; returns ``(read (B, C), h', c')``. No validation.

    Each primitive runs through ``ops_for(xp)`` (a backend fast path or the generic one).
    """
    step = DenseStep(eps, radius)
    read, h, c, _ = step.advance(xp, params, h, c, inputs, step.write(xp, inputs,
                                                                      tuple(h.shape[2:])))
    return read, h, c


def step_bwd(
    xp: Any, h: Any, c: Any, inputs: StepInputs, params: ConvParams, g_read: Any, g_h: Any,
    g_c: Any, eps: float, radius: float | None,
) -> tuple[Any, Any, StepInputs, ConvParams]:
    """VJP of :func:`step_fwd` from the step's input state (recomputes the gates).

    Returns ``(d_h, d_c, d_inputs, d_params)``.
    """
    step = DenseStep(eps, radius)
    written = step.write(xp, inputs, tuple(h.shape[2:]))
    d_h, d_c, d_read_coords, _, g_W, d_params = step.advance_vjp(
        xp, params, h, c, inputs, written, None, g_read, g_h, g_c)
    d_mu, d_sigma, d_content = step.write_vjp(xp, inputs, written, g_W)
    return d_h, d_c, StepInputs(d_read_coords, d_mu, d_sigma, d_content), d_params


def memory_scan_fwd(
    xp: Any, h0: Any, c0: Any, read_coords: Any, write_coords: Any, write_sigma: Any,
    write_content: Any, params: ConvParams, *, eps: float = DEFAULT_EPS,
    radius: float | None = None, checkpoint_every: int = 1, reset: Any = None,
    active: Any = None,
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
    reset, active : bool array, shape ``(B, T)``, optional
        Per-step row masks: ``reset[b, t]`` zeroes row ``b``'s state entering step
        ``t`` (its read too); ``active[b, t]`` False gives the row back, after step
        ``t``, the state it entered it with. ``None``: no reset, every row active.

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
    reads, h, c, residuals = scan_forward(
        xp, DenseStep(eps, radius), params, h0, c0,
        StepInputs(read_coords, write_coords, write_sigma, write_content),
        checkpoint_every=checkpoint_every, reset=reset, active=active)
    return reads, h, c, residuals.h, residuals.c


def memory_scan_bwd(
    xp: Any, read_coords: Any, write_coords: Any, write_sigma: Any, write_content: Any,
    params: ConvParams, h_checkpoints: Any, c_checkpoints: Any, g_reads: Any, g_h: Any,
    g_c: Any, *, eps: float = DEFAULT_EPS, radius: float | None = None,
    checkpoint_every: int = 1, reset: Any = None, active: Any = None,
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
    reset, active : bool array, shape ``(B, T)``, optional
        As in the forward scan.

    Returns
    -------
    ScanGrads
        The gradients for every input, shaped like it.
    """
    d_h0, d_c0, d_xs, d_params = scan_backward(
        xp, DenseStep(eps, radius), params, Residuals(h_checkpoints, c_checkpoints, None),
        StepInputs(read_coords, write_coords, write_sigma, write_content), g_reads, g_h, g_c,
        checkpoint_every=checkpoint_every, reset=reset, active=active)
    return ScanGrads(d_h0, d_c0, *d_xs, d_params)


def validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma, write_content, params,
                         checkpoint_every, radius, g_reads=None, g_h=None, g_c=None,
                         eps=DEFAULT_EPS, backward=None, reset=None, active=None):
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
    validate_gate_conv(params, n, channels)
    check_int("checkpoint_every", checkpoint_every, 1)
    check_radius(radius)
    check_eps(eps)
    if steps < 1:
        raise ValueError(f"read_coords: expected at least one step (T >= 1), got shape "
                         f"{tuple(read_coords.shape)}")
    for name, mask in (("reset", reset), ("active", active)):
        if mask is not None:
            check_bool_mask(xp, mask, name, "(B, T)", (batch, steps))
    # before allocating: a forward that keeps the backward's checkpoints counts them
    _sizes.check_scan(xp, h0, steps, checkpoint_every,
                      g_reads is not None if backward is None else backward)
    check_positive(xp, "write_sigma", write_sigma)
    return xp, params


def memory_scan(
    h0: Any, c0: Any, read_coords: Any, write_coords: Any, write_sigma: Any, write_content: Any,
    params: ConvParams, *, eps: float = DEFAULT_EPS, radius: float | None = None,
    checkpoint_every: int = 1, reset: Any = None, active: Any = None,
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
    reset, active : bool array, shape ``(B, T)``, optional
        Per-step row masks: ``reset[b, t]`` zeroes row ``b``'s state entering step
        ``t`` (its read too); ``active[b, t]`` False gives the row back, after step
        ``t``, the state it entered it with. ``None``: no reset, every row active.

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
                                      write_content, params, checkpoint_every, radius, eps=eps,
                                      reset=reset, active=active)
    reads, h, c, _, _ = memory_scan_fwd(
        xp, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
        eps=eps, radius=radius, checkpoint_every=read_coords.shape[1], reset=reset,
        active=active,
    )
    return reads, h, c


def memory_scan_vjp(
    h0: Any, c0: Any, read_coords: Any, write_coords: Any, write_sigma: Any, write_content: Any,
    params: ConvParams, g_reads: Any, g_h: Any = None, g_c: Any = None, *,
    eps: float = DEFAULT_EPS, radius: float | None = None, checkpoint_every: int = 1,
    reset: Any = None, active: Any = None,
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
    reset, active : bool array, shape ``(B, T)``, optional
        As in :func:`memory_scan`.

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
                                      g_h, g_c, eps=eps, reset=reset, active=active)
    masks = {"reset": reset, "active": active}
    _, _, _, h_ckpt, c_ckpt = memory_scan_fwd(
        xp, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
        eps=eps, radius=radius, checkpoint_every=checkpoint_every, **masks,
    )
    g_h, g_c = zero_if_none(xp, h0, c0, g_h, g_c)
    return memory_scan_bwd(
        xp, read_coords, write_coords, write_sigma, write_content, params, h_ckpt, c_ckpt,
        g_reads, g_h, g_c, eps=eps, radius=radius, checkpoint_every=checkpoint_every, **masks,
    )
