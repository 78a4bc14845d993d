"""Triton kernels of the fused chunk step: one launch forward, two backward.

Imported only by :mod:`tmcore.backends._triton` (and only when ``triton``
imports). Every kernel sees the state as ``(B, C, P)`` with the grid padded to
three axes ``S0 x S1 x S2`` (``n = 1``: ``1 x 1 x S``, ``n = 2``: ``1 x S0 x
S1``; a padded axis has no taps, no coordinate and a write profile of 1).
Grid of every kernel: ``(B, G)``; program ``(b, g)`` handles batch element
``b`` and the cell tiles ``g, g + G, ...`` of ``BP`` cells, all ``C``
channels at once (``CB`` = ``C`` rounded up to a power of two >= 16, masked).

Math (docs/guides/conventions.md, docs/LAYER.md; ``u = concat(x, h)``, ``x`` the written volume):

- the ``n`` depthwise passes compose into one 3^n stencil per channel,
  ``y[p] = sum_d K[d] u[p + d] + Bias(p)`` with ``K[d] = prod_a taps_a[d_a]``
  and ``Bias`` the per-pass biases carried through the later passes
  (``Bias = (b_0 V_1 + b_1) V_2 + b_2``, ``V_a`` the sum of the taps that see
  a cell inside the grid). The ``h`` half gathers its 3^n neighbours; the
  ``x`` half is separable (``x = content * prod_a g_a``), so its stencil is a
  product of three 3-tap sums of the Gaussian profiles: the write volume and
  ``concat`` are never in memory.
- ``z = W y + b`` as eight ``tl.dot`` (four gate quarters x two halves),
  then the LSTM gates in registers; ``h', c'`` stored, and the step's read
  (of the state entering the step) by the first program of each batch row.
- backward A: recompute ``y, z``, gate VJP, ``d_c`` (in place over ``g_c``),
  ``d_y = W^T d_z`` (stored for B), the pointwise weight / bias gradients
  and the bias-class sums (below) accumulated in per-program slots;
- backward B: ``d_u[q] = sum_d K[d] d_y[q - d]`` (the transposed stencil;
  gathers), plus the read's volume gradient, stored as the new ``g_h``; the
  stencil correlation ``sum_q d_y[q - d] u[q]`` (-> tap gradients); the
  write's content / centre / spread partial sums of this step; the read
  coordinate gradient (first program of each row).

The step index ``t``, ``T`` and ``C`` are not specialized on (Triton would otherwise
compile new variants for ``t == 1`` and ``t % 16 == 0``). Tap and bias gradients are
finished once per scan from the per-program
sums (``corr`` and the bias classes ``E``: every bias term depends on a cell
only through whether it is first / interior / last along each axis, so 27
class sums per channel carry everything). No atomics: each program owns its
accumulator slot and steps are sequential launches, so results are
deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["step_fwd_kernel", "step_bwd_a_kernel", "step_bwd_b_kernel"]


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
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
def _coord(ptr, A: tl.constexpr, N: tl.constexpr):
    """Coordinate component addressing padded axis ``A`` (component ``2 - A``)."""
    if A >= 3 - N:
        v = tl.load(ptr + (2 - A))
    else:
        v = tl.load(ptr) * 0.0  # a padded axis: unused
    return v


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
def _taps(dw_ptr, A: tl.constexpr, N: tl.constexpr, base, offs_c, mask_c, C2):
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
def _x_axis(i, mu, denom, rs, t0, t1, t2, S: tl.constexpr, HAS_RADIUS: tl.constexpr):
    """One axis of the ``x`` half: ``G = sum_k t_k g(i + k - 1)`` over cells inside,
    ``(CB, BP)``, ``g`` the axis's Gaussian profile."""
    g_mid, off = _gauss(i, mu, denom, rs, S, HAS_RADIUS)
    G = t1[:, None] * g_mid[None, :]
    if S > 1:
        g_prev, off_prev = _gauss(i - 1, mu, denom, rs, S, HAS_RADIUS)
        g_next, off_next = _gauss(i + 1, mu, denom, rs, S, HAS_RADIUS)
        G += t0[:, None] * tl.where(i > 0, g_prev, 0.0)[None, :]
        G += t2[:, None] * tl.where(i < S - 1, g_next, 0.0)[None, :]
    return G


