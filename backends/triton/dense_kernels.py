"""Triton kernels of the fused chunk step: one launch forward, two backward.

Every kernel sees the state as ``(B, C, P)``, the grid padded to three axes ``S0 x S1 x S2``
(a padded axis has no taps, no coordinate and a write profile of 1); program ``(b, g)`` of
the grid ``(B, G)`` handles batch row ``b``, cell tiles ``g, g + G, ...`` of ``BP`` cells and
all ``C`` channels (``CB``: ``C`` rounded up to a power of two >= 16, masked). With
``u = concat(x, h)``, ``x`` the written volume:

- forward: the ``n`` depthwise passes compose into one 3^n stencil per channel, ``y[p] =
  sum_d K[d] u[p + d] + Bias(p)``, ``K[d] = prod_a taps_a[d_a]``, ``Bias = (b_0 V_1 + b_1)
  V_2 + b_2`` (``V_a`` the sum of the taps that see a cell inside the grid); the ``h``
  half gathers its 3^n neighbours, the ``x`` half is separable (``content * prod_a g_a``),
  so neither the write volume nor ``concat`` is ever in memory. Then ``z = W y + b`` as
  eight ``tl.dot``, the gates in registers, and the step's read by each row's program 0.
- backward A: recompute ``y, z``; gate VJP, ``d_c`` over ``g_c``, ``d_y = W^T d_z``; the
  pointwise and bias-class partial sums.
- backward B: the transposed stencil plus the read's volume gradient as the new ``g_h``;
  the stencil correlations (tap gradients); the write's partial sums; the read's
  coordinate gradient.

``t``, ``T`` and ``C`` are not specialized on (Triton would compile variants for ``t == 1``
and ``t % 16 == 0``). Every bias term depends on a cell only through whether it is first,
interior or last per axis, so 27 class sums per channel carry the bias gradients. No
atomics: each program owns its slots and steps are sequential launches (deterministic).
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
    taps,
)

__all__ = ["read_at", "step_fwd_kernel", "step_bwd_a_kernel", "step_bwd_b_kernel"]


@triton.jit
def _gauss(j, mu, denom, rs, S: tl.constexpr, HAS_RADIUS: tl.constexpr):
    """Gaussian profile of one axis at (integer) cell index ``j``: ``(weight, p - mu)``."""
    if S == 1:
        pos = j.to(mu.dtype) * 0.0 - 1.0
    else:
        pos = (2 * j - (S - 1)).to(mu.dtype) / (S - 1)
    off = pos - mu
    g = tl.exp(-(off * off) / denom)
    if HAS_RADIUS:
        g = tl.where(tl.abs(off) <= rs, g, g * 0.0)  # 0, but NaN stays NaN
    return g, off


@triton.jit
def _x_axis(dw_ptr, A: tl.constexpr, N: tl.constexpr, offs_c, mask_c, C2, i, mu, denom, rs,
            S: tl.constexpr, HAS_RADIUS: tl.constexpr):
    """Padded axis ``A`` of the ``x`` half: ``G = sum_k t_k g(i + k - 1)`` over cells inside,
    ``(CB, BP)`` (``t``: the axis's ``x`` taps, ``g``: its Gaussian profile)."""
    t0, t1, t2 = taps(dw_ptr, A, N, 0, offs_c, mask_c, C2)
    g_mid, off = _gauss(i, mu, denom, rs, S, HAS_RADIUS)
    G = t1[:, None] * g_mid[None, :]
    if S > 1:
        g_prev, off_prev = _gauss(i - 1, mu, denom, rs, S, HAS_RADIUS)
        g_next, off_next = _gauss(i + 1, mu, denom, rs, S, HAS_RADIUS)
        G += t0[:, None] * tl.where(i > 0, g_prev, 0.0)[None, :]
        G += t2[:, None] * tl.where(i < S - 1, g_next, 0.0)[None, :]
    return G


@triton.jit
def _write_profile(i0, i1, i2, mu0, mu1, mu2, denom, rs, N: tl.constexpr, S0: tl.constexpr,
                   S1: tl.constexpr, S2: tl.constexpr, HAS_RADIUS: tl.constexpr):
    """``w(p) = prod_a g_a(i_a)`` over the real axes at cells ``(i0, i1, i2)`` (BP,)."""
    w, _ = _gauss(i2, mu2, denom, rs, S2, HAS_RADIUS)
    if N >= 2:
        g1, _ = _gauss(i1, mu1, denom, rs, S1, HAS_RADIUS)
        w = w * g1
    if N >= 3:
        g0, _ = _gauss(i0, mu0, denom, rs, S0, HAS_RADIUS)
        w = w * g0
    return w


@triton.jit
def _conv_input(h_row, content, mu0, mu1, mu2, denom, rs, dw_ptr, db_ptr, offs_c, mask_c,
                i0, i1, i2, offs_p, C, N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                S2: tl.constexpr, HAS_RADIUS: tl.constexpr):
    """The depthwise output ``(y_x, y_h)``, each ``(CB, BP)``, at the tile's cells (``h_row``:
    ``h[b, 0, 0]``; rows ``>= C`` are 0)."""
    C2 = 2 * C
    # ---- x half: separable
    G = _x_axis(dw_ptr, 2, N, offs_c, mask_c, C2, i2, mu2, denom, rs, S2, HAS_RADIUS)
    if N >= 2:
        G = G * _x_axis(dw_ptr, 1, N, offs_c, mask_c, C2, i1, mu1, denom, rs, S1, HAS_RADIUS)
    if N >= 3:
        G = G * _x_axis(dw_ptr, 0, N, offs_c, mask_c, C2, i0, mu0, denom, rs, S0, HAS_RADIUS)
    y_x = content[:, None] * G + bias_field(dw_ptr, db_ptr, 0, i0, i1, i2, offs_c, mask_c,
                                             C2, N, S0, S1, S2)
    # ---- h half: 3^n gathers
    y_h = gather(h_row, dw_ptr, C, offs_c, mask_c, i0, i1, i2, offs_p, tl.zeros_like(G), C, N,
                 S0, S1, S2)
    y_h += bias_field(dw_ptr, db_ptr, C, i0, i1, i2, offs_c, mask_c, C2, N, S0, S1, S2)
    row_ok = mask_c[:, None]
    return tl.where(row_ok, y_x, 0.0), tl.where(row_ok, y_h, 0.0)


@triton.jit
def _tent(x, S: tl.constexpr):
    """Read interpolation along one axis: ``(lower index (NaN -> 0), frac, inside)``."""
    u = (x + 1.0) * (S - 1) * 0.5
    top = u * 0.0 + (S - 1)
    clamped = tl.where(u < 0.0, u * 0.0, tl.where(u > top, top, u))
    lower = tl.floor(clamped)
    frac = clamped - lower
    lower_i = tl.where(lower == lower, lower, 0.0).to(tl.int32)
    inside = (u > 0.0) & (u < top)
    return lower_i, lower, frac, inside


@triton.jit
def _tent_weight(i, lower, frac):
    """Interpolation weight of cell index ``i`` (BP,) given the lower corner ``lower``."""
    fi = i.to(frac.dtype)
    return (fi == lower).to(frac.dtype) * (1.0 - frac) + (fi == lower + 1.0).to(frac.dtype) * frac


@triton.jit
def _write_params(wcont_ptr, ws_ptr, wc_ptr, bt, offs_c, mask_c, C, eps, radius,
                  N: tl.constexpr):
    """Step ``bt``'s write: content ``(CB,)``, sigma, ``2 sigma^2 + eps``, ``radius * sigma`` and
    the centre ``mu0, mu1, mu2`` (coordinate order)."""
    content = tl.load(wcont_ptr + bt * C + offs_c, mask=mask_c, other=0.0)
    sigma = tl.load(ws_ptr + bt)
    mu0 = coord(wc_ptr + bt * N, 0, N)
    mu1 = coord(wc_ptr + bt * N, 1, N)
    mu2 = coord(wc_ptr + bt * N, 2, N)
    return content, sigma, 2.0 * sigma * sigma + eps, radius * sigma, mu0, mu1, mu2


@triton.jit(do_not_specialize=["t", "T", "C"])
def step_fwd_kernel(
    h_ptr, c_ptr, h_out, c_out, reads_ptr, rc_ptr, wc_ptr, ws_ptr, wcont_ptr,
    dw_ptr, db_ptr, pw_ptr, pb_ptr, active_ptr, t, T, C, eps, radius,
    N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    CB: tl.constexpr, BP: tl.constexpr, HAS_RADIUS: tl.constexpr, WRITE_READ: tl.constexpr,
    PRECISION: tl.constexpr, HAS_ACTIVE: tl.constexpr,
):
    """One chunk step forward: ``h, c (B, C, P) -> h_out, c_out``; ``reads[b, t]``. With
    ``HAS_ACTIVE`` a row whose ``active_ptr[b]`` (int8) is 0 keeps its state."""
    b = tl.program_id(0)
    pid = tl.program_id(1)
    programs = tl.num_programs(1)
    P: tl.constexpr = S0 * S1 * S2
    TILES: tl.constexpr = (P + BP - 1) // BP
    offs_c = tl.arange(0, CB)
    mask_c = offs_c < C
    row = b * C * P
    bt = b * T + t
    content, sigma, denom, rs, mu0, mu1, mu2 = _write_params(
        wcont_ptr, ws_ptr, wc_ptr, bt, offs_c, mask_c, C, eps, radius, N)
    if WRITE_READ:
        if pid == 0:
            _read(h_ptr + row, rc_ptr + bt * N, reads_ptr + bt * C, offs_c, mask_c, N, S0, S1,
                  S2)
    live = True
    if HAS_ACTIVE:
        live = tl.load(active_ptr + b) != 0
    for tile in range(pid, TILES, programs):
        offs_p, i0, i1, i2, mask_p = cells(tile, BP, S0, S1, S2)
        at = row + offs_c[:, None] * P + offs_p[None, :]
        mask = mask_c[:, None] & mask_p[None, :]
        if live:
            y_x, y_h = _conv_input(h_ptr + row, content, mu0, mu1, mu2, denom, rs, dw_ptr,
                                   db_ptr, offs_c, mask_c, i0, i1, i2, offs_p, C, N, S0, S1,
                                   S2, HAS_RADIUS)
            h_new, c_new = gates_fwd(y_x, y_h, c_ptr + at, mask, pw_ptr, pb_ptr, offs_c, mask_c,
                                     C, PRECISION)
        else:
            h_new = tl.load(h_ptr + at, mask=mask, other=0.0)
            c_new = tl.load(c_ptr + at, mask=mask, other=0.0)
        tl.store(c_out + at, c_new, mask=mask)
        tl.store(h_out + at, h_new, mask=mask)


@triton.jit
def _read_tents(x0, x1, x2, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """:func:`_tent` of a read's coordinates ``x0, x1, x2`` along the three padded axes:
    ``(lower index, lower, frac, inside)`` per axis."""
    l0, low0, fr0, in0 = _tent(x0, S0)
    l1, low1, fr1, in1 = _tent(x1, S1)
    l2, low2, fr2, in2 = _tent(x2, S2)
    return l0, low0, fr0, in0, l1, low1, fr1, in1, l2, low2, fr2, in2


@triton.jit
def _corner_value(h_row, offs_c, mask_c, l0, l1, l2, e0: tl.constexpr, e1: tl.constexpr,
                  e2: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """``h[c, corner]`` (CB,) at the read's corner, 0 past the grid's last cell."""
    P: tl.constexpr = S0 * S1 * S2
    j0 = offs_c * 0 + (l0 + e0)  # per-channel copies: masks are vectors
    j1 = offs_c * 0 + (l1 + e1)
    j2 = offs_c * 0 + (l2 + e2)
    ok = (j0 < S0) & (j1 < S1) & (j2 < S2)
    return tl.load(h_row + offs_c * P + (j0 * S1 * S2 + j1 * S2 + j2), mask=mask_c & ok,
                   other=0.0)


@triton.jit
def read_at(h_row, x0, x1, x2, offs_c, mask_c, S0: tl.constexpr, S1: tl.constexpr,
            S2: tl.constexpr):
    """``(CB,)``: the sum over the 2^n corners of weight * ``h[c, corner]`` (border clamped),
    ``x0, x1, x2`` the coordinates along the padded axes."""
    l0, _, fr0, in0, l1, _, fr1, in1, l2, _, fr2, in2 = _read_tents(x0, x1, x2, S0, S1, S2)
    acc = (offs_c * 0).to(fr2.dtype)
    for e0 in tl.static_range(2):
        for e1 in tl.static_range(2):
            for e2 in tl.static_range(2):
                if (e0 == 0 or S0 > 1) and (e1 == 0 or S1 > 1) and (e2 == 0 or S2 > 1):
                    w0, _ = corner(e0, fr0, fr0)
                    w1, _ = corner(e1, fr1, fr1)
                    w2, _ = corner(e2, fr2, fr2)
                    w = w0 * w1 * w2
                    hv = _corner_value(h_row, offs_c, mask_c, l0, l1, l2, e0, e1, e2, S0, S1, S2)
                    acc += w * hv
    return acc


@triton.jit
def _read(h_row, rc, out, offs_c, mask_c, N: tl.constexpr, S0: tl.constexpr,
          S1: tl.constexpr, S2: tl.constexpr):
    """``out[c]``: :func:`read_at` the coordinates at ``rc``."""
    acc = read_at(h_row, coord(rc, 0, N), coord(rc, 1, N), coord(rc, 2, N), offs_c, mask_c,
                  S0, S1, S2)
    tl.store(out + offs_c, acc, mask=mask_c)


@triton.jit(do_not_specialize=["t", "T", "C"])
def step_bwd_a_kernel(
    h_ptr, c_ptr, gh_ptr, gc_ptr, dy_ptr, wcont_ptr, wc_ptr, ws_ptr,
    dw_ptr, db_ptr, pw_ptr, pb_ptr, dpw_part, dpb_part, e_part, t, T, C, eps, radius,
    N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    CB: tl.constexpr, BP: tl.constexpr, HAS_RADIUS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Backward A of step ``t``: ``d_c`` over ``g_c``, ``d_y (B, 2C, P)``, and this program's slots
    of ``dpw_part (prog, 4C, 2C)``, ``dpb_part (prog, 4C)``, ``e_part (prog, 2C, 27)``."""
    b = tl.program_id(0)
    pid = tl.program_id(1)
    programs = tl.num_programs(1)
    slot = b * programs + pid
    P: tl.constexpr = S0 * S1 * S2
    TILES: tl.constexpr = (P + BP - 1) // BP
    offs_c = tl.arange(0, CB)
    mask_c = offs_c < C
    row = b * C * P
    bt = b * T + t
    content, sigma, denom, rs, mu0, mu1, mu2 = _write_params(
        wcont_ptr, ws_ptr, wc_ptr, bt, offs_c, mask_c, C, eps, radius, N)
    for tile in range(pid, TILES, programs):
        offs_p, i0, i1, i2, mask_p = cells(tile, BP, S0, S1, S2)
        y_x, y_h = _conv_input(h_ptr + row, content, mu0, mu1, mu2, denom, rs, dw_ptr, db_ptr,
                               offs_c, mask_c, i0, i1, i2, offs_p, C, N, S0, S1, S2,
                               HAS_RADIUS)
        y_x = tl.where(mask_p[None, :], y_x, 0.0)
        y_h = tl.where(mask_p[None, :], y_h, 0.0)
        s_i, s_f, s_o, t_g = gate_activations(y_x, y_h, pw_ptr, pb_ptr, offs_c, mask_c, C,
                                              PRECISION)
        at = row + offs_c[:, None] * P + offs_p[None, :]
        mask = mask_c[:, None] & mask_p[None, :]
        c = tl.load(c_ptr + at, mask=mask, other=0.0)
        g_h = tl.load(gh_ptr + at, mask=mask, other=0.0)
        g_c = tl.load(gc_ptr + at, mask=mask, other=0.0)
        d_c, dz_i, dz_f, dz_o, dz_g = gate_vjp(s_i, s_f, s_o, t_g, c, g_h, g_c, mask)
        tl.store(gc_ptr + at, d_c, mask=mask)
        # d_y = W^T d_z, per half
        dy_x, dy_h = pointwise_vjp(pw_ptr, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                                    PRECISION)
        dy_at = b * 2 * C * P + offs_c[:, None] * P + offs_p[None, :]
        tl.store(dy_ptr + dy_at, dy_x, mask=mask)
        tl.store(dy_ptr + dy_at + C * P, dy_h, mask=mask)
        # the parameter gradients' terms, added to this program's slot
        dy_x = tl.where(mask, dy_x, 0.0)
        dy_h = tl.where(mask, dy_h, 0.0)
        add_param_sums(dpw_part, dpb_part, e_part, slot, y_x, y_h, dz_i, dz_f, dz_o, dz_g, dy_x,
                       dy_h, i0, i1, i2, offs_c, mask_c, C, S0, S1, S2, PRECISION)


@triton.jit(do_not_specialize=["t", "T", "C"])
def step_bwd_b_kernel(
    h_ptr, gh_ptr, dy_ptr, g_reads, rc_ptr, wcont_ptr, wc_ptr, ws_ptr, dw_ptr,
    corr_part, write_part, d_rc, t, T, C, eps, radius,
    N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    CB: tl.constexpr, BP: tl.constexpr, HAS_RADIUS: tl.constexpr,
):
    """Backward B of step ``t``: ``d_h`` over ``g_h``; ``corr_part (prog, 2C, 27)``; the write's
    partial sums ``write_part[b, t, g] = (d_content (C), sum w s (p - mu)_A (3), sum w s
    |p - mu|^2)``; the read's coordinate gradient ``d_rc[b, t]``."""
    b = tl.program_id(0)
    pid = tl.program_id(1)
    programs = tl.num_programs(1)
    slot = b * programs + pid
    P: tl.constexpr = S0 * S1 * S2
    TILES: tl.constexpr = (P + BP - 1) // BP
    offs_c = tl.arange(0, CB)
    mask_c = offs_c < C
    C2 = 2 * C
    row = b * C * P
    dy_row = b * 2 * C * P
    bt = b * T + t
    content, sigma, denom, rs, mu0, mu1, mu2 = _write_params(
        wcont_ptr, ws_ptr, wc_ptr, bt, offs_c, mask_c, C, eps, radius, N)
    g_read = tl.load(g_reads + bt * C + offs_c, mask=mask_c, other=0.0)
    rc = rc_ptr + bt * N
    li0, low0, fr0, in0, li1, low1, fr1, in1, li2, low2, fr2, in2 = _read_tents(
        coord(rc, 0, N), coord(rc, 1, N), coord(rc, 2, N), S0, S1, S2)
    zero_c = tl.zeros((CB,), dtype=content.dtype)
    d_content = zero_c
    s_mu0 = tl.sum(zero_c, axis=0)
    s_mu1 = s_mu0
    s_mu2 = s_mu0
    s_m2 = s_mu0
    for tile in range(pid, TILES, programs):
        offs_p, i0, i1, i2, mask_p = cells(tile, BP, S0, S1, S2)
        mask = mask_c[:, None] & mask_p[None, :]
        at = row + offs_c[:, None] * P + offs_p[None, :]
        h_own = tl.load(h_ptr + at, mask=mask, other=0.0)
        w = _write_profile(i0, i1, i2, mu0, mu1, mu2, denom, rs, N, S0, S1, S2, HAS_RADIUS)
        w = tl.where(mask_p, w, 0.0)
        x_own = content[:, None] * w[None, :]
        d_h, d_x = stencil_vjp(dy_ptr, dy_row, dw_ptr, corr_part, slot, x_own, h_own,
                                offs_c, mask_c, offs_p, mask_p, i0, i1, i2, C, C2, P, N,
                                S0, S1, S2)
        # the read's volume gradient: g_read (x) interpolation weights
        w_read = _tent_weight(i2, low2, fr2)
        if N >= 2:
            w_read = w_read * _tent_weight(i1, low1, fr1)
        if N >= 3:
            w_read = w_read * _tent_weight(i0, low0, fr0)
        d_h += g_read[:, None] * w_read[None, :]
        tl.store(gh_ptr + at, d_h, mask=mask)
        # the write: d_content, and the weighted moments for d_mu, d_sigma
        d_x = tl.where(mask, d_x, 0.0)
        d_content += tl.sum(d_x * w[None, :], axis=1)
        weighted = tl.sum(d_x * content[:, None], axis=0) * w
        gw2, off2 = _gauss(i2, mu2, denom, rs, S2, HAS_RADIUS)
        s_mu2 += tl.sum(weighted * off2, axis=0)
        s_m2 += tl.sum(weighted * off2 * off2, axis=0)
        if N >= 2:
            gw1, off1 = _gauss(i1, mu1, denom, rs, S1, HAS_RADIUS)
            s_mu1 += tl.sum(weighted * off1, axis=0)
            s_m2 += tl.sum(weighted * off1 * off1, axis=0)
        if N >= 3:
            gw0, off0 = _gauss(i0, mu0, denom, rs, S0, HAS_RADIUS)
            s_mu0 += tl.sum(weighted * off0, axis=0)
            s_m2 += tl.sum(weighted * off0 * off0, axis=0)
    width = C + 4
    out = write_part + (bt * programs + pid) * width
    tl.store(out + offs_c, d_content, mask=mask_c)
    tl.store(out + C, s_mu0)
    tl.store(out + C + 1, s_mu1)
    tl.store(out + C + 2, s_mu2)
    tl.store(out + C + 3, s_m2)
    if pid == 0:
        _read_coord_grad(h_ptr + row, rc_ptr + bt * N, g_read, d_rc + bt * N, offs_c, mask_c,
                         N, S0, S1, S2)


@triton.jit
def _read_coord_grad(h_row, rc, g_read, out, offs_c, mask_c, N: tl.constexpr,
                     S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """``d read / d coords`` contracted with ``g_read`` (C,), stored per component."""
    l0, _, fr0, in0, l1, _, fr1, in1, l2, _, fr2, in2 = _read_tents(
        coord(rc, 0, N), coord(rc, 1, N), coord(rc, 2, N), S0, S1, S2)
    # d weight / d coordinate: -+ (S - 1) / 2 at the lower / upper corner, 0 when clamped
    slope0 = in0.to(fr0.dtype) * ((S0 - 1) * 0.5)
    slope1 = in1.to(fr1.dtype) * ((S1 - 1) * 0.5)
    slope2 = in2.to(fr2.dtype) * ((S2 - 1) * 0.5)
    a0 = tl.sum(g_read * 0.0, axis=0)
    a1 = a0
    a2 = a0
    for e0 in tl.static_range(2):
        for e1 in tl.static_range(2):
            for e2 in tl.static_range(2):
                if (e0 == 0 or S0 > 1) and (e1 == 0 or S1 > 1) and (e2 == 0 or S2 > 1):
                    hv = _corner_value(h_row, offs_c, mask_c, l0, l1, l2, e0, e1, e2, S0, S1, S2)
                    gh = tl.sum(g_read * hv, axis=0)
                    w0, s0 = corner(e0, fr0, slope0)
                    w1, s1 = corner(e1, fr1, slope1)
                    w2, s2 = corner(e2, fr2, slope2)
                    a0 += gh * s0 * w1 * w2
                    a1 += gh * w0 * s1 * w2
                    a2 += gh * w0 * w1 * s2
    store_coord_grad(out, a0, a1, a2, N)
