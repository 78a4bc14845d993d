"""The paper's chunk step (:class:`DenseStep`) and its scan, :func:`memory_scan`, with its VJP.

A backend may run the whole scan in fused kernels (the ``scan_fwd`` / ``scan_bwd`` entries of
its Ops table) with the same arguments, results and checkpoints, or decline with None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tmcore.ops.cell import cell_bwd, cell_cache, cell_fwd, validate_gate_conv, validate_state
from tmcore.ops.conv import as_conv_params
from tmcore.ops.splat import DEFAULT_EPS, splat_rows, splat_rows_vjp
from tmcore.runtime import validate
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
    """The paper's chunk step: read, Gaussian write over the whole grid, ConvLSTM update.
    ``params``: the gate :class:`ConvParams`; ``W``: the written volume ``(M, C, *S)``; ``eps``,
    ``radius``: the splat's. Hashable (a static ``jit`` argument)."""

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
        """VJP of :meth:`update`: ``(d_h, d_c, g_W, d_params)`` (gates recomputed)."""
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
    """A backend's whole-scan backward result (None: declined) as the loop's."""
    if out is None:
        return None
    return out.h0, out.c0, StepInputs(*out[2:6]), out.params


def step_fwd(
    xp: Any, h: Any, c: Any, inputs: StepInputs, params: ConvParams, eps: float,
    radius: float | None,
) -> tuple[Any, Any, Any]:
    """One chunk step through ``ops_for(xp)``, no validation: ``(read (B, C), h', c')``."""
    step = DenseStep(eps, radius)
    read, h, c, _ = step.advance(xp, params, h, c, inputs, step.write(xp, inputs,
                                                                      tuple(h.shape[2:])))
    return read, h, c


