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

from collections.abc import Callable
from typing import Any, NamedTuple

from tmcore.ops.common import box_index, gather_box, set_box
from tmcore.ops.splat import DEFAULT_EPS, splat_rows_vjp
from tmcore.ops.window import (
    BoxWrite,
    Window,
    box_update,
    box_write_bwd,
    check_method,
    corners,
    masked_update_vjp,
    masked_write,
    owned,
    read_corners,
    read_corners_bwd,
    state_update_vjp,
    update_in_box,
    update_in_box_vjp,
    window_geometry,
    window_sizes,
    window_write,
)
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import check_int, require_array
from tmcore.scan.base import (
    read_then_update,
    read_then_update_vjp,
    scan_backward,
    scan_forward,
    zero_if_none,
)
from tmcore.scan.dense import fused_grads, validate_scan_inputs
from tmcore.types import ConvParams, LocalScanResiduals, Residuals, ScanGrads, StepInputs

__all__ = ["BoxWrites", "LocalStep", "LocalWrite", "MaskedWrite",
           "box_writes", "box_writes_bwd", "local_memory_scan", "local_memory_scan_vjp",
           "local_scan_fwd", "local_scan_bwd"]


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


def _time_major_writes(xp: Any, *writes: Any) -> StepInputs:
    """``write_coords, write_sigma, write_content (B, T, ...)`` as time-major write rows."""
    return StepInputs(None, *(_time_major(xp, x) for x in writes))


def box_writes(xp: Any, write_coords: Any, write_sigma: Any, write_content: Any,
               shape: tuple[int, ...], window: int, eps: float = DEFAULT_EPS,
               radius: float | None = None) -> BoxWrites:
    """The windows and written boxes of all ``T`` steps in one pass (no validation).

    ``write_coords (B, T, n)``, ``write_sigma (B, T)``, ``write_content (B, T, C)``;
    ``shape`` the grid. The values are those of the fast path's per-step write.
    """
    write = _time_major_writes(xp, write_coords, write_sigma, write_content)
    geometry = window_geometry(xp, write.write_coords, shape, window)
    volumes, inside, parts = window_write(xp, write, geometry, shape, eps, radius)
    return BoxWrites(geometry, inside, volumes, parts)


def box_writes_bwd(xp: Any, writes: BoxWrites, write_coords: Any, write_sigma: Any,
                   write_content: Any, g: Any) -> tuple[Any, Any, Any]:
    """VJP of :func:`box_writes` for ``g (T * B, C, *box)`` (time-major, the cotangents
    of ``writes.volumes``): ``(d_write_coords (B, T, n), d_write_sigma (B, T),
    d_write_content (B, T, C))``."""
    batch = write_sigma.shape[0]
    write = _time_major_writes(xp, write_coords, write_sigma, write_content)
    d_content, d_mu, d_sigma = box_write_bwd(xp, write, writes.parts, g, write.write_sigma)
    return (_batch_major(xp, d_mu, batch), _batch_major(xp, d_sigma, batch),
            _batch_major(xp, d_content, batch))


class LocalWrite(NamedTuple):
    """A fast local step's write product (arrays with leading ``M`` rows): the window's
    and the box's starts ``(M, n)``, the window's cells in the box ``(M, 1, *box)``, the
    written box ``(M, C, *box)`` and what the write's VJP needs."""

    start: Any
    box_start: Any
    inside: Any
    volume: Any
    parts: BoxWrite


class MaskedWrite(NamedTuple):
    """A masked local step's write product: ``written (M, C, *S)`` (zero outside the
    window) and the window ``mask (M, 1, *S)``."""

    volume: Any
    mask: Any


