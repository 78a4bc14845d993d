"""The fused CPU local scan for torch tensors (``update="local"``): C kernels per step.

Entries ``local_scan_fwd`` / ``local_scan_bwd`` of the torch backend's
:class:`~tmcore.runtime.dispatch.Ops` table (contract: :func:`tmcore.scan.local.local_scan_fwd` /
``local_scan_bwd``, the same undo-log residuals). They return ``None`` whenever the
fused path does not apply (where the dense fused CPU scan would not run either:
not plain CPU float32 / float64 tensors of one dtype, autograd recording, native
kernels off, a forced depthwise kernel or Triton, not 1 to 4 spatial axes, or
``T = 0``), and tmcore's loop then runs.

Once per call, what does not depend on the state is one C call (``local_geometry``):
every step's window, box and written box (the values of
:func:`tmcore.scan.local.box_writes`, time-major rows ``t * B + b``) and every read's corner
geometry (the n-linear weights of the ``2^n`` cells, the backward also their slopes).
Per step, the forward then makes the C calls

- ``box_op`` (copy) x 3: the read's corner box and the ``h, c`` boxes into their
  residual slots ``read_boxes[t], h_boxes[t], c_boxes[t]``;
- ``dw2_fwd`` on (written box, ``h`` box) with the box as the grid (its zero padding
  is the grid's where the box touches the border; its own edge cells, which see a
  wrong padding, lie outside the window and are not kept), one ``bmm`` for the
  pointwise conv, ``gates2_fwd`` (pointwise bias in the kernel);
- ``box_op`` (copy) x 2: the window cells of the new ``h, c`` boxes into the state;

and one torch op (the ``bmm``). The reads are one batched product over the saved
corner boxes at the end. The backward runs the steps in reverse: the cotangent boxes
masked to the window (``box_op`` mode 1), the gates recomputed from the saved boxes
(``dw2_fwd``, ``bmm``), ``gates2_bwd``, the pointwise weight's gradient by an in-place
``baddbmm`` into a ``(B, 4C, 2C)`` buffer, ``bmm`` for ``d_y``, ``dw2_bwd`` (the
written box's gradient into a ``(T B, C, *box)`` buffer, the ``h`` box's, and the
depthwise taps / biases added into float64 accumulators, as is the pointwise bias by
``gates2_bwd``), the box cotangents written back (``box_op`` mode 2: the window's
cells replaced, the others passed through plus the conv's halo term), then the read's
VJP (``corner_read_bwd``). The write gradients are one C call at the end
(``box_write_bwd``, the rules of :func:`tmcore.scan.local.box_writes_bwd`). Three torch ops
per step; about 40 once per call.

The state (forward, unless ``overwrite_state``) and the two state cotangents
(backward) are copied once per call, as on the generic path; the scan never modifies
its inputs otherwise. Shapes are checked before any kernel runs (``ValueError`` naming
the argument), and every box kernel checks its own starts against its grid.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from tmcore.ops.conv import ConvParams
from tmcore.scan.dense import ScanGrads
from tmcore.scan.local import LocalScanResiduals

from . import _torch as bt

__all__ = ["scan_fwd", "scan_bwd"]

_EINDEX = 2  # the box kernels' return for a box outside its grid


def _run(lib: ctypes.CDLL, kernel: str, suffix: str, *args: Any) -> None:
    """One C kernel; a box outside its grid is a ``ValueError``, a failed scratch
    allocation a ``MemoryError``."""
    status = getattr(lib, f"{kernel}_{suffix}")(*args)
    if status == _EINDEX:
        raise ValueError(f"tmcore: the fused local-scan kernel {kernel} was given a box "
                         f"outside its grid (a start index out of range)")
    if status != 0:
        raise MemoryError(f"tmcore: the fused CPU kernel {kernel} could not allocate its "
                          f"scratch memory (TMCORE_NATIVE=0 uses the torch ops instead)")


def _ptr_at(t: torch.Tensor, elements: int) -> ctypes.c_void_p:
    return bt._offset(t, elements)


class _Geometry:
    """Every step's window, box, written box and read corners (time-major rows ``t B +
    b``) in one C call (``local_geometry``): the formulas of
    :func:`tmcore.scan.local.box_writes` and of the read's corners, in their operation order
    and on the same cell centres (``torch.linspace``), so the same values to within an
    ulp of ``exp``; the generic functions take ~250 torch ops for it, the setup of a
    short scan. ``slopes``: also the corner weights' derivatives (the backward).
    :meth:`write_bwd` is the VJP of the written boxes (``box_write_bwd``)."""

    def __init__(self, kernels, read_coords: torch.Tensor, write_coords: torch.Tensor,
                 write_sigma: torch.Tensor, write_content: torch.Tensor,
                 shape: tuple[int, ...], window: int, eps: float, radius: float | None,
                 slopes: bool = False):
        self.kernels = kernels
        lib, suffix = kernels
        batch, steps, channels = write_content.shape
        n = len(shape)
        dtype = write_content.dtype
        self.size = tuple(min(window, s) for s in shape)
        self.box = tuple(min(window + 2, s) for s in shape)
        self.corners = tuple(1 if s == 1 else 2 for s in shape)
        self.box_cells = math.prod(self.box)
        self.corner_cells = math.prod(self.corners)
        rows = steps * batch
        index = torch.int64
        self.win_start = torch.empty((rows, n), dtype=index)
        self.box_start = torch.empty((rows, n), dtype=index)
        self.win_off = torch.empty((rows, n), dtype=index)
        self.corner_start = torch.empty((rows, n), dtype=index)
        self.dense = torch.empty((rows, 1, self.corner_cells), dtype=dtype)
        self.volumes = bt._uninitialized((rows, channels, *self.box), dtype)
        self.slope_dense = (torch.empty((rows, n, self.corner_cells), dtype=dtype) if slopes
                            else None)
        centres = torch.cat([torch.linspace(-1.0, 1.0, s, dtype=dtype) for s in shape])
        self.shape_arg = bt._shape_arg(shape)
        self.box_arg = bt._shape_arg(self.box)
        self.size_arg = bt._shape_arg(self.size)
        self.corners_arg = bt._shape_arg(self.corners)
        inputs = [bt._plain(t) for t in (read_coords, write_coords, write_sigma, write_content)]
        self._args = (inputs, centres, batch, steps, channels, n, window, float(eps),
                      -1.0 if radius is None else float(radius))
        _run(lib, "local_geometry", suffix, *(bt._ptr(t) for t in inputs), bt._ptr(centres),
             batch, steps, channels, n, self.shape_arg, window, self.size_arg, self.box_arg,
             self.corners_arg, float(eps), self._args[-1], bt._ptr(self.win_start),
             bt._ptr(self.box_start), bt._ptr(self.win_off), bt._ptr(self.corner_start),
             bt._ptr(self.dense), bt._ptr(self.volumes),
             None if self.slope_dense is None else bt._ptr(self.slope_dense))

    def write_bwd(self, d_volumes: torch.Tensor):
        """``(d_write_coords (B, T, n), d_write_sigma (B, T), d_write_content (B, T, C))``
        for the cotangents ``d_volumes (T B, C, *box)`` of :attr:`volumes`."""
        lib, suffix = self.kernels
        inputs, centres, batch, steps, channels, n, window, eps, radius = self._args
        _, write_coords, write_sigma, write_content = inputs
        bt._expect_shape("d_volumes", d_volumes, tuple(self.volumes.shape), "(T B, C, *box)")
        d_coords = torch.empty_like(write_coords)
        d_sigma = torch.empty_like(write_sigma)
        d_content = torch.empty_like(write_content)
        _run(lib, "box_write_bwd", suffix, bt._ptr(write_coords), bt._ptr(write_sigma),
             bt._ptr(write_content), bt._ptr(centres), batch, steps, channels, n,
             self.shape_arg, window, self.size_arg, self.box_arg, eps, radius,
             bt._ptr(d_volumes), bt._ptr(d_coords), bt._ptr(d_sigma), bt._ptr(d_content))
        return d_coords, d_sigma, d_content


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that the scan updates in place and returns: from the
    backend's buffer pool (a block nothing else refers to, of exactly its size), so
    that a call does not fault in fresh pages for a state-sized copy (measured at 64^3,
    B 4, C 16: ~70 ms of page faults for the four copies of a forward + backward)."""
    plain = bt._plain(t)
    if plain is not t:  # already a fresh copy (a strided view, a ZeroTensor)
        return plain
    return bt._POOL.take(tuple(t.shape), t.dtype, huge=True, exact=True).copy_(t)


