"""Triton kernels of a decode token (the CPU's ``token_fwd`` in backends/native/token.inc), each
row at any slot of its chunk: one launch where no row completes its chunk, four where some
row does (against 9 to 32 torch operations on the layer's path):

- :func:`token_kernel`, program ``b`` per batch row: the norm, the token joining its row's
  chunk, the read coordinates and the read where the row's chunk starts, the read-out and
  the gated residual, the next ``read`` and ``count``;
- where a row completes its chunk, :func:`summary_kernel` (program ``(b, tile of outputs)``:
  ``write_proj`` over the row's chunk), :func:`heads_kernel` (program ``b``: the write's
  centre, content and sigma) and the scan's own ``step_fwd_kernel`` (one step; the other
  rows keep their state).

Products are sums of broadcast tiles (no ``tl.dot``: one row each). Rows of ``d`` values
are tiles of ``BD`` (``d`` rounded up to a power of two), weight tiles ``BT`` rows or
columns of ``d`` at a time; ``C`` channels of ``CB``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dense_kernels import read_at
from .parts import sigmoid, tanh

__all__ = ["token_kernel", "summary_kernel", "heads_kernel"]


@triton.jit
def _row_dot(w_ptr, v, offs_d, mask_d):
    """``sum_j w[j] v[j]`` over a row of ``d`` weights."""
    return tl.sum(tl.load(w_ptr + offs_d, mask=mask_d, other=0.0) * v, axis=0)


@triton.jit
def _coords(w_ptr, b_ptr, v, offs_d, mask_d, d, N: tl.constexpr):
    """``tanh(W v + b)`` of a ``coord_net`` ``(N, d)``, as the coordinates along the padded
    axes ``x0, x1, x2`` (component ``2 - A`` addresses axis ``A``; padded axes get 0)."""
    c0 = tanh(_row_dot(w_ptr, v, offs_d, mask_d) + tl.load(b_ptr))
    x0 = c0 * 0.0
    x1 = c0 * 0.0
    x2 = c0
    if N >= 2:
        x1 = tanh(_row_dot(w_ptr + d, v, offs_d, mask_d) + tl.load(b_ptr + 1))
    if N >= 3:
        x0 = tanh(_row_dot(w_ptr + 2 * d, v, offs_d, mask_d) + tl.load(b_ptr + 2))
    return x0, x1, x2


@triton.jit
def token_kernel(
    x_ptr, x_stride, pending_ptr, h_ptr, read_ptr, count_ptr,
    norm_w, norm_b, coord_w, coord_b, out_w, out_b, gate_ptr,
    y_ptr, pending_out, read_out, count_out, u_out, active_out,
    d, C, L, norm_eps,
    LAYER_NORM: tl.constexpr, NORM_W: tl.constexpr, NORM_B: tl.constexpr,
    RESIDUAL: tl.constexpr, N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
    S2: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
):
    """Row ``b``'s token: ``y (B, d)``, ``pending_out (B, L, d)`` (zeros where the chunk
    completes), ``read_out (B, C)``, ``count_out (B,)``, ``u_out (B, d)`` (the memory's input,
    the completing chunk's last token), ``active_out (B,)`` (int8: whether it completes)."""
    b = tl.program_id(0)
    P: tl.constexpr = S0 * S1 * S2
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < d
    offs_c = tl.arange(0, CB)
    mask_c = offs_c < C
    k = tl.load(count_ptr + b)
    complete = k == L - 1
    x = tl.load(x_ptr + b * x_stride + offs_d, mask=mask_d, other=0.0)
    u = x
    if LAYER_NORM:  # as nn.LayerNorm: the biased variance, eps inside the root
        mean = tl.sum(x, axis=0) / d
        centred = tl.where(mask_d, x - mean, 0.0)
        u = centred * (1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / d + norm_eps))
        if NORM_W:
            u = u * tl.load(norm_w + offs_d, mask=mask_d, other=0.0)
        if NORM_B:
            u = u + tl.load(norm_b + offs_d, mask=mask_d, other=0.0)
    tl.store(u_out + b * d + offs_d, u, mask=mask_d)
    for j in range(0, L):  # the chunk so far, the token at slot k, zeros after
        old = tl.load(pending_ptr + (b * L + j) * d + offs_d, mask=mask_d & (offs_d * 0 + j < k),
                      other=0.0)
        value = tl.where(complete, 0.0, tl.where(j == k, u, old))  # (not 0 * a NaN token)
        tl.store(pending_out + (b * L + j) * d + offs_d, value, mask=mask_d)
    read = tl.load(read_ptr + b * C + offs_c, mask=mask_c, other=0.0)
    if k == 0:  # the chunk starts: read the state at tanh(coord_net(token))
        x0, x1, x2 = _coords(coord_w, coord_b, u, offs_d, mask_d, d, N)
        read = read_at(h_ptr + b * C * P, x0, x1, x2, offs_c, mask_c, S0, S1, S2)
    tl.store(read_out + b * C + offs_c, tl.where(complete, 0.0, read), mask=mask_c)
    tl.store(count_out + b, tl.where(complete, k * 0, k + 1))
    tl.store(active_out + b, complete.to(tl.int8))
    # out_proj (d, C) read, then the gated residual, BT outputs at a time
    for d0 in range(0, d, BT):
        rows = d0 + tl.arange(0, BT)
        inside = rows < d
        w = tl.load(out_w + rows[:, None] * C + offs_c[None, :],
                    mask=inside[:, None] & mask_c[None, :], other=0.0)
        out = tl.sum(w * read[None, :], axis=1) + tl.load(out_b + rows, mask=inside, other=0.0)
        if RESIDUAL:
            out = tl.load(x_ptr + b * x_stride + rows, mask=inside, other=0.0) \
                + sigmoid(tl.load(gate_ptr)) * out
        tl.store(y_ptr + b * d + rows, out, mask=inside)


