"""The generic path is lazy-safe: under ``jax.jit`` and on dask it never syncs to the host.

array-api-extra's :func:`~array_api_extra.testing.lazy_xp_function` tags tmcore's public
functions; :func:`~array_api_extra.testing.patch_lazy_xp_functions` then replaces them,
for the tests of this module only, with a ``jax.jit``-ed version (JAX) or with one that
raises if it computes the dask graph (dask). A data-dependent shape, a ``float()`` /
``bool()`` of an array or an ``np.asarray`` inside tmcore fails here. Every result is also
compared with the same call on NumPy. The generic path is forced (``generic=True``): it is
the reference every backend is held to and what any other lazy namespace runs.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import numpy as np
import pytest
from array_api_extra.testing import lazy_xp_function, patch_lazy_xp_functions

import tmcore
from tmcore import (
    convlstm_step,
    convlstm_step_vjp,
    factorized_conv,
    factorized_conv_vjp,
    gaussian_splat,
    gaussian_splat_vjp,
    memory_scan,
    memory_scan_vjp,
    trilinear_sample,
    trilinear_sample_vjp,
)

for _fn in (trilinear_sample, trilinear_sample_vjp, gaussian_splat, gaussian_splat_vjp,
            factorized_conv, factorized_conv_vjp, convlstm_step, convlstm_step_vjp,
            memory_scan, memory_scan_vjp):
    lazy_xp_function(_fn)

B, C, T, S = 2, 3, 2, (2, 3, 2)
RNG = np.random.default_rng(7)
COORDS = RNG.uniform(-1.2, 1.2, (B, T, len(S)))  # some beyond the border
VOLUME = RNG.standard_normal((B, C, *S))
SIGMA = RNG.uniform(0.2, 0.6, (B, T))
CONTENT = RNG.standard_normal((B, T, C))
BOUND = tmcore.xavier_uniform_bound(2 * C, 4 * C)
POINTWISE = RNG.uniform(-BOUND, BOUND, (4 * C, 2 * C))
G_READS = RNG.standard_normal((B, T, C))


def _load(name: str) -> ModuleType:
    if name == "jax":
        pytest.importorskip("jax", reason="jax is not installed")
        import jax.numpy as jnp

        return jnp
    pytest.importorskip("dask", reason="dask is not installed")
    import array_api_compat.dask.array as da

    return da


@pytest.fixture(params=["jax", "dask"])
def xp(request) -> ModuleType:
    """A lazy namespace, with this module's tagged functions patched for it."""
    xp = _load(request.param)
    x64 = contextlib.nullcontext()
    if request.param == "jax":
        import jax

        x64 = jax.enable_x64(True)
    with x64, tmcore.options(generic=True), patch_lazy_xp_functions(request, xp=xp):
        yield xp


def _np(a) -> np.ndarray:
    return np.asarray(a.compute() if hasattr(a, "compute") else a)


def _close(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(_np(g), _np(w), rtol=1e-10, atol=1e-12)


def _params(xp):
    params = tmcore.conv_params_from_pointwise(POINTWISE, ndim=len(S))
    return type(params)(*(xp.asarray(p) for p in params))


def test_read_and_its_vjp(xp):
    volume, coords = xp.asarray(VOLUME), xp.asarray(COORDS)
    g = xp.asarray(G_READS)
    _close([trilinear_sample(volume, coords)], [tmcore.trilinear_sample(VOLUME, COORDS)])
    _close(trilinear_sample_vjp(volume, coords, g),
           tmcore.trilinear_sample_vjp(VOLUME, COORDS, G_READS))


@pytest.mark.parametrize("radius", [None, 2.0])
def test_write_and_its_vjp(xp, radius):
    args = (xp.asarray(CONTENT), xp.asarray(COORDS), xp.asarray(SIGMA))
    g = RNG.standard_normal((B, C, *S))
    _close([gaussian_splat(*args, S, radius=radius)],
           [tmcore.gaussian_splat(CONTENT, COORDS, SIGMA, S, radius=radius)])
    _close(gaussian_splat_vjp(*args, S, xp.asarray(g), radius=radius),
           tmcore.gaussian_splat_vjp(CONTENT, COORDS, SIGMA, S, g, radius=radius))


def test_conv_cell_and_their_vjps(xp):
    params, ref_params = _params(xp), tmcore.conv_params_from_pointwise(POINTWISE, ndim=len(S))
    x = RNG.standard_normal((B, C, *S))
    h = RNG.standard_normal((B, C, *S))
    c = RNG.standard_normal((B, C, *S))
    both = np.concatenate([x, h], axis=1)
    g = RNG.standard_normal((B, 4 * C, *S))
    _close([factorized_conv(xp.asarray(both), params)],
           [tmcore.factorized_conv(both, ref_params)])
    d_x, d_p = factorized_conv_vjp(xp.asarray(both), params, xp.asarray(g))
    ref_x, ref_p = tmcore.factorized_conv_vjp(both, ref_params, g)
    _close([d_x, *d_p], [ref_x, *ref_p])
    args = (xp.asarray(x), xp.asarray(h), xp.asarray(c))
    _close(convlstm_step(*args, params), tmcore.convlstm_step(x, h, c, ref_params))
    d_x, d_h, d_c, d_p = convlstm_step_vjp(*args, params, args[1], args[2])
    refs = tmcore.convlstm_step_vjp(x, h, c, ref_params, h, c)
    _close([d_x, d_h, d_c, *d_p], [*refs[:3], *refs[3]])


def test_scan_and_its_vjp(xp):
    zeros = np.zeros((B, C, *S))
    ref_args = (zeros, zeros, COORDS, COORDS[:, ::-1], SIGMA, CONTENT)
    ref_params = tmcore.conv_params_from_pointwise(POINTWISE, ndim=len(S))
    args = tuple(xp.asarray(a) for a in ref_args)
    _close(memory_scan(*args, _params(xp)), tmcore.memory_scan(*ref_args, ref_params))
    grads = memory_scan_vjp(*args, _params(xp), g_reads=xp.asarray(G_READS))
    ref = tmcore.memory_scan_vjp(*ref_args, ref_params, g_reads=G_READS)
    for name in ("h0", "c0", "read_coords", "write_coords", "write_sigma", "write_content"):
        _close([getattr(grads, name)], [getattr(ref, name)])
    _close(grads.params, ref.params)


def test_the_functions_are_patched(xp):
    """The tags take effect: the module's names are the wrapped functions here."""
    assert trilinear_sample is not tmcore.trilinear_sample
    assert memory_scan_vjp is not tmcore.memory_scan_vjp