@triton.jit
def _bias_field(dw_ptr, db_ptr, base, i0, i1, i2, offs_c, mask_c, C2, N: tl.constexpr,
                S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """The per-pass biases of channels ``base + offs_c`` carried through the later passes
    (first real axis first): ``((b_0 V_1 + b_1) V_2 + b_2)``, ``(CB, BP)``. Each tap sum
    ``V`` is made just before it is used (fewer live tiles, fewer registers)."""
    t0, t1, t2 = _taps(dw_ptr, 2, N, base, offs_c, mask_c, C2)
    last = _bias(db_ptr, 2, N, base, offs_c, mask_c, C2)
    if N == 1:
        field = last[:, None] + (i2 * 0).to(t1.dtype)[None, :]
    else:
        if N == 3:
            field = _bias(db_ptr, 0, N, base, offs_c, mask_c, C2)[:, None] + \
                (i1 * 0).to(t1.dtype)[None, :]
            u0, u1, u2 = _taps(dw_ptr, 1, N, base, offs_c, mask_c, C2)
            field = field * _tap_sums(i1, u0, u1, u2, S1) + \
                _bias(db_ptr, 1, N, base, offs_c, mask_c, C2)[:, None]
        else:
            field = _bias(db_ptr, 1, N, base, offs_c, mask_c, C2)[:, None] + \
                (i1 * 0).to(t1.dtype)[None, :]
        field = field * _tap_sums(i2, t0, t1, t2, S2) + last[:, None]
    return field


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
    """The depthwise output ``(y_x, y_h)``, each ``(CB, BP)``, at the tile's cells.

    ``h_row`` points at ``h[b, 0, 0]``; rows ``>= C`` come out 0.
    """
    C2 = 2 * C
    P: tl.constexpr = S0 * S1 * S2
    # ---- x half: separable
    tx0, tx1, tx2 = _taps(dw_ptr, 2, N, 0, offs_c, mask_c, C2)
    G = _x_axis(i2, mu2, denom, rs, tx0, tx1, tx2, S2, HAS_RADIUS)
    if N >= 2:
        ty0, ty1, ty2 = _taps(dw_ptr, 1, N, 0, offs_c, mask_c, C2)
        G = G * _x_axis(i1, mu1, denom, rs, ty0, ty1, ty2, S1, HAS_RADIUS)
    if N >= 3:
        tz0, tz1, tz2 = _taps(dw_ptr, 0, N, 0, offs_c, mask_c, C2)
        G = G * _x_axis(i0, mu0, denom, rs, tz0, tz1, tz2, S0, HAS_RADIUS)
    y_x = content[:, None] * G + _bias_field(dw_ptr, db_ptr, 0, i0, i1, i2, offs_c, mask_c,
                                             C2, N, S0, S1, S2)
    # ---- h half: 3^n gathers (runtime loops: an unrolled 27-way body compiles for minutes)
    LO0: tl.constexpr = 0 if S0 > 1 else 1
    HI0: tl.constexpr = 3 if S0 > 1 else 2
    LO1: tl.constexpr = 0 if S1 > 1 else 1
    HI1: tl.constexpr = 3 if S1 > 1 else 2
    LO2: tl.constexpr = 0 if S2 > 1 else 1
    HI2: tl.constexpr = 3 if S2 > 1 else 2
    y_h = tl.zeros_like(G)
    one = (offs_c * 0 + 1).to(G.dtype)
    # taps inline (not through a helper: each helper call costs ~10 ms in the interpreter)
    for d0 in range(LO0, HI0):
        if N >= 3:
            k0 = tl.load(dw_ptr + (C + offs_c) * 3 + d0, mask=mask_c, other=0.0)
        else:
            k0 = one
        for d1 in range(LO1, HI1):
            if N >= 2:
                k01 = k0 * tl.load(dw_ptr + ((N - 2) * C2 + C + offs_c) * 3 + d1, mask=mask_c,
                                   other=0.0)
            else:
                k01 = k0
            for d2 in range(LO2, HI2):
                k = k01 * tl.load(dw_ptr + ((N - 1) * C2 + C + offs_c) * 3 + d2, mask=mask_c,
                                  other=0.0)
                j0 = i0 + (d0 - 1)
                j1 = i1 + (d1 - 1)
                j2 = i2 + (d2 - 1)
                valid = ((j0 >= 0) & (j0 < S0) & (j1 >= 0) & (j1 < S1) & (j2 >= 0)
                         & (j2 < S2) & (offs_p < P))
                q = offs_p + ((d0 - 1) * (S1 * S2) + (d1 - 1) * S2 + (d2 - 1))
                u = tl.load(h_row + offs_c[:, None] * P + q[None, :],
                            mask=mask_c[:, None] & valid[None, :], other=0.0)
                y_h += k[:, None] * u
    y_h += _bias_field(dw_ptr, db_ptr, C, i0, i1, i2, offs_c, mask_c, C2, N, S0, S1, S2)
    row_ok = mask_c[:, None]
    return tl.where(row_ok, y_x, 0.0), tl.where(row_ok, y_h, 0.0)


@triton.jit
def _weight(pw_ptr, q: tl.constexpr, half: tl.constexpr, offs_c, mask_c, C):
    """``W[q C + r, half C + k]`` as a ``(CB, CB)`` tile (rows r, columns k)."""
    rows = q * C + offs_c
    cols = half * C + offs_c
    return tl.load(pw_ptr + rows[:, None] * (2 * C) + cols[None, :],
                   mask=mask_c[:, None] & mask_c[None, :], other=0.0)


@triton.jit
def _mix(y_x, y_h, pw_ptr, pb_ptr, q: tl.constexpr, offs_c, mask_c, C,
         PRECISION: tl.constexpr):
    """Gate quarter ``q`` of ``z = W concat(y_x, y_h) + b``: ``(CB, BP)``."""
    z = tl.dot(_weight(pw_ptr, q, 0, offs_c, mask_c, C), y_x, input_precision=PRECISION)
    z += tl.dot(_weight(pw_ptr, q, 1, offs_c, mask_c, C), y_h, input_precision=PRECISION)
    bias = tl.load(pb_ptr + q * C + offs_c, mask=mask_c, other=0.0)
    return z + bias[:, None]


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
def _cells(tile, BP: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    offs_p = tile * BP + tl.arange(0, BP)
    return offs_p, offs_p // (S1 * S2), (offs_p // S2) % S1, offs_p % S2


@triton.jit
def _write_params(wcont_ptr, ws_ptr, wc_ptr, bt, offs_c, mask_c, C, eps, radius,
                  N: tl.constexpr):
    """Step ``bt``'s write: content ``(CB,)``, sigma, ``2 sigma^2 + eps``, the truncation
    radius ``radius * sigma`` and the centre ``mu0, mu1, mu2`` (coordinate order)."""
    content = tl.load(wcont_ptr + bt * C + offs_c, mask=mask_c, other=0.0)
    sigma = tl.load(ws_ptr + bt)
    mu0 = _coord(wc_ptr + bt * N, 0, N)
    mu1 = _coord(wc_ptr + bt * N, 1, N)
    mu2 = _coord(wc_ptr + bt * N, 2, N)
    return content, sigma, 2.0 * sigma * sigma + eps, radius * sigma, mu0, mu1, mu2


@triton.jit(do_not_specialize=["t", "T", "C"])
def step_fwd_kernel(
    h_ptr, c_ptr, h_out, c_out, reads_ptr, rc_ptr, wc_ptr, ws_ptr, wcont_ptr,
    dw_ptr, db_ptr, pw_ptr, pb_ptr, t, T, C, eps, radius,
    N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    CB: tl.constexpr, BP: tl.constexpr, HAS_RADIUS: tl.constexpr, WRITE_READ: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One chunk step forward: ``h, c (B, C, P) -> h_out, c_out``; ``reads[b, t]``."""
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
    for tile in range(pid, TILES, programs):
        offs_p, i0, i1, i2 = _cells(tile, BP, S1, S2)
        mask_p = offs_p < P
        y_x, y_h = _conv_input(h_ptr + row, content, mu0, mu1, mu2, denom, rs, dw_ptr, db_ptr,
                               offs_c, mask_c, i0, i1, i2, offs_p, C, N, S0, S1, S2,
                               HAS_RADIUS)
        at = row + offs_c[:, None] * P + offs_p[None, :]
        mask = mask_c[:, None] & mask_p[None, :]
        # one gate quarter at a time, each consumed at once (fewer live tiles)
        c_new = _sigmoid(_mix(y_x, y_h, pw_ptr, pb_ptr, 1, offs_c, mask_c, C, PRECISION)) \
            * tl.load(c_ptr + at, mask=mask, other=0.0)
        c_new += _sigmoid(_mix(y_x, y_h, pw_ptr, pb_ptr, 0, offs_c, mask_c, C, PRECISION)) \
            * _tanh(_mix(y_x, y_h, pw_ptr, pb_ptr, 3, offs_c, mask_c, C, PRECISION))
        h_new = _sigmoid(_mix(y_x, y_h, pw_ptr, pb_ptr, 2, offs_c, mask_c, C, PRECISION)) \
            * _tanh(c_new)
        tl.store(c_out + at, c_new, mask=mask)
        tl.store(h_out + at, h_new, mask=mask)


@triton.jit
def _corner_loop_setup(rc, N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                       S2: tl.constexpr):
    x0 = _coord(rc, 0, N)
    x1 = _coord(rc, 1, N)
    x2 = _coord(rc, 2, N)
    l0, f0l, fr0, in0 = _tent(x0, S0)
    l1, f1l, fr1, in1 = _tent(x1, S1)
    l2, f2l, fr2, in2 = _tent(x2, S2)
    return l0, fr0, in0, l1, fr1, in1, l2, fr2, in2


@triton.jit
def _read(h_row, rc, out, offs_c, mask_c, N: tl.constexpr, S0: tl.constexpr,
          S1: tl.constexpr, S2: tl.constexpr):
    """``out[c] = sum over the 2^n corners of weight * h[c, corner]`` (border clamped)."""
    P: tl.constexpr = S0 * S1 * S2
    l0, fr0, in0, l1, fr1, in1, l2, fr2, in2 = _corner_loop_setup(rc, N, S0, S1, S2)
    acc = (offs_c * 0).to(fr2.dtype)
    for e0 in tl.static_range(2):
        for e1 in tl.static_range(2):
            for e2 in tl.static_range(2):
                if (e0 == 0 or S0 > 1) and (e1 == 0 or S1 > 1) and (e2 == 0 or S2 > 1):
                    if e0 == 0:
                        w = 1.0 - fr0
                    else:
                        w = fr0
                    if e1 == 0:
                        w = w * (1.0 - fr1)
                    else:
                        w = w * fr1
                    if e2 == 0:
                        w = w * (1.0 - fr2)
                    else:
                        w = w * fr2
                    j0 = offs_c * 0 + (l0 + e0)  # per-channel copies: masks are vectors
                    j1 = offs_c * 0 + (l1 + e1)
                    j2 = offs_c * 0 + (l2 + e2)
                    ok = (j0 < S0) & (j1 < S1) & (j2 < S2)
                    hv = tl.load(h_row + offs_c * P + (j0 * S1 * S2 + j1 * S2 + j2),
                                 mask=mask_c & ok, other=0.0)
                    acc += w * hv
    tl.store(out + offs_c, acc, mask=mask_c)


@triton.jit
def _add_bias_classes(e_part, slot, dy_x, dy_h, k0, k1, k2, offs_c, mask_c, C,
                      S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """Add the tile's ``d_y`` (CB, BP) per border class (``k_a``: 0 first cell, 2 last,
    1 inside, per axis) into ``e_part``'s row ``slot`` (27 per channel of
    ``concat(x, h)``): what the depthwise biases' gradients are made of."""
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
def _pointwise_half_vjp(pw_ptr, half: tl.constexpr, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c,
                        C, PRECISION: tl.constexpr):
    """One half (``half`` 0: ``x``, 1: ``h``) of ``d_y = W^T d_z``: ``(CB, BP)``, summed
    over the four gate quarters of the pointwise weight ``(4C, 2C)``."""
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
def _pointwise_vjp(pw_ptr, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                   PRECISION: tl.constexpr):
    """``d_y = W^T d_z`` per half: ``(dy_x, dy_h)`` (CB, BP) from the four gates'
    pre-activation cotangents (CB, BP) and the pointwise weight ``(4C, 2C)``."""
    dy_x = _pointwise_half_vjp(pw_ptr, 0, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                               PRECISION)
    dy_h = _pointwise_half_vjp(pw_ptr, 1, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                               PRECISION)
    return dy_x, dy_h


@triton.jit(do_not_specialize=["t", "T", "C"])
def step_bwd_a_kernel(
    h_ptr, c_ptr, gh_ptr, gc_ptr, dy_ptr, wcont_ptr, wc_ptr, ws_ptr,
    dw_ptr, db_ptr, pw_ptr, pb_ptr, dpw_part, dpb_part, e_part, t, T, C, eps, radius,
    N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    CB: tl.constexpr, BP: tl.constexpr, HAS_RADIUS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Backward A of step ``t``: gate VJP and pointwise VJP.

    Reads ``g_h, g_c`` (cotangents of ``h', c'``); writes ``d_c`` over ``g_c`` and
    ``d_y (B, 2C, P)``; adds to this program's slots of ``dpw_part (prog, 4C, 2C)``,
    ``dpb_part (prog, 4C)`` and ``e_part (prog, 2C, 27)`` (bias-class sums of ``d_y``).
    """
    b = tl.program_id(0)
    pid = tl.program_id(1)
    programs = tl.num_programs(1)
    slot = b * programs + pid
    P: tl.constexpr = S0 * S1 * S2
    TILES: tl.constexpr = (P + BP - 1) // BP
    # bias classes per axis (0 first, 1 interior, 2 last): S = 1 has only 0, S = 2 only 0, 2
    offs_c = tl.arange(0, CB)
    mask_c = offs_c < C
    row = b * C * P
    bt = b * T + t
    content, sigma, denom, rs, mu0, mu1, mu2 = _write_params(
        wcont_ptr, ws_ptr, wc_ptr, bt, offs_c, mask_c, C, eps, radius, N)
    for tile in range(pid, TILES, programs):
        offs_p, i0, i1, i2 = _cells(tile, BP, S1, S2)
        mask_p = offs_p < P
        y_x, y_h = _conv_input(h_ptr + row, content, mu0, mu1, mu2, denom, rs, dw_ptr, db_ptr,
                               offs_c, mask_c, i0, i1, i2, offs_p, C, N, S0, S1, S2,
                               HAS_RADIUS)
        y_x = tl.where(mask_p[None, :], y_x, 0.0)
        y_h = tl.where(mask_p[None, :], y_h, 0.0)
        s_i = _sigmoid(_mix(y_x, y_h, pw_ptr, pb_ptr, 0, offs_c, mask_c, C, PRECISION))
        s_f = _sigmoid(_mix(y_x, y_h, pw_ptr, pb_ptr, 1, offs_c, mask_c, C, PRECISION))
        s_o = _sigmoid(_mix(y_x, y_h, pw_ptr, pb_ptr, 2, offs_c, mask_c, C, PRECISION))
        t_g = _tanh(_mix(y_x, y_h, pw_ptr, pb_ptr, 3, offs_c, mask_c, C, PRECISION))
        at = row + offs_c[:, None] * P + offs_p[None, :]
        mask = mask_c[:, None] & mask_p[None, :]
        c = tl.load(c_ptr + at, mask=mask, other=0.0)
        g_h = tl.load(gh_ptr + at, mask=mask, other=0.0)
        g_c = tl.load(gc_ptr + at, mask=mask, other=0.0)
        tanh_c = _tanh(s_f * c + s_i * t_g)
        d_cn = g_c + g_h * s_o * (1.0 - tanh_c * tanh_c)
        dz_i = tl.where(mask, d_cn * t_g * (s_i - s_i * s_i), 0.0)
        dz_f = tl.where(mask, d_cn * c * (s_f - s_f * s_f), 0.0)
        dz_o = tl.where(mask, g_h * tanh_c * (s_o - s_o * s_o), 0.0)
        dz_g = tl.where(mask, d_cn * s_i * (1.0 - t_g * t_g), 0.0)
        tl.store(gc_ptr + at, d_cn * s_f, mask=mask)
        # d_y = W^T d_z, per half
        dy_x, dy_h = _pointwise_vjp(pw_ptr, dz_i, dz_f, dz_o, dz_g, offs_c, mask_c, C,
                                    PRECISION)
        dy_at = b * 2 * C * P + offs_c[:, None] * P + offs_p[None, :]
        tl.store(dy_ptr + dy_at, dy_x, mask=mask)
        tl.store(dy_ptr + dy_at + C * P, dy_h, mask=mask)
        # pointwise weight and bias gradients, added to this program's slot tile by tile
        # (register accumulators for the eight (C, C) blocks would spill)
        _add_w(dpw_part, slot, 0, dz_i, y_x, y_h, offs_c, mask_c, C, PRECISION)
        _add_w(dpw_part, slot, 1, dz_f, y_x, y_h, offs_c, mask_c, C, PRECISION)
        _add_w(dpw_part, slot, 2, dz_o, y_x, y_h, offs_c, mask_c, C, PRECISION)
        _add_w(dpw_part, slot, 3, dz_g, y_x, y_h, offs_c, mask_c, C, PRECISION)
        # bias-class sums: class per axis 0 = first cell, 1 = interior, 2 = last (S > 1)
        dy_x = tl.where(mask, dy_x, 0.0)
        dy_h = tl.where(mask, dy_h, 0.0)
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
def _stencil_vjp(dy_ptr, dy_row, dw_ptr, corr_ptr, slot, x_own, h_own, offs_c, mask_c,
                 offs_p, mask_p, i0, i1, i2, C, C2, P, N: tl.constexpr, S0: tl.constexpr,
                 S1: tl.constexpr, S2: tl.constexpr):
    """The transposed depthwise stencil at a tile of cells: ``(d_h, d_x)`` (CB, BP) from
    ``d_y`` (the stencil's output cotangent, rows ``dy_row + [0, 2C)`` of ``dy_ptr``), and
    the tap correlations of the tile added into ``corr_ptr``'s row ``slot`` (27 per
    channel of ``concat(x, h)``, the input ``x_own, h_own`` at the tile)."""
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


@triton.jit(do_not_specialize=["t", "T", "C"])
def step_bwd_b_kernel(
    h_ptr, gh_ptr, dy_ptr, g_reads, rc_ptr, wcont_ptr, wc_ptr, ws_ptr, dw_ptr,
    corr_part, write_part, d_rc, t, T, C, eps, radius,
    N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    CB: tl.constexpr, BP: tl.constexpr, HAS_RADIUS: tl.constexpr,
):
    """Backward B of step ``t``: transposed stencil and the write / read gradients.

    Writes ``d_h`` (conv path + read path) over ``g_h``; adds the stencil
    correlations to ``corr_part (prog, 2C, 27)``; stores this step's write partial
    sums in ``write_part[b, t, g] = (d_content (C), sum w s (p - mu)_A (3), sum w s
    |p - mu|^2)`` and the read coordinate gradient ``d_rc[b, t]``.
    """
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
    x0 = _coord(rc_ptr + bt * N, 0, N)
    x1 = _coord(rc_ptr + bt * N, 1, N)
    x2 = _coord(rc_ptr + bt * N, 2, N)
    li0, low0, fr0, in0 = _tent(x0, S0)
    li1, low1, fr1, in1 = _tent(x1, S1)
    li2, low2, fr2, in2 = _tent(x2, S2)
    zero_c = tl.zeros((CB,), dtype=content.dtype)
    d_content = zero_c
    s_mu0 = tl.sum(zero_c, axis=0)
    s_mu1 = s_mu0
    s_mu2 = s_mu0
    s_m2 = s_mu0
    for tile in range(pid, TILES, programs):
        offs_p, i0, i1, i2 = _cells(tile, BP, S1, S2)
        mask_p = offs_p < P
        mask = mask_c[:, None] & mask_p[None, :]
        at = row + offs_c[:, None] * P + offs_p[None, :]
        h_own = tl.load(h_ptr + at, mask=mask, other=0.0)
        w = _write_profile(i0, i1, i2, mu0, mu1, mu2, denom, rs, N, S0, S1, S2, HAS_RADIUS)
        w = tl.where(mask_p, w, 0.0)
        x_own = content[:, None] * w[None, :]
        d_h, d_x = _stencil_vjp(dy_ptr, dy_row, dw_ptr, corr_part, slot, x_own, h_own,
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
    P: tl.constexpr = S0 * S1 * S2
    l0, fr0, in0, l1, fr1, in1, l2, fr2, in2 = _corner_loop_setup(rc, N, S0, S1, S2)
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
                    j0 = offs_c * 0 + (l0 + e0)  # per-channel copies: masks are vectors
                    j1 = offs_c * 0 + (l1 + e1)
                    j2 = offs_c * 0 + (l2 + e2)
                    ok = (j0 < S0) & (j1 < S1) & (j2 < S2)
                    hv = tl.load(h_row + offs_c * P + (j0 * S1 * S2 + j1 * S2 + j2),
                                 mask=mask_c & ok, other=0.0)
                    gh = tl.sum(g_read * hv, axis=0)
                    if e0 == 0:
                        w0 = 1.0 - fr0
                        s0 = -slope0
                    else:
                        w0 = fr0
                        s0 = slope0
                    if e1 == 0:
                        w1 = 1.0 - fr1
                        s1 = -slope1
                    else:
                        w1 = fr1
                        s1 = slope1
                    if e2 == 0:
                        w2 = 1.0 - fr2
                        s2 = -slope2
                    else:
                        w2 = fr2
                        s2 = slope2
                    a0 += gh * s0 * w1 * w2
                    a1 += gh * w0 * s1 * w2
                    a2 += gh * w0 * w1 * s2
    tl.store(out + 0, a2)  # component 0 addresses the last axis
    if N >= 2:
        tl.store(out + 1, a1)
    if N >= 3:
        tl.store(out + 2, a0)