def step_bwd(
    xp: Any, h: Any, c: Any, inputs: StepInputs, params: ConvParams, g_read: Any, g_h: Any,
    g_c: Any, eps: float, radius: float | None,
) -> tuple[Any, Any, StepInputs, ConvParams]:
    """VJP of :func:`step_fwd` from the step's input state (gates recomputed): ``(d_h, d_c,
    d_inputs, d_params)``."""
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

    The half of :func:`memory_scan_vjp` that adapters register with an autodiff (inside ``jit``:
    it checks nothing; validate with :func:`memory_scan` first).

    Parameters
    ----------
    xp : namespace
        The array namespace of the arguments.
    h0, c0, read_coords, write_coords, write_sigma, write_content, params : array or ConvParams
        As in :func:`memory_scan`.
    eps, radius : float, float or None
        As in :func:`memory_scan`.
    checkpoint_every : int, default 1
        Keep the state entering every ``checkpoint_every``-th step.
    reset, active : bool array, shape ``(B, T)``, optional
        As in :func:`memory_scan`.

    Returns
    -------
    reads, h_T, c_T : array
        As :func:`memory_scan` returns them.
    h_checkpoints, c_checkpoints : array, shape ``(ceil(T / checkpoint_every), B, C, *S)``
        The states entering steps ``0, k, 2k, ...``: all :func:`memory_scan_bwd` needs.
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

    Each segment of ``checkpoint_every`` steps is replayed from its checkpoint (holding that
    segment's states only), then differentiated step by step.

    Parameters
    ----------
    xp : namespace
        The array namespace of the arguments.
    read_coords, write_coords, write_sigma, write_content, params : array or ConvParams
        As in the forward scan.
    h_checkpoints, c_checkpoints : array, shape ``(ceil(T / checkpoint_every), B, C, *S)``
        As :func:`memory_scan_fwd` returns them.
    g_reads, g_h, g_c : array
        The cotangents of the reads ``(B, T, C)`` and of the final state ``(B, C, *S)``.
    eps, radius, checkpoint_every, reset, active : optional
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
    """Check the arguments of :func:`memory_scan` / :func:`memory_scan_vjp`, naming the argument;
    values (finite, ``write_sigma > 0``) in validate mode only. Returns ``(xp, ConvParams)``."""
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
    validate.check_scan(xp, h0, steps, checkpoint_every,
                      g_reads is not None if backward is None else backward)
    check_positive(xp, "write_sigma", write_sigma)
    return xp, params


def memory_scan(
    h0: Any, c0: Any, read_coords: Any, write_coords: Any, write_sigma: Any, write_content: Any,
    params: ConvParams, *, eps: float = DEFAULT_EPS, radius: float | None = None,
    checkpoint_every: int = 1, reset: Any = None, active: Any = None,
) -> tuple[Any, Any, Any]:
    """Run the chunk recurrence over ``T`` steps: read, then write, then update.

    Step ``t`` reads ``h`` at ``read_coords[:, t]`` from the state BEFORE its write, splats
    ``write_content[:, t]`` around ``write_coords[:, t]`` with spread ``write_sigma[:, t]``
    (:func:`gaussian_splat`) and updates ``(h, c)`` (:func:`convlstm_step`).

    Parameters
    ----------
    h0, c0 : array, shape ``(B, C, *S)``
        The initial state, with 1 to 4 spatial axes.
    read_coords, write_coords : array, shape ``(B, T, n)``
        Each step's normalized read position and write centre.
    write_sigma : array, shape ``(B, T)``
        Each step's write spread, > 0 (checked in validate mode only).
    write_content : array, shape ``(B, T, C)``
        Each step's content vector.
    params : ConvParams
        The ConvLSTM's gate conv, ``C_in = 2C``, ``C_out = 4C``.
    eps, radius : float, float or None
        As in :func:`gaussian_splat` (defaults 1e-6, None).
    checkpoint_every : int, default 1
        Checked, but used only by :func:`memory_scan_vjp` (both take the same keywords).
    reset, active : bool array, shape ``(B, T)``, optional
        Per-step row masks: ``reset[b, t]`` zeroes row ``b``'s state entering step ``t`` (its
        read too); ``active[b, t]`` False gives the row back, after step ``t``, the state it
        entered it with. None: no reset, every row active.

    Returns
    -------
    reads : array, shape ``(B, T, C)``
        What each step read.
    h_T, c_T : array, shape ``(B, C, *S)``
        The final state.

    Raises
    ------
    TypeError
        If ``params`` is not a 4-tuple, an argument is not an array, the arrays mix
        namespaces, or ``checkpoint_every`` is not an int.
    ValueError
        If a shape does not match the layouts above (``B, C, S`` from ``h0``, ``T`` from
        ``read_coords``), ``T`` is 0, ``checkpoint_every < 1``, ``eps`` or ``radius`` is out
        of range, or (validate mode only) an array holds NaN or inf or a sigma is not > 0.

    Examples
    --------
    Write one vector at the centre of a 1-D grid, then read it back there:

    >>> import numpy as np
    >>> import tmcore
    >>> B, C, T, S = 1, 2, 2, (5,)
    >>> h0 = c0 = np.zeros((B, C, *S))
    >>> coords = np.zeros((B, T, 1))                   # read and write at the centre
    >>> sigma, content = np.full((B, T), 0.3), np.ones((B, T, C))
    >>> pointwise = np.zeros((4 * C, 2 * C))           # (4C, 2C), gates i, f, o, g
    >>> pointwise[3 * C:, :C] = np.eye(C)              # the candidate g is the write
    >>> params = tmcore.conv_params_from_pointwise(pointwise, ndim=1)
    >>> reads, h, c = tmcore.memory_scan(h0, c0, coords, coords, sigma, content, params)
    >>> reads[0, 0], bool(np.all(reads[0, 1] > 0))     # step 1 reads step 0's write
    (array([0., 0.]), True)
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
    """Give the gradients of :func:`memory_scan` for the cotangents of its outputs.

    The forward runs again keeping only the state entering every ``checkpoint_every``-th
    step and replays each segment on the way back (docs/guides/conventions.md); the
    gradients do not depend on ``checkpoint_every``.

    Parameters
    ----------
    h0, c0, read_coords, write_coords, write_sigma, write_content, params : array or ConvParams
        As in :func:`memory_scan`.
    g_reads : array, shape ``(B, T, C)``
        The cotangent of the reads.
    g_h, g_c : array, shape ``(B, C, *S)``, optional
        The cotangents of the final state; None means zero.
    eps, radius : float, float or None
        As in :func:`memory_scan`.
    checkpoint_every : int, default 1
        The checkpoint interval.
    reset, active : bool array, shape ``(B, T)``, optional
        As in :func:`memory_scan`.

    Returns
    -------
    ScanGrads
        The gradient for each input, shaped like it.

    Raises
    ------
    TypeError, ValueError
        As :func:`memory_scan`; also if ``g_reads`` is not an array or a cotangent is not
        shaped like its output.
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