@triton.jit
def summary_kernel(pending_ptr, u_ptr, w_ptr, bias_ptr, s_ptr, d, L,
                   BO: tl.constexpr, BI: tl.constexpr):
    """``s[b, o] = bias[o] + sum_j W[o, j] chunk_b[j]`` for a tile of ``BO`` outputs, the chunk
    its first ``L - 1`` tokens from ``pending`` and its last ``u``; ``W (d, L d)``."""
    b = tl.program_id(0)
    offs_o = tl.program_id(1) * BO + tl.arange(0, BO)
    mask_o = offs_o < d
    offs_i = tl.arange(0, BI)
    acc = tl.load(bias_ptr + offs_o, mask=mask_o, other=0.0) * 0.0
    for j in range(0, L):
        for i0 in range(0, d, BI):
            cols = i0 + offs_i
            inside = cols < d
            at = cols * 0 + j  # (masks are vectors)
            v = tl.load(pending_ptr + (b * L + j) * d + cols, mask=inside & (at < L - 1),
                        other=0.0)
            v += tl.load(u_ptr + b * d + cols, mask=inside & (at == L - 1), other=0.0)
            w = tl.load(w_ptr + offs_o[:, None] * (L * d) + j * d + cols[None, :],
                        mask=mask_o[:, None] & inside[None, :], other=0.0)
            acc += tl.sum(w * v[None, :], axis=1)
    acc += tl.load(bias_ptr + offs_o, mask=mask_o, other=0.0)
    tl.store(s_ptr + b * d + offs_o, acc, mask=mask_o)


@triton.jit
def heads_kernel(s_ptr, coord_w, coord_b, content_w, content_b, sigma_w, sigma_b,
                 wc_ptr, ws_ptr, wcont_ptr, d, C, min_sigma, sigma_scale, threshold,
                 N: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    """Row ``b``'s write from its summary ``s``: ``wc (B, N)`` (coordinate order), ``ws (B,)``,
    ``wcont (B, C)``, as the scan step reads them (one step)."""
    b = tl.program_id(0)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < d
    offs_c = tl.arange(0, CB)
    mask_c = offs_c < C
    s = tl.load(s_ptr + b * d + offs_d, mask=mask_d, other=0.0)
    x0, x1, x2 = _coords(coord_w, coord_b, s, offs_d, mask_d, d, N)
    tl.store(wc_ptr + b * N, x2)  # component 0 addresses the last axis
    if N >= 2:
        tl.store(wc_ptr + b * N + 1, x1)
    if N >= 3:
        tl.store(wc_ptr + b * N + 2, x0)
    content = tl.load(content_b + offs_c, mask=mask_c, other=0.0)
    for d0 in range(0, d, BT):  # content_net (C, d), BT inputs at a time
        cols = d0 + tl.arange(0, BT)
        inside = cols < d
        w = tl.load(content_w + offs_c[:, None] * d + cols[None, :],
                    mask=mask_c[:, None] & inside[None, :], other=0.0)
        content += tl.sum(w * tl.load(s_ptr + b * d + cols, mask=inside, other=0.0)[None, :],
                          axis=1)
    tl.store(wcont_ptr + b * C + offs_c, content, mask=mask_c)
    v = _row_dot(sigma_w, s, offs_d, mask_d) + tl.load(sigma_b)
    # F.softplus with its threshold, then the least sigma and the scale
    soft = tl.where(v > threshold, v, tl.log(1.0 + tl.exp(tl.where(v > threshold, 0.0, v))))
    tl.store(ws_ptr + b, (soft + min_sigma) * sigma_scale)
