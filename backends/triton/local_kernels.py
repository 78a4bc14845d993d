"""Triton kernels of the fused local scan (``update="local"``): one launch per step each way.

Program ``b`` of the grid ``(B,)`` owns batch row ``b`` of the state and of every buffer, all
``C`` channels (``CB``, masked), and loops over the step's *box* (the window plus its 1-cell
halo, inside the grid) in tiles of ``BP`` cells. Box ``S0 x S1 x S2``, grid ``G0 x G1 x G2``
and window ``W0 x W1 x W2`` are padded to three axes; the box and window sizes are
constexprs, the grid's are not (one kernel serves every grid of >= ``w + 2`` cells per
axis). A window cell's conv neighbours lie in the box or outside the grid, so the box's
zero padding and bias field are the grid's for the window cells (the halo's values are
dropped). ``K0, K1, K2``: the read's corners per axis; ``geo (T * B, 6)`` int32: per row
``t * B + b`` the box start in the grid and the window start in the box. The written
volume is the precomputed box of :func:`tmcore.scan.local.box_writes`.

- forward: the box of ``h, c`` into the undo log; the read and its ``2^n`` corner cells;
  barrier; the gates on the box, stored into the window cells of the state (in place).
- backward: A) gate VJP on the window, pointwise and bias-class sums; B) the transposed
  stencil (``d_h`` over ``g_h``, ``d_x`` into the step's box buffer, the correlations);
  C) the read's VJP. Barriers between them; per-row slots: no atomics, deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .parts import (
    add_param_sums,
    bias_field,
    cells,
    coord,
    corner,
    gate_activations,
    gate_vjp,
    gates_fwd,
    gather,
    pointwise_vjp,
    stencil_vjp,
    store_coord_grad,
)

__all__ = ["local_fwd_kernel", "local_bwd_kernel"]


@triton.jit
def _box_conv(h_row, x_row, dw_ptr, db_ptr, offs_c, mask_c, i0, i1, i2, offs_p, C,
              N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
              CB: tl.constexpr, BP: tl.constexpr):
    """The depthwise output ``(y_x, y_h)``, each ``(CB, BP)``, at the box cells ``offs_p``
    (``h_row`` / ``x_row``: channel 0 of the box ``(C, P)`` of ``h`` / ``x``)."""
    C2 = 2 * C
    P: tl.constexpr = S0 * S1 * S2
    zeros = tl.zeros((CB, BP), dtype=h_row.dtype.element_ty)
    y_x = gather(x_row, dw_ptr, 0, offs_c, mask_c, i0, i1, i2, offs_p, zeros, C, N, S0, S1, S2)
    y_h = gather(h_row, dw_ptr, C, offs_c, mask_c, i0, i1, i2, offs_p, zeros, C, N, S0, S1, S2)
    y_x += bias_field(dw_ptr, db_ptr, 0, i0, i1, i2, offs_c, mask_c, C2, N, S0, S1, S2)
    y_h += bias_field(dw_ptr, db_ptr, C, i0, i1, i2, offs_c, mask_c, C2, N, S0, S1, S2)
    row_ok = mask_c[:, None] & (offs_p < P)[None, :]
    return tl.where(row_ok, y_x, 0.0), tl.where(row_ok, y_h, 0.0)


@triton.jit
def _local_tent(x, G):
    """The read's interpolation along a grid axis of ``G`` cells, ``(lower index, frac, slope)``,
    the lower corner clamped to ``max(G - 2, 0)`` (the corner box's conventions)."""
    xc = tl.where(x < -1.0, x * 0.0 - 1.0, tl.where(x > 1.0, x * 0.0 + 1.0, x))
    xc = tl.where(x == x, xc, x)  # NaN stays NaN
    half = (G - 1) * 0.5
    u = (xc + 1.0) * half
    top = u * 0.0 + (G - 1)
    clamped = tl.where(u < 0.0, u * 0.0, tl.where(u > top, top, u))
    lower = tl.floor(clamped)
    lower = tl.where(lower > top - 1.0, top - 1.0, lower)
    lower = tl.where(lower < 0.0, lower * 0.0, lower)
    frac = clamped - lower
    lower_i = tl.where(lower == lower, lower, 0.0).to(tl.int32)
    slope = ((u > 0.0) & (u < top)).to(x.dtype) * half + u * 0.0
    return lower_i, frac, slope


@triton.jit
def _read_corners(rc, N: tl.constexpr, G0, G1, G2):
    """:func:`_local_tent` of a read's coordinates along the three padded axes:
    ``(l0, f0, s0, l1, f1, s1, l2, f2, s2)``."""
    l0, f0, s0 = _local_tent(coord(rc, 0, N), G0)
    l1, f1, s1 = _local_tent(coord(rc, 1, N), G1)
    l2, f2, s2 = _local_tent(coord(rc, 2, N), G2)
    return l0, f0, s0, l1, f1, s1, l2, f2, s2


@triton.jit
def _box_cells(geo_ptr, tb, i0, i1, i2, G1, G2):
    """Grid cell index of box cells ``(i0, i1, i2)`` and their window mask (BP,)."""
    bs0 = tl.load(geo_ptr + tb * 6)
    bs1 = tl.load(geo_ptr + tb * 6 + 1)
    bs2 = tl.load(geo_ptr + tb * 6 + 2)
    cell = (bs0 + i0) * (G1 * G2) + (bs1 + i1) * G2 + (bs2 + i2)
    return cell


@triton.jit
def _in_window(geo_ptr, tb, i0, i1, i2, mask_p, W0: tl.constexpr, W1: tl.constexpr,
               W2: tl.constexpr):
    o0 = tl.load(geo_ptr + tb * 6 + 3)
    o1 = tl.load(geo_ptr + tb * 6 + 4)
    o2 = tl.load(geo_ptr + tb * 6 + 5)
    return ((i0 >= o0) & (i0 < o0 + W0) & (i1 >= o1) & (i1 < o1 + W1) & (i2 >= o2)
            & (i2 < o2 + W2) & mask_p)


@triton.jit(do_not_specialize=["t", "B", "T", "C", "G0", "G1", "G2"])
def local_fwd_kernel(
    h_ptr, c_ptr, hbox_ptr, cbox_ptr, rbox_ptr, reads_ptr, vol_ptr, geo_ptr, rc_ptr,
    dw_ptr, db_ptr, pw_ptr, pb_ptr, t, B, T, C,
    G0, G1, G2, N: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
    CB: tl.constexpr, BP: tl.constexpr, PRECISION: tl.constexpr,
):
    """Step ``t`` forward for row ``b``: undo log ``hbox, cbox (T, B, C, P)``, corners ``rbox (T, B,
    C, K)``, ``reads (B, T, C)``; ``h, c (B, C, G)`` updated in place."""
    b = tl.program_id(0)
    P: tl.constexpr = S0 * S1 * S2
    GP = G0 * G1 * G2
    TILES: tl.constexpr = (P + BP - 1) // BP
    K: tl.constexpr = K0 * K1 * K2
    offs_c = tl.arange(0, CB)
    mask_c = offs_c < C
    tb = t * B + b
    bt = b * T + t
    row = b * C * GP
    brow = tb * C * P
    # ---- the undo log: the box of h, c before the update
    for tile in range(0, TILES):
        offs_p, i0, i1, i2, mask_p = cells(tile, BP, S0, S1, S2)
        cell = _box_cells(geo_ptr, tb, i0, i1, i2, G1, G2)
        m = mask_c[:, None] & mask_p[None, :]
        src = row + offs_c[:, None] * GP + cell[None, :]
        dst = brow + offs_c[:, None] * P + offs_p[None, :]
        tl.store(hbox_ptr + dst, tl.load(h_ptr + src, mask=m, other=0.0), mask=m)
        tl.store(cbox_ptr + dst, tl.load(c_ptr + src, mask=m, other=0.0), mask=m)
    # ---- the read of the state entering the step, and its corner cells
    l0, f0, s0, l1, f1, s1, l2, f2, s2 = _read_corners(rc_ptr + bt * N, N, G0, G1, G2)
    acc = (offs_c * 0).to(f2.dtype)
    for e0 in tl.static_range(2):
        for e1 in tl.static_range(2):
            for e2 in tl.static_range(2):
                if (e0 < K0) and (e1 < K1) and (e2 < K2):
                    w0, _ = corner(e0, f0, s0)
                    w1, _ = corner(e1, f1, s1)
                    w2, _ = corner(e2, f2, s2)
                    spot = (l0 + e0) * (G1 * G2) + (l1 + e1) * G2 + (l2 + e2)
                    hv = tl.load(h_ptr + row + offs_c * GP + spot, mask=mask_c, other=0.0)
                    tl.store(rbox_ptr + (tb * C + offs_c) * K + (e0 * K1 * K2 + e1 * K2 + e2),
                             hv, mask=mask_c)
                    acc += w0 * w1 * w2 * hv
    tl.store(reads_ptr + bt * C + offs_c, acc, mask=mask_c)
    tl.debug_barrier()  # every load of this row's state before its first store
    # ---- the gates on the box (from the undo log), stored into the window cells
    for tile in range(0, TILES):
        offs_p, i0, i1, i2, mask_p = cells(tile, BP, S0, S1, S2)
        y_x, y_h = _box_conv(hbox_ptr + brow, vol_ptr + brow, dw_ptr, db_ptr, offs_c, mask_c,
                             i0, i1, i2, offs_p, C, N, S0, S1, S2, CB, BP)
        m = mask_c[:, None] & mask_p[None, :]
        h_new, c_new = gates_fwd(y_x, y_h, cbox_ptr + brow + offs_c[:, None] * P + offs_p[None, :],
                                 m, pw_ptr, pb_ptr, offs_c, mask_c, C, PRECISION)
        inside = _in_window(geo_ptr, tb, i0, i1, i2, mask_p, W0, W1, W2)
        cell = _box_cells(geo_ptr, tb, i0, i1, i2, G1, G2)
        at = row + offs_c[:, None] * GP + cell[None, :]
        mi = mask_c[:, None] & inside[None, :]
        tl.store(c_ptr + at, c_new, mask=mi)
        tl.store(h_ptr + at, h_new, mask=mi)


@triton.jit(do_not_specialize=["t", "B", "T", "C", "G0", "G1", "G2"])
def local_bwd_kernel(
    gh_ptr, gc_ptr, hbox_ptr, cbox_ptr, rbox_ptr, vol_ptr, geo_ptr, rc_ptr, g_reads,
    dy_ptr, dx_ptr, dw_ptr, db_ptr, pw_ptr, pb_ptr, dpw_part, dpb_part, e_part, corr_part,
    d_rc, t, B, T, C,
    G0, G1, G2, N: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
    CB: tl.constexpr, BP: tl.constexpr, PRECISION: tl.constexpr,
):
    """Step ``t`` backward for row ``b``: ``g_h, g_c (B, C, G)`` become the state-before-step's in
    place; ``dx (T * B, C, P)`` the box cotangent, ``d_rc (B, T, n)``; row ``b``'s slots of ``dpw
    (B, 4C, 2C)``, ``dpb (B, 4C)``, ``e``, ``corr (B, 2C, 27)``; ``dy (B, 2C, P)`` scratch."""
    b = tl.program_id(0)
    P: tl.constexpr = S0 * S1 * S2
    GP = G0 * G1 * G2
    TILES: tl.constexpr = (P + BP - 1) // BP
    K: tl.constexpr = K0 * K1 * K2
    offs_c = tl.arange(0, CB)
    mask_c = offs_c < C
    C2 = 2 * C
    tb = t * B + b
    bt = b * T + t
    row = b * C * GP
    brow = tb * C * P
    dy_row = b * C2 * P
    # ---- A: gate VJP on the window cells; d_c over g_c on the box
    for tile in range(0, TILES):
        offs_p, i0, i1, i2, mask_p = cells(tile, BP, S0, S1, S2)
        y_x, y_h = _box_conv(hbox_ptr + brow, vol_ptr + brow, dw_ptr, db_ptr, offs_c, mask_c,
                             i0, i1, i2, offs_p, C, N, S0, S1, S2, CB, BP)
        s_i, s_f, s_o, t_g = gate_activations(y_x, y_h, pw_ptr, pb_ptr, offs_c, mask_c, C,
                                              PRECISION)
        m = mask_c[:, None] & mask_p[None, :]
        inside = _in_window(geo_ptr, tb, i0, i1, i2, mask_p, W0, W1, W2)
        mi = mask_c[:, None] & inside[None, :]
        cell = _box_cells(geo_ptr, tb, i0, i1, i2, G1, G2)
        at = row + offs_c[:, None] * GP + cell[None, :]
        c = tl.load(cbox_ptr + brow + offs_c[:, None] * P + offs_p[None, :], mask=m, other=0.0)
        g_c_all = tl.load(gc_ptr + at, mask=m, other=0.0)
        g_h = tl.load(gh_ptr + at, mask=mi, other=0.0)
        g_c = tl.where(mi, g_c_all, 0.0)
        d_c, dz_i, dz_f, dz_o, dz_g = gate_vjp(s_i, s_f, s_o, t_g, c, g_h, g_c, mi)
        tl.store(gc_ptr + at, tl.where(mi, d_c, g_c_all), mask=m)
        dy_x, dy_h = pointwise_vjp(pw_ptr, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                                    PRECISION)
        dy_x = tl.where(mi, dy_x, 0.0)
        dy_h = tl.where(mi, dy_h, 0.0)
        dy_at = dy_row + offs_c[:, None] * P + offs_p[None, :]
        tl.store(dy_ptr + dy_at, dy_x, mask=m)
        tl.store(dy_ptr + dy_at + C * P, dy_h, mask=m)
        add_param_sums(dpw_part, dpb_part, e_part, b, y_x, y_h, dz_i, dz_f, dz_o, dz_g, dy_x,
                       dy_h, i0, i1, i2, offs_c, mask_c, C, S0, S1, S2, PRECISION)
    tl.debug_barrier()  # d_y of the whole box before the transposed stencil
    # ---- B: transposed stencil; d_h over g_h on the box, d_x into the step's buffer
    for tile in range(0, TILES):
        offs_p, i0, i1, i2, mask_p = cells(tile, BP, S0, S1, S2)
        m = mask_c[:, None] & mask_p[None, :]
        own = brow + offs_c[:, None] * P + offs_p[None, :]
        h_own = tl.load(hbox_ptr + own, mask=m, other=0.0)
        x_own = tl.load(vol_ptr + own, mask=m, other=0.0)
        d_h, d_x = stencil_vjp(dy_ptr, dy_row, dw_ptr, corr_part, b, x_own, h_own, offs_c,
                                mask_c, offs_p, mask_p, i0, i1, i2, C, C2, P, N, S0, S1, S2)
        inside = _in_window(geo_ptr, tb, i0, i1, i2, mask_p, W0, W1, W2)
        cell = _box_cells(geo_ptr, tb, i0, i1, i2, G1, G2)
        at = row + offs_c[:, None] * GP + cell[None, :]
        g_h = tl.load(gh_ptr + at, mask=m, other=0.0)
        tl.store(gh_ptr + at, tl.where(inside[None, :], 0.0, g_h) + d_h, mask=m)
        tl.store(dx_ptr + own, d_x, mask=m)
    tl.debug_barrier()  # the box of g_h stored before the read adds to its corners
    # ---- C: the read's VJP (the corner cells stored by the forward)
    g_read = tl.load(g_reads + bt * C + offs_c, mask=mask_c, other=0.0)
    l0, f0, s0, l1, f1, s1, l2, f2, s2 = _read_corners(rc_ptr + bt * N, N, G0, G1, G2)
    a0 = tl.sum(g_read * 0.0, axis=0)
    a1 = a0
    a2 = a0
    for e0 in tl.static_range(2):
        for e1 in tl.static_range(2):
            for e2 in tl.static_range(2):
                if (e0 < K0) and (e1 < K1) and (e2 < K2):
                    w0, q0 = corner(e0, f0, s0)
                    w1, q1 = corner(e1, f1, s1)
                    w2, q2 = corner(e2, f2, s2)
                    spot = (l0 + e0) * (G1 * G2) + (l1 + e1) * G2 + (l2 + e2)
                    at = gh_ptr + row + offs_c * GP + spot
                    tl.store(at, tl.load(at, mask=mask_c, other=0.0) + g_read * (w0 * w1 * w2),
                             mask=mask_c)
                    hv = tl.load(rbox_ptr + (tb * C + offs_c) * K + (e0 * K1 * K2 + e1 * K2
                                                                     + e2),
                                 mask=mask_c, other=0.0)
                    gh = tl.sum(g_read * hv, axis=0)
                    a0 += gh * q0 * w1 * w2
                    a1 += gh * w0 * q1 * w2
                    a2 += gh * w0 * w1 * q2
    store_coord_grad(d_rc + bt * N, a0, a1, a2, N)
