"""The ``@triton.jit`` parts of the fused cell both kernel modules assemble, on tiles of ``BP``
cells of a grid (or box) padded to three axes and all ``C`` channels (``CB``, masked by
``mask_c``); ``i0, i1, i2``: the tile's cell indices per axis. Each part computes in the
order the kernels did before they shared it, so results do not depend on the kernel module.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["sigmoid", "tanh", "coord", "taps", "bias_field", "gather", "mix", "cells",
           "gates_fwd", "gate_activations", "gate_vjp", "pointwise_vjp", "add_param_sums",
           "stencil_vjp", "corner", "store_coord_grad"]


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    """tanh without cancellation near 0 (odd Taylor series below 0.05, else via exp)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0.0, -big, big)
    x2 = x * x
    poly = 21844.0 / 6081075.0
    poly = poly * x2 - 1382.0 / 155925.0
    poly = poly * x2 + 62.0 / 2835.0
    poly = poly * x2 - 17.0 / 315.0
    poly = poly * x2 + 2.0 / 15.0
    poly = poly * x2 - 1.0 / 3.0
    small = x + x * x2 * poly
    return tl.where(ax < 0.05, small, big)


@triton.jit
def coord(ptr, A: tl.constexpr, N: tl.constexpr):
    """Coordinate component addressing padded axis ``A`` (component ``2 - A``)."""
    if A >= 3 - N:
        v = tl.load(ptr + (2 - A))
    else:
        v = tl.load(ptr) * 0.0  # a padded axis: unused
    return v


@triton.jit
def taps(dw_ptr, A: tl.constexpr, N: tl.constexpr, base, offs_c, mask_c, C2):
    """Taps ``(prev, centre, next)`` of padded axis ``A`` for channels ``base + offs_c``."""
    a = A - (3 - N)
    row = (a * C2 + base + offs_c) * 3
    t0 = tl.load(dw_ptr + row, mask=mask_c, other=0.0)
    t1 = tl.load(dw_ptr + row + 1, mask=mask_c, other=0.0)
    t2 = tl.load(dw_ptr + row + 2, mask=mask_c, other=0.0)
    return t0, t1, t2


@triton.jit
def _bias(db_ptr, A: tl.constexpr, N: tl.constexpr, base, offs_c, mask_c, C2):
    a = A - (3 - N)
    return tl.load(db_ptr + a * C2 + base + offs_c, mask=mask_c, other=0.0)


@triton.jit
def _tap_sums(i, t0, t1, t2, S: tl.constexpr):
    """``V = sum_k t_k [cell i + k - 1 inside]``: ``(CB, BP)``."""
    V = t1[:, None] + (i * 0).to(t1.dtype)[None, :]
    if S > 1:
        has_prev = (i > 0).to(t1.dtype)
        has_next = (i < S - 1).to(t1.dtype)
        V += t0[:, None] * has_prev[None, :] + t2[:, None] * has_next[None, :]
    return V


