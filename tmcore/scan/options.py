"""The layer's scan options (``update``, ``window``, ``dynamics``, ``checkpoint_every``)
as a :class:`~tmcore.scan.base.Step`, and the scan over them with its VJP.

:func:`step_for` picks the step: :class:`~tmcore.scan.dense.DenseStep` (the paper's),
:class:`~tmcore.scan.local.LocalStep` (``update="local"``) or, with a shift,
:class:`~tmcore.scan.warped.WarpStep` around either. :func:`scan_fwd` / :func:`scan_bwd`
run it through the one loop (:mod:`tmcore.scan.base`); :func:`dynamic_memory_scan` and
its VJP are the validated public entries.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from tmcore.ops.conv import as_conv_params, validate_conv_params
from tmcore.ops.splat import DEFAULT_EPS
from tmcore.ops.window import check_method, window_sizes
from tmcore.runtime import sizes
from tmcore.runtime.validate import check_dim, check_int, check_rank, require_array
from tmcore.scan.base import Step, scan_backward, scan_forward, zero_if_none
from tmcore.scan.dense import DenseStep, validate_scan_inputs
from tmcore.scan.local import LocalStep
from tmcore.scan.warped import WarpStep
from tmcore.types import ConvParams, Residuals, StepInputs, WarpInputs, WarpParams

__all__ = ["ScanOptions", "check_options", "check_scan_bytes", "dynamic_memory_scan",
           "dynamic_memory_scan_vjp", "scan_bwd", "scan_fwd", "scan_options", "step_for"]


class ScanOptions(NamedTuple):
    """The static options of :func:`scan_fwd` (hashable). ``checkpoint_every = k`` (an
    int >= 1, as in :func:`tmcore.memory_scan`): the per-step loop (a warp) keeps the
    state entering steps ``0, k, 2k, ...`` for the backward, which replays each segment
    (``k >= T``: only the initial state); the local scan without warp ignores it."""

    update: str = "dense"
    window: int | None = None
    eps: float = DEFAULT_EPS
    radius: float | None = None
    method: str = "fast"
    checkpoint_every: int = 1


def scan_options(config: Any, method: str = "fast") -> ScanOptions:
    """The :class:`ScanOptions` of a :class:`tmcore.layer.LayerConfig` (its ``update``,
    ``window``, ``eps``, ``radius`` and ``checkpoint_every``)."""
    return ScanOptions(config.update, config.window, config.eps, config.radius, method,
                       check_int("checkpoint_every", config.checkpoint_every, 1))


_UPDATES = ("dense", "local")


def check_options(options: ScanOptions) -> ScanOptions:
    """``options`` with every field checked (a named error): ``update`` one of
    ``"dense"`` / ``"local"``, ``window`` an int >= 1 for ``"local"``, ``method`` a
    window method, ``checkpoint_every`` an int >= 1. The adapters call it once per scan,
    and :func:`step_for` at every scan (the custom ops take the options as plain values
    a caller may get wrong: nothing falls back to other options)."""
    if options.update not in _UPDATES:
        raise ValueError(f"update: expected one of {_UPDATES}, got {options.update!r}")
    if options.update == "local":
        check_int("window", options.window, 1)
        check_method(options.method)
    every = check_int("checkpoint_every", options.checkpoint_every, 1)
    return options if every == options.checkpoint_every else options._replace(
        checkpoint_every=every)


def step_for(options: ScanOptions, warp: bool = False) -> Step:
    """The chunk step of ``options``: dense or local, inside a :class:`WarpStep` when
    ``warp`` (the inputs carry a shift). Raises what :func:`check_options` raises."""
    options = check_options(options)
    step: Step = (DenseStep(options.eps, options.radius) if options.update == "dense" else
                  LocalStep(options.window, options.eps, options.radius, options.method))
    return WarpStep(step) if warp else step


def check_scan_bytes(xp: Any, step: Step, h0: Any, steps: int, checkpoint_every: int,
                     backward: bool, flow: bool = False) -> None:
    """Before a scan of ``step`` allocates: what it keeps for a backward (checkpoints, or
    the local step's per-step log) and its per-step working set fit the device, or the
    bound ``TMCORE_MEMORY_LIMIT`` sets (``MemoryError`` / ``ValueError`` naming ``h0``)."""
    batch, channels, *grid = (int(s) for s in h0.shape)
    inner = step.update if isinstance(step, WarpStep) else step
    working = 0
    if isinstance(step, WarpStep):
        working = sizes.warp_states(len(grid), flow)
    if isinstance(inner, LocalStep) and inner.policy == "log" and step is inner:
        box = math.prod(window_sizes(tuple(grid), inner.window)[1])
        corners = math.prod(1 if s == 1 else 2 for s in grid)
        sizes.check_scan(xp, h0, steps, steps, backward,
                         log_elements=batch * channels * (2 * box + corners))
        return
    sizes.check_scan(xp, h0, steps, checkpoint_every, backward, working_states=working)


def _shift_of(inputs: Any) -> Any:
    return getattr(inputs, "shift", None)


def _params(params: ConvParams, warp: bool, flow_params: ConvParams | None) -> Any:
    return WarpParams(params, flow_params) if warp else params


def scan_fwd(xp: Any, h0: Any, c0: Any, inputs: Any, params: ConvParams,
             options: ScanOptions, *, keep: bool = True, flow_params: ConvParams | None = None,
             reset: Any = None, active: Any = None) -> tuple[Any, Any, Any, Residuals | None]:
    """The scan of ``options`` without validation: ``(reads (B, T, C), h_T, c_T,
    residuals)``.

    ``inputs``: :class:`tmcore.StepInputs` or :class:`WarpInputs` of ``(B, T, ...)``
    arrays (a warp when it has a ``shift (B, T, n)``). ``keep=False``: no residuals
    (``None``). ``h0, c0`` are never modified. ``flow_params`` (with a warp): the
    :class:`tmcore.ConvParams` (``C_in = C``, ``C_out = n``) of the per-cell flow.
    ``reset, active``: the per-step masks (:class:`tmcore.scan.base.Masks`).
    """
    warp = _shift_of(inputs) is not None
    return scan_forward(xp, step_for(options, warp), _params(params, warp, flow_params), h0,
                        c0, inputs, checkpoint_every=options.checkpoint_every, keep=keep,
                        reset=reset, active=active)


def scan_bwd(xp: Any, residuals: Residuals, inputs: Any, params: ConvParams,
             options: ScanOptions, g_reads: Any, g_h: Any, g_c: Any, *,
             flow_params: ConvParams | None = None, reset: Any = None, active: Any = None
             ) -> tuple[Any, ...]:
    """VJP of :func:`scan_fwd` from its residuals: ``(d_h0, d_c0, d_inputs, d_params)``,
    ``d_inputs`` of the type of ``inputs``, plus ``d_flow_params`` when ``flow_params``
    is given. No validation; ``g_h, g_c`` are not modified."""
    warp = _shift_of(inputs) is not None
    d_h, d_c, d_inputs, d_params = scan_backward(
        xp, step_for(options, warp), _params(params, warp, flow_params), residuals, inputs,
        g_reads, g_h, g_c, checkpoint_every=options.checkpoint_every, reset=reset,
        active=active)
    if not warp:
        return d_h, d_c, d_inputs, d_params
    if flow_params is not None:
        return d_h, d_c, d_inputs, d_params.cell, d_params.flow
    return d_h, d_c, d_inputs, d_params.cell


def _validate(h0, c0, inputs, params, update, window, eps, radius, method, checkpoint_every,
              g_reads=None, g_h=None, g_c=None, flow_params=None, reset=None, active=None):
    if not isinstance(inputs, (StepInputs, WarpInputs)):
        raise TypeError(f"inputs: expected a StepInputs or WarpInputs of (B, T, ...) arrays, "
                        f"got {type(inputs).__name__}")
    xp, params = validate_scan_inputs(h0, c0, *inputs[:4], params, 1, radius, g_reads, g_h,
                                      g_c, eps=eps, reset=reset, active=active)
    shift = _shift_of(inputs)
    if shift is not None:
        require_array("inputs.shift", shift)
        batch, steps, n = inputs.read_coords.shape
        check_rank("inputs.shift", shift, 3, "(B, T, n)")
        check_dim("inputs.shift", shift, 0, batch, "(B, T, n)", "B = h0.shape[0]")
        check_dim("inputs.shift", shift, 1, steps, "(B, T, n)", "T = read_coords.shape[1]")
        check_dim("inputs.shift", shift, 2, n, "(B, T, n)", "n = number of spatial axes")
    if flow_params is not None:
        if shift is None:
            raise ValueError("flow_params: a flow needs a warp (inputs with a shift, "
                             "WarpInputs)")
        flow_params = as_conv_params(flow_params)
        validate_conv_params(flow_params, h0.ndim - 2, h0.shape[1])
        n = h0.ndim - 2
        if tuple(flow_params.pointwise_weight.shape) != (n, h0.shape[1]):
            raise ValueError(f"flow_params.pointwise_weight: expected shape (n, C) = "
                             f"{(n, h0.shape[1])}, got "
                             f"{tuple(flow_params.pointwise_weight.shape)}")
    if update not in _UPDATES:
        raise ValueError(f"update: expected 'dense' or 'local', got {update!r}")
    if update == "local":
        check_int("window", window, 1)
    check_method(method)
    every = check_int("checkpoint_every", checkpoint_every, 1)
    return xp, params, flow_params, ScanOptions(update, window if update == "local" else None,
                                                eps, radius, method, every)


def dynamic_memory_scan(h0: Any, c0: Any, inputs: Any, params: ConvParams, *,
                        update: str = "dense", window: int | None = None,
                        eps: float = DEFAULT_EPS, radius: float | None = None,
                        method: str = "fast", flow_params: ConvParams | None = None,
                        checkpoint_every: int = 1, reset: Any = None, active: Any = None
                        ) -> tuple[Any, Any, Any]:
    """The chunk recurrence with the layer's options (see the module docstring).

    Parameters
    ----------
    h0, c0 : ``(B, C, *S)`` initial state (not modified).
    inputs : :class:`tmcore.StepInputs` (``(B, T, n)``, ``(B, T, n)``, ``(B, T)``,
        ``(B, T, C)``) or :class:`WarpInputs` (plus ``shift (B, T, n)``: warp).
    params : :class:`tmcore.ConvParams` of the gates.
    update : ``"dense"`` or ``"local"`` (then ``window``, cells per axis).
    eps, radius : as in :func:`tmcore.gaussian_splat`.
    method : the local update's path, ``"fast"`` or ``"masked"`` (:mod:`tmcore.scan.local`).
    flow_params : with a warp, optional :class:`tmcore.ConvParams` (depthwise ``(n, C, 3)``,
        ``(n, C)``, pointwise ``(n, C)``, ``(n,)``) of a per-cell flow ``conv(h_{t-1})``
        ``(B, n, *S)`` added to each step's shift.
    checkpoint_every : the backward's checkpoint interval ``k`` (an int >= 1, as in
        :func:`tmcore.memory_scan`; used by :func:`dynamic_memory_scan_vjp` with a warp):
        the state entering every ``k``-th step is kept and each segment replayed.
    reset, active : the per-step row masks, bool ``(B, T)`` (:func:`tmcore.memory_scan`).

    Returns
    -------
    ``(reads (B, T, C), h_T, c_T)``.
    """
    xp, params, flow_params, options = _validate(h0, c0, inputs, params, update, window, eps,
                                                 radius, method, checkpoint_every,
                                                 flow_params=flow_params, reset=reset,
                                                 active=active)
    reads, h, c, _ = scan_fwd(xp, h0, c0, inputs, params, options, keep=False,
                              flow_params=flow_params, reset=reset, active=active)
    return reads, h, c


def dynamic_memory_scan_vjp(h0: Any, c0: Any, inputs: Any, params: ConvParams, g_reads: Any,
                            g_h: Any = None, g_c: Any = None, *, update: str = "dense",
                            window: int | None = None, eps: float = DEFAULT_EPS,
                            radius: float | None = None, method: str = "fast",
                            flow_params: ConvParams | None = None, checkpoint_every: int = 1,
                            reset: Any = None, active: Any = None) -> tuple[Any, ...]:
    """VJP of :func:`dynamic_memory_scan` for ``g_reads (B, T, C)`` and the final-state
    cotangents ``g_h, g_c (B, C, *S)`` (``None``: zero).

    Returns ``(d_h0, d_c0, d_inputs, d_params)``, ``d_inputs`` of the type of ``inputs``,
    plus ``d_flow_params`` when ``flow_params`` is given. With a warp the backward keeps
    ``ceil(T / checkpoint_every)`` states and replays the segments (the same operations
    as ``checkpoint_every=1``, so the same values).
    """
    require_array("g_reads", g_reads)
    xp, params, flow_params, options = _validate(h0, c0, inputs, params, update, window, eps,
                                                 radius, method, checkpoint_every, g_reads,
                                                 g_h, g_c, flow_params, reset, active)
    _, _, _, residuals = scan_fwd(xp, h0, c0, inputs, params, options,
                                  flow_params=flow_params, reset=reset, active=active)
    g_h, g_c = zero_if_none(xp, h0, c0, g_h, g_c)
    return scan_bwd(xp, residuals, inputs, params, options, g_reads, g_h, g_c,
                    flow_params=flow_params, reset=reset, active=active)
