"""The local scan (``update="local"``): the chunk recurrence of :func:`tmcore.memory_scan`
with each step's write and update restricted to a window around the write
(:mod:`tmcore.ops.window`), and its undo-log backward.

The fast path's backward keeps, per step, the overwritten boxes of ``h, c`` and the
``2^n`` cells of the read (the *undo log*, ``O(T B C (w + 2)^n)`` numbers, no dense state
per step) and replays no step. The masked scan keeps every step's dense input state. A
backend may fuse the fast scan (the ``local_scan_fwd`` / ``local_scan_bwd`` entries of
its :class:`tmcore.runtime.dispatch.Ops` table, declining with ``None``): the same
results and the same undo log, so either direction may run on either path. Its writes
do not depend on the state, so :func:`box_writes` makes every step's window and written
box in one pass before the loop, and :func:`box_writes_bwd` is their VJP after it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tmcore.ops.conv import ConvParams
from tmcore.ops.gather import box_index, gather_box, set_box
from tmcore.ops.splat import DEFAULT_EPS
from tmcore.ops.window import (
    Window,
    box_window_masks,
    box_write,
    box_write_bwd,
    check_method,
    combine,
    corners,
    fast_box,
    fast_step_bwd,
    masked_step,
    masked_step_bwd,
    owned,
    read_corners,
    read_corners_bwd,
    window_geometry,
)
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import check_int, require_array
from tmcore.scan.dense import ScanGrads, StepInputs, add_params, validate_scan_inputs

__all__ = ["BoxWrites", "LocalScanResiduals", "box_writes", "box_writes_bwd",
           "local_memory_scan", "local_memory_scan_vjp", "local_scan_fwd", "local_scan_bwd"]


class BoxWrites(NamedTuple):
    """Every step's window and written box at once, time-major (row ``t * B + b``):
    what a fused local scan needs from the writes, which do not depend on the state.

    geometry : :class:`Window` of ``(T * B, n)`` arrays.
    inside : ``(T * B, 1, *box)`` bool, the window's cells within the box.
    volumes : ``(T * B, C, *box)``, the written boxes (the splat restricted to the window).
    parts : what :func:`box_writes_bwd` needs.
    """

    geometry: Window
    inside: Any
    volumes: Any
    parts: Any


def _time_major(xp: Any, x: Any) -> Any:
    """``(B, T, ...) -> (T * B, ...)``."""
    batch, steps = x.shape[:2]
    order = (1, 0, *range(2, x.ndim))
    return xp.reshape(xp.permute_dims(x, order), (steps * batch, *x.shape[2:]))


def _batch_major(xp: Any, x: Any, batch: int) -> Any:
    """``(T * B, ...) -> (B, T, ...)``."""
    steps = x.shape[0] // batch
    x = xp.reshape(x, (steps, batch, *x.shape[1:]))
    return xp.permute_dims(x, (1, 0, *range(2, x.ndim)))


def box_writes(xp: Any, write_coords: Any, write_sigma: Any, write_content: Any,
               shape: tuple[int, ...], window: int, eps: float = DEFAULT_EPS,
               radius: float | None = None) -> BoxWrites:
    """The windows and written boxes of all ``T`` steps in one pass (no validation).

    ``write_coords (B, T, n)``, ``write_sigma (B, T)``, ``write_content (B, T, C)``;
    ``shape`` the grid. The values are those of the fast path's per-step write.
    """
    write = StepInputs(None, _time_major(xp, write_coords), _time_major(xp, write_sigma),
                       _time_major(xp, write_content))
    geometry = window_geometry(xp, write.write_coords, shape, window)
    masks = box_window_masks(xp, geometry)
    volumes, parts = box_write(xp, write, geometry, shape, eps, radius, masks)
    return BoxWrites(geometry, combine(xp, masks), volumes, parts)


def box_writes_bwd(xp: Any, writes: BoxWrites, write_coords: Any, write_sigma: Any,
                   write_content: Any, g: Any) -> tuple[Any, Any, Any]:
    """VJP of :func:`box_writes` for ``g (T * B, C, *box)`` (time-major, the cotangents
    of ``writes.volumes``): ``(d_write_coords (B, T, n), d_write_sigma (B, T),
    d_write_content (B, T, C))``."""
    batch = write_sigma.shape[0]
    write = StepInputs(None, _time_major(xp, write_coords), _time_major(xp, write_sigma),
                       _time_major(xp, write_content))
    d_content, d_mu, d_sigma = box_write_bwd(xp, write, writes.parts, g, write.write_sigma)
    return (_batch_major(xp, d_mu, batch), _batch_major(xp, d_sigma, batch),
            _batch_major(xp, d_content, batch))


class LocalScanResiduals(NamedTuple):
    """What :func:`local_scan_bwd` needs from :func:`local_scan_fwd`.

    Fast path: ``h_boxes, c_boxes (T, B, C, *box)`` (each step's box before its update)
    and ``read_boxes (T, B, C, *corners)`` (the cells each read used). Masked path: the
    dense input states ``(T, B, C, *S)`` in ``h_boxes, c_boxes`` and ``read_boxes=None``.
    """

    h_boxes: Any
    c_boxes: Any
    read_boxes: Any


def _step_inputs(read_coords, write_coords, write_sigma, write_content, t: int) -> StepInputs:
    return StepInputs(read_coords[:, t, ...], write_coords[:, t, ...], write_sigma[:, t],
                      write_content[:, t, ...])


def local_scan_fwd(xp: Any, h0: Any, c0: Any, read_coords: Any, write_coords: Any,
                   write_sigma: Any, write_content: Any, params: ConvParams, *, window: int,
                   eps: float = DEFAULT_EPS, radius: float | None = None, method: str = "fast",
                   overwrite_state: bool = False,
                   ) -> tuple[Any, Any, Any, LocalScanResiduals]:
    """Forward local scan without validation: ``(reads (B, T, C), h_T, c_T, residuals)``.

    ``overwrite_state=True`` (fast path) lets the scan update ``h0, c0`` themselves in
    place where the namespace allows it, saving the one copy of the state.
    """
    steps = read_coords.shape[1]
    reads, h_saved, c_saved, read_saved = [], [], [], []
    if method == "masked":
        h, c = h0, c0
        sample = ops_for(xp).sample_fwd
        for t in range(steps):
            step = _step_inputs(read_coords, write_coords, write_sigma, write_content, t)
            h_saved.append(h)
            c_saved.append(c)
            reads.append(sample(xp, h, step.read_coords[:, None, :])[:, 0, :])
            h, c, _, _ = masked_step(xp, h, c, step, params, window, eps, radius)
        return (xp.stack(reads, axis=1), h, c,
                LocalScanResiduals(xp.stack(h_saved), xp.stack(c_saved), None))
    fused = ops_for(xp).local_scan_fwd
    if fused is not None:
        out = fused(xp, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
                    window, eps, radius, overwrite_state)
        if out is not None:
            return out
    h = h0 if overwrite_state else owned(xp, h0)
    c = c0 if overwrite_state else owned(xp, c0)
    with ops_for(xp).workspace(xp):
        for t in range(steps):
            step = _step_inputs(read_coords, write_coords, write_sigma, write_content, t)
            read, read_box, *_ = read_corners(xp, h, step.read_coords)
            reads.append(read)
            read_saved.append(read_box)
            geometry, index, h_box, c_box, h_new, c_new = fast_box(xp, h, c, step, params,
                                                                     window, eps, radius)
            h_saved.append(h_box)
            c_saved.append(c_box)
            h = set_box(xp, h, geometry.box_start, h_new, index)
            c = set_box(xp, c, geometry.box_start, c_new, index)
    return (xp.stack(reads, axis=1), h, c,
            LocalScanResiduals(xp.stack(h_saved), xp.stack(c_saved), xp.stack(read_saved)))


def local_scan_bwd(xp: Any, residuals: LocalScanResiduals, read_coords: Any, write_coords: Any,
                   write_sigma: Any, write_content: Any, params: ConvParams, g_reads: Any,
                   g_h: Any, g_c: Any, *, window: int, eps: float = DEFAULT_EPS,
                   radius: float | None = None, method: str = "fast") -> ScanGrads:
    """Backward local scan from :func:`local_scan_fwd`'s residuals. No validation.

    ``g_h, g_c (B, C, *S)`` are copied once (fast path) and updated in place per step.
    """
    steps = read_coords.shape[1]
    shape = tuple(g_h.shape[2:])
    batch, channels = g_h.shape[:2]
    d_read, d_mu, d_sigma, d_content = [None] * steps, [None] * steps, [None] * steps, \
        [None] * steps
    d_params = None
    masked = method == "masked"
    if not masked:
        fused = ops_for(xp).local_scan_bwd
        if fused is not None:
            out = fused(xp, residuals, read_coords, write_coords, write_sigma, write_content,
                        params, g_reads, g_h, g_c, window, eps, radius)
            if out is not None:
                return out
        g_h, g_c = owned(xp, g_h), owned(xp, g_c)
    with ops_for(xp).workspace(xp):
        for t in reversed(range(steps)):
            step = _step_inputs(read_coords, write_coords, write_sigma, write_content, t)
            h_prev, c_prev = residuals.h_boxes[t, ...], residuals.c_boxes[t, ...]
            if masked:
                g_h, g_c, grads, step_params = masked_step_bwd(
                    xp, h_prev, c_prev, step, params, window, g_h, g_c, eps, radius)
                d_volume, d_coords = ops_for(xp).sample_bwd(
                    xp, h_prev, step.read_coords[:, None, :], g_reads[:, t, None, :])
                g_h = g_h + d_volume
                d_read[t] = d_coords[:, 0, :]
            else:
                geometry = window_geometry(xp, step.write_coords, shape, window)
                index = box_index(xp, geometry.box_start, geometry.box, batch, channels, shape)
                g_h_box = gather_box(xp, g_h, geometry.box_start, geometry.box, index)
                g_c_box = gather_box(xp, g_c, geometry.box_start, geometry.box, index)
                d_h_box, d_c_box, grads, step_params = fast_step_bwd(
                    xp, h_prev, c_prev, step, geometry, shape, params, g_h_box, g_c_box, eps,
                    radius)
                g_h = set_box(xp, g_h, geometry.box_start, d_h_box, index)
                g_c = set_box(xp, g_c, geometry.box_start, d_c_box, index)
                start, size, weights, slopes = corners(xp, step.read_coords, shape)
                d_box, d_read[t] = read_corners_bwd(xp, residuals.read_boxes[t, ...], weights,
                                                 slopes, g_reads[:, t, ...])
                corner = box_index(xp, start, size, batch, channels, shape)
                g_h = set_box(xp, g_h, start,
                              gather_box(xp, g_h, start, size, corner) + d_box, corner)
            d_mu[t], d_sigma[t], d_content[t] = grads
            d_params = step_params if d_params is None else add_params(d_params, step_params)
    return ScanGrads(g_h, g_c, xp.stack(d_read, axis=1), xp.stack(d_mu, axis=1),
                     xp.stack(d_sigma, axis=1), xp.stack(d_content, axis=1), d_params)


def _validate_scan(h0, c0, read_coords, write_coords, write_sigma, write_content, params, window,
                   radius, eps, method, g_reads=None, g_h=None, g_c=None):
    xp, params = validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma,
                                      write_content, params, 1, radius, g_reads, g_h, g_c,
                                      eps=eps)
    check_int("window", window, 1)
    check_method(method)
    return xp, params


def local_memory_scan(h0: Any, c0: Any, read_coords: Any, write_coords: Any, write_sigma: Any,
                      write_content: Any, params: ConvParams, *, window: int,
                      eps: float = DEFAULT_EPS, radius: float | None = None,
                      method: str = "fast", overwrite_state: bool = False,
                      ) -> tuple[Any, Any, Any]:
    """The chunk recurrence of :func:`tmcore.memory_scan` with local updates.

    Per step: read ``h`` at ``read_coords[:, t]`` (n-linear, border), then
    :func:`local_update` with the step's write.

    Parameters
    ----------
    h0, c0 : array, shape ``(B, C, *S)``
        The initial state.
    read_coords, write_coords : array, shape ``(B, T, n)``
        Each step's read position and write centre (normalized).
    write_sigma : array, shape ``(B, T)``
        Each step's write spread (> 0).
    write_content : array, shape ``(B, T, C)``
        Each step's content vector.
    params : ConvParams
        The gates' factorized conv (``C_in = 2C``, ``C_out = 4C``).
    window, eps, radius, method : see local_update
        The options of every step.
    overwrite_state : bool, default False
        Let the fast path update ``h0, c0`` in place (NumPy, PyTorch, CuPy,
        ...) instead of copying them once.

    Returns
    -------
    reads : array, shape ``(B, T, C)``
        What each step read (before its write).
    h_T, c_T : array, shape ``(B, C, *S)``
        The final state.

    Raises
    ------
    TypeError
        As :func:`tmcore.memory_scan` for the arrays; also if
        ``overwrite_state`` is not a bool.
    ValueError
        As :func:`tmcore.memory_scan` for the arrays; also if ``window`` is
        < 1 or ``method`` is unknown.
    """
    xp, params = _validate_scan(h0, c0, read_coords, write_coords, write_sigma, write_content,
                                params, window, radius, eps, method)
    if not isinstance(overwrite_state, bool):
        raise TypeError(f"overwrite_state: expected True or False, got {overwrite_state!r}")
    reads, h, c, _ = local_scan_fwd(xp, h0, c0, read_coords, write_coords, write_sigma,
                                    write_content, params, window=window, eps=eps,
                                    radius=radius, method=method,
                                    overwrite_state=overwrite_state)
    return reads, h, c


def local_memory_scan_vjp(h0: Any, c0: Any, read_coords: Any, write_coords: Any,
                          write_sigma: Any, write_content: Any, params: ConvParams,
                          g_reads: Any, g_h: Any = None, g_c: Any = None, *, window: int,
                          eps: float = DEFAULT_EPS, radius: float | None = None,
                          method: str = "fast") -> ScanGrads:
    """VJP of :func:`local_memory_scan` (``g_h, g_c = None`` mean zero).

    Parameters
    ----------
    h0, c0, read_coords, write_coords, write_sigma, write_content : array
        The scan's inputs, shaped as in :func:`local_memory_scan`.
    params : ConvParams
        The gates' factorized conv.
    g_reads : array, shape ``(B, T, C)``
        The cotangent of the reads.
    g_h, g_c : array, shape ``(B, C, *S)``, or None
        The cotangents of the final state (``None``: zero).
    window, eps, radius, method : see local_update
        The options of the forward scan.

    Returns
    -------
    ScanGrads
        The gradients for every input, shaped like it.

    Raises
    ------
    TypeError, ValueError
        As :func:`local_memory_scan`; ``g_reads`` is a required array.
    """
    require_array("g_reads", g_reads)
    xp, params = _validate_scan(h0, c0, read_coords, write_coords, write_sigma, write_content,
                                params, window, radius, eps, method, g_reads, g_h, g_c)
    _, _, _, residuals = local_scan_fwd(xp, h0, c0, read_coords, write_coords, write_sigma,
                                        write_content, params, window=window, eps=eps,
                                        radius=radius, method=method)
    g_h = xp.zeros_like(h0) if g_h is None else g_h
    g_c = xp.zeros_like(c0) if g_c is None else g_c
    return local_scan_bwd(xp, residuals, read_coords, write_coords, write_sigma, write_content,
                          params, g_reads, g_h, g_c, window=window, eps=eps, radius=radius,
                          method=method)
