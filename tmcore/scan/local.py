"""The local scan (``update="local"``): :func:`tmcore.memory_scan`'s recurrence with the
window update of :mod:`tmcore.ops.window`, and its undo-log backward
(docs/guides/local-and-warp.md). A backend may fuse the fast path (its Ops table's
``local_scan_fwd`` / ``local_scan_bwd``, declining with None) with the same undo log, from
every step's window and written box made once before the loop (:func:`box_writes`).
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
    """Every step's window and written box, time-major (row ``t * B + b``): ``geometry`` (a
    :class:`Window` of ``(T * B, n)`` arrays), ``inside`` ``(T * B, 1, *box)`` bool, ``volumes``
    ``(T * B, C, *box)`` and ``parts`` (what :func:`box_writes_bwd` needs)."""

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
    """``write_coords, write_sigma, write_content (B, T, ...)`` as time-major rows."""
    return StepInputs(None, *(_time_major(xp, x) for x in writes))


def box_writes(xp: Any, write_coords: Any, write_sigma: Any, write_content: Any,
               shape: tuple[int, ...], window: int, eps: float = DEFAULT_EPS,
               radius: float | None = None) -> BoxWrites:
    """The windows and written boxes of all ``T`` steps of ``write_coords (B, T, n)``,
    ``write_sigma (B, T)``, ``write_content (B, T, C)`` in one pass (no validation)."""
    write = _time_major_writes(xp, write_coords, write_sigma, write_content)
    geometry = window_geometry(xp, write.write_coords, shape, window)
    volumes, inside, parts = window_write(xp, write, geometry, shape, eps, radius)
    return BoxWrites(geometry, inside, volumes, parts)


def box_writes_bwd(xp: Any, writes: BoxWrites, write_coords: Any, write_sigma: Any,
                   write_content: Any, g: Any) -> tuple[Any, Any, Any]:
    """VJP of :func:`box_writes` for the boxes' cotangents ``g (T * B, C, *box)``:
    ``(d_write_coords (B, T, n), d_write_sigma (B, T), d_write_content (B, T, C))``."""
    batch = write_sigma.shape[0]
    write = _time_major_writes(xp, write_coords, write_sigma, write_content)
    d_content, d_mu, d_sigma = box_write_bwd(xp, write, writes.parts, g, write.write_sigma)
    return (_batch_major(xp, d_mu, batch), _batch_major(xp, d_sigma, batch),
            _batch_major(xp, d_content, batch))


class LocalWrite(NamedTuple):
    """A fast local step's write product (``M`` rows): window and box starts ``(M, n)``, the
    window's cells in the box ``(M, 1, *box)``, the box ``(M, C, *box)`` and its VJP's parts."""

    start: Any
    box_start: Any
    inside: Any
    volume: Any
    parts: BoxWrite


class MaskedWrite(NamedTuple):
    """A masked local step's write product: ``volume (M, C, *S)`` (zero outside the window) and
    the window ``mask (M, 1, *S)``."""

    volume: Any
    mask: Any


class LocalStep(NamedTuple):
    """The local chunk step: read, then the window's write and update. ``method="fast"`` updates
    a box in place and logs what it overwrote (policy ``"log"``); ``"masked"`` is the dense
    definition (``"checkpoint"``). Inside a warp only :meth:`update` / :meth:`update_vjp` run,
    on the dense warped state. Hashable (a static ``jit`` argument)."""

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
        """The write's :class:`Window` on ``like (B, C, *S)`` and its box's :func:`box_index`."""
        shape = tuple(like.shape[2:])
        sizes, boxes = window_sizes(shape, self.window)
        geometry = Window(W.start, sizes, W.box_start, boxes)
        return geometry, box_index(xp, geometry.box_start, geometry.box, like.shape[0],
                                   like.shape[1], shape)

    def update(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any
               ) -> tuple[Any, Any]:
        """The write and update of a dense state the step may update in place."""
        if self.method == "masked":
            return box_update(xp, params, h, c, W.volume, W.mask)
        h, c, _, _ = update_in_box(xp, params, h, c, *self._box(xp, W, h), W.volume, W.inside)
        return h, c

    def update_vjp(self, xp: Any, params: ConvParams, h: Any, c: Any, x: Any, W: Any,
                   g_h: Any, g_c: Any) -> tuple[Any, Any, Any, ConvParams]:
        """VJP of :meth:`update`: ``(d_h, d_c, g_W, d_params)`` (``g_h, g_c`` not modified)."""
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
    """The loop's residuals as :class:`LocalScanResiduals` (undo log, or dense states)."""
    if residuals.log is not None:
        return LocalScanResiduals(*residuals.log)
    return LocalScanResiduals(residuals.h, residuals.c, None)


