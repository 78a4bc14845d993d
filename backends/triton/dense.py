"""The fused Triton scan for torch tensors: the torch table's ``scan_fwd`` / ``scan_bwd``
(contract :func:`tmcore.memory_scan_fwd` / ``memory_scan_bwd``, same checkpoints), or None
where it does not apply and the generic loop runs.

Per chunk step 1 launch forward and 2 backward (:mod:`.dense_kernels`), plus the forward
replays of ``checkpoint_every > 1``; when it runs, its precision, fallback and CUDA-graph
replay: :mod:`.launch`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from tmcore.types import ConvParams

from . import launch

__all__ = ["scan_fwd", "scan_bwd", "launches_per_step", "MAX_PROGRAMS_PER_ROW"]

#: Programs per batch row on CUDA at most (each loops over its cell tiles).
MAX_PROGRAMS_PER_ROW = 64


def _kernels() -> Any:
    return launch.kernels("dense_kernels")


def launches_per_step(checkpoint_every: int = 1) -> float:
    """Kernel launches per chunk step, forward + backward (replays included)."""
    return 1 + 2 + (checkpoint_every - 1) / checkpoint_every


class _Geometry(launch.Tiles):
    """Launch geometry of a state ``(B, C, *S)``: the grid padded to three axes, ``(B, G)``
    programs that each loop over their cell tiles."""

    def __init__(self, state: Any) -> None:
        self.cells = math.prod(state.shape[2:])
        super().__init__(state, self.cells)
        self.s3 = (1,) * (3 - self.n) + self.spatial
        tiles = -(-self.cells // self.bp)
        # the interpreter runs programs one after another: two per row still tests the
        # slot logic and the tile loop
        cap = 2 if not state.is_cuda else MAX_PROGRAMS_PER_ROW
        self.programs = min(tiles, cap)
        self.grid = (self.batch, self.programs)
        # the forward at C = 64 spilled 7.2 KB with 8 warps, 1.3 KB with 16; backward A
        # went the other way (4.8 -> 9.8 KB), so only the forward takes 16 there
        self.fwd_warps = 16 if self.cb >= 64 else self.num_warps

    def constexprs(self, has_radius: bool) -> dict:
        s0, s1, s2 = self.s3
        return {"N": self.n, "S0": s0, "S1": s1, "S2": s2, "CB": self.cb, "BP": self.bp,
                "HAS_RADIUS": has_radius}


def _forward_loop(h0, c0, rc, wc, ws, wcont, dw, db, pw, pb, *, eps, r, consts, every, geo):
    """The forward launches: ``(reads, h_T, c_T, h_checkpoints, c_checkpoints)``."""
    k = _kernels()
    steps = rc.shape[1]
    saved = -(-steps // every)
    h_ck = torch.empty((saved, *h0.shape), dtype=h0.dtype, device=h0.device)
    c_ck = torch.empty_like(h_ck)
    h_ck[0].copy_(h0)
    c_ck[0].copy_(c0)
    reads = torch.empty((geo.batch, steps, geo.channels), dtype=h0.dtype, device=h0.device)
    # states that are neither checkpoints nor the result: two buffers, alternating by
    # step (consecutive such states land in different ones; one is enough for one state)
    between = sum(1 for t in range(steps - 1) if (t + 1) % every)
    scratch = [(torch.empty_like(h0), torch.empty_like(c0)) for _ in range(min(between, 2))]
    h_t, c_t = torch.empty_like(h0), torch.empty_like(c0)
    cur = (h_ck[0], c_ck[0])
    for t in range(steps):
        if t + 1 == steps:
            out = (h_t, c_t)
        elif (t + 1) % every == 0:
            out = (h_ck[(t + 1) // every], c_ck[(t + 1) // every])
        else:
            out = scratch[t % len(scratch)]  # never the buffer it reads: see above
        k.step_fwd_kernel[geo.grid](
            cur[0], cur[1], out[0], out[1], reads, rc, wc, ws, wcont, dw, db, pw, pb, rc,
            t, steps, geo.channels, eps, r, WRITE_READ=True, PRECISION=launch.precision(h0),
            HAS_ACTIVE=False, **consts, **geo.launch_kw(geo.fwd_warps))
        cur = out
    return reads, h_t, c_t, h_ck, c_ck


def _accepts(state, read_coords, arrays: dict, params: ConvParams, **kw: Any) -> bool:
    """Whether the kernels take these arguments (else the scan declines); if so every shape is
    checked (``ValueError`` naming the argument)."""
    if read_coords.ndim != 3 or read_coords.shape[2] != state.ndim - 2:
        return False
    if not launch.usable(state, read_coords, *arrays.values(), *params):
        return False
    launch.check_shapes(state, read_coords, arrays, params, **kw)
    return True


def _run(kind: str, loop, state, read_coords, inputs: tuple, eps, radius, every, geo) -> Any:
    """``loop(*inputs)`` through the shared fallback and CUDA-graph replay, keyed by ``kind``,
    shapes, dtype and options; None where its kernels failed."""
    key = (kind, tuple(state.shape), read_coords.shape[1], state.dtype, state.device,
           float(eps), radius, every, launch.precision(state))

    def run():
        return launch.replay(key, functools.partial(
            loop, eps=float(eps), r=0.0 if radius is None else float(radius),
            consts=geo.constexprs(radius is not None), every=every, geo=geo), inputs)

    return launch.guarded("scan", key, 4, state, run)


def scan_fwd(xp: Any, h0, c0, read_coords, write_coords, write_sigma, write_content,
             params: ConvParams, eps: float, radius: float | None, checkpoint_every: int,
             reset: Any = None, active: Any = None):
    """Fused :func:`tmcore.memory_scan_fwd`, or None where it does not apply (no per-step masks)."""
    if reset is not None or active is not None:
        return None
    params = ConvParams(*params)
    if not _accepts(h0, read_coords, {"c0": c0, "write_coords": write_coords,
                                      "write_sigma": write_sigma,
                                      "write_content": write_content}, params):
        return None
    inputs = launch.contiguous(h0, c0, read_coords, write_coords, write_sigma,
                               write_content, *params)
    return _run("fwd", _forward_loop, h0, read_coords, inputs, eps, radius, checkpoint_every,
                _Geometry(h0))


def _backward_loop(rc, wc, ws, wcont, dw, db, pw, pb, h_ck, c_ck, g_reads, g_h, g_c, *, eps, r,
                   consts, every, geo):
    """The backward launches: ``(d_h0, d_c0, d_read_coords, write partials (B, T, G, C + 4),
    d_pointwise, d_pointwise_bias partials, bias-class sums, stencil sums)``."""
    k = _kernels()
    steps = rc.shape[1]
    batch, channels, cells = geo.batch, geo.channels, geo.cells
    like = {"dtype": g_h.dtype, "device": g_h.device}
    g_h, g_c = g_h.clone(), g_c.clone()  # updated in place, step by step
    d_y = torch.empty((batch, 2 * channels, cells), **like)
    d_pw, d_pb, e_sums, corr = launch.param_sums(batch * geo.programs, channels, like)
    write_part = torch.empty((batch, steps, geo.programs, channels + 4), **like)
    d_rc = torch.empty((batch, steps, geo.n), **like)
    replay = (torch.empty((every - 1, *g_h.shape), **like),
              torch.empty((every - 1, *g_h.shape), **like)) if every > 1 else None
    precision = launch.precision(g_h)
    extra = geo.launch_kw()
    for segment in reversed(range(h_ck.shape[0])):
        start = segment * every
        stop = min(start + every, steps)
        states = [(h_ck[segment], c_ck[segment])]
        for t in range(start, stop - 1):
            out = (replay[0][t - start], replay[1][t - start])
            k.step_fwd_kernel[geo.grid](
                *states[-1], out[0], out[1], d_rc, rc, wc, ws, wcont, dw, db, pw, pb, rc, t,
                steps, channels, eps, r, WRITE_READ=False, PRECISION=precision,
                HAS_ACTIVE=False, **consts, **geo.launch_kw(geo.fwd_warps))
            states.append(out)
        for t in reversed(range(start, stop)):
            h, c = states[t - start]
            k.step_bwd_a_kernel[geo.grid](
                h, c, g_h, g_c, d_y, wcont, wc, ws, dw, db, pw, pb, d_pw, d_pb, e_sums, t,
                steps, channels, eps, r, PRECISION=precision, **consts, **extra)
            k.step_bwd_b_kernel[geo.grid](
                h, g_h, d_y, g_reads, rc, wcont, wc, ws, dw, corr, write_part, d_rc, t, steps,
                channels, eps, r, **consts, **extra)
    return g_h, g_c, d_rc, write_part, d_pw, d_pb, e_sums, corr


def scan_bwd(xp: Any, read_coords, write_coords, write_sigma, write_content,
             params: ConvParams, h_checkpoints, c_checkpoints, g_reads, g_h, g_c, eps: float,
             radius: float | None, checkpoint_every: int, reset: Any = None, active: Any = None):
    """Fused :func:`tmcore.memory_scan_bwd`, or None where it does not apply."""
    from tmcore.types import ScanGrads

    if reset is not None or active is not None:
        return None
    params = ConvParams(*params)
    saved = -(-read_coords.shape[1] // checkpoint_every)
    if not _accepts(g_h, read_coords, {
            "g_c": g_c, "g_reads": g_reads, "h_checkpoints": h_checkpoints,
            "c_checkpoints": c_checkpoints, "write_coords": write_coords,
            "write_sigma": write_sigma, "write_content": write_content}, params, saved=saved):
        return None
    geo = _Geometry(g_h)
    inputs = launch.contiguous(read_coords, write_coords, write_sigma, write_content, *params,
                               h_checkpoints, c_checkpoints, g_reads, g_h, g_c)
    out = _run("bwd", _backward_loop, g_h, read_coords, inputs, eps, radius, checkpoint_every,
               geo)
    if out is None:
        return None
    d_h0, d_c0, d_rc, write_part, d_pw, d_pb, e_sums, corr = out
    ws = inputs[2]
    channels, n = geo.channels, geo.n
    sums = write_part.sum(dim=2)  # (B, T, C + 4), a fixed-order reduction
    denom = 2.0 * ws * ws + eps
    d_content = sums[..., :channels]
    d_mu = torch.stack([sums[..., channels + 2 - comp] for comp in range(n)], dim=-1)
    d_mu = d_mu * (2.0 / denom)[..., None]
    d_sigma = sums[..., channels + 3] * (4.0 * ws / (denom * denom))
    d_params = launch.param_grads(inputs[4:8], d_pw, d_pb, e_sums, corr, geo.s3)
    return ScanGrads(d_h0, d_c0, d_rc, d_mu, d_sigma, d_content, d_params)
