"""The layer's scan options as a :class:`~tmcore.scan.base.Step` (:func:`step_for`: dense,
local, either inside a warp) and the scan over them (:func:`scan_fwd` / :func:`scan_bwd`
unvalidated, :func:`dynamic_memory_scan` and its VJP validated).
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

from tmcore.ops.conv import as_conv_params, validate_conv_params
from tmcore.ops.splat import DEFAULT_EPS
from tmcore.ops.window import check_method, window_sizes
from tmcore.runtime import validate
from tmcore.runtime.validate import check_dim, check_int, check_rank, require_array
from tmcore.scan.base import Step, scan_backward, scan_forward, zero_if_none
from tmcore.scan.dense import DenseStep, validate_scan_inputs
from tmcore.scan.local import LocalStep
from tmcore.scan.warped import WarpStep
from tmcore.types import ConvParams, Residuals, StepInputs, WarpInputs, WarpParams

__all__ = ["ScanOptions", "check_options", "check_scan_bytes", "dynamic_memory_scan",
           "dynamic_memory_scan_vjp", "scan_bwd", "scan_fwd", "scan_options", "step_for"]


class ScanOptions(NamedTuple):
    """The static options of :func:`scan_fwd` (hashable); ``checkpoint_every``: the warp's
    checkpoint interval (as in :func:`tmcore.memory_scan_vjp`), ignored by the local scan alone."""

    update: str = "dense"
    window: int | None = None
    eps: float = DEFAULT_EPS
    radius: float | None = None
    method: str = "fast"
    checkpoint_every: int = 1


def scan_options(config: Any, method: str = "fast") -> ScanOptions:
    """The :class:`ScanOptions` of a :class:`tmcore.layer.LayerConfig`."""
    return ScanOptions(config.update, config.window, config.eps, config.radius, method,
                       check_int("checkpoint_every", config.checkpoint_every, 1))


_UPDATES = ("dense", "local")


def check_options(options: ScanOptions) -> ScanOptions:
    """``options`` with every field checked (a named error); the custom ops take them as plain
    values a caller may get wrong, so :func:`step_for` checks them at every scan."""
    if options.update not in _UPDATES:
        raise ValueError(f"update: expected one of {_UPDATES}, got {options.update!r}")
    if options.update == "local":
        check_int("window", options.window, 1)
        check_method(options.method)
    every = check_int("checkpoint_every", options.checkpoint_every, 1)
    return options if every == options.checkpoint_every else options._replace(
        checkpoint_every=every)


def step_for(options: ScanOptions, warp: bool = False) -> Step:
    """The chunk step of ``options``, inside a :class:`WarpStep` when ``warp`` (the inputs carry a
    shift); raises what :func:`check_options` raises."""
    options = check_options(options)
    step: Step = (DenseStep(options.eps, options.radius) if options.update == "dense" else
                  LocalStep(options.window, options.eps, options.radius, options.method))
    return WarpStep(step) if warp else step


def check_scan_bytes(xp: Any, step: Step, h0: Any, steps: int, checkpoint_every: int,
                     backward: bool, flow: bool = False) -> None:
    """Before a scan of ``step`` allocates: its residuals (checkpoints, or the local log) and
    working set fit (``MemoryError`` / ``ValueError`` naming ``h0``)."""
    try:
        batch, channels, *grid = (operator.index(s) for s in h0.shape)
    except TypeError:  # symbolic sizes (jax.export): nothing to measure
        return
    inner = step.update if isinstance(step, WarpStep) else step
    working = 0
    if isinstance(step, WarpStep):
        working = validate.warp_states(len(grid), flow)
    if isinstance(inner, LocalStep) and inner.policy == "log" and step is inner:
        box = math.prod(window_sizes(tuple(grid), inner.window)[1])
        corners = math.prod(1 if s == 1 else 2 for s in grid)
        validate.check_scan(xp, h0, steps, steps, backward,
                         log_elements=batch * channels * (2 * box + corners))
        return
    validate.check_scan(xp, h0, steps, checkpoint_every, backward, working_states=working)


def _shift_of(inputs: Any) -> Any:
    return getattr(inputs, "shift", None)


def _params(params: ConvParams, warp: bool, flow_params: ConvParams | None) -> Any:
    return WarpParams(params, flow_params) if warp else params


def scan_fwd(xp: Any, h0: Any, c0: Any, inputs: Any, params: ConvParams,
             options: ScanOptions, *, keep: bool = True, flow_params: ConvParams | None = None,
             reset: Any = None, active: Any = None) -> tuple[Any, Any, Any, Residuals | None]:
    """The scan of ``options``, unvalidated: ``(reads (B, T, C), h_T, c_T, residuals or None)``.

    ``inputs``: :class:`tmcore.StepInputs`, or :class:`WarpInputs` with a ``shift (B, T, n)``;
    ``flow_params``: the warp's flow conv (``C_in = C``, ``C_out = n``); ``h0, c0`` are never
    modified.
    """
    warp = _shift_of(inputs) is not None
    return scan_forward(xp, step_for(options, warp), _params(params, warp, flow_params), h0,
                        c0, inputs, checkpoint_every=options.checkpoint_every, keep=keep,
                        reset=reset, active=active)


def scan_bwd(xp: Any, residuals: Residuals, inputs: Any, params: ConvParams,
             options: ScanOptions, g_reads: Any, g_h: Any, g_c: Any, *,
             flow_params: ConvParams | None = None, reset: Any = None, active: Any = None
             ) -> tuple[Any, ...]:
    """VJP of :func:`scan_fwd` from its residuals, unvalidated: ``(d_h0, d_c0, d_inputs,
    d_params)``, plus ``d_flow_params`` with ``flow_params``; ``g_h, g_c`` not modified."""
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
    """The chunk recurrence with the layer's options: ``(reads (B, T, C), h_T, c_T)``.

    ``h0, c0 (B, C, *S)`` (not modified); ``inputs``: a :class:`tmcore.StepInputs` of ``(B, T,
    ...)`` arrays, or a :class:`WarpInputs` that adds a ``shift (B, T, n)`` (a warp); ``params``:
    the gate conv; ``update``: ``"dense"`` or ``"local"`` (with ``window``); ``eps``,
    ``radius``, ``reset``, ``active``: as in :func:`tmcore.memory_scan`; ``method``: as in
    :func:`tmcore.local_update`; ``flow_params`` (warp only): the :class:`tmcore.ConvParams`
    (``C_in = C``, ``C_out = n``) of a per-cell flow ``conv(h_{t-1}) (B, n, *S)`` added to the
    shift; ``checkpoint_every``: the warp backward's checkpoint interval.
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
    """VJP of :func:`dynamic_memory_scan` for ``g_reads (B, T, C)`` and ``g_h, g_c (B, C, *S)``
    (None: zero): ``(d_h0, d_c0, d_inputs, d_params)``, plus ``d_flow_params`` with
    ``flow_params``."""
    require_array("g_reads", g_reads)
    xp, params, flow_params, options = _validate(h0, c0, inputs, params, update, window, eps,
                                                 radius, method, checkpoint_every, g_reads,
                                                 g_h, g_c, flow_params, reset, active)
    _, _, _, residuals = scan_fwd(xp, h0, c0, inputs, params, options,
                                  flow_params=flow_params, reset=reset, active=active)
    g_h, g_c = zero_if_none(xp, h0, c0, g_h, g_c)
    return scan_bwd(xp, residuals, inputs, params, options, g_reads, g_h, g_c,
                    flow_params=flow_params, reset=reset, active=active)
