"""Ground-truth reference implementations of the tmcore memory algebra.

Everything here is plain, slow, obviously-correct float64 NumPy: explicit Python
loops over batch entries, queries, cells and interpolation corners, with at most
small per-cell vector operations over channels. These functions are the
contract that every namespace and every fast path is tested against; they never
import torch or jax and must stay simple enough to check by reading.

Conventions (as in docs/guides/conventions.md):

* Layout is channels-first, batch-first: a volume is ``(B, C, *S)`` with
  ``n = len(S)`` spatial axes (1 to 4).
* Coordinates are normalized to ``[-1, 1]`` and ordered like
  ``torch.nn.functional.grid_sample``: ``coords[..., k]`` addresses spatial
  axis ``n - 1 - k`` (the last coordinate addresses the first spatial axis).
* Cell centres are ``linspace(-1, 1, S_a)`` per axis; the voxel position of a
  coordinate is ``u_a = (x_a + 1) / 2 * (S_a - 1)``.

Parameters of the factorized convolution are passed as four separate arrays:
``depthwise_weight (n, Cin, 3)``, ``depthwise_bias (n, Cin)``,
``pointwise_weight (Cout, Cin)``, ``pointwise_bias (Cout,)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "cell_centers",
    "ref_trilinear_sample",
    "ref_trilinear_sample_vjp",
    "ref_gaussian_splat",
    "ref_gaussian_splat_vjp",
    "ref_factorized_conv",
    "ref_factorized_conv_vjp",
    "ref_convlstm_step",
    "ref_convlstm_step_vjp",
    "ref_memory_scan",
    "ref_memory_scan_vjp",
]


def _f64(a) -> np.ndarray:
    """A float64 copy of ``a`` (never a view of the caller's array)."""
    return np.array(a, dtype=np.float64, copy=True)


def cell_centers(size: int) -> np.ndarray:
    """Give the normalized cell-centre positions of one axis: ``linspace(-1, 1, size)``.

    Parameters
    ----------
    size : int
        The number of cells along the axis, >= 1.

    Returns
    -------
    numpy.ndarray, shape ``(size,)``
        The centres, float64; with ``size == 1`` the single centre is -1.
    """
    return np.linspace(-1.0, 1.0, size)


def _voxel_position(x: float, size: int) -> float:
    """Unclamped voxel position ``u = (x + 1) / 2 * (size - 1)`` (grid_sample formula)."""
    return (x + 1.0) / 2.0 * (size - 1)


# --------------------------------------------------------------------------------------
# Trilinear (n-linear) sampling with border padding, align_corners=True
# --------------------------------------------------------------------------------------


def _corner_setup(coord_row: np.ndarray, spatial: Sequence[int]):
    """Per-axis ``(u_unclamped, i0, t)`` for one query point.

    ``coord_row`` is ``(n,)`` in grid_sample order; the result is indexed by spatial
    axis ``a`` (so ``coord_row[n - 1 - a]`` feeds axis ``a``).
    """
    n = len(spatial)
    u_raw, i0, t = [], [], []
    for a in range(n):
        size = spatial[a]
        u = _voxel_position(float(coord_row[n - 1 - a]), size)
        uc = min(max(u, 0.0), float(size - 1))
        base = math.floor(uc)
        u_raw.append(u)
        i0.append(base)
        t.append(uc - base)
    return u_raw, i0, t


def ref_trilinear_sample(volume: np.ndarray, coords: np.ndarray) -> np.ndarray:
    """Read ``volume`` at ``coords`` by n-linear interpolation, one query at a time.

    Border padding: the voxel position is clamped to ``[0, S_a - 1]``, then the
    ``2**n`` corners around it are blended with n-linear weights. A corner index
    past the end of an axis is skipped (its weight is exactly 0 after the clamp).

    Parameters
    ----------
    volume : numpy.ndarray, shape ``(B, C, *S)``
        The grid, 1 to 4 spatial axes.
    coords : numpy.ndarray, shape ``(B, Q, n)``
        Normalized query positions; ``coords[..., k]`` addresses axis ``n - 1 - k``.

    Returns
    -------
    numpy.ndarray, shape ``(B, Q, C)``
        The reads, float64.
    """
    volume = _f64(volume)
    coords = _f64(coords)
    B, C = volume.shape[:2]
    spatial = volume.shape[2:]
    n = len(spatial)
    Q = coords.shape[1]
    out = np.zeros((B, Q, C))
    for b in range(B):
        for q in range(Q):
            _, i0, t = _corner_setup(coords[b, q], spatial)
            for bits in itertools.product((0, 1), repeat=n):
                idx = tuple(i0[a] + bits[a] for a in range(n))
                if any(idx[a] >= spatial[a] for a in range(n)):
                    continue
                weight = 1.0
                for a in range(n):
                    weight *= t[a] if bits[a] else 1.0 - t[a]
                out[b, q, :] += weight * volume[(b, slice(None), *idx)]
    return out


def ref_trilinear_sample_vjp(
    volume: np.ndarray, coords: np.ndarray, g: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Give the gradients of :func:`ref_trilinear_sample` with torch ``grid_sample``'s semantics.

    ``d_volume`` scatters ``g`` with the corner weights. ``d_coords`` is the
    derivative of the n-linear interpolant with respect to ``u_a`` at
    ``i0 = floor(clamped u)`` (so at an interior integer position it is the
    right-sided difference ``h[i0 + 1] - h[i0]``; an out-of-range corner has
    value 0), times ``(S_a - 1) / 2``, times a mask that is 0 when the unclamped
    ``u_a <= 0`` or ``u_a >= S_a - 1`` (torch treats the borders themselves as
    out of bounds for the gradient; with ``S_a == 1`` it is always 0).

    Parameters
    ----------
    volume : numpy.ndarray, shape ``(B, C, *S)``
        The grid that was read.
    coords : numpy.ndarray, shape ``(B, Q, n)``
        The normalized query positions.
    g : numpy.ndarray, shape ``(B, Q, C)``
        The cotangent of the reads.

    Returns
    -------
    d_volume : numpy.ndarray, shape ``(B, C, *S)``
        The gradient for ``volume``.
    d_coords : numpy.ndarray, shape ``(B, Q, n)``
        The gradient for ``coords``.
    """
    volume = _f64(volume)
    coords = _f64(coords)
    g = _f64(g)
    B, C = volume.shape[:2]
    spatial = volume.shape[2:]
    n = len(spatial)
    Q = coords.shape[1]
    d_volume = np.zeros_like(volume)
    d_coords = np.zeros_like(coords)
    for b in range(B):
        for q in range(Q):
            u_raw, i0, t = _corner_setup(coords[b, q], spatial)
            d_u = np.zeros(n)  # d(sum_c g * out_c) / d u_a, before the clamp mask
            for bits in itertools.product((0, 1), repeat=n):
                idx = tuple(i0[a] + bits[a] for a in range(n))
                if any(idx[a] >= spatial[a] for a in range(n)):
                    continue  # value 0: contributes to neither gradient
                value = float(np.dot(g[b, q], volume[(b, slice(None), *idx)]))
                weight = 1.0
                for a in range(n):
                    weight *= t[a] if bits[a] else 1.0 - t[a]
                d_volume[(b, slice(None), *idx)] += weight * g[b, q]
                for a in range(n):
                    others = 1.0
                    for a2 in range(n):
                        if a2 != a:
                            others *= t[a2] if bits[a2] else 1.0 - t[a2]
                    sign = 1.0 if bits[a] else -1.0
                    d_u[a] += sign * others * value
            for a in range(n):
                size = spatial[a]
                inside = 0.0 < u_raw[a] < size - 1
                if inside:
                    d_coords[b, q, n - 1 - a] = d_u[a] * (size - 1) / 2.0
    return d_volume, d_coords


# --------------------------------------------------------------------------------------
# Isotropic Gaussian splat
# --------------------------------------------------------------------------------------


def _splat_weight(
    p: Sequence[float], mu_row: np.ndarray, sigma: float, eps: float, radius: float | None
) -> tuple[float, float]:
    """Weight ``w`` and squared distance ``d2`` of one Gaussian at cell centre ``p``.

    ``p`` is indexed by spatial axis, ``mu_row`` is ``(n,)`` in grid_sample order.
    With a radius the weight is 0 when any axis has ``|p_a - mu_a| > radius * sigma``.
    """
    n = len(p)
    denom = 2.0 * sigma * sigma + eps
    d2 = 0.0
    kept = True
    for a in range(n):
        diff = p[a] - float(mu_row[n - 1 - a])
        d2 += diff * diff
        if radius is not None and abs(diff) > radius * sigma:
            kept = False
    weight = math.exp(-d2 / denom) if kept else 0.0
    return weight, d2


def ref_gaussian_splat(
    content: np.ndarray,
    mu: np.ndarray,
    sigma: np.ndarray,
    shape: Sequence[int],
    eps: float = 1e-6,
    radius: float | None = None,
) -> np.ndarray:
    """Write ``K`` isotropic Gaussians into a zero volume, cell by cell.

    ``volume[b, :, p] = sum_k content[b, k, :] * exp(-||p - mu_bk||^2 /
    (2 sigma_bk^2 + eps))``.

    Parameters
    ----------
    content : numpy.ndarray, shape ``(B, K, C)``
        The content vectors.
    mu : numpy.ndarray, shape ``(B, K, n)``
        The normalized centres, in grid_sample order.
    sigma : numpy.ndarray, shape ``(B, K)``
        The widths, in normalized units.
    shape : sequence of int
        The spatial shape ``S`` (``n`` ints).
    eps : float, default 1e-6
        Added to the denominator ``2 sigma^2 + eps``.
    radius : float or None, default None
        Box truncation per axis, in units of sigma.

    Returns
    -------
    numpy.ndarray, shape ``(B, C, *shape)``
        The written volume, float64.
    """
    content = _f64(content)
    mu = _f64(mu)
    sigma = _f64(sigma)
    shape = tuple(int(s) for s in shape)
    B, K, C = content.shape
    centers = [cell_centers(s) for s in shape]
    out = np.zeros((B, C, *shape))
    for b in range(B):
        for k in range(K):
            for idx in np.ndindex(*shape):
                p = [centers[a][idx[a]] for a in range(len(shape))]
                w, _ = _splat_weight(p, mu[b, k], float(sigma[b, k]), eps, radius)
                out[(b, slice(None), *idx)] += w * content[b, k]
    return out


def ref_gaussian_splat_vjp(
    content: np.ndarray,
    mu: np.ndarray,
    sigma: np.ndarray,
    shape: Sequence[int],
    g: np.ndarray,
    eps: float = 1e-6,
    radius: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give the gradients of :func:`ref_gaussian_splat`.

    With ``D = 2 sigma^2 + eps``: ``dw/dmu_a = w * 2 (p_a - mu_a) / D`` and
    ``dw/dsigma = w * d2 * 4 sigma / D^2``. The truncation mask is treated as a
    constant (its derivative is 0 almost everywhere).

    Parameters
    ----------
    content, mu, sigma : numpy.ndarray
        The content vectors, normalized centres and widths, shaped as in
        :func:`ref_gaussian_splat` (``(B, K, C)``, ``(B, K, n)``, ``(B, K)``).
    shape : sequence of int
        The spatial shape ``S``.
    g : numpy.ndarray, shape ``(B, C, *shape)``
        The cotangent of the written volume.
    eps : float, default 1e-6
        As in :func:`ref_gaussian_splat`.
    radius : float or None, default None
        As in :func:`ref_gaussian_splat`.

    Returns
    -------
    d_content : numpy.ndarray, shape ``(B, K, C)``
        The gradient for ``content``.
    d_mu : numpy.ndarray, shape ``(B, K, n)``
        The gradient for ``mu``.
    d_sigma : numpy.ndarray, shape ``(B, K)``
        The gradient for ``sigma``.
    """
    content = _f64(content)
    mu = _f64(mu)
    sigma = _f64(sigma)
    g = _f64(g)
    shape = tuple(int(s) for s in shape)
    n = len(shape)
    B, K, C = content.shape
    centers = [cell_centers(s) for s in shape]
    d_content = np.zeros_like(content)
    d_mu = np.zeros_like(mu)
    d_sigma = np.zeros_like(sigma)
    for b in range(B):
        for k in range(K):
            s = float(sigma[b, k])
            denom = 2.0 * s * s + eps
            for idx in np.ndindex(*shape):
                p = [centers[a][idx[a]] for a in range(n)]
                w, d2 = _splat_weight(p, mu[b, k], s, eps, radius)
                g_cell = g[(b, slice(None), *idx)]  # (C,)
                d_content[b, k] += w * g_cell
                d_w = float(np.dot(g_cell, content[b, k]))  # d L / d w
                for a in range(n):
                    diff = p[a] - float(mu[b, k, n - 1 - a])
                    d_mu[b, k, n - 1 - a] += d_w * w * 2.0 * diff / denom
                d_sigma[b, k] += d_w * w * d2 * 4.0 * s / (denom * denom)
    return d_content, d_mu, d_sigma


# --------------------------------------------------------------------------------------
# Factorized convolution: depthwise 3-tap per axis, then pointwise mixing
# --------------------------------------------------------------------------------------


def _shifted(idx: tuple[int, ...], axis: int, delta: int) -> tuple[int, ...]:
    """``idx`` moved by ``delta`` along ``axis``."""
    out = list(idx)
    out[axis] += delta
    return tuple(out)


def _depthwise_axis(y: np.ndarray, w: np.ndarray, bias: np.ndarray, axis: int) -> np.ndarray:
    """One depthwise 3-tap cross-correlation along spatial ``axis`` with zero padding.

    ``y`` is ``(B, C, *S)``, ``w`` is ``(C, 3)``, ``bias`` is ``(C,)``.
    ``out[..., i, ...] = w[:, 0] y[i-1] + w[:, 1] y[i] + w[:, 2] y[i+1] + bias``.
    """
    B = y.shape[0]
    spatial = y.shape[2:]
    out = np.zeros_like(y)
    for b in range(B):
        for idx in np.ndindex(*spatial):
            acc = bias.copy()
            for j, delta in enumerate((-1, 0, 1)):
                src = _shifted(idx, axis, delta)
                if 0 <= src[axis] < spatial[axis]:
                    acc = acc + w[:, j] * y[(b, slice(None), *src)]
            out[(b, slice(None), *idx)] = acc
    return out


def _depthwise_stages(x: np.ndarray, depthwise_weight, depthwise_bias) -> list[np.ndarray]:
    """All intermediate depthwise outputs ``[x, y_0, ..., y_{n-1}]``."""
    n = x.ndim - 2
    stages = [x]
    for a in range(n):
        stages.append(_depthwise_axis(stages[-1], depthwise_weight[a], depthwise_bias[a], a))
    return stages


def ref_factorized_conv(
    x: np.ndarray,
    depthwise_weight: np.ndarray,
    depthwise_bias: np.ndarray,
    pointwise_weight: np.ndarray,
    pointwise_bias: np.ndarray,
) -> np.ndarray:
    """Apply the factorized conv, cell by cell.

    Depthwise 3-tap conv along spatial axis 0, then 1, ..., then ``n - 1`` (zero
    padding, per-channel bias), then ``z[b, :, p] = P @ y[b, :, p] + pb``.

    Parameters
    ----------
    x : numpy.ndarray, shape ``(B, Cin, *S)``
        The input.
    depthwise_weight : numpy.ndarray, shape ``(n, Cin, 3)``
        The taps (previous, centre, next) per axis and channel.
    depthwise_bias : numpy.ndarray, shape ``(n, Cin)``
        The bias of each depthwise pass.
    pointwise_weight : numpy.ndarray, shape ``(Cout, Cin)``
        The channel-mixing matrix ``P``.
    pointwise_bias : numpy.ndarray, shape ``(Cout,)``
        The mixing's bias ``pb``.

    Returns
    -------
    numpy.ndarray, shape ``(B, Cout, *S)``
        The output, float64.
    """
    x = _f64(x)
    dw, db = _f64(depthwise_weight), _f64(depthwise_bias)
    pw, pb = _f64(pointwise_weight), _f64(pointwise_bias)
    y = _depthwise_stages(x, dw, db)[-1]
    B = x.shape[0]
    spatial = x.shape[2:]
    out = np.zeros((B, pw.shape[0], *spatial))
    for b in range(B):
        for idx in np.ndindex(*spatial):
            out[(b, slice(None), *idx)] = pw @ y[(b, slice(None), *idx)] + pb
    return out


def ref_factorized_conv_vjp(
    x: np.ndarray,
    depthwise_weight: np.ndarray,
    depthwise_bias: np.ndarray,
    pointwise_weight: np.ndarray,
    pointwise_bias: np.ndarray,
    g: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Give the gradients of :func:`ref_factorized_conv`.

    Parameters
    ----------
    x, depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias : numpy.ndarray
        The input and the conv's parameters, shaped as in
        :func:`ref_factorized_conv` (``(B, Cin, *S)``, ``(n, Cin, 3)``,
        ``(n, Cin)``, ``(Cout, Cin)``, ``(Cout,)``).
    g : numpy.ndarray, shape ``(B, Cout, *S)``
        The cotangent of the output.

    Returns
    -------
    tuple of numpy.ndarray
        ``(d_x, d_depthwise_weight, d_depthwise_bias, d_pointwise_weight,
        d_pointwise_bias)``, each shaped like its input.
    """
    x = _f64(x)
    dw, db = _f64(depthwise_weight), _f64(depthwise_bias)
    pw, pb = _f64(pointwise_weight), _f64(pointwise_bias)
    g = _f64(g)
    stages = _depthwise_stages(x, dw, db)
    B = x.shape[0]
    spatial = x.shape[2:]
    n = len(spatial)
    d_pw = np.zeros_like(pw)
    d_pb = np.zeros_like(pb)
    d_y = np.zeros_like(stages[-1])
    for b in range(B):
        for idx in np.ndindex(*spatial):
            g_cell = g[(b, slice(None), *idx)]
            d_pw += np.outer(g_cell, stages[-1][(b, slice(None), *idx)])
            d_pb += g_cell
            d_y[(b, slice(None), *idx)] = pw.T @ g_cell
    d_dw = np.zeros_like(dw)
    d_db = np.zeros_like(db)
    for a in reversed(range(n)):
        y_in = stages[a]
        d_in = np.zeros_like(y_in)
        for b in range(B):
            for idx in np.ndindex(*spatial):
                g_cell = d_y[(b, slice(None), *idx)]
                d_db[a] += g_cell
                for j, delta in enumerate((-1, 0, 1)):
                    src = _shifted(idx, a, delta)
                    if 0 <= src[a] < spatial[a]:
                        d_dw[a, :, j] += g_cell * y_in[(b, slice(None), *src)]
                        d_in[(b, slice(None), *src)] += dw[a, :, j] * g_cell
        d_y = d_in
    return d_y, d_dw, d_db, d_pw, d_pb


# --------------------------------------------------------------------------------------
# ConvLSTM cell
# --------------------------------------------------------------------------------------


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _convlstm_gates(x, h, dw, db, pw, pb):
    """Gate activations ``(i, f, o, g)``, each ``(B, C, *S)``."""
    C = h.shape[1]
    z = ref_factorized_conv(np.concatenate([x, h], axis=1), dw, db, pw, pb)
    i = _sigmoid(z[:, 0 * C : 1 * C])
    f = _sigmoid(z[:, 1 * C : 2 * C])
    o = _sigmoid(z[:, 2 * C : 3 * C])
    gg = np.tanh(z[:, 3 * C : 4 * C])
    return i, f, o, gg


def ref_convlstm_step(
    x: np.ndarray,
    h: np.ndarray,
    c: np.ndarray,
    depthwise_weight: np.ndarray,
    depthwise_bias: np.ndarray,
    pointwise_weight: np.ndarray,
    pointwise_bias: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Apply one ConvLSTM step.

    ``z = conv([x, h])`` is split into ``i, f, o, g``; ``c' = f c + i g``;
    ``h' = o tanh(c')`` (``i, f, o`` through a sigmoid, ``g`` through tanh).

    Parameters
    ----------
    x : numpy.ndarray, shape ``(B, C, *S)``
        The written volume.
    h : numpy.ndarray, shape ``(B, C, *S)``
        The hidden state.
    c : numpy.ndarray, shape ``(B, C, *S)``
        The cell state.
    depthwise_weight : numpy.ndarray, shape ``(n, 2C, 3)``
        The gate conv's taps.
    depthwise_bias : numpy.ndarray, shape ``(n, 2C)``
        The gate conv's depthwise biases.
    pointwise_weight : numpy.ndarray, shape ``(4C, 2C)``
        The gate conv's mixing matrix.
    pointwise_bias : numpy.ndarray, shape ``(4C,)``
        The gate conv's mixing bias.

    Returns
    -------
    h_new : numpy.ndarray, shape ``(B, C, *S)``
        The new hidden state.
    c_new : numpy.ndarray, shape ``(B, C, *S)``
        The new cell state.
    """
    x, h, c = _f64(x), _f64(h), _f64(c)
    i, f, o, gg = _convlstm_gates(
        x, h, _f64(depthwise_weight), _f64(depthwise_bias),
        _f64(pointwise_weight), _f64(pointwise_bias),
    )
    c_new = f * c + i * gg
    h_new = o * np.tanh(c_new)
    return h_new, c_new


def ref_convlstm_step_vjp(
    x: np.ndarray,
    h: np.ndarray,
    c: np.ndarray,
    depthwise_weight: np.ndarray,
    depthwise_bias: np.ndarray,
    pointwise_weight: np.ndarray,
    pointwise_bias: np.ndarray,
    g_h: np.ndarray,
    g_c: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """Give the gradients of :func:`ref_convlstm_step`.

    Parameters
    ----------
    x, h, c : numpy.ndarray, shape ``(B, C, *S)``
        The written volume, the hidden and the cell state.
    depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias : numpy.ndarray
        The gate conv's parameters, shaped as in :func:`ref_convlstm_step`
        (``(n, 2C, 3)``, ``(n, 2C)``, ``(4C, 2C)``, ``(4C,)``).
    g_h, g_c : numpy.ndarray, shape ``(B, C, *S)``
        The cotangents of the new hidden and cell state.

    Returns
    -------
    tuple of numpy.ndarray
        ``(d_x, d_h, d_c, d_depthwise_weight, d_depthwise_bias,
        d_pointwise_weight, d_pointwise_bias)``, each shaped like its input.
    """
    x, h, c = _f64(x), _f64(h), _f64(c)
    dw, db = _f64(depthwise_weight), _f64(depthwise_bias)
    pw, pb = _f64(pointwise_weight), _f64(pointwise_bias)
    g_h, g_c = _f64(g_h), _f64(g_c)
    C = h.shape[1]
    i, f, o, gg = _convlstm_gates(x, h, dw, db, pw, pb)
    c_new = f * c + i * gg
    tanh_c = np.tanh(c_new)
    d_c_new = g_c + g_h * o * (1.0 - tanh_c**2)
    d_o = g_h * tanh_c
    d_f = d_c_new * c
    d_i = d_c_new * gg
    d_g = d_c_new * i
    d_c = d_c_new * f
    d_z = np.concatenate(
        [d_i * i * (1.0 - i), d_f * f * (1.0 - f), d_o * o * (1.0 - o), d_g * (1.0 - gg**2)],
        axis=1,
    )
    d_xh, d_dw, d_db, d_pw, d_pb = ref_factorized_conv_vjp(
        np.concatenate([x, h], axis=1), dw, db, pw, pb, d_z
    )
    return d_xh[:, :C], d_xh[:, C:], d_c, d_dw, d_db, d_pw, d_pb


# --------------------------------------------------------------------------------------
# The chunk recurrence: read, then write, then update
# --------------------------------------------------------------------------------------


def ref_memory_scan(
    h0: np.ndarray,
    c0: np.ndarray,
    read_coords: np.ndarray,
    write_coords: np.ndarray,
    write_sigma: np.ndarray,
    write_content: np.ndarray,
    depthwise_weight: np.ndarray,
    depthwise_bias: np.ndarray,
    pointwise_weight: np.ndarray,
    pointwise_bias: np.ndarray,
    eps: float = 1e-6,
    radius: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run ``T`` memory steps, one primitive at a time.

    Step ``t``: ``r_t = sample(h_{t-1}, read_coords[:, t])`` (read before the
    write), ``x = splat(write_content[:, t], write_coords[:, t], write_sigma[:, t])``,
    ``(h, c) = convlstm_step(x, h, c)``.

    Parameters
    ----------
    h0 : numpy.ndarray, shape ``(B, C, *S)``
        The initial hidden state.
    c0 : numpy.ndarray, shape ``(B, C, *S)``
        The initial cell state.
    read_coords : numpy.ndarray, shape ``(B, T, n)``
        The read position of each step.
    write_coords : numpy.ndarray, shape ``(B, T, n)``
        The write centre of each step.
    write_sigma : numpy.ndarray, shape ``(B, T)``
        The write spread of each step.
    write_content : numpy.ndarray, shape ``(B, T, C)``
        The content written by each step.
    depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias : numpy.ndarray
        The gate conv's parameters, as in :func:`ref_convlstm_step`: shapes
        ``(n, 2C, 3)``, ``(n, 2C)``, ``(4C, 2C)`` and ``(4C,)``.
    eps : float, default 1e-6
        As in :func:`ref_gaussian_splat`.
    radius : float or None, default None
        As in :func:`ref_gaussian_splat`.

    Returns
    -------
    reads : numpy.ndarray, shape ``(B, T, C)``
        What each step read.
    h_T : numpy.ndarray, shape ``(B, C, *S)``
        The final hidden state.
    c_T : numpy.ndarray, shape ``(B, C, *S)``
        The final cell state.
    """
    h, c = _f64(h0), _f64(c0)
    read_coords, write_coords = _f64(read_coords), _f64(write_coords)
    write_sigma, write_content = _f64(write_sigma), _f64(write_content)
    params = (depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias)
    B, C = h.shape[:2]
    shape = h.shape[2:]
    T = read_coords.shape[1]
    reads = np.zeros((B, T, C))
    for t in range(T):
        reads[:, t] = ref_trilinear_sample(h, read_coords[:, t : t + 1])[:, 0]
        x = ref_gaussian_splat(
            write_content[:, t : t + 1], write_coords[:, t : t + 1],
            write_sigma[:, t : t + 1], shape, eps=eps, radius=radius,
        )
        h, c = ref_convlstm_step(x, h, c, *params)
    return reads, h, c


def ref_memory_scan_vjp(
    h0: np.ndarray,
    c0: np.ndarray,
    read_coords: np.ndarray,
    write_coords: np.ndarray,
    write_sigma: np.ndarray,
    write_content: np.ndarray,
    depthwise_weight: np.ndarray,
    depthwise_bias: np.ndarray,
    pointwise_weight: np.ndarray,
    pointwise_bias: np.ndarray,
    g_reads: np.ndarray,
    g_h: np.ndarray,
    g_c: np.ndarray,
    eps: float = 1e-6,
    radius: float | None = None,
) -> tuple[np.ndarray, ...]:
    """Give the gradients of :func:`ref_memory_scan` by plain backpropagation through time.

    Parameters
    ----------
    h0, c0 : numpy.ndarray, shape ``(B, C, *S)``
        The initial hidden and cell state.
    read_coords, write_coords, write_sigma, write_content : numpy.ndarray
        Each step's addressing and content, shaped as in :func:`ref_memory_scan`
        (``(B, T, n)``, ``(B, T, n)``, ``(B, T)``, ``(B, T, C)``).
    depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias : numpy.ndarray
        The gate conv's parameters (``(n, 2C, 3)``, ``(n, 2C)``, ``(4C, 2C)``,
        ``(4C,)``).
    g_reads : numpy.ndarray, shape ``(B, T, C)``
        The cotangent of the reads.
    g_h, g_c : numpy.ndarray, shape ``(B, C, *S)``
        The cotangents of the final hidden and cell state.
    eps : float, default 1e-6
        The splat's ``eps``, as in :func:`ref_memory_scan`.
    radius : float or None, default None
        The splat's truncation radius, as in :func:`ref_memory_scan`.

    Returns
    -------
    tuple of numpy.ndarray
        ``(d_h0, d_c0, d_read_coords, d_write_coords, d_write_sigma,
        d_write_content, d_depthwise_weight, d_depthwise_bias, d_pointwise_weight,
        d_pointwise_bias)``, each shaped like its input.
    """
    h, c = _f64(h0), _f64(c0)
    read_coords, write_coords = _f64(read_coords), _f64(write_coords)
    write_sigma, write_content = _f64(write_sigma), _f64(write_content)
    params = tuple(_f64(p) for p in (depthwise_weight, depthwise_bias,
                                     pointwise_weight, pointwise_bias))
    shape = h.shape[2:]
    T = read_coords.shape[1]
    states, volumes = [], []
    for t in range(T):
        x = ref_gaussian_splat(
            write_content[:, t : t + 1], write_coords[:, t : t + 1],
            write_sigma[:, t : t + 1], shape, eps=eps, radius=radius,
        )
        states.append((h, c))
        volumes.append(x)
        h, c = ref_convlstm_step(x, h, c, *params)

    d_h, d_c = _f64(g_h), _f64(g_c)
    g_reads = _f64(g_reads)
    d_read_coords = np.zeros_like(read_coords)
    d_write_coords = np.zeros_like(write_coords)
    d_write_sigma = np.zeros_like(write_sigma)
    d_write_content = np.zeros_like(write_content)
    d_params = [np.zeros_like(p) for p in params]
    for t in reversed(range(T)):
        h_prev, c_prev = states[t]
        d_x, d_h_prev, d_c_prev, *d_p = ref_convlstm_step_vjp(
            volumes[t], h_prev, c_prev, *params, d_h, d_c
        )
        for acc, d in zip(d_params, d_p, strict=True):
            acc += d
        d_content, d_mu, d_sigma = ref_gaussian_splat_vjp(
            write_content[:, t : t + 1], write_coords[:, t : t + 1],
            write_sigma[:, t : t + 1], shape, d_x, eps=eps, radius=radius,
        )
        d_write_content[:, t] = d_content[:, 0]
        d_write_coords[:, t] = d_mu[:, 0]
        d_write_sigma[:, t] = d_sigma[:, 0]
        d_vol, d_rc = ref_trilinear_sample_vjp(
            h_prev, read_coords[:, t : t + 1], g_reads[:, t : t + 1]
        )
        d_read_coords[:, t] = d_rc[:, 0]
        d_h = d_h_prev + d_vol
        d_c = d_c_prev
    return (d_h, d_c, d_read_coords, d_write_coords, d_write_sigma, d_write_content,
            *d_params)