def _check_common(h: torch.Tensor, read_coords: torch.Tensor, params: ConvParams,
                  write_coords: torch.Tensor, write_sigma: torch.Tensor,
                  write_content: torch.Tensor, extra: dict) -> None:
    shapes = bt._scan_shapes(h)
    bt._check_scan_shapes(h, read_coords, params, {
        **extra,
        **{k: (v, *shapes[k]) for k, v in (("write_coords", write_coords),
                                           ("write_sigma", write_sigma),
                                           ("write_content", write_content))}})


def _params_plain(params: ConvParams):
    return (bt._plain(params.depthwise_weight), bt._plain(params.depthwise_bias),
            bt._plain(params.pointwise_weight), bt._plain(params.pointwise_bias))


def scan_fwd(xp: Any, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
             window: int, eps: float, radius: float | None, overwrite_state: bool, *,
             options: Any):
    """The fused forward ``(reads (B, T, C), h_T, c_T, LocalScanResiduals)``, or ``None``
    to decline."""
    params = ConvParams(*params)
    kernels = bt._cpu_scan_kernels(options, h0, c0, read_coords, write_coords, write_sigma,
                                   write_content, *params)
    if kernels is None or read_coords.ndim != 3 or read_coords.shape[1] == 0:
        return None
    _check_common(h0, read_coords, params, write_coords, write_sigma, write_content,
                  {"c0": (c0, tuple(h0.shape), "(B, C, *S) like h0")})
    lib, suffix = kernels
    batch, channels, *spatial = h0.shape
    shape = tuple(spatial)
    n, steps = len(shape), read_coords.shape[1]
    bt._POOL.begin()
    geo = _Geometry(kernels, read_coords, write_coords, write_sigma, write_content, shape,
                    window, eps, radius)
    taps, biases, weight, zb = _params_plain(params)
    h, c = (bt._plain(h0), bt._plain(c0)) if overwrite_state else (_owned(h0), _owned(c0))
    dtype = h.dtype
    pb, k = geo.box_cells, geo.corner_cells
    h_boxes = bt._uninitialized((steps, batch, channels, *geo.box), dtype)
    c_boxes = bt._uninitialized((steps, batch, channels, *geo.box), dtype)
    read_boxes = bt._uninitialized((steps, batch, channels, *geo.corners), dtype)
    y = torch.empty((batch, 2 * channels, pb), dtype=dtype)
    z = torch.empty((batch, 4 * channels, pb), dtype=dtype)
    h_new = torch.empty((batch, channels, pb), dtype=dtype)
    c_new = torch.empty((batch, channels, pb), dtype=dtype)
    w_expanded = weight.expand(batch, 4 * channels, 2 * channels)
    null = None  # a NULL pointer
    box_elems, corner_elems = batch * channels * pb, batch * channels * k
    for t in range(steps):
        rows = t * batch * n
        # the read's corners, then the h, c boxes: all before this step's update
        _run(lib, "box_op", suffix, bt._ptr(h), geo.shape_arg, _ptr_at(geo.corner_start, rows),
             _ptr_at(read_boxes, t * corner_elems), geo.corners_arg, null, geo.corners_arg,
             null, null, 0, batch, channels, n)
        for state, saved in ((h, h_boxes), (c, c_boxes)):
            _run(lib, "box_op", suffix, bt._ptr(state), geo.shape_arg,
                 _ptr_at(geo.box_start, rows), _ptr_at(saved, t * box_elems), geo.box_arg,
                 null, geo.box_arg, null, null, 0, batch, channels, n)
        x = _ptr_at(geo.volumes, t * box_elems)
        _run(lib, "dw2_fwd", suffix, x, channels * pb, _ptr_at(h_boxes, t * box_elems),
             channels * pb, channels, bt._ptr(y), bt._ptr(taps), bt._ptr(biases), batch,
             2 * channels, n, geo.box_arg)
        torch.bmm(w_expanded, y, out=z)
        _run(lib, "gates2_fwd", suffix, bt._ptr(z), bt._ptr(zb), _ptr_at(c_boxes, t * box_elems),
             bt._ptr(h_new), bt._ptr(c_new), batch, channels, pb)
        for new, state in ((h_new, h), (c_new, c)):  # the window's cells only
            _run(lib, "box_op", suffix, bt._ptr(new), geo.box_arg, _ptr_at(geo.win_off, rows),
                 bt._ptr(state), geo.shape_arg, _ptr_at(geo.win_start, rows), geo.size_arg,
                 null, null, 0, batch, channels, n)
    flat = read_boxes.reshape(steps * batch, channels, k)
    reads = torch.matmul(geo.dense, flat.transpose(1, 2))[:, 0, :]
    reads = reads.reshape(steps, batch, channels).transpose(0, 1).contiguous()
    return reads, h, c, LocalScanResiduals(h_boxes, c_boxes, read_boxes)


