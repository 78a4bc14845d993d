"""Numeric edges give one answer on every path (docs/guides/errors-and-cache.md).

Each case runs on NumPy (the generic path), torch with its fast paths (the
fused C kernels, ``grid_sample``), torch forced onto the generic path, and JAX
(fast paths, including the C kernels as XLA custom calls, and generic) where
installed, and compares them:

- the float32 gates: ``sigmoid(-inf)`` is exactly 0 (the C kernels' clamped
  ``exp`` gave 2.9e-39, and then a huge ``c`` leaked into ``c'``);
- a write centred at +-1e30 in float32: finite gradients (``0 * inf`` was NaN);
- an infinite read coordinate: the border value and a zero coordinate gradient
  (NumPy / JAX gave NaN on a size-1 axis, torch finite; torch's ``grid_sampler``
  backward crashed on NaN coordinates);
- ``sigma = 0`` with ``eps = 0`` on a cell centre: weight 1 there, 0 elsewhere,
  zero gradients for mu and sigma (``0 / 0`` was NaN).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pytest

import tmcore
from tmcore.runtime.dispatch import ops_for

INF = float("inf")


def _to_numpy(value):
    if isinstance(value, (tuple, list)):
        return [_to_numpy(v) for v in value]
    if hasattr(value, "detach"):
        value = value.detach()
    return np.asarray(value)


def _paths() -> list[tuple[str, Callable, Callable]]:
    """``(name, to_array(np_array), runner(fn))`` for every available path."""
    paths = [("numpy", lambda a: a, lambda fn: fn())]

    def generic(fn):
        with tmcore.options(generic=True):
            return fn()

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        paths += [("torch", torch.from_numpy, lambda fn: fn()),
                  ("torch-generic", torch.from_numpy, generic)]
    try:
        import jax.numpy as jnp
    except ImportError:
        jnp = None
    if jnp is not None:
        paths += [("jax", jnp.asarray, lambda fn: fn()), ("jax-generic", jnp.asarray, generic)]
    return paths


PATHS = _paths()


def _run_all(fn: Callable, *arrays: np.ndarray) -> dict[str, list[np.ndarray]]:
    """``fn(*arrays)`` on every path, as flat lists of NumPy arrays."""
    results = {}
    for name, to_array, runner in PATHS:
        converted = [to_array(a) for a in arrays]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # NumPy: overflow in squares
            out = runner(lambda: fn(*converted))  # noqa: B023
        flat = []
        for part in out if isinstance(out, (tuple, list)) else (out,):
            flat.extend(_to_numpy(part) if isinstance(part, (tuple, list)) else [_to_numpy(part)])
        results[name] = flat
    return results


def _agree(results: dict[str, list[np.ndarray]], rtol: float = 1e-6, atol: float = 1e-6):
    """Every path gives the NumPy result (same NaN pattern, values close)."""
    reference = results["numpy"]
    for name, got in results.items():
        assert len(got) == len(reference)
        for a, b in zip(got, reference, strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                       rtol=rtol, atol=atol, equal_nan=True, err_msg=name)


# --------------------------------------------------------------------------- gates


def _gates_case():
    """z (1, 4C, 4), c (1, C, 4), C = 2, with -inf / +inf pre-activations and a huge c."""
    z = np.zeros((1, 8, 4), np.float32)
    c = np.full((1, 2, 4), 1e38, np.float32)
    z[0, 0:2] = -INF  # input gate shut: sigmoid(-inf) = 0 exactly
    z[0, 2:4] = -INF  # forget gate shut: c' = 0 * 1e38 + 0 * g = 0
    z[0, 2:4, 1] = INF  # ... except position 1: c' = c
    z[0, 4:6] = INF
    z[0, 6:8] = np.array([-INF, -3.0, 0.5, INF], np.float32)
    return z, c


def test_float32_gates_saturate_exactly_on_every_path():
    z, c = _gates_case()

    def gates(z_, c_):
        xp = tmcore.runtime.validate.namespace_of(z=z_, c=c_)
        h, c_new, residuals = ops_for(xp).gates_fwd(xp, z_, c_)
        d_z, d_c = ops_for(xp).gates_bwd(xp, residuals, c_ * 0.0 + 1.0, c_ * 0.0 + 1.0)
        return h, c_new, d_z, d_c

    results = _run_all(gates, z, c)
    _agree(results, rtol=1e-6, atol=1e-30)
    h, c_new = results["numpy"][:2]
    assert np.all(c_new[0, :, [0, 2, 3]] == 0.0), c_new  # exactly 0, not 3e38 * 2.9e-39
    np.testing.assert_array_equal(c_new[0, :, 1], 1e38 * np.ones(2, np.float32))
    assert np.all(h[0, :, [0, 2, 3]] == 0.0)


def test_the_c_kernels_sigmoid_of_minus_inf_is_zero():
    """The float32 C gates alone: sigmoid(-inf) = 0 and sigmoid(inf) = 1 exactly."""
    torch = pytest.importorskip("torch")
    from tmcore.backends.native import calls
    from tmcore.backends.torch import gates

    z = torch.zeros(1, 4, 3)
    z[0, 0] = torch.tensor([-INF, INF, -100.0])  # input gate
    z[0, 3] = 1.0  # g = tanh(1)
    c = torch.zeros(1, 1, 3)
    with torch.no_grad():
        assert calls.kernels_for(z, c) is not None or pytest.skip("no fused kernels here")
        _, c_new, residuals = gates.gates_fwd(None, z, c)
    assert isinstance(residuals, gates._NativeGateResiduals)
    i = c_new[0, 0] / np.tanh(1.0)
    assert i[0] == 0.0 and i[2] == 0.0  # the old clamped exp gave 2.9e-39
    torch.testing.assert_close(i[1], torch.tensor(1.0))


# --------------------------------------------------------------------------- writes


@pytest.mark.parametrize("far", [1e30, -1e30, 1e20])
def test_a_far_write_has_finite_gradients_on_every_path(far):
    content = np.array([[[1.0, -2.0]]], np.float32)
    mu = np.array([[[far, 0.0]]], np.float32)
    sigma = np.array([[0.3]], np.float32)
    g = np.ones((1, 2, 3, 4), np.float32)

    def splat(content_, mu_, sigma_, g_):
        volume = tmcore.gaussian_splat(content_, mu_, sigma_, (3, 4))
        return volume, *tmcore.gaussian_splat_vjp(content_, mu_, sigma_, (3, 4), g_)

    results = _run_all(splat, content, mu, sigma, g)
    _agree(results)
    for name, parts in results.items():
        for part in parts:
            assert np.all(np.isfinite(part)) and not np.any(part), name  # all exactly 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigma_zero_with_eps_zero_on_a_centre_is_a_one_hot_weight(dtype):
    """The documented limit: weight 1 on the centre the write hits, 0 elsewhere, and
    zero gradients for mu and sigma (the weight is flat on either side of the step)."""
    shape = (3, 5)
    content = np.array([[[2.0], [1.0]]], dtype)  # K = 2 writes
    mu = np.array([[[0.5, 0.0], [0.3, 1.0]]], dtype)  # the first on a centre, the second off
    sigma = np.zeros((1, 2), dtype)
    g = np.arange(15, dtype=dtype).reshape(1, 1, *shape)

    def splat(content_, mu_, sigma_, g_):
        volume = tmcore.gaussian_splat(content_, mu_, sigma_, shape, eps=0.0)
        return volume, *tmcore.gaussian_splat_vjp(content_, mu_, sigma_, shape, g_, eps=0.0)

    results = _run_all(splat, content, mu, sigma, g)
    _agree(results)
    volume, d_content, d_mu, d_sigma = results["numpy"]
    expected = np.zeros((1, 1, *shape), dtype)
    expected[0, 0, 1, 3] = 2.0  # mu = (x 0.5, y 0.0): column 3 of 5, row 1 of 3
    np.testing.assert_array_equal(volume, expected)
    np.testing.assert_array_equal(d_content[0, :, 0], [g[0, 0, 1, 3], 0.0])
    assert not np.any(d_mu) and not np.any(d_sigma)


# --------------------------------------------------------------------------- reads


@pytest.mark.parametrize("shape", [(4,), (1,), (3, 4), (4, 1), (2, 3, 4), (1, 2, 1)])
def test_an_infinite_read_coordinate_reads_the_border_on_every_path(shape):
    n = len(shape)
    rng = np.random.default_rng(0)
    volume = rng.standard_normal((2, 3, *shape)).astype(np.float32)
    coords = rng.uniform(-0.9, 0.9, (2, 4, n)).astype(np.float32)
    coords[0, 1, 0] = INF
    coords[1, 2, :] = -INF
    coords[1, 3, -1] = -INF
    far = np.clip(coords, -5.0, 5.0)  # any far coordinate reads the border
    g = rng.standard_normal((2, 4, 3)).astype(np.float32)

    def sample(volume_, coords_, g_):
        return (tmcore.trilinear_sample(volume_, coords_),
                *tmcore.trilinear_sample_vjp(volume_, coords_, g_))

    results = _run_all(sample, volume, coords, g)
    _agree(results, rtol=1e-5, atol=1e-5)
    read, d_volume, d_coords = results["numpy"]
    assert np.all(np.isfinite(read)) and np.all(np.isfinite(d_volume))
    assert d_coords[0, 1, 0] == 0.0 and not np.any(d_coords[1, 2])
    expected = _run_all(sample, volume, far, g)["numpy"]
    for a, b in zip(results["numpy"], expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(4,), (1,), (3, 4), (2, 3, 4)])
def test_a_nan_read_coordinate_propagates_alike_and_never_crashes(shape):
    """NaN reads NaN, its query's coordinate gradient is NaN and so is the volume gradient
    of its batch element; the other batch element is untouched (torch's grid_sampler
    backward crashed here)."""
    n = len(shape)
    rng = np.random.default_rng(1)
    volume = rng.standard_normal((2, 2, *shape)).astype(np.float32)
    coords = rng.uniform(-1, 1, (2, 3, n)).astype(np.float32)
    coords[0, 1, 0] = np.nan
    g = rng.standard_normal((2, 3, 2)).astype(np.float32)

    def sample(volume_, coords_, g_):
        return (tmcore.trilinear_sample(volume_, coords_),
                *tmcore.trilinear_sample_vjp(volume_, coords_, g_))

    results = _run_all(sample, volume, coords, g)
    _agree(results, rtol=1e-5, atol=1e-5)
    read, d_volume, d_coords = results["numpy"]
    assert np.isnan(read[0, 1]).all() and np.isfinite(np.delete(read[0], 1, axis=0)).all()
    assert np.isnan(d_coords[0, 1]).all() and np.isfinite(d_coords[1]).all()
    assert np.isnan(d_volume[0]).all() and np.isfinite(d_volume[1]).all()
