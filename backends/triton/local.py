"""The fused Triton local scan for torch tensors (``update="local"``): the torch table's
``local_scan_fwd`` / ``local_scan_bwd`` (contract :mod:`tmcore.scan.local`, the same undo
log, so either direction may run on either path), or None where it does not apply.

Per chunk step 1 launch each way, grid ``(B,)``: each program works on its row's box only,
so a step's cost does not depend on the grid (launch-bound by design, not filling the
GPU). The writes, their gradients and the parameter gradients are made once per scan with
torch ops. Tested under Triton's interpreter only; built for sm_90 (Triton 3.9, C = 32,
w = 4) ptxas reports 255 registers and ~0.7 / 1.5 KB spills per thread forward / backward.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from tmcore.backends.fused import window_boxes
from tmcore.types import ConvParams

from . import launch

__all__ = ["scan_fwd", "scan_bwd", "launches_per_step"]


def _kernels() -> Any:
    return launch.kernels("local_kernels")


def launches_per_step() -> int:
    """Kernel launches per chunk step, forward + backward (the generic fast path: about 300 torch
    ops forward, 440 backward)."""
    return 1 + 1


class _Geometry(launch.Tiles):
    """Launch constants of a local scan on a state ``(B, C, *S)`` with window ``w``."""

    def __init__(self, state: Any, window: int) -> None:
        spatial = tuple(int(s) for s in state.shape[2:])
        self.size, self.box, self.corners = window_boxes(spatial, window)
        super().__init__(state, math.prod(self.box))
        pad = (1,) * (3 - self.n)
        self.g3, self.s3, self.w3 = pad + self.spatial, pad + self.box, pad + self.size

    def constexprs(self, precision: str) -> dict:
        (g0, g1, g2), (s0, s1, s2), (w0, w1, w2) = self.g3, self.s3, self.w3
        k0, k1, k2 = (1 if g == 1 else 2 for g in self.g3)
        # the grid's sizes are not specialized on: every grid with the same box and
        # window (all grids >= w + 2 cells per axis) shares one compiled kernel
        return {"G0": g0, "G1": g1, "G2": g2, "N": self.n, "K0": k0, "K1": k1, "K2": k2,
                "S0": s0, "S1": s1, "S2": s2, "W0": w0, "W1": w1, "W2": w2, "CB": self.cb,
                "BP": self.bp, "PRECISION": precision, **self.launch_kw()}


def _writes(xp, geo: _Geometry, wc, ws, wcont, window, eps, radius):
    """``(BoxWrites, geo (T * B, 6) int32, volumes (T * B, C, prod(box)))``."""
    from tmcore.scan.local import box_writes

    writes = box_writes(xp, wc, ws, wcont, geo.spatial, window, eps, radius)
    start = writes.geometry.box_start
    offset = writes.geometry.start - start
    zeros = torch.zeros((start.shape[0], 3 - geo.n), dtype=start.dtype, device=start.device)
    table = torch.cat([zeros, start, zeros, offset], dim=1).to(torch.int32).contiguous()
    volumes = writes.volumes.reshape(start.shape[0], geo.channels, -1).contiguous()
    return writes, table, volumes


def _run(kind: str, state, rc, tensors: tuple, arrays: dict, params: ConvParams, window, eps,
         radius, run) -> Any:
    """``run()`` through the shared fallback, or None; every shape checked first."""
    if not launch.usable(*tensors) or _kernels() is None:
        return None
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window: expected an int >= 1, got {window!r}")
    launch.check_shapes(state, rc, arrays, params, window=window)
    if rc.shape[1] == 0:
        return None
    return launch.guarded("local scan", _key(kind, state, rc, window, eps, radius), 5, state,
                          run)


def _key(kind, state, rc, window, eps, radius) -> tuple:
    return (kind, tuple(state.shape), rc.shape[1], window, state.dtype, state.device,
            float(eps), radius)


def scan_fwd(xp: Any, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
             window: int, eps: float, radius: float | None, overwrite_state: bool, *,
             options: Any):
    """The fused forward ``(reads (B, T, C), h_T, c_T, LocalScanResiduals)``, or None to decline."""
    params = ConvParams(*params)
    tensors = (h0, c0, read_coords, write_coords, write_sigma, write_content, *params)
    arrays = {"c0": c0, "write_coords": write_coords, "write_sigma": write_sigma,
              "write_content": write_content}
    return _run("fwd", h0, read_coords, tensors, arrays, params, window, eps, radius,
                lambda: _forward(xp, h0, c0, read_coords, write_coords, write_sigma,
                                 write_content, params, window, eps, radius, overwrite_state))


def _own(x: torch.Tensor, overwrite: bool) -> torch.Tensor:
    return x if overwrite and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _forward(xp, h0, c0, rc, wc, ws, wcont, params, window, eps, radius, overwrite):
    from tmcore.types import LocalScanResiduals

    geo = _Geometry(h0, window)
    _, table, volumes = _writes(xp, geo, wc, ws, wcont, window, eps, radius)
    inputs = launch.contiguous(h0, c0, volumes, table, rc, *params)
    key = ("local_fwd", *_key("", h0, rc, window, eps, radius)[1:], overwrite,
           launch.precision(h0))
    reads, h, c, h_boxes, c_boxes, read_boxes = launch.replay(
        key, functools.partial(_forward_loop, geo=geo, overwrite=overwrite), inputs)
    return reads, h, c, LocalScanResiduals(h_boxes, c_boxes, read_boxes)


def _forward_loop(h0, c0, volumes, table, rc, dw, db, pw, pb, *, geo, overwrite):
    """The forward launches: ``(reads, h_T, c_T, h_boxes, c_boxes, read_boxes)``."""
    k = _kernels()
    batch, channels, steps = geo.batch, geo.channels, rc.shape[1]
    h, c = _own(h0, overwrite), _own(c0, overwrite)
    like = {"dtype": h0.dtype, "device": h0.device}
    h_boxes = torch.empty((steps, batch, channels, *geo.box), **like)
    c_boxes = torch.empty_like(h_boxes)
    read_boxes = torch.empty((steps, batch, channels, *geo.corners), **like)
    reads = torch.empty((batch, steps, channels), **like)
    consts = geo.constexprs(launch.precision(h0))
    for t in range(steps):
        k.local_fwd_kernel[(batch,)](
            h, c, h_boxes, c_boxes, read_boxes, reads, volumes, table, rc, dw, db, pw, pb,
            t, batch, steps, channels, **consts)
    return reads, h, c, h_boxes, c_boxes, read_boxes

def scan_bwd(xp: Any, residuals, read_coords, write_coords, write_sigma, write_content,
             params, g_reads, g_h, g_c, window: int, eps: float, radius: float | None, *,
             options: Any):
    """The fused backward (a :class:`tmcore.scan.ScanGrads`), or ``None`` to decline."""
    params = ConvParams(*params)
    if residuals.read_boxes is None:
        return None
    tensors = (g_h, g_c, g_reads, *residuals, read_coords, write_coords, write_sigma,
               write_content, *params)
    arrays = {"g_c": g_c, "g_reads": g_reads, "residuals.h_boxes": residuals.h_boxes,
              "residuals.c_boxes": residuals.c_boxes,
              "residuals.read_boxes": residuals.read_boxes, "write_coords": write_coords,
              "write_sigma": write_sigma, "write_content": write_content}
    return _run("bwd", g_h, read_coords, tensors, arrays, params, window, eps, radius,
                lambda: _backward(xp, _Geometry(g_h, window), residuals, read_coords,
                                  write_coords, write_sigma, write_content, params, g_reads,
                                  g_h, g_c, window, eps, radius))


def _backward(xp, geo, residuals, rc, wc, ws, wcont, params, g_reads, g_h, g_c, window, eps,
              radius):
    from tmcore.scan.local import box_writes_bwd
    from tmcore.types import ScanGrads

    writes, table, volumes = _writes(xp, geo, wc, ws, wcont, window, eps, radius)
    inputs = launch.contiguous(g_h, g_c, *residuals, volumes, table, rc, g_reads, *params)
    key = ("local_bwd", *_key("", g_h, rc, window, eps, radius)[1:], launch.precision(g_h))
    d_h, d_c, d_x, d_rc, d_pw, d_pb, e_sums, corr = launch.replay(
        key, functools.partial(_backward_loop, geo=geo), inputs)
    d_wc, d_ws, d_wcont = box_writes_bwd(xp, writes, wc, ws, wcont, d_x)
    d_params = launch.param_grads(inputs[-4:], d_pw, d_pb, e_sums, corr, geo.s3)
    return ScanGrads(d_h, d_c, d_rc, d_wc, d_ws, d_wcont, d_params)


def _backward_loop(g_h, g_c, h_boxes, c_boxes, read_boxes, volumes, table, rc, g_reads, dw, db,
                   pw, pb, *, geo):
    """The backward launches: ``(d_h0, d_c0, d_x (T * B, C, *box), d_read_coords, d_pw (B, 4C,
    2C), d_pb (B, 4C) partials, bias-class sums, stencil sums)``."""
    k = _kernels()
    batch, channels, steps = geo.batch, geo.channels, rc.shape[1]
    like = {"dtype": g_h.dtype, "device": g_h.device}
    g_h, g_c = _own(g_h, False), _own(g_c, False)  # updated in place, step by step
    d_y = torch.empty((batch, 2 * channels, math.prod(geo.box)), **like)
    d_x = torch.empty((steps * batch, channels, *geo.box), **like)
    d_pw, d_pb, e_sums, corr = launch.param_sums(batch, channels, like)
    d_rc = torch.empty((batch, steps, geo.n), **like)
    consts = geo.constexprs(launch.precision(g_h))
    for t in reversed(range(steps)):
        k.local_bwd_kernel[(batch,)](
            g_h, g_c, h_boxes, c_boxes, read_boxes, volumes, table, rc, g_reads, d_y, d_x,
            dw, db, pw, pb, d_pw, d_pb, e_sums, corr, d_rc, t, batch, steps, channels,
            **consts)
    return g_h, g_c, d_x, d_rc, d_pw, d_pb, e_sums, corr
