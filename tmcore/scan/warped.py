"""The layer's scan with the options beyond the paper: local updates and warped dynamics.

:class:`tmcore.layer.Layer` scans with :func:`tmcore.memory_scan` by default. Its
options (``update="local"``, ``dynamics="warp"``, :func:`tmcore.layer.layer_config`)
change the chunk step, and this module is the recurrence for them, with its VJP, in the
array API (every namespace; the adapters register it with their autodiff):

- ``update="local"`` without warp: :func:`tmcore.scan.local.local_scan_fwd` /
  :func:`tmcore.scan.local.local_scan_bwd` (the box fast path and its undo-log backward);
- ``dynamics="warp"`` (with either update): per chunk ``t``

  1. read ``h_{t-1}`` at ``read_coords[:, t]`` (from the state BEFORE the warp, so the
     read is the default layer's and a warp moves what later chunks read);
  2. warp the state, ``(h, c) <- warp(h, c, shift[:, t])``
     (:func:`tmcore.ops.warp.warp_state`: n-linear resampling at the cell centres plus the
     shift, border padding; exactly the identity for a zero shift);
  3. write and update the warped state (the dense step, or the local one).

  The shift is the layer's ``warp_net`` head on the chunk's write summary
  (:class:`WarpInputs`), zero at initialization, so the layer starts as the default.
  With ``flow_params`` (the layer's ``flow=True``, group ``warp_flow``) a per-cell flow
  ``conv(h_{t-1}) (B, n, *S)`` (a factorized conv, ``C -> n``) is added to the shift.
  The backward keeps the state entering every ``checkpoint_every``-th step
  (:class:`ScanOptions`, the layer's ``checkpoint_every``; ``ceil(T / k)`` states, as
  the default scan: the warp moves every cell, so no undo log applies), replays each
  segment forward from its checkpoint and recomputes each step's warp and gates; the
  replay repeats the forward's operations, so the values and gradients are those of
  ``k = 1``, bit for bit (NumPy, PyTorch; a compiler such as XLA may round the replayed
  program differently).

Cost per step: the local update's work is the window's (:mod:`tmcore.scan.local`); the
warp's is the grid's, ``O(B C P sum(S_a))`` for a shift (``P`` cells), forward and
backward, so a warped local step is no longer independent of the grid. With a flow the
warp gathers ``2^n`` corners per cell, ``O(2^n B C P)``, and the state's VJP through it
is their scatter-add, ``O(2^n B C P)``, on PyTorch and JAX (the table's
``scatter_add``; JAX off the CPU only with ``deterministic=False``); the generic path
(NumPy, array-api-strict, any other namespace, ``generic=True``) keeps its
``O(B C P^2)`` contraction over tiles of cells (:mod:`tmcore.ops.warp`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tmcore.ops.cell import cell_bwd, cell_cache, cell_fwd
from tmcore.ops.conv import ConvParams, as_conv_params, validate_conv_params
from tmcore.ops.gather import box_index, gather_box, set_box
from tmcore.ops.splat import DEFAULT_EPS
from tmcore.ops.warp import warp_bwd, warp_fwd
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import check_dim, check_int, check_rank, require_array
from tmcore.scan.dense import StepInputs, add_params, validate_scan_inputs
from tmcore.scan.local import (
    LocalScanResiduals,
    check_method,
    fast_box,
    fast_step_bwd,
    local_scan_bwd,
    local_scan_fwd,
    masked_step,
    masked_step_bwd,
    owned,
    window_geometry,
)

__all__ = [
    "ScanOptions",
    "WarpInputs",
    "DynamicResiduals",
    "dynamic_memory_scan",
    "dynamic_memory_scan_vjp",
    "scan_fwd",
    "scan_bwd",
    "scan_options",
    "check_options",
]


class WarpInputs(NamedTuple):
    """:class:`tmcore.StepInputs` plus the warp's ``shift`` (``(..., n)``, normalized units,
    coordinate order: component ``k`` moves along spatial axis ``n - 1 - k``)."""

    read_coords: Any
    write_coords: Any
    write_sigma: Any
    write_content: Any
    shift: Any


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


def check_options(options: ScanOptions) -> ScanOptions:
    """``options`` with its ``checkpoint_every`` checked (an int >= 1, a named error);
    the adapters call it once per scan (the other fields come from a validated config)."""
    every = check_int("checkpoint_every", options.checkpoint_every, 1)
    return options if every == options.checkpoint_every else options._replace(
        checkpoint_every=every)


class DynamicResiduals(NamedTuple):
    """What :func:`scan_bwd` needs: the local scan's undo log (``update="local"`` without
    warp), or the states entering steps ``0, k, 2k, ...`` (``k`` the options'
    ``checkpoint_every``): ``h_states, c_states (ceil(T / k), B, C, *S)`` (with warp)."""

    local: LocalScanResiduals | None
    h_states: Any
    c_states: Any


def _step(inputs: Any, t: int) -> StepInputs:
    return StepInputs(inputs.read_coords[:, t, ...], inputs.write_coords[:, t, ...],
                      inputs.write_sigma[:, t], inputs.write_content[:, t, ...])


def _shift_of(inputs: Any) -> Any:
    return getattr(inputs, "shift", None)


def _warp(xp: Any, h: Any, c: Any, shift: Any, flow_params: ConvParams | None = None):
    """``(h_w, c_w, residuals, flow stages)``: both halves of the state warped by
    ``shift (B, n)`` plus, with ``flow_params``, the flow ``conv(h) (B, n, *S)``."""
    channels = h.shape[1]
    flow = stages = None
    if flow_params is not None:
        flow, stages = ops_for(xp).conv_fwd(xp, h, flow_params)
    out, residuals = warp_fwd(xp, xp.concat([h, c], axis=1), shift, flow)
    return out[:, :channels, ...], out[:, channels:, ...], residuals, stages


def _update_fwd(xp: Any, h: Any, c: Any, write: StepInputs, params: ConvParams,
                options: ScanOptions, owned: bool) -> tuple[Any, Any]:
    """The write and the ConvLSTM update of one step (no read). ``owned``: ``h, c`` may
    be updated in place (the local fast path)."""
    shape = tuple(h.shape[2:])
    if options.update == "dense":
        written = ops_for(xp).splat_fwd(xp, write.write_content[:, None, :],
                                        write.write_coords[:, None, :],
                                        write.write_sigma[:, None], shape, options.eps,
                                        options.radius)
        h_new, c_new, _ = cell_fwd(xp, written, h, c, params)
        return h_new, c_new
    if options.method == "masked":
        h_new, c_new, _, _ = masked_step(xp, h, c, write, params, options.window,
                                          options.eps, options.radius)
        return h_new, c_new
    geometry, index, _, _, h_box, c_box = fast_box(xp, h, c, write, params, options.window,
                                                    options.eps, options.radius)
    if not owned:
        h, c = owned(xp, h), owned(xp, c)
    return (set_box(xp, h, geometry.box_start, h_box, index),
            set_box(xp, c, geometry.box_start, c_box, index))


def _advance(xp: Any, h: Any, c: Any, step: StepInputs, shift: Any, params: ConvParams,
             options: ScanOptions, flow_params: ConvParams | None) -> tuple[Any, Any]:
    """The state after one step from the state before it (the warp, when ``shift (B, n)``
    is given, then the update; the read is not part of it): the forward's step and the
    backward's replay, the same operations."""
    if shift is not None:
        h, c, _, _ = _warp(xp, h, c, shift, flow_params)
    return _update_fwd(xp, h, c, step, params, options, owned=shift is not None)