def scan_bwd(xp: Any, residuals, read_coords, write_coords, write_sigma, write_content,
             params, g_reads, g_h, g_c, window: int, eps: float, radius: float | None, *,
             options: Any):
    """The fused backward (a :class:`tmcore.scan.ScanGrads`), or ``None`` to decline.
    ``g_h, g_c`` are not modified (the scan updates its own copies)."""
    params = ConvParams(*params)
    h_boxes, c_boxes, read_boxes = residuals
    if read_boxes is None or not all(isinstance(r, torch.Tensor) for r in residuals):
        return None
    kernels = bt._cpu_scan_kernels(options, g_h, g_c, g_reads, h_boxes, c_boxes, read_boxes,
                                   read_coords, write_coords, write_sigma, write_content,
                                   *params)
    if kernels is None or read_coords.ndim != 3 or read_coords.shape[1] == 0:
        return None
    batch, channels, *spatial = g_h.shape
    shape = tuple(spatial)
    n, steps = len(shape), read_coords.shape[1]
    box = tuple(min(window + 2, s) for s in shape)
    corners = tuple(1 if s == 1 else 2 for s in shape)
    _check_common(g_h, read_coords, params, write_coords, write_sigma, write_content, {
        "g_c": (g_c, tuple(g_h.shape), "(B, C, *S) like g_h"),
        "g_reads": (g_reads, (batch, steps, channels), "(B, T, C)"),
        "residuals.h_boxes": (h_boxes, (steps, batch, channels, *box), "(T, B, C, *box)"),
        "residuals.c_boxes": (c_boxes, (steps, batch, channels, *box), "(T, B, C, *box)"),
        "residuals.read_boxes": (read_boxes, (steps, batch, channels, *corners),
                                 "(T, B, C, *corners)")})
    lib, suffix = kernels
    bt._POOL.begin()
    geo = _Geometry(kernels, read_coords, write_coords, write_sigma, write_content, shape,
                    window, eps, radius, slopes=True)
    dense, slope_dense = geo.dense, geo.slope_dense
    taps, biases, weight, zb = _params_plain(params)
    h_boxes, c_boxes, read_boxes = (bt._plain(r) for r in (h_boxes, c_boxes, read_boxes))
    g_reads = bt._plain(g_reads)
    g_h, g_c = _owned(g_h), _owned(g_c)  # updated in place
    dtype = g_h.dtype
    pb, k = geo.box_cells, geo.corner_cells
    f64 = torch.float64
    acc_taps = torch.zeros((n, 2 * channels, 3), dtype=f64)
    acc_biases = torch.zeros((n, 2 * channels), dtype=f64)
    acc_zb = torch.zeros((4 * channels,), dtype=f64)
    d_weight = torch.zeros((batch, 4 * channels, 2 * channels), dtype=dtype)
    y = torch.empty((batch, 2 * channels, pb), dtype=dtype)
    y_t = y.transpose(1, 2)
    z = torch.empty((batch, 4 * channels, pb), dtype=dtype)
    d_z = torch.empty((batch, 4 * channels, pb), dtype=dtype)
    d_y = torch.empty((batch, 2 * channels, pb), dtype=dtype)
    gh_in = torch.empty((batch, channels, pb), dtype=dtype)
    gc_in = torch.empty((batch, channels, pb), dtype=dtype)
    d_h_box = torch.empty((batch, channels, pb), dtype=dtype)
    d_c_box = torch.empty((batch, channels, pb), dtype=dtype)
    d_volumes = bt._uninitialized(tuple(geo.volumes.shape), dtype)
    d_read_coords = bt._uninitialized((batch, steps, n), dtype)
    w_expanded = weight.expand(batch, 4 * channels, 2 * channels)
    w_t = weight.T.expand(batch, 2 * channels, 4 * channels)
    null = None  # a NULL pointer
    box_elems = batch * channels * pb
    for t in reversed(range(steps)):
        rows = t * batch * n
        at_box, at_win = _ptr_at(geo.box_start, rows), _ptr_at(geo.win_off, rows)
        for grad, masked in ((g_h, gh_in), (g_c, gc_in)):  # the window's cotangents
            _run(lib, "box_op", suffix, bt._ptr(grad), geo.shape_arg, at_box, bt._ptr(masked),
                 geo.box_arg, null, geo.box_arg, at_win, geo.size_arg, 1, batch, channels, n)
        x, h_box = _ptr_at(geo.volumes, t * box_elems), _ptr_at(h_boxes, t * box_elems)
        _run(lib, "dw2_fwd", suffix, x, channels * pb, h_box, channels * pb, channels,
             bt._ptr(y), bt._ptr(taps), bt._ptr(biases), batch, 2 * channels, n, geo.box_arg)
        torch.bmm(w_expanded, y, out=z)
        _run(lib, "gates2_bwd", suffix, bt._ptr(z), bt._ptr(zb),
             _ptr_at(c_boxes, t * box_elems), bt._ptr(gh_in), bt._ptr(gc_in), bt._ptr(d_z),
             bt._ptr(d_c_box), bt._ptr(acc_zb), batch, channels, pb)
        d_weight.baddbmm_(d_z, y_t)
        torch.bmm(w_t, d_z, out=d_y)
        _run(lib, "dw2_bwd", suffix, x, channels * pb, h_box, channels * pb, channels,
             bt._ptr(d_y), _ptr_at(d_volumes, t * box_elems), channels * pb, bt._ptr(d_h_box),
             channels * pb, bt._ptr(acc_taps), bt._ptr(acc_biases), bt._ptr(taps),
             bt._ptr(biases), batch, 2 * channels, n, geo.box_arg)
        for grad, d_box in ((g_h, d_h_box), (g_c, d_c_box)):  # pass-through + the step's
            _run(lib, "box_op", suffix, bt._ptr(d_box), geo.box_arg, null, bt._ptr(grad),
                 geo.shape_arg, at_box, geo.box_arg, at_win, geo.size_arg, 2, batch, channels,
                 n)
        _run(lib, "corner_read_bwd", suffix, bt._ptr(g_h), geo.shape_arg,
             _ptr_at(geo.corner_start, rows), geo.corners_arg,
             _ptr_at(dense, t * batch * k), _ptr_at(slope_dense, t * batch * n * k),
             _ptr_at(read_boxes, t * batch * channels * k), _ptr_at(g_reads, t * channels),
             steps * channels, _ptr_at(d_read_coords, t * n), steps * n, batch, channels, n)
    d_coords, d_sigma, d_content = geo.write_bwd(d_volumes)
    d_params = ConvParams(acc_taps.to(dtype), acc_biases.to(dtype), d_weight.sum(0),
                          acc_zb.to(dtype))
    return ScanGrads(g_h, g_c, d_read_coords, d_coords, d_sigma, d_content, d_params)
