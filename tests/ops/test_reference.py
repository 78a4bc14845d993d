"""Tests of the ground truth itself: ``tmcore.testing.reference`` and ``finite_diff``.

The references are checked against closed forms (cell centres, affine fields,
near-delta splats, identity convolutions, zero-parameter LSTM cells), against each
other (scan = composition of steps), against central differences, and, when
torch is installed, against ``torch.nn.functional.grid_sample`` and torch's
convolutions.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import (
    coords_array,
    fd_step_for_sigma,
    grid_shapes,
    log_uniform_sigma,
    seeds,
    smooth_coords_array,
    splat_margin_ok,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tmcore.testing.finite_diff import central_difference_vjp, relative_error
from tmcore.testing.reference import (
    cell_centers,
    ref_convlstm_step,
    ref_convlstm_step_vjp,
    ref_factorized_conv,
    ref_factorized_conv_vjp,
    ref_gaussian_splat,
    ref_gaussian_splat_vjp,
    ref_memory_scan,
    ref_memory_scan_vjp,
    ref_trilinear_sample,
    ref_trilinear_sample_vjp,
)

FD_TOL = 1e-6
FD_FLOOR = 1e-2  # absolute gradient scale below which FD noise dominates


def _conv_params(rng, n: int, c_in: int, c_out: int) -> list[np.ndarray]:
    return [
        rng.standard_normal((n, c_in, 3)) * 0.6,
        rng.standard_normal((n, c_in)) * 0.3,
        rng.standard_normal((c_out, c_in)) / math.sqrt(c_in),
        rng.standard_normal((c_out,)) * 0.3,
    ]


# ----------------------------------------------------------------------------- finite_diff


def test_central_difference_on_closed_forms():
    a = np.array([0.3, -1.2, 2.0])
    b = np.array([[1.0, 2.0], [0.5, -0.5]])
    g = np.array([0.7, -0.2, 1.1])
    (da,) = central_difference_vjp(lambda x: x**3, [a], g, [0])
    np.testing.assert_allclose(da, 3 * a**2 * g, rtol=1e-8)
    g2 = (np.ones((2, 2)), np.array(2.0))
    da2, db2 = central_difference_vjp(
        lambda x, y: (y * x[0], np.sum(y)), [a, b], g2, [0, 1]
    )
    np.testing.assert_allclose(da2, [b.sum(), 0.0, 0.0], atol=1e-8)
    np.testing.assert_allclose(db2, np.full((2, 2), a[0] + 2.0), atol=1e-8)


def test_relative_error_definition():
    assert relative_error(np.array([1.0, 2.0]), np.array([1.0, 2.5])) == pytest.approx(0.2)
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error(np.array([1e-9]), np.zeros(1), floor=1.0) == pytest.approx(1e-9)
    assert relative_error(np.zeros((0,)), np.zeros((0,))) == 0.0


# ----------------------------------------------------------------------------- sampling


@settings(max_examples=30)
@given(shape=grid_shapes(), batch=st.integers(1, 2), seed=seeds, data=st.data())
def test_sample_at_cell_centres_returns_voxel(shape, batch, seed, data):
    rng = np.random.default_rng(seed)
    n = len(shape)
    volume = rng.standard_normal((batch, 2, *shape))
    idx = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    coord = [cell_centers(shape[n - 1 - k])[idx[n - 1 - k]] for k in range(n)]
    coords = np.tile(np.asarray(coord), (batch, 1, 1))
    out = ref_trilinear_sample(volume, coords)
    np.testing.assert_allclose(out[:, 0, :], volume[(slice(None), slice(None), *idx)],
                               rtol=1e-13, atol=1e-13)


@settings(max_examples=30)
@given(shape=grid_shapes(), seed=seeds, data=st.data())
def test_sample_reproduces_affine_fields(shape, seed, data):
    """n-linear interpolation is exact for affine fields; outside it clamps."""
    rng = np.random.default_rng(seed)
    n = len(shape)
    slope = rng.standard_normal(n)
    offset = float(rng.standard_normal())
    field = np.zeros(shape)
    for idx in np.ndindex(*shape):
        field[idx] = offset + float(np.dot(slope, idx))
    coords = data.draw(coords_array(1, 3, shape))
    out = ref_trilinear_sample(field[None, None], coords)[0, :, 0]
    for q in range(3):
        u = [min(max((coords[0, q, n - 1 - a] + 1) / 2 * (shape[a] - 1), 0.0), shape[a] - 1)
             for a in range(n)]
        assert out[q] == pytest.approx(offset + float(np.dot(slope, u)), abs=1e-12)


def test_sample_vjp_conventions_1d():
    """Right-sided derivative at interior centres, zero at and beyond the borders."""
    volume = np.array([[[0.0, 1.0, 3.0]]])  # (1, 1, 3); slopes 1 then 2 per voxel
    coords = np.array([[[-1.0], [-0.5], [0.0], [0.5], [1.0], [1.3], [-1.2]]])
    g = np.ones((1, 7, 1))
    out = ref_trilinear_sample(volume, coords)[0, :, 0]
    np.testing.assert_allclose(out, [0.0, 0.5, 1.0, 2.0, 3.0, 3.0, 0.0], atol=1e-15)
    _, d_coords = ref_trilinear_sample_vjp(volume, coords, g)
    # voxel/normalized factor (S-1)/2 = 1
    np.testing.assert_allclose(d_coords[0, :, 0], [0.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0])
    d_volume, d_coords = ref_trilinear_sample_vjp(np.ones((1, 1, 1)), coords, g)
    assert np.all(d_coords == 0.0)  # S_a == 1: always zero
    assert d_volume[0, 0, 0] == 7.0


@settings(max_examples=25)
@given(shape=grid_shapes(max_cells=12), batch=st.integers(1, 2), seed=seeds, data=st.data())
def test_sample_vjp_matches_central_differences(shape, batch, seed, data):
    rng = np.random.default_rng(seed)
    volume = rng.standard_normal((batch, 2, *shape))
    coords = data.draw(smooth_coords_array(batch, 2, shape))
    g = rng.standard_normal((batch, 2, 2))
    d_volume, d_coords = ref_trilinear_sample_vjp(volume, coords, g)
    fd_volume, fd_coords = central_difference_vjp(ref_trilinear_sample, [volume, coords], g,
                                                  [0, 1])
    assert relative_error(d_volume, fd_volume, floor=FD_FLOOR) <= FD_TOL
    assert relative_error(d_coords, fd_coords, floor=FD_FLOOR) <= FD_TOL


@settings(max_examples=40)
@given(n=st.sampled_from([2, 3]), batch=st.integers(1, 2), channels=st.integers(1, 3),
       seed=seeds, data=st.data())
def test_sample_matches_torch_grid_sample(n, batch, channels, seed, data):
    """Value and both gradients equal grid_sample(bilinear, border, align_corners=True)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    functional = torch.nn.functional
    shape = data.draw(grid_shapes(min_ndim=n, max_ndim=n, max_cells=60))
    rng = np.random.default_rng(seed)
    volume = rng.standard_normal((batch, channels, *shape))
    coords = data.draw(coords_array(batch, 3, shape))
    g = rng.standard_normal((batch, 3, channels))

    t_volume = torch.tensor(volume, requires_grad=True)
    t_coords = torch.tensor(coords, requires_grad=True)
    grid = t_coords.reshape(batch, 1, 3, 2) if n == 2 else t_coords.reshape(batch, 1, 1, 3, 3)
    out = functional.grid_sample(t_volume, grid, mode="bilinear", padding_mode="border",
                                 align_corners=True)
    out = out.reshape(batch, channels, 3).permute(0, 2, 1)
    out.backward(torch.tensor(g))

    ref = ref_trilinear_sample(volume, coords)
    d_volume, d_coords = ref_trilinear_sample_vjp(volume, coords, g)
    np.testing.assert_allclose(ref, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(d_volume, t_volume.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(d_coords, t_coords.grad.numpy(), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- splat


@settings(max_examples=25)
@given(shape=grid_shapes(), seed=seeds, data=st.data())
def test_splat_with_tiny_sigma_is_a_delta(shape, seed, data):
    rng = np.random.default_rng(seed)
    n = len(shape)
    idx = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    mu = np.array([[[cell_centers(shape[n - 1 - k])[idx[n - 1 - k]] for k in range(n)]]])
    content = rng.standard_normal((1, 1, 3))
    out = ref_gaussian_splat(content, mu, np.array([[1e-4]]), shape)
    expected = np.zeros((1, 3, *shape))
    expected[(0, slice(None), *idx)] = content[0, 0]
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-300)


def test_splat_closed_form_and_truncation():
    """1-D: w = exp(-(p - mu)^2 / (2 sigma^2 + eps)); radius zeroes |p - mu| > r sigma."""
    content = np.array([[[2.0]]])
    mu = np.array([[[0.1]]])
    sigma = np.array([[0.3]])
    p = np.linspace(-1, 1, 5)
    w = np.exp(-((p - 0.1) ** 2) / (2 * 0.09 + 1e-6))
    np.testing.assert_allclose(ref_gaussian_splat(content, mu, sigma, (5,))[0, 0], 2 * w,
                               rtol=1e-14)
    trunc = ref_gaussian_splat(content, mu, sigma, (5,), radius=2.0)[0, 0]
    np.testing.assert_allclose(trunc, np.where(np.abs(p - 0.1) <= 0.6, 2 * w, 0.0), rtol=1e-14)
    # 2-D: mu[..., 0] addresses the last axis, and the weight is separable.
    mu2 = np.array([[[0.5, -1.0]]])
    out2 = ref_gaussian_splat(content, mu2, sigma, (3, 5))[0, 0]
    py, px = np.linspace(-1, 1, 3), np.linspace(-1, 1, 5)
    d = 2 * 0.09 + 1e-6
    expected2 = 2 * np.outer(np.exp(-((py + 1.0) ** 2) / d), np.exp(-((px - 0.5) ** 2) / d))
    np.testing.assert_allclose(out2, expected2, rtol=1e-14)
    # A huge radius truncates nothing.
    np.testing.assert_array_equal(
        ref_gaussian_splat(content, mu2, sigma, (3, 5), radius=1e6)[0, 0], out2
    )


@settings(max_examples=25)
@given(shape=grid_shapes(max_cells=12), batch=st.integers(1, 2), k=st.integers(1, 2),
       sigma=st.lists(log_uniform_sigma, min_size=4, max_size=4),
       radius=st.one_of(st.none(), st.floats(1.0, 3.0)), seed=seeds, data=st.data())
def test_splat_vjp_matches_central_differences(shape, batch, k, sigma, radius, seed, data):
    rng = np.random.default_rng(seed)
    content = rng.standard_normal((batch, k, 2))
    mu = data.draw(coords_array(batch, k, shape))
    sig = np.asarray(sigma[: batch * k]).reshape(batch, k)
    assume(splat_margin_ok(shape, mu, sig, radius))  # keep cells off the truncation edge
    g = rng.standard_normal((batch, 2, *shape))
    analytic = ref_gaussian_splat_vjp(content, mu, sig, shape, g, radius=radius)
    fd = central_difference_vjp(
        lambda c, m, s: ref_gaussian_splat(c, m, s, shape, radius=radius),
        [content, mu, sig], g, [0, 1, 2], step=fd_step_for_sigma(sig),
    )
    for name, a, f in zip(("content", "mu", "sigma"), analytic, fd, strict=True):
        assert relative_error(a, f, floor=FD_FLOOR) <= FD_TOL, name


# ----------------------------------------------------------------------------- conv


@settings(max_examples=20)
@given(shape=grid_shapes(), batch=st.integers(1, 2), channels=st.integers(1, 3), seed=seeds)
def test_conv_identity(shape, batch, channels, seed):
    rng = np.random.default_rng(seed)
    n = len(shape)
    x = rng.standard_normal((batch, channels, *shape))
    taps = np.zeros((n, channels, 3))
    taps[:, :, 1] = 1.0
    out = ref_factorized_conv(x, taps, np.zeros((n, channels)), np.eye(channels),
                              np.zeros(channels))
    np.testing.assert_array_equal(out, x)


def test_conv_1d_matches_numpy_correlate():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 6))
    taps = rng.standard_normal((1, 2, 3))
    bias = rng.standard_normal((1, 2))
    pw = rng.standard_normal((3, 2))
    pb = rng.standard_normal(3)
    y = np.stack([np.correlate(x[0, c], taps[0, c], mode="same") + bias[0, c] for c in range(2)])
    expected = pw @ y + pb[:, None]
    np.testing.assert_allclose(ref_factorized_conv(x, taps, bias, pw, pb)[0], expected,
                               rtol=1e-13, atol=1e-13)