def _update_bwd(xp: Any, h: Any, c: Any, write: StepInputs, params: ConvParams,
                options: ScanOptions, g_h: Any, g_c: Any):
    """VJP of :func:`_update_fwd`: ``(d_h, d_c, (d_mu, d_sigma, d_content), d_params)``."""
    shape = tuple(h.shape[2:])
    eps, radius = options.eps, options.radius
    if options.update == "dense":
        ops = ops_for(xp)
        content = write.write_content[:, None, :]
        mu = write.write_coords[:, None, :]
        sigma = write.write_sigma[:, None]
        written = ops.splat_fwd(xp, content, mu, sigma, shape, eps, radius)
        cache = cell_cache(xp, written, h, c, params)
        d_written, d_h, d_c, d_params = cell_bwd(xp, cache, params, g_h, g_c)
        d_content, d_mu, d_sigma = ops.splat_bwd(xp, content, mu, sigma, shape, d_written,
                                                 eps, radius)
        return d_h, d_c, (d_mu[:, 0, :], d_sigma[:, 0], d_content[:, 0, :]), d_params
    if options.method == "masked":
        return masked_step_bwd(xp, h, c, write, params, options.window, g_h, g_c, eps,
                                radius)
    geometry = window_geometry(xp, write.write_coords, shape, options.window)
    index = box_index(xp, geometry.box_start, geometry.box, h.shape[0], h.shape[1], shape)

    def box(x: Any) -> Any:
        return gather_box(xp, x, geometry.box_start, geometry.box, index)

    d_h_box, d_c_box, grads, d_params = fast_step_bwd(
        xp, box(h), box(c), write, geometry, shape, params, box(g_h), box(g_c), eps, radius)
    d_h = set_box(xp, owned(xp, g_h), geometry.box_start, d_h_box, index)
    d_c = set_box(xp, owned(xp, g_c), geometry.box_start, d_c_box, index)
    return d_h, d_c, grads, d_params


