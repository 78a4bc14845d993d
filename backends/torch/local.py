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
Per step, the forward copies the read's corner box and the ``h, c`` boxes into their
residual slots (``box_op`` x 3), runs the dense fused scan's cell step on the box
(:meth:`tmcore.backends.torch.scan.Cell.step`, the box as the grid: its zero padding
is the grid's where the box touches the border, and its own edge cells, which see a
wrong padding, lie outside the window and are not kept) and copies the window's cells
of the new ``h, c`` into the state (``box_op`` x 2): one torch op (the ``bmm``). The
reads are one batched product over the saved corner boxes at the end. The backward
runs the steps in reverse: the cotangent boxes masked to the window (``box_op`` mode
1), the cell's VJP on the box (:meth:`~tmcore.backends.torch.scan.Cell.backward_step`:
the written box's gradient into a ``(T B, C, *box)`` buffer, the parameter gradients
accumulated), the box cotangents written back (``box_op`` mode 2: the window's cells
replaced, the others passed through plus the conv's halo term), then the read's VJP
(``corner_read_bwd``). The write gradients are one C call at the end
(``box_write_bwd``, the rules of :func:`tmcore.scan.local.box_writes_bwd`). Three torch
ops per step; about 40 once per call.

The state (forward, unless ``overwrite_state``) and the two state cotangents
(backward) are copied once per call, as on the generic path; the scan never modifies
its inputs otherwise. Shapes are checked before any kernel runs (``ValueError`` naming
the argument), and every box kernel checks its own starts against its grid.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tmcore.backends.fused import check_scan_shapes, expect_shape, window_boxes
from tmcore.backends.native.calls import Kernels, call, offset, plain, ptr, shape_arg
from tmcore.backends.triton import local as triton_local
from tmcore.types import ConvParams, LocalScanResiduals, ScanGrads

from . import memory
from .scan import Cell, scan_kernels

__all__ = ["scan_fwd", "scan_bwd"]


class _Geometry:
    """Every step's window, box, written box and read corners (time-major rows ``t B +
    b``) in one C call (``local_geometry``): the formulas of
    :func:`tmcore.scan.local.box_writes` and of the read's corners, in their operation order
    and on the same cell centres (``torch.linspace``), so the same values to within an
    ulp of ``exp``; the generic functions take ~250 torch ops for it, the setup of a
    short scan. ``slopes``: also the corner weights' derivatives (the backward).
    :meth:`write_bwd` is the VJP of the written boxes (``box_write_bwd``)."""

    def __init__(self, kernels: Kernels, read_coords: torch.Tensor, write_coords: torch.Tensor,
                 write_sigma: torch.Tensor, write_content: torch.Tensor,
                 shape: tuple[int, ...], window: int, eps: float, radius: float | None,
                 slopes: bool = False):
        self.kernels = kernels
        batch, steps, channels = write_content.shape
        n = len(shape)
        dtype = write_content.dtype
        self.size, self.box, self.corners = window_boxes(shape, window)
        self.box_cells = math.prod(self.box)
        self.corner_cells = math.prod(self.corners)
        rows = steps * batch
        index = torch.int64
        self.win_start = torch.empty((rows, n), dtype=index)
        self.box_start = torch.empty((rows, n), dtype=index)
        self.win_off = torch.empty((rows, n), dtype=index)
        self.corner_start = torch.empty((rows, n), dtype=index)
        self.dense = torch.empty((rows, 1, self.corner_cells), dtype=dtype)
        self.volumes = memory.uninitialized((rows, channels, *self.box), dtype)
        self.slope_dense = (torch.empty((rows, n, self.corner_cells), dtype=dtype) if slopes
                            else None)
        centres = torch.cat([torch.linspace(-1.0, 1.0, s, dtype=dtype) for s in shape])
        self.shape_arg = shape_arg(shape)
        self.box_arg = shape_arg(self.box)
        self.size_arg = shape_arg(self.size)
        self.corners_arg = shape_arg(self.corners)
        inputs = [plain(t) for t in (read_coords, write_coords, write_sigma, write_content)]
        self._args = (inputs, centres, batch, steps, channels, n, window, float(eps),
                      -1.0 if radius is None else float(radius))
        call(kernels, "local_geometry", *(ptr(t) for t in inputs), ptr(centres),
             batch, steps, channels, n, self.shape_arg, window, self.size_arg, self.box_arg,
             self.corners_arg, float(eps), self._args[-1], ptr(self.win_start),
             ptr(self.box_start), ptr(self.win_off), ptr(self.corner_start),
             ptr(self.dense), ptr(self.volumes),
             None if self.slope_dense is None else ptr(self.slope_dense))

    def write_bwd(self, d_volumes: torch.Tensor):
        """``(d_write_coords (B, T, n), d_write_sigma (B, T), d_write_content (B, T, C))``
        for the cotangents ``d_volumes (T B, C, *box)`` of :attr:`volumes`."""
        inputs, centres, batch, steps, channels, n, window, eps, radius = self._args
        _, write_coords, write_sigma, write_content = inputs
        expect_shape("d_volumes", d_volumes, tuple(self.volumes.shape), "(T B, C, *box)")
        d_coords = torch.empty_like(write_coords)
        d_sigma = torch.empty_like(write_sigma)
        d_content = torch.empty_like(write_content)
        call(self.kernels, "box_write_bwd", ptr(write_coords), ptr(write_sigma),
             ptr(write_content), ptr(centres), batch, steps, channels, n,
             self.shape_arg, window, self.size_arg, self.box_arg, eps, radius,
             ptr(d_volumes), ptr(d_coords), ptr(d_sigma), ptr(d_content))
        return d_coords, d_sigma, d_content


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that the scan updates in place and returns: from the
    backend's buffer pool (a block nothing else refers to, of exactly its size), so
    that a call does not fault in fresh pages for a state-sized copy (measured at 64^3,
    B 4, C 16: ~70 ms of page faults for the four copies of a forward + backward)."""
    fresh = plain(t)
    if fresh is not t:  # already a fresh copy (a strided view, a ZeroTensor)
        return fresh
    return memory.take(tuple(t.shape), t.dtype, huge=True, exact=True).copy_(t)


def _writes(write_coords, write_sigma, write_content) -> dict[str, torch.Tensor]:
    return {"write_coords": write_coords, "write_sigma": write_sigma,
            "write_content": write_content}


def scan_fwd(xp: Any, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
             window: int, eps: float, radius: float | None, overwrite_state: bool, *,
             options: Any):
    """The fused forward ``(reads (B, T, C), h_T, c_T, LocalScanResiduals)``: the C kernels'
    on the CPU, else the Triton kernels', or ``None`` to decline."""
    params = ConvParams(*params)
    kernels = scan_kernels(options, h0, c0, read_coords, write_coords, write_sigma,
                           write_content, *params)
    if kernels is None:
        return triton_local.scan_fwd(xp, h0, c0, read_coords, write_coords, write_sigma,
                                     write_content, params, window, eps, radius,
                                     overwrite_state, options=options)
    if read_coords.ndim != 3 or read_coords.shape[1] == 0:
        return None
    check_scan_shapes(h0, read_coords, {"c0": c0, **_writes(write_coords, write_sigma,
                                                            write_content)}, params)
    batch, channels, *spatial = h0.shape
    shape = tuple(spatial)
    n, steps = len(shape), read_coords.shape[1]
    memory.begin()
    geo = _Geometry(kernels, read_coords, write_coords, write_sigma, write_content, shape,
                    window, eps, radius)
    h, c = (plain(h0), plain(c0)) if overwrite_state else (_owned(h0), _owned(c0))
    dtype = h.dtype
    cell = Cell(kernels, batch, channels, geo.box, dtype, params)
    pb, k = geo.box_cells, geo.corner_cells
    h_boxes = memory.uninitialized((steps, batch, channels, *geo.box), dtype)
    c_boxes = memory.uninitialized((steps, batch, channels, *geo.box), dtype)
    read_boxes = memory.uninitialized((steps, batch, channels, *geo.corners), dtype)
    h_new = torch.empty((batch, channels, pb), dtype=dtype)
    c_new = torch.empty((batch, channels, pb), dtype=dtype)
    null = None  # a NULL pointer
    box_elems, corner_elems = batch * channels * pb, batch * channels * k
    for t in range(steps):
        rows = t * batch * n
        # the read's corners, then the h, c boxes: all before this step's update
        call(kernels, "box_op", ptr(h), geo.shape_arg, offset(geo.corner_start, rows),
             offset(read_boxes, t * corner_elems), geo.corners_arg, null, geo.corners_arg,
             null, null, 0, batch, channels, n)
        for state, saved in ((h, h_boxes), (c, c_boxes)):
            call(kernels, "box_op", ptr(state), geo.shape_arg, offset(geo.box_start, rows),
                 offset(saved, t * box_elems), geo.box_arg, null, geo.box_arg, null, null, 0,
                 batch, channels, n)
        cell.step(offset(geo.volumes, t * box_elems), channels * pb,
                  offset(h_boxes, t * box_elems), offset(c_boxes, t * box_elems), ptr(h_new),
                  ptr(c_new))
        for new, state in ((h_new, h), (c_new, c)):  # the window's cells only
            call(kernels, "box_op", ptr(new), geo.box_arg, offset(geo.win_off, rows),
                 ptr(state), geo.shape_arg, offset(geo.win_start, rows), geo.size_arg,
                 null, null, 0, batch, channels, n)
    flat = read_boxes.reshape(steps * batch, channels, k)
    reads = torch.matmul(geo.dense, flat.transpose(1, 2))[:, 0, :]
    reads = reads.reshape(steps, batch, channels).transpose(0, 1).contiguous()
    return reads, h, c, LocalScanResiduals(h_boxes, c_boxes, read_boxes)


def scan_bwd(xp: Any, residuals, read_coords, write_coords, write_sigma, write_content,
             params, g_reads, g_h, g_c, window: int, eps: float, radius: float | None, *,
             options: Any):
    """The fused backward (a :class:`tmcore.scan.ScanGrads`): the C kernels' on the CPU,
    else the Triton kernels', or ``None`` to decline. ``g_h, g_c`` are not modified."""
    params = ConvParams(*params)
    h_boxes, c_boxes, read_boxes = residuals
    if read_boxes is None or not all(isinstance(r, torch.Tensor) for r in residuals):
        return None
    kernels = scan_kernels(options, g_h, g_c, g_reads, h_boxes, c_boxes, read_boxes,
                           read_coords, write_coords, write_sigma, write_content, *params)
    if kernels is None:
        return triton_local.scan_bwd(xp, residuals, read_coords, write_coords, write_sigma,
                                     write_content, params, g_reads, g_h, g_c, window, eps,
                                     radius, options=options)
    if read_coords.ndim != 3 or read_coords.shape[1] == 0:
        return None
    batch, channels, *spatial = g_h.shape
    shape = tuple(spatial)
    n, steps = len(shape), read_coords.shape[1]
    check_scan_shapes(g_h, read_coords, {
        "g_c": g_c, "g_reads": g_reads, "residuals.h_boxes": h_boxes,
        "residuals.c_boxes": c_boxes, "residuals.read_boxes": read_boxes,
        **_writes(write_coords, write_sigma, write_content)}, params, window=window)
    memory.begin()
    geo = _Geometry(kernels, read_coords, write_coords, write_sigma, write_content, shape,
                    window, eps, radius, slopes=True)
    h_boxes, c_boxes, read_boxes = (plain(r) for r in (h_boxes, c_boxes, read_boxes))
    g_reads = plain(g_reads)
    g_h, g_c = _owned(g_h), _owned(g_c)  # updated in place
    dtype = g_h.dtype
    cell = Cell(kernels, batch, channels, geo.box, dtype, params)
    cell.start_backward()
    pb, k = geo.box_cells, geo.corner_cells
    gh_in = torch.empty((batch, channels, pb), dtype=dtype)
    gc_in = torch.empty((batch, channels, pb), dtype=dtype)
    d_h_box = torch.empty((batch, channels, pb), dtype=dtype)
    d_c_box = torch.empty((batch, channels, pb), dtype=dtype)
    d_volumes = memory.uninitialized(tuple(geo.volumes.shape), dtype)
    d_read_coords = memory.uninitialized((batch, steps, n), dtype)
    null = None  # a NULL pointer
    box_elems = batch * channels * pb
    for t in reversed(range(steps)):
        rows = t * batch * n
        at_box, at_win = offset(geo.box_start, rows), offset(geo.win_off, rows)
        for grad, masked in ((g_h, gh_in), (g_c, gc_in)):  # the window's cotangents
            call(kernels, "box_op", ptr(grad), geo.shape_arg, at_box, ptr(masked),
                 geo.box_arg, null, geo.box_arg, at_win, geo.size_arg, 1, batch, channels, n)
        cell.backward_step(offset(geo.volumes, t * box_elems), channels * pb,
                           offset(h_boxes, t * box_elems), offset(c_boxes, t * box_elems),
                           ptr(gh_in), ptr(gc_in), offset(d_volumes, t * box_elems),
                           channels * pb, ptr(d_h_box), ptr(d_c_box))
        for grad, d_box in ((g_h, d_h_box), (g_c, d_c_box)):  # pass-through + the step's
            call(kernels, "box_op", ptr(d_box), geo.box_arg, null, ptr(grad), geo.shape_arg,
                 at_box, geo.box_arg, at_win, geo.size_arg, 2, batch, channels, n)
        call(kernels, "corner_read_bwd", ptr(g_h), geo.shape_arg,
             offset(geo.corner_start, rows), geo.corners_arg,
             offset(geo.dense, t * batch * k), offset(geo.slope_dense, t * batch * n * k),
             offset(read_boxes, t * batch * channels * k), offset(g_reads, t * channels),
             steps * channels, offset(d_read_coords, t * n), steps * n, batch, channels, n)
    d_coords, d_sigma, d_content = geo.write_bwd(d_volumes)
    return ScanGrads(g_h, g_c, d_read_coords, d_coords, d_sigma, d_content, cell.param_grads())