@triton.jit
def bias_field(dw_ptr, db_ptr, base, i0, i1, i2, offs_c, mask_c, C2, N: tl.constexpr,
                S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """The per-pass biases of channels ``base + offs_c`` carried through the later passes,
    ``((b_0 V_1 + b_1) V_2 + b_2)`` ``(CB, BP)``; each ``V`` made just before its use."""
    t0, t1, t2 = taps(dw_ptr, 2, N, base, offs_c, mask_c, C2)
    last = _bias(db_ptr, 2, N, base, offs_c, mask_c, C2)
    if N == 1:
        field = last[:, None] + (i2 * 0).to(t1.dtype)[None, :]
    else:
        if N == 3:
            field = _bias(db_ptr, 0, N, base, offs_c, mask_c, C2)[:, None] + \
                (i1 * 0).to(t1.dtype)[None, :]
            u0, u1, u2 = taps(dw_ptr, 1, N, base, offs_c, mask_c, C2)
            field = field * _tap_sums(i1, u0, u1, u2, S1) + \
                _bias(db_ptr, 1, N, base, offs_c, mask_c, C2)[:, None]
        else:
            field = _bias(db_ptr, 1, N, base, offs_c, mask_c, C2)[:, None] + \
                (i1 * 0).to(t1.dtype)[None, :]
        field = field * _tap_sums(i2, t0, t1, t2, S2) + last[:, None]
    return field


@triton.jit
def gather(row, dw_ptr, half, offs_c, mask_c, i0, i1, i2, offs_p, acc, C, N: tl.constexpr,
           S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """``acc`` plus the 3^n stencil ``sum_d K[d] u[p + d]`` (CB, BP) of one half of ``u``
    (``half`` 0: ``x``, ``C``: ``h``; ``row``: its channel 0), 0 outside the grid. Runtime
    loops (an unrolled 27-way body compiles for minutes); taps inline (a helper call costs
    ~10 ms interpreted)."""
    C2 = 2 * C
    P: tl.constexpr = S0 * S1 * S2
    LO0: tl.constexpr = 0 if S0 > 1 else 1
    HI0: tl.constexpr = 3 if S0 > 1 else 2
    LO1: tl.constexpr = 0 if S1 > 1 else 1
    HI1: tl.constexpr = 3 if S1 > 1 else 2
    LO2: tl.constexpr = 0 if S2 > 1 else 1
    HI2: tl.constexpr = 3 if S2 > 1 else 2
    one = (offs_c * 0 + 1).to(acc.dtype)
    for d0 in range(LO0, HI0):
        if N >= 3:
            k0 = tl.load(dw_ptr + (half + offs_c) * 3 + d0, mask=mask_c, other=0.0)
        else:
            k0 = one
        for d1 in range(LO1, HI1):
            if N >= 2:
                k01 = k0 * tl.load(dw_ptr + ((N - 2) * C2 + half + offs_c) * 3 + d1,
                                   mask=mask_c, other=0.0)
            else:
                k01 = k0
            for d2 in range(LO2, HI2):
                k = k01 * tl.load(dw_ptr + ((N - 1) * C2 + half + offs_c) * 3 + d2,
                                  mask=mask_c, other=0.0)
                j0 = i0 + (d0 - 1)
                j1 = i1 + (d1 - 1)
                j2 = i2 + (d2 - 1)
                valid = ((j0 >= 0) & (j0 < S0) & (j1 >= 0) & (j1 < S1) & (j2 >= 0)
                         & (j2 < S2) & (offs_p < P))
                q = offs_p + ((d0 - 1) * (S1 * S2) + (d1 - 1) * S2 + (d2 - 1))
                u = tl.load(row + offs_c[:, None] * P + q[None, :],
                            mask=mask_c[:, None] & valid[None, :], other=0.0)
                acc += k[:, None] * u
    return acc


@triton.jit
def _weight(pw_ptr, q: tl.constexpr, half: tl.constexpr, offs_c, mask_c, C):
    """``W[q C + r, half C + k]`` as a ``(CB, CB)`` tile (rows r, columns k)."""
    rows = q * C + offs_c
    cols = half * C + offs_c
    return tl.load(pw_ptr + rows[:, None] * (2 * C) + cols[None, :],
                   mask=mask_c[:, None] & mask_c[None, :], other=0.0)


@triton.jit
def mix(y_x, y_h, pw_ptr, pb_ptr, q: tl.constexpr, offs_c, mask_c, C,
         PRECISION: tl.constexpr):
    """Gate quarter ``q`` of ``z = W concat(y_x, y_h) + b``: ``(CB, BP)``."""
    z = tl.dot(_weight(pw_ptr, q, 0, offs_c, mask_c, C), y_x, input_precision=PRECISION)
    z += tl.dot(_weight(pw_ptr, q, 1, offs_c, mask_c, C), y_h, input_precision=PRECISION)
    bias = tl.load(pb_ptr + q * C + offs_c, mask=mask_c, other=0.0)
    return z + bias[:, None]


@triton.jit
def cells(tile, BP: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """Tile ``tile`` of the grid (or box): ``(offs_p, i0, i1, i2, mask_p)``, its cells (BP,), their
    index per axis and which are inside."""
    offs_p = tile * BP + tl.arange(0, BP)
    i0 = offs_p // (S1 * S2)
    i1 = (offs_p // S2) % S1
    i2 = offs_p % S2
    return offs_p, i0, i1, i2, offs_p < S0 * S1 * S2


@triton.jit
def gates_fwd(y_x, y_h, c_at, mask, pw_ptr, pb_ptr, offs_c, mask_c, C,
              PRECISION: tl.constexpr):
    """``(h', c')`` (CB, BP) of the gates on ``(y_x, y_h)``, ``c`` loaded from ``c_at``: one gate
    quarter at a time, each consumed at once (fewer live tiles)."""
    c_new = sigmoid(mix(y_x, y_h, pw_ptr, pb_ptr, 1, offs_c, mask_c, C, PRECISION)) \
        * tl.load(c_at, mask=mask, other=0.0)
    c_new += sigmoid(mix(y_x, y_h, pw_ptr, pb_ptr, 0, offs_c, mask_c, C, PRECISION)) \
        * tanh(mix(y_x, y_h, pw_ptr, pb_ptr, 3, offs_c, mask_c, C, PRECISION))
    h_new = sigmoid(mix(y_x, y_h, pw_ptr, pb_ptr, 2, offs_c, mask_c, C, PRECISION)) \
        * tanh(c_new)
    return h_new, c_new


@triton.jit
def gate_activations(y_x, y_h, pw_ptr, pb_ptr, offs_c, mask_c, C, PRECISION: tl.constexpr):
    """The gates ``(s_i, s_f, s_o, tanh(g))`` (CB, BP) on the depthwise output."""
    s_i = sigmoid(mix(y_x, y_h, pw_ptr, pb_ptr, 0, offs_c, mask_c, C, PRECISION))
    s_f = sigmoid(mix(y_x, y_h, pw_ptr, pb_ptr, 1, offs_c, mask_c, C, PRECISION))
    s_o = sigmoid(mix(y_x, y_h, pw_ptr, pb_ptr, 2, offs_c, mask_c, C, PRECISION))
    t_g = tanh(mix(y_x, y_h, pw_ptr, pb_ptr, 3, offs_c, mask_c, C, PRECISION))
    return s_i, s_f, s_o, t_g


@triton.jit
def gate_vjp(s_i, s_f, s_o, t_g, c, g_h, g_c, mask):
    """The gates' VJP for ``g_h, g_c``: ``(d_c, dz_i, dz_f, dz_o, dz_g)`` (CB, BP), 0 outside
    ``mask``."""
    tanh_c = tanh(s_f * c + s_i * t_g)
    d_cn = g_c + g_h * s_o * (1.0 - tanh_c * tanh_c)
    dz_i = tl.where(mask, d_cn * t_g * (s_i - s_i * s_i), 0.0)
    dz_f = tl.where(mask, d_cn * c * (s_f - s_f * s_f), 0.0)
    dz_o = tl.where(mask, g_h * tanh_c * (s_o - s_o * s_o), 0.0)
    dz_g = tl.where(mask, d_cn * s_i * (1.0 - t_g * t_g), 0.0)
    return d_cn * s_f, dz_i, dz_f, dz_o, dz_g


@triton.jit
def _pointwise_half_vjp(pw_ptr, half: tl.constexpr, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c,
                        C, PRECISION: tl.constexpr):
    """One half (``half`` 0: ``x``, 1: ``h``) of ``d_y = W^T d_z``, ``(CB, BP)``, over the four gate
    quarters of ``W (4C, 2C)``."""
    d_y = tl.dot(tl.trans(_weight(pw_ptr, 0, half, offs_c, mask_c, C)), dz_i,
                 input_precision=PRECISION)
    d_y += tl.dot(tl.trans(_weight(pw_ptr, 1, half, offs_c, mask_c, C)), dz_f,
                  input_precision=PRECISION)
    d_y += tl.dot(tl.trans(_weight(pw_ptr, 2, half, offs_c, mask_c, C)), dz_o,
                  input_precision=PRECISION)
    d_y += tl.dot(tl.trans(_weight(pw_ptr, 3, half, offs_c, mask_c, C)), dz_g,
                  input_precision=PRECISION)
    return d_y


@triton.jit
def pointwise_vjp(pw_ptr, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                   PRECISION: tl.constexpr):
    """``d_y = W^T d_z`` per half: ``(dy_x, dy_h)`` (CB, BP), ``W (4C, 2C)``."""
    dy_x = _pointwise_half_vjp(pw_ptr, 0, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                               PRECISION)
    dy_h = _pointwise_half_vjp(pw_ptr, 1, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                               PRECISION)
    return dy_x, dy_h


@triton.jit
def add_param_sums(dpw_part, dpb_part, e_part, slot, y_x, y_h, dz_i, dz_f, dz_o, dz_g, dy_x,
                   dy_h, i0, i1, i2, offs_c, mask_c, C, S0: tl.constexpr, S1: tl.constexpr,
                   S2: tl.constexpr, PRECISION: tl.constexpr):
    """Add the tile's terms into row ``slot``: ``dpw (slots, 4C, 2C) += d_z y^T`` (tile by tile:
    eight (C, C) register accumulators would spill), ``e (slots, 2C, 27) += d_y`` per bias
    class, ``dpb (slots, 4C) += d_z``."""
    _add_w(dpw_part, slot, 0, dz_i, y_x, y_h, offs_c, mask_c, C, PRECISION)
    _add_w(dpw_part, slot, 1, dz_f, y_x, y_h, offs_c, mask_c, C, PRECISION)
    _add_w(dpw_part, slot, 2, dz_o, y_x, y_h, offs_c, mask_c, C, PRECISION)
    _add_w(dpw_part, slot, 3, dz_g, y_x, y_h, offs_c, mask_c, C, PRECISION)
    # bias class per axis: 0 = first cell, 1 = interior, 2 = last (S > 1)
    k0 = tl.where(i0 == 0, 0, tl.where(i0 == S0 - 1, 2, 1))
    k1 = tl.where(i1 == 0, 0, tl.where(i1 == S1 - 1, 2, 1))
    k2 = tl.where(i2 == 0, 0, tl.where(i2 == S2 - 1, 2, 1))
    _add_bias_classes(e_part, slot, dy_x, dy_h, k0, k1, k2, offs_c, mask_c, C, S0, S1, S2)
    _add_b(dpb_part, slot, 0, tl.sum(dz_i, axis=1), offs_c, mask_c, C)
    _add_b(dpb_part, slot, 1, tl.sum(dz_f, axis=1), offs_c, mask_c, C)
    _add_b(dpb_part, slot, 2, tl.sum(dz_o, axis=1), offs_c, mask_c, C)
    _add_b(dpb_part, slot, 3, tl.sum(dz_g, axis=1), offs_c, mask_c, C)


@triton.jit
def _add_w(part, slot, q: tl.constexpr, d_z, y_x, y_h, offs_c, mask_c, C,
           PRECISION: tl.constexpr):
    """Slot ``(4C, 2C)`` rows of quarter ``q`` += ``d_z y^T`` for both halves."""
    rows = q * C + offs_c
    base = part + slot * 8 * C * C + rows[:, None] * (2 * C)
    mask = mask_c[:, None] & mask_c[None, :]
    at_x = base + offs_c[None, :]
    tl.store(at_x, tl.load(at_x, mask=mask, other=0.0)
             + tl.dot(d_z, tl.trans(y_x), input_precision=PRECISION), mask=mask)
    at_h = base + C + offs_c[None, :]
    tl.store(at_h, tl.load(at_h, mask=mask, other=0.0)
             + tl.dot(d_z, tl.trans(y_h), input_precision=PRECISION), mask=mask)


@triton.jit
def _add_b(part, slot, q: tl.constexpr, d, offs_c, mask_c, C):
    at = part + slot * 4 * C + q * C + offs_c
    tl.store(at, tl.load(at, mask=mask_c, other=0.0) + d, mask=mask_c)


@triton.jit
def _add_bias_classes(e_part, slot, dy_x, dy_h, k0, k1, k2, offs_c, mask_c, C,
                      S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """Add the tile's ``d_y`` (CB, BP) per border class (``k_a``: 0 first cell, 2 last, 1 inside)
    into ``e_part``'s row ``slot``, 27 per channel: what the bias gradients are made of."""
    MH0: tl.constexpr = 1 if S0 == 1 else 3
    MS0: tl.constexpr = 2 if S0 == 2 else 1
    MH1: tl.constexpr = 1 if S1 == 1 else 3
    MS1: tl.constexpr = 2 if S1 == 2 else 1
    MH2: tl.constexpr = 1 if S2 == 1 else 3
    MS2: tl.constexpr = 2 if S2 == 2 else 1
    for m0 in range(0, MH0, MS0):
        for m1 in range(0, MH1, MS1):
            for m2 in range(0, MH2, MS2):
                sel = ((k0 == m0) & (k1 == m1) & (k2 == m2)).to(dy_x.dtype)
                e_at = e_part + (slot * 2 * C + offs_c) * 27 + (m0 * 9 + m1 * 3 + m2)
                ex = tl.load(e_at, mask=mask_c, other=0.0)
                tl.store(e_at, ex + tl.sum(dy_x * sel[None, :], axis=1), mask=mask_c)
                eh = tl.load(e_at + C * 27, mask=mask_c, other=0.0)
                tl.store(e_at + C * 27, eh + tl.sum(dy_h * sel[None, :], axis=1),
                         mask=mask_c)


@triton.jit
def stencil_vjp(dy_ptr, dy_row, dw_ptr, corr_ptr, slot, x_own, h_own, offs_c, mask_c,
                 offs_p, mask_p, i0, i1, i2, C, C2, P, N: tl.constexpr, S0: tl.constexpr,
                 S1: tl.constexpr, S2: tl.constexpr):
    """The transposed stencil at a tile: ``(d_h, d_x)`` (CB, BP) from ``d_y`` (rows ``dy_row +
    [0, 2C)`` of ``dy_ptr``), and the tile's tap correlations (input ``x_own, h_own``) added
    into ``corr_ptr``'s row ``slot``."""
    LO0: tl.constexpr = 0 if S0 > 1 else 1
    HI0: tl.constexpr = 3 if S0 > 1 else 2
    LO1: tl.constexpr = 0 if S1 > 1 else 1
    HI1: tl.constexpr = 3 if S1 > 1 else 2
    LO2: tl.constexpr = 0 if S2 > 1 else 1
    HI2: tl.constexpr = 3 if S2 > 1 else 2
    one = (offs_c * 0 + 1).to(h_own.dtype)
    d_h = tl.zeros_like(h_own)
    d_x = tl.zeros_like(h_own)
    for d0 in range(LO0, HI0):
        if N >= 3:
            kh0 = tl.load(dw_ptr + (C + offs_c) * 3 + d0, mask=mask_c, other=0.0)
            kx0 = tl.load(dw_ptr + offs_c * 3 + d0, mask=mask_c, other=0.0)
        else:
            kh0 = one
            kx0 = one
        for d1 in range(LO1, HI1):
            if N >= 2:
                at1 = dw_ptr + ((N - 2) * C2 + offs_c) * 3 + d1
                kh01 = kh0 * tl.load(at1 + 3 * C, mask=mask_c, other=0.0)
                kx01 = kx0 * tl.load(at1, mask=mask_c, other=0.0)
            else:
                kh01 = kh0
                kx01 = kx0
            for d2 in range(LO2, HI2):
                at2 = dw_ptr + ((N - 1) * C2 + offs_c) * 3 + d2
                k_h = kh01 * tl.load(at2 + 3 * C, mask=mask_c, other=0.0)
                k_x = kx01 * tl.load(at2, mask=mask_c, other=0.0)
                j0 = i0 - (d0 - 1)
                j1 = i1 - (d1 - 1)
                j2 = i2 - (d2 - 1)
                valid = ((j0 >= 0) & (j0 < S0) & (j1 >= 0) & (j1 < S1) & (j2 >= 0)
                         & (j2 < S2) & mask_p)
                src = offs_p - ((d0 - 1) * (S1 * S2) + (d1 - 1) * S2 + (d2 - 1))
                m = mask_c[:, None] & valid[None, :]
                g_x = tl.load(dy_ptr + dy_row + offs_c[:, None] * P + src[None, :],
                              mask=m, other=0.0)
                g_hh = tl.load(dy_ptr + dy_row + (C + offs_c[:, None]) * P + src[None, :],
                               mask=m, other=0.0)
                d_h += k_h[:, None] * g_hh
                d_x += k_x[:, None] * g_x
                c_at = corr_ptr + (slot * C2 + offs_c) * 27 + (d0 * 9 + d1 * 3 + d2)
                cx = tl.load(c_at, mask=mask_c, other=0.0)
                tl.store(c_at, cx + tl.sum(g_x * x_own, axis=1), mask=mask_c)
                ch = tl.load(c_at + C * 27, mask=mask_c, other=0.0)
                tl.store(c_at + C * 27, ch + tl.sum(g_hh * h_own, axis=1), mask=mask_c)
    return d_h, d_x


@triton.jit
def corner(e: tl.constexpr, frac, slope):
    """Weight and slope of corner ``e`` (0 lower, 1 upper) along one axis."""
    if e == 0:
        w = 1.0 - frac
        s = -slope
    else:
        w = frac
        s = slope
    return w, s


@triton.jit
def store_coord_grad(out, a0, a1, a2, N: tl.constexpr):
    """Store a read's coordinate gradient, ``a_k`` the one of padded axis ``k``."""
    tl.store(out + 0, a2)  # component 0 addresses the last axis
    if N >= 2:
        tl.store(out + 1, a1)
    if N >= 3:
        tl.store(out + 2, a0)