def scan_fwd(xp: Any, h0: Any, c0: Any, inputs: Any, params: ConvParams,
             options: ScanOptions, *, keep: bool = True, flow_params: ConvParams | None = None
             ) -> tuple[Any, Any, Any, DynamicResiduals | None]:
    """The scan without validation: ``(reads (B, T, C), h_T, c_T, residuals)``.

    ``inputs``: :class:`tmcore.StepInputs` or :class:`WarpInputs` of ``(B, T, ...)``
    arrays (a warp when it has a ``shift (B, T, n)``). ``keep=False``: no residuals
    (``None``; no gradient will be asked for). ``h0, c0`` are never modified.
    ``flow_params`` (with a warp): the :class:`tmcore.ConvParams` (``C_in = C``,
    ``C_out = n``) of the per-cell flow ``conv(h)`` added to each step's shift. The
    residuals of the per-step loop are the states entering every
    ``options.checkpoint_every``-th step, ``(ceil(T / k), B, C, *S)`` each.
    """
    shift = _shift_of(inputs)
    if shift is None and options.update == "local":
        reads, h, c, residuals = local_scan_fwd(
            xp, h0, c0, *inputs[:4], params, window=options.window, eps=options.eps,
            radius=options.radius, method=options.method)
        return reads, h, c, DynamicResiduals(residuals, None, None) if keep else None
    sample = ops_for(xp).sample_fwd
    every = options.checkpoint_every
    h, c = h0, c0
    reads, h_saved, c_saved = [], [], []
    for t in range(inputs.read_coords.shape[1]):
        step = _step(inputs, t)
        if keep and t % every == 0:
            h_saved.append(h)
            c_saved.append(c)
        reads.append(sample(xp, h, step.read_coords[:, None, :])[:, 0, :])
        h, c = _advance(xp, h, c, step, None if shift is None else shift[:, t, ...], params,
                        options, flow_params)
    residuals = DynamicResiduals(None, xp.stack(h_saved), xp.stack(c_saved)) if keep else None
    return xp.stack(reads, axis=1), h, c, residuals


