"""The fused CPU local scan for torch tensors (``update="local"``): C kernels per step.

Entries ``local_scan_fwd`` / ``local_scan_bwd`` of the torch table (contract:
:func:`tmcore.scan.local.local_scan_fwd` / ``local_scan_bwd``, the same undo-log
residuals); they decline (``None``) where the dense fused scan would, and for ``T = 0``.

Once per call, one C call (``local_geometry``) computes every step's window, box and
written box (:func:`tmcore.scan.local.box_writes`, rows ``t * B + b``) and every read's
corner weights. Per step, the forward copies the read's corners and the ``h, c`` boxes into
their residual slots, runs the dense scan's :meth:`~tmcore.backends.torch.scan.Cell.step`
on the box (its edge cells, which see a wrong padding, lie outside the window) and copies
the window's cells back into the state; the reads are one batched product at the end. The
backward runs in reverse: the window's cotangents, the cell's VJP on the box, the box
cotangents written back with the conv's halo term, the read's VJP; the write gradients are
one C call (``box_write_bwd``). Three torch ops per step, about 40 per call. The inputs
are copied once (the state unless ``overwrite_state``, the cotangents) and never modified;
shapes are checked before any kernel runs.
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
    """Every step's window, box, written box and read corners (rows ``t B + b``) in one C call:
    :func:`tmcore.scan.local.box_writes`' formulas in their order, the same values to an ulp
    (the generic functions take ~250 torch ops). ``slopes``: the corner weights' derivatives
    too (backward); :meth:`write_bwd`: the VJP of the written boxes."""

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
    """A contiguous copy of ``t`` that the scan updates and returns, on a pooled block of its
    exact size (fresh pages for the four copies measured ~70 ms at 64^3, B 4, C 16)."""
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