def local_scan_fwd(xp: Any, h0: Any, c0: Any, read_coords: Any, write_coords: Any,
                   write_sigma: Any, write_content: Any, params: ConvParams, *, window: int,
                   eps: float = DEFAULT_EPS, radius: float | None = None, method: str = "fast",
                   overwrite_state: bool = False,
                   ) -> tuple[Any, Any, Any, LocalScanResiduals]:
    """Forward local scan, no validation: ``(reads (B, T, C), h_T, c_T, residuals)``;
    ``overwrite_state=True`` lets the fast path update ``h0, c0`` themselves in place."""
    reads, h, c, residuals = scan_forward(
        xp, LocalStep(window, eps, radius, method), params, h0, c0,
        StepInputs(read_coords, write_coords, write_sigma, write_content),
        overwrite_state=overwrite_state)
    return reads, h, c, _residuals(residuals)


def local_scan_bwd(xp: Any, residuals: LocalScanResiduals, read_coords: Any, write_coords: Any,
                   write_sigma: Any, write_content: Any, params: ConvParams, g_reads: Any,
                   g_h: Any, g_c: Any, *, window: int, eps: float = DEFAULT_EPS,
                   radius: float | None = None, method: str = "fast") -> ScanGrads:
    """Backward local scan from :func:`local_scan_fwd`'s residuals, no validation; the fast path
    copies ``g_h, g_c (B, C, *S)`` once and updates them in place."""
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
    """Run the chunk recurrence of :func:`tmcore.memory_scan` with local updates.

    Step ``t`` reads ``h`` at ``read_coords[:, t]``, then runs :func:`local_update` with its write.

    Parameters
    ----------
    h0, c0, read_coords, write_coords, write_sigma, write_content, params : array or ConvParams
        As in :func:`tmcore.memory_scan`: ``(B, C, *S)`` twice, ``(B, T, n)`` twice,
        ``(B, T)``, ``(B, T, C)`` and the gate conv.
    window, eps, radius, method : see local_update
        The options of every step.
    overwrite_state : bool, default False
        Let the fast path update ``h0, c0`` in place (NumPy, PyTorch, CuPy) instead of
        copying them once.

    Returns
    -------
    reads : array, shape ``(B, T, C)``
        What each step read (before its write).
    h_T, c_T : array, shape ``(B, C, *S)``
        The final state.

    Raises
    ------
    TypeError, ValueError
        As :func:`tmcore.memory_scan` for the arrays; also if ``window`` is not an int >= 1,
        ``method`` is unknown, or ``overwrite_state`` is not a bool.
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
    """Give the gradients of :func:`local_memory_scan` (``g_h, g_c`` None mean zero).

    Parameters
    ----------
    h0, c0, read_coords, write_coords, write_sigma, write_content, params : array or ConvParams
        As in :func:`local_memory_scan`.
    g_reads : array, shape ``(B, T, C)``
        The cotangent of the reads.
    g_h, g_c : array, shape ``(B, C, *S)``, or None
        The cotangents of the final state.
    window, eps, radius, method : see local_update
        The options of the forward scan.

    Returns
    -------
    ScanGrads
        The gradients for every input, shaped like it.

    Raises
    ------
    TypeError, ValueError
        As :func:`local_memory_scan`; also if ``g_reads`` is not an array.
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