def scan_bwd(xp: Any, residuals: DynamicResiduals, inputs: Any, params: ConvParams,
             options: ScanOptions, g_reads: Any, g_h: Any, g_c: Any, *,
             flow_params: ConvParams | None = None) -> tuple[Any, ...]:
    """VJP of :func:`scan_fwd` from its residuals: ``(d_h0, d_c0, d_inputs, d_params)``,
    ``d_inputs`` of the type of ``inputs`` (with ``shift`` for a warp), plus
    ``d_flow_params`` when ``flow_params`` is given. No validation; ``g_h, g_c`` are
    not modified. The per-step loop goes back segment by segment: it replays the
    segment's ``checkpoint_every`` steps forward from its checkpoint (the forward's
    operations, so the same bits), then runs each step's VJP in reverse, holding at most
    ``checkpoint_every`` states at a time."""
    shift = _shift_of(inputs)
    if residuals.local is not None:
        grads = local_scan_bwd(xp, residuals.local, *inputs[:4], params, g_reads, g_h, g_c,
                               window=options.window, eps=options.eps,
                               radius=options.radius, method=options.method)
        return grads.h0, grads.c0, StepInputs(grads.read_coords, grads.write_coords,
                                              grads.write_sigma, grads.write_content), \
            grads.params
    steps = inputs.read_coords.shape[1]
    channels = g_h.shape[1]
    sample_bwd = ops_for(xp).sample_bwd
    d_read, d_mu, d_sigma, d_content, d_shift = ([None] * steps for _ in range(5))
    d_params = d_flow_params = None
    every = options.checkpoint_every
    states: list[Any] = []
    for t in reversed(range(steps)):
        step = _step(inputs, t)
        if not states:  # the segment of t: replay it from its checkpoint
            start = t - t % every
            states = [(residuals.h_states[start // every, ...],
                       residuals.c_states[start // every, ...])]
            for u in range(start, t):
                states.append(_advance(xp, *states[-1], _step(inputs, u),
                                       None if shift is None else shift[:, u, ...], params,
                                       options, flow_params))
        h, c = states.pop()
        if shift is not None:
            h_w, c_w, warp_residuals, flow_stages = _warp(xp, h, c, shift[:, t, ...],
                                                          flow_params)
        else:
            h_w, c_w = h, c
        d_h, d_c, grads, step_params = _update_bwd(xp, h_w, c_w, step, params, options, g_h,
                                                   g_c)
        if shift is not None:
            d_volume, d_shift[t], d_flow = warp_bwd(xp, warp_residuals,
                                                    xp.concat([d_h, d_c], axis=1))
            d_h, d_c = d_volume[:, :channels, ...], d_volume[:, channels:, ...]
            if flow_params is not None:  # the flow conv(h) reads the step's input state
                d_h_flow, step_flow = ops_for(xp).conv_bwd(xp, flow_stages, flow_params,
                                                           d_flow)
                d_h = d_h + d_h_flow
                d_flow_params = step_flow if d_flow_params is None else add_params(
                    d_flow_params, step_flow)
        d_volume, d_coords = sample_bwd(xp, h, step.read_coords[:, None, :],
                                        g_reads[:, t, None, :])
        g_h, g_c = d_h + d_volume, d_c
        d_read[t] = d_coords[:, 0, :]
        d_mu[t], d_sigma[t], d_content[t] = grads
        d_params = step_params if d_params is None else add_params(d_params, step_params)
    fields = [xp.stack(d, axis=1) for d in (d_read, d_mu, d_sigma, d_content)]
    d_inputs = StepInputs(*fields) if shift is None else WarpInputs(*fields,
                                                                     xp.stack(d_shift, axis=1))
    if flow_params is not None:
        return g_h, g_c, d_inputs, d_params, d_flow_params
    return g_h, g_c, d_inputs, d_params


# ----------------------------------------------------------------------------- public


def _validate(h0, c0, inputs, params, update, window, eps, radius, method, checkpoint_every,
              g_reads=None, g_h=None, g_c=None, flow_params=None):
    if not isinstance(inputs, (StepInputs, WarpInputs)):
        raise TypeError(f"inputs: expected a StepInputs or WarpInputs of (B, T, ...) arrays, "
                        f"got {type(inputs).__name__}")
    xp, params = validate_scan_inputs(h0, c0, *inputs[:4], params, 1, radius, g_reads, g_h,
                                      g_c, eps=eps)
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
    if update not in ("dense", "local"):
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
                        checkpoint_every: int = 1) -> tuple[Any, Any, Any]:
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

    Returns
    -------
    ``(reads (B, T, C), h_T, c_T)``.
    """
    xp, params, flow_params, options = _validate(h0, c0, inputs, params, update, window, eps,
                                                 radius, method, checkpoint_every,
                                                 flow_params=flow_params)
    reads, h, c, _ = scan_fwd(xp, h0, c0, inputs, params, options, keep=False,
                              flow_params=flow_params)
    return reads, h, c


def dynamic_memory_scan_vjp(h0: Any, c0: Any, inputs: Any, params: ConvParams, g_reads: Any,
                            g_h: Any = None, g_c: Any = None, *, update: str = "dense",
                            window: int | None = None, eps: float = DEFAULT_EPS,
                            radius: float | None = None, method: str = "fast",
                            flow_params: ConvParams | None = None, checkpoint_every: int = 1
                            ) -> tuple[Any, ...]:
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
                                                 g_h, g_c, flow_params)
    _, _, _, residuals = scan_fwd(xp, h0, c0, inputs, params, options,
                                  flow_params=flow_params)
    g_h = xp.zeros_like(h0) if g_h is None else g_h
    g_c = xp.zeros_like(c0) if g_c is None else g_c
    return scan_bwd(xp, residuals, inputs, params, options, g_reads, g_h, g_c,
                    flow_params=flow_params)