class LocalStep(NamedTuple):
    """The local chunk step (:class:`tmcore.scan.base.Step`): read, then the write and the
    ConvLSTM update on a window of ``window`` cells per axis around the write
    (:mod:`tmcore.ops.window`). Hashable (a static ``jit`` argument).

    ``method="fast"`` updates a box in place and logs what it overwrote (policy
    ``"log"``: the undo log, no replay); ``"masked"`` is the dense definition (policy
    ``"checkpoint"``). Inside a warp (:class:`tmcore.scan.warped.WarpStep`) only
    :meth:`update` / :meth:`update_vjp` run, on the dense warped state.
    """

    window: int
    eps: float = DEFAULT_EPS
    radius: float | None = None
    method: str = "fast"

    @property
    def policy(self) -> str:
        return "log" if self.method == "fast" else "checkpoint"

    @property
    def workspace(self) -> bool:
        return self.method == "fast"

    def write(self, xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
        if self.method == "masked":
            return MaskedWrite(*masked_write(xp, x, shape, self.window, self.eps, self.radius))
        geometry = window_geometry(xp, x.write_coords, shape, self.window)
        volume, inside, parts = window_write(xp, x, geometry, shape, self.eps, self.radius)
        return LocalWrite(geometry.start, geometry.box_start, inside, volume, parts)

    def write_vjp(self, xp: Any, x: Any, W: Any, g_W: Any) -> tuple[Any, Any, Any]:
        if self.method == "masked":
            return splat_rows_vjp(xp, x, tuple(W.volume.shape[2:]), g_W, self.eps, self.radius)
        d_content, d_mu, d_sigma = box_write_bwd(xp, x, W.parts, g_W, x.write_sigma)
        return d_mu, d_sigma, d_content

    def _box(self, xp: Any, W: LocalWrite, like: Any) -> tuple[Window, Any]:
        """The write's :class:`Window` on ``like (B, C, *S)``, and its box's
        :func:`box_index`."""
        shape = tuple(like.shape[2:])
        sizes, boxes = window_sizes(shape, self.window)
        geometry = Window(W.start, sizes, W.box_start, boxes)
        return geometry, box_index(xp, geometry.box_start, geometry.box, like.shape[0],
                                   like.shape[1], shape)

    def update(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any
               ) -> tuple[Any, Any]:
        """The write and update of a dense state that the step may update in place."""
        if self.method == "masked":
            return box_update(xp, params, h, c, W.volume, W.mask)
        h, c, _, _ = update_in_box(xp, params, h, c, *self._box(xp, W, h), W.volume, W.inside)
        return h, c

    def update_vjp(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any,
                   g_h: Any, g_c: Any) -> tuple[Any, Any, Any, ConvParams]:
        """VJP of :meth:`update` from the dense state: ``(d_h, d_c, g_W, d_params)``
        (``g_h, g_c`` are not modified)."""
        if self.method == "masked":
            return masked_update_vjp(xp, params, h, c, W.volume, W.mask, g_h, g_c)
        return state_update_vjp(xp, params, h, c, g_h, g_c, *self._box(xp, W, h), W.volume,
                                W.inside)

    def advance(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any):
        if self.method == "masked":
            return read_then_update(self, xp, params, h, c, x, W)
        read, read_box, *_ = read_corners(xp, h, x.read_coords)
        h, c, h_box, c_box = update_in_box(xp, params, h, c, *self._box(xp, W, h), W.volume,
                                           W.inside)
        return read, h, c, (h_box, c_box, read_box)

    def advance_vjp(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any,
                    log: Any, g_read: Any, g_h: Any, g_c: Any):
        if self.method == "masked":
            return read_then_update_vjp(self, xp, params, h, c, x, W, g_read, g_h, g_c)
        h_box, c_box, read_box = log
        g_h, g_c, g_W, d_params = update_in_box_vjp(xp, params, g_h, g_c, *self._box(xp, W, g_h),
                                                    h_box, c_box, W.volume, W.inside)
        start, size, weights, slopes = corners(xp, x.read_coords, tuple(g_h.shape[2:]))
        d_box, d_read = read_corners_bwd(xp, read_box, weights, slopes, g_read)
        corner = box_index(xp, start, size, g_h.shape[0], g_h.shape[1], tuple(g_h.shape[2:]))
        g_h = set_box(xp, g_h, start, gather_box(xp, g_h, start, size, corner) + d_box, corner)
        return g_h, g_c, d_read, None, g_W, d_params

    def own_state(self, xp: Any, h: Any, c: Any, overwrite: bool) -> tuple[Any, Any]:
        if self.method == "masked" or overwrite:
            return h, c
        return owned(xp, h), owned(xp, c)

    def own_cotangents(self, xp: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
        return (g_h, g_c) if self.method == "masked" else (owned(xp, g_h), owned(xp, g_c))

    def fused(self, xp: Any) -> tuple[Callable, Callable] | None:
        ops = ops_for(xp)
        if self.method != "fast" or (ops.local_scan_fwd is None and ops.local_scan_bwd is None):
            return None
        window, eps, radius = self.window, self.eps, self.radius

        # the fused local scans take no per-step masks: a masked call runs the loop
        def forward(xp, params, h0, c0, xs, every, keep, overwrite, reset, active):
            if ops.local_scan_fwd is None or reset is not None or active is not None:
                return None
            out = ops.local_scan_fwd(xp, h0, c0, *xs, params, window, eps, radius, overwrite)
            if out is None:
                return None
            reads, h, c, log = out
            return reads, h, c, Residuals(None, None, tuple(log)) if keep else None

        def backward(xp, params, residuals, xs, g_reads, g_h, g_c, every, reset, active):
            if ops.local_scan_bwd is None or reset is not None or active is not None:
                return None
            return fused_grads(ops.local_scan_bwd(xp, LocalScanResiduals(*residuals.log), *xs,
                                                  params, g_reads, g_h, g_c, window, eps,
                                                  radius))

        return forward, backward


def _residuals(residuals: Residuals) -> LocalScanResiduals:
    """The loop's residuals as :class:`LocalScanResiduals` (the undo log, or the masked
    path's dense states)."""
    if residuals.log is not None:
        return LocalScanResiduals(*residuals.log)
    return LocalScanResiduals(residuals.h, residuals.c, None)


def local_scan_fwd(xp: Any, h0: Any, c0: Any, read_coords: Any, write_coords: Any,
                   write_sigma: Any, write_content: Any, params: ConvParams, *, window: int,
                   eps: float = DEFAULT_EPS, radius: float | None = None, method: str = "fast",
                   overwrite_state: bool = False,
                   ) -> tuple[Any, Any, Any, LocalScanResiduals]:
    """Forward local scan without validation: ``(reads (B, T, C), h_T, c_T, residuals)``.

    ``overwrite_state=True`` (fast path) lets the scan update ``h0, c0`` themselves in
    place where the namespace allows it, saving the one copy of the state.
    """
    reads, h, c, residuals = scan_forward(
        xp, LocalStep(window, eps, radius, method), params, h0, c0,
        StepInputs(read_coords, write_coords, write_sigma, write_content),
        overwrite_state=overwrite_state)
    return reads, h, c, _residuals(residuals)


def local_scan_bwd(xp: Any, residuals: LocalScanResiduals, read_coords: Any, write_coords: Any,
                   write_sigma: Any, write_content: Any, params: ConvParams, g_reads: Any,
                   g_h: Any, g_c: Any, *, window: int, eps: float = DEFAULT_EPS,
                   radius: float | None = None, method: str = "fast") -> ScanGrads:
    """Backward local scan from :func:`local_scan_fwd`'s residuals. No validation.

    ``g_h, g_c (B, C, *S)`` are copied once (fast path) and updated in place per step.
    """
    kept = (Residuals(None, None, tuple(residuals)) if method == "fast"
            else Residuals(residuals.h_boxes, residuals.c_boxes, None))
    d_h0, d_c0, d_xs, d_params = scan_backward(
        xp, LocalStep(window, eps, radius, method), params, kept,
        StepInputs(read_coords, write_coords, write_sigma, write_content), g_reads, g_h, g_c)
    return ScanGrads(d_h0, d_c0, *d_xs, d_params)


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
    g_h, g_c = zero_if_none(xp, h0, c0, g_h, g_c)
    return local_scan_bwd(xp, residuals, read_coords, write_coords, write_sigma, write_content,
                          params, g_reads, g_h, g_c, window=window, eps=eps, radius=radius,
                          method=method)