@settings(max_examples=15)
@given(n=st.sampled_from([1, 2, 3]), batch=st.integers(1, 2), c_in=st.integers(1, 3),
       c_out=st.integers(1, 3), seed=seeds, data=st.data())
def test_conv_matches_torch(n, batch, c_in, c_out, seed, data):
    """Depthwise (3,1,1)/(1,3,1)/(1,1,3) kernels with groups=C, then a 1x1 conv."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    functional = torch.nn.functional
    conv = {1: functional.conv1d, 2: functional.conv2d, 3: functional.conv3d}[n]
    shape = data.draw(grid_shapes(min_ndim=n, max_ndim=n, max_cells=40))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, c_in, *shape))
    dw, db, pw, pb = _conv_params(rng, n, c_in, c_out)
    y = torch.tensor(x)
    for a in range(n):
        kernel_shape = [1] * n
        kernel_shape[a] = 3
        padding = [0] * n
        padding[a] = 1
        weight = torch.tensor(dw[a]).reshape(c_in, 1, *kernel_shape)
        y = conv(y, weight, torch.tensor(db[a]), padding=tuple(padding), groups=c_in)
    z = conv(y, torch.tensor(pw).reshape(c_out, c_in, *([1] * n)), torch.tensor(pb))
    np.testing.assert_allclose(ref_factorized_conv(x, dw, db, pw, pb), z.numpy(),
                               rtol=1e-12, atol=1e-12)


@settings(max_examples=15)
@given(shape=grid_shapes(max_cells=10), batch=st.integers(1, 2), c_in=st.integers(1, 2),
       c_out=st.integers(1, 3), seed=seeds)
def test_conv_vjp_matches_central_differences(shape, batch, c_in, c_out, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, c_in, *shape))
    params = _conv_params(rng, len(shape), c_in, c_out)
    g = rng.standard_normal((batch, c_out, *shape))
    analytic = ref_factorized_conv_vjp(x, *params, g)
    fd = central_difference_vjp(ref_factorized_conv, [x, *params], g, range(5))
    for i, (a, f) in enumerate(zip(analytic, fd, strict=True)):
        assert relative_error(a, f, floor=FD_FLOOR) <= FD_TOL, i


# ----------------------------------------------------------------------------- convlstm


def test_convlstm_with_zero_parameters():
    """z = 0: i = f = o = 1/2, g = 0, so c' = c / 2 and h' = tanh(c / 2) / 2."""
    rng = np.random.default_rng(1)
    c = rng.standard_normal((2, 3, 4, 2))
    x = rng.standard_normal(c.shape)
    h = rng.standard_normal(c.shape)
    zeros = [np.zeros((2, 6, 3)), np.zeros((2, 6)), np.zeros((12, 6)), np.zeros(12)]
    h_new, c_new = ref_convlstm_step(x, h, c, *zeros)
    np.testing.assert_allclose(c_new, c / 2, rtol=1e-15)
    np.testing.assert_allclose(h_new, np.tanh(c / 2) / 2, rtol=1e-15)


def test_convlstm_gate_order():
    """With identity depthwise taps, pointwise bias alone picks the gates i, f, o, g."""
    c = np.full((1, 1, 3), 0.5)
    x = np.zeros_like(c)
    h = np.zeros_like(c)
    taps = np.zeros((1, 2, 3))
    taps[:, :, 1] = 1.0
    pb = np.array([0.1, 0.2, 0.3, 0.4])  # i, f, o, g
    h_new, c_new = ref_convlstm_step(x, h, c, taps, np.zeros((1, 2)), np.zeros((4, 2)), pb)

    def sig(v):
        return 1 / (1 + math.exp(-v))

    c_exp = sig(0.2) * 0.5 + sig(0.1) * math.tanh(0.4)
    np.testing.assert_allclose(c_new, c_exp, rtol=1e-15)
    np.testing.assert_allclose(h_new, sig(0.3) * math.tanh(c_exp), rtol=1e-15)


@settings(max_examples=10)
@given(shape=grid_shapes(max_cells=8), batch=st.integers(1, 2), channels=st.integers(1, 2),
       seed=seeds)
def test_convlstm_vjp_matches_central_differences(shape, batch, channels, seed):
    rng = np.random.default_rng(seed)
    state = [rng.standard_normal((batch, channels, *shape)) for _ in range(3)]
    params = _conv_params(rng, len(shape), 2 * channels, 4 * channels)
    g = (rng.standard_normal(state[0].shape), rng.standard_normal(state[0].shape))
    analytic = ref_convlstm_step_vjp(*state, *params, *g)
    fd = central_difference_vjp(ref_convlstm_step, [*state, *params], g, range(7))
    for i, (a, f) in enumerate(zip(analytic, fd, strict=True)):
        assert relative_error(a, f, floor=FD_FLOOR) <= FD_TOL, i


# ----------------------------------------------------------------------------- scan


def _scan_inputs(rng, batch, channels, shape, steps):
    n = len(shape)
    return dict(
        h0=rng.standard_normal((batch, channels, *shape)) * 0.5,
        c0=rng.standard_normal((batch, channels, *shape)) * 0.5,
        read_coords=rng.uniform(-1.2, 1.2, (batch, steps, n)),
        write_coords=rng.uniform(-1.2, 1.2, (batch, steps, n)),
        write_sigma=np.exp(rng.uniform(-2.0, 0.5, (batch, steps))),
        write_content=rng.standard_normal((batch, steps, channels)),
    )


def test_scan_reads_before_write_and_composes():
    rng = np.random.default_rng(3)
    shape = (3, 2)
    inputs = _scan_inputs(rng, 2, 2, shape, 3)
    params = _conv_params(rng, 2, 4, 8)
    reads, h, c = ref_memory_scan(*inputs.values(), *params)
    # step by step, by hand
    h_t, c_t = inputs["h0"], inputs["c0"]
    for t in range(3):
        r = ref_trilinear_sample(h_t, inputs["read_coords"][:, t : t + 1])[:, 0]
        np.testing.assert_allclose(reads[:, t], r, rtol=1e-14)
        x = ref_gaussian_splat(inputs["write_content"][:, t : t + 1],
                               inputs["write_coords"][:, t : t + 1],
                               inputs["write_sigma"][:, t : t + 1], shape)
        h_t, c_t = ref_convlstm_step(x, h_t, c_t, *params)
    np.testing.assert_allclose(h, h_t, rtol=1e-14)
    np.testing.assert_allclose(c, c_t, rtol=1e-14)
    # the first read sees only h0: from a zero state it is zero
    zero_inputs = dict(inputs, h0=np.zeros_like(inputs["h0"]))
    reads0, _, _ = ref_memory_scan(*zero_inputs.values(), *params)
    assert np.all(reads0[:, 0] == 0.0)
    # splitting the sequence and passing the state on gives the same result
    first = {k: (v[:, :1] if k not in ("h0", "c0") else v) for k, v in inputs.items()}
    r1, h1, c1 = ref_memory_scan(*first.values(), *params)
    rest = {k: (v[:, 1:] if k not in ("h0", "c0") else v) for k, v in inputs.items()}
    rest.update(h0=h1, c0=c1)
    r2, h2, c2 = ref_memory_scan(*rest.values(), *params)
    np.testing.assert_allclose(np.concatenate([r1, r2], axis=1), reads, rtol=1e-14)
    np.testing.assert_allclose(h2, h, rtol=1e-14)


@settings(max_examples=6)
@given(shape=grid_shapes(max_cells=6), batch=st.integers(1, 2), channels=st.integers(1, 2),
       steps=st.integers(1, 3), sigma=st.lists(log_uniform_sigma, min_size=6, max_size=6),
       seed=seeds, data=st.data())
def test_scan_vjp_matches_central_differences(shape, batch, channels, steps, sigma, seed, data):
    rng = np.random.default_rng(seed)
    inputs = _scan_inputs(rng, batch, channels, shape, steps)
    inputs["read_coords"] = data.draw(smooth_coords_array(batch, steps, shape))
    inputs["write_sigma"] = np.asarray(sigma[: batch * steps]).reshape(batch, steps)
    params = _conv_params(rng, len(shape), 2 * channels, 4 * channels)
    args = [*inputs.values(), *params]
    g = (rng.standard_normal((batch, steps, channels)),
         rng.standard_normal(inputs["h0"].shape), rng.standard_normal(inputs["h0"].shape))
    analytic = ref_memory_scan_vjp(*args, *g)
    fd = central_difference_vjp(ref_memory_scan, args, g, range(10),
                                step=fd_step_for_sigma(inputs["write_sigma"]))
    for i, (a, f) in enumerate(zip(analytic, fd, strict=True)):
        assert relative_error(a, f, floor=FD_FLOOR) <= FD_TOL, i
