"""Backend dispatch and cross-backend agreement of every primitive, fast path and generic.

Every available namespace (numpy, array_api_strict, torch, jax; cupy on a GPU)
x every primitive (read, write, factorized conv, ConvLSTM step, scan) x forward
and VJP x {default table (fast paths), forced generic} agrees with the float64
reference of ``tmcore.testing.reference`` within its dtype's tolerance. Torch is
also checked against ``grid_sample`` / ``conv3d`` and their autograd, JAX against
``jax.vjp`` of the generic forward and under ``jax.jit`` (64-bit mode on and
off), and float16 / bfloat16 against the mixed-precision rule.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from _helpers import coords_array, grid_shapes, radii, seeds, smooth_coords_array, to_numpy
from conftest import load_namespace
from hypothesis import given, settings
from hypothesis import strategies as st

import tmcore
import tmcore.backends as backends
from tmcore.runtime.dispatch import generic_ops, ops_for
from tmcore.testing import reference as ref
from tmcore.types import ConvParams

BACKENDS = ["numpy", "array_api_strict", "torch", "jax", "cupy"]
PATHS = ["default", "generic"]
TOL = {"float64": 1e-9, "float32": 2e-4, "float16": 2e-2, "bfloat16": 8e-2}
EXAMPLES = 5


def _gpu_ok(module) -> bool:
    try:
        return module.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any CUDA failure means no usable GPU
        return False


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    """``(name, namespace module)`` for each installed namespace."""
    name = request.param
    module = load_namespace(name)
    if name == "cupy" and not _gpu_ok(module):
        pytest.skip("cupy: no CUDA GPU available")
    return name, module


@pytest.fixture(scope="module", params=PATHS)
def path(request, backend):
    """The dispatch path: the default table or forced generic (skipped when identical)."""
    name, module = backend
    if request.param == "generic":
        sample = convert(name, np.zeros((1, 1, 1)), "float64")
        if ops_for(_namespace(sample)) is generic_ops():
            pytest.skip(f"{name} has no fast path: default is the generic path")
        if name == "jax":
            import jax

            from tmcore.backends import native

            if jax.default_backend() == "cpu" and native.jax_library() is None:
                pytest.skip("jax on CPU without the fused kernels: the default table runs the "
                            "generic math (its lax conv is tested by "
                            "test_jax_matches_autodiff_of_generic_under_jit)")
    return request.param


def _namespace(x):
    import array_api_compat

    return array_api_compat.array_namespace(x)


def convert(name: str, value: np.ndarray, dtype: str):
    """``value`` as an array of backend ``name`` with ``dtype``."""
    if name == "torch":
        import torch

        return torch.tensor(np.asarray(value, dtype=np.float64), dtype=getattr(torch, dtype))
    if name == "jax":
        import jax.numpy as jnp

        return jnp.asarray(np.asarray(value, dtype=np.float64), dtype=getattr(jnp, dtype))
    module = load_namespace(name)
    return module.asarray(np.asarray(value, dtype=dtype))


def quantize(value: np.ndarray, dtype: str) -> np.ndarray:
    """``value`` rounded to ``dtype`` and back to float64 (the reference's inputs)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(value, dtype=ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(value, dtype=dtype).astype(np.float64)


@contextlib.contextmanager
def running(name: str, dtype: str, path: str):
    """JAX 64-bit mode for float64 only (so both modes are exercised), and the path switch."""
    with contextlib.ExitStack() as stack:
        if name == "jax":
            import jax

            stack.enter_context(jax.enable_x64(dtype == "float64"))
        stack.enter_context(tmcore.options(generic=path == "generic"))
        yield


def as_float64(x) -> np.ndarray:
    """A float64 NumPy copy of an array of any backend (bfloat16 included)."""
    if hasattr(x, "detach"):  # torch: NumPy has no bfloat16
        import torch

        return x.detach().to("cpu", torch.float64).numpy()
    if type(x).__module__.startswith("jax"):
        return np.asarray(x).astype(np.float64)
    return np.asarray(to_numpy(x), dtype=np.float64)


# JAX compiles every eager op per shape: a few fixed shapes keep its cache warm.
JAX_SHAPES = [(3,), (2, 3), (3, 2, 2), (2, 1, 2, 2)]


def draw_shape(data, name: str, max_cells: int = 24) -> tuple[int, ...]:
    if name == "jax":
        return data.draw(st.sampled_from(JAX_SHAPES))
    return data.draw(grid_shapes(max_cells=max_cells))


def check(actual, expected, dtype: str, what: str) -> None:
    actual = as_float64(actual)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-3)
    err = float(np.max(np.abs(actual - expected), initial=0.0)) / scale
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def _smooth_coords(rng, batch: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """Coordinates strictly between cell centres (away from every kink)."""
    n = len(shape)
    sizes = np.asarray([shape[n - 1 - k] for k in range(n)], dtype=np.float64)
    cell = rng.integers(0, np.maximum(sizes - 1, 1), (batch, count, n))
    u = cell + rng.uniform(0.1, 0.9, (batch, count, n))
    return np.where(sizes > 1, 2.0 * u / np.maximum(sizes - 1, 1) - 1.0, 0.3)


def _params(rng, n: int, c_in: int, c_out: int) -> list[np.ndarray]:
    return [rng.standard_normal((n, c_in, 3)) * 0.6, rng.standard_normal((n, c_in)) * 0.3,
            rng.standard_normal((c_out, c_in)) / math.sqrt(c_in),
            rng.standard_normal((c_out,)) * 0.3]


DTYPES = pytest.mark.parametrize("dtype", ["float64", "float32"])


# ----------------------------------------------------------------------------- agreement


@DTYPES
@settings(max_examples=EXAMPLES)
@given(data=st.data(), seed=seeds)
def test_sample_agrees(backend, path, dtype, data, seed):
    with running(backend[0], dtype, path):
        name, _ = backend
        shape = draw_shape(data, name)
        rng = np.random.default_rng(seed)
        batch, queries, channels = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), 2
        if name == "jax":
            batch, queries = 2, 2
        coords_of = coords_array if dtype == "float64" else smooth_coords_array
        coords = quantize(data.draw(coords_of(batch, queries, shape)), dtype)
        volume = quantize(rng.standard_normal((batch, channels, *shape)), dtype)
        g = quantize(rng.standard_normal((batch, queries, channels)), dtype)
        v, c, gg = (convert(name, a, dtype) for a in (volume, coords, g))
        out = tmcore.trilinear_sample(v, c)
        d_volume, d_coords = tmcore.trilinear_sample_vjp(v, c, gg)
        assert out.dtype == v.dtype and d_coords.dtype == c.dtype
        check(out, ref.ref_trilinear_sample(volume, coords), dtype, "sample")
        ref_dv, ref_dc = ref.ref_trilinear_sample_vjp(volume, coords, g)
        check(d_volume, ref_dv, dtype, "d_volume")
        check(d_coords, ref_dc, dtype, "d_coords")


@DTYPES
@settings(max_examples=EXAMPLES)
@given(data=st.data(), seed=seeds)
def test_splat_agrees(backend, path, dtype, data, seed):
    with running(backend[0], dtype, path):
        name, _ = backend
        shape = draw_shape(data, name)
        rng = np.random.default_rng(seed)
        batch, writes, channels = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), 2
        if name == "jax":
            batch, writes = 2, 1
        mu = quantize(data.draw(coords_array(batch, writes, shape)), dtype)
        sigma = quantize(rng.uniform(0.15, 0.8, (batch, writes)), dtype)
        # a truncation box can flip on rounding at its edge: only in float64
        radius = data.draw(radii) if dtype == "float64" else None
        content = quantize(rng.standard_normal((batch, writes, channels)), dtype)
        g = quantize(rng.standard_normal((batch, channels, *shape)), dtype)
        a = [convert(name, x, dtype) for x in (content, mu, sigma, g)]
        out = tmcore.gaussian_splat(*a[:3], shape, radius=radius)
        grads = tmcore.gaussian_splat_vjp(*a[:3], shape, a[3], radius=radius)
        check(out, ref.ref_gaussian_splat(content, mu, sigma, shape, radius=radius), dtype, "splat")
        expected = ref.ref_gaussian_splat_vjp(content, mu, sigma, shape, g, radius=radius)
        for got, want, what in zip(grads, expected, ("d_content", "d_mu", "d_sigma"), strict=True):
            check(got, want, dtype, what)


@DTYPES
@settings(max_examples=EXAMPLES)
@given(data=st.data(), c_in=st.integers(1, 4), c_out=st.integers(1, 4), seed=seeds)
def test_conv_agrees(backend, path, dtype, data, c_in, c_out, seed):
    with running(backend[0], dtype, path):
        name, _ = backend
        if name == "jax":
            c_in, c_out = 3, 4
        shape = draw_shape(data, name)
        rng = np.random.default_rng(seed)
        x = quantize(rng.standard_normal((2, c_in, *shape)), dtype)
        params = [quantize(p, dtype) for p in _params(rng, len(shape), c_in, c_out)]
        g = quantize(rng.standard_normal((2, c_out, *shape)), dtype)
        xa, ga = convert(name, x, dtype), convert(name, g, dtype)
        pa = ConvParams(*(convert(name, p, dtype) for p in params))
        out = tmcore.factorized_conv(xa, pa)
        d_x, d_params = tmcore.factorized_conv_vjp(xa, pa, ga)
        check(out, ref.ref_factorized_conv(x, *params), dtype, "conv")
        expected = ref.ref_factorized_conv_vjp(x, *params, g)
        for got, want, what in zip((d_x, *d_params), expected, ("d_x", *ConvParams._fields),
                                   strict=True):
            check(got, want, dtype, what)


@DTYPES
@settings(max_examples=EXAMPLES)
@given(data=st.data(), steps=st.integers(1, 2), seed=seeds)
def test_scan_agrees(backend, path, dtype, data, steps, seed):
    """The scan composes ``step_fwd`` / ``step_bwd``, so this covers their dispatch too."""
    with running(backend[0], dtype, path):
        name, _ = backend
        shape = draw_shape(data, name, max_cells=12)
        if name == "jax":
            shape, steps = (2, 3), 2
        rng = np.random.default_rng(seed)
        batch, channels, n = 2, 2, len(shape)
        q = [
            quantize(rng.standard_normal((batch, channels, *shape)) * 0.5, dtype),
            quantize(rng.standard_normal((batch, channels, *shape)) * 0.5, dtype),
            quantize(rng.uniform(-0.9, 0.9, (batch, steps, n)), dtype),
            quantize(rng.uniform(-0.9, 0.9, (batch, steps, n)), dtype),
            quantize(rng.uniform(0.2, 0.6, (batch, steps)), dtype),
            quantize(rng.standard_normal((batch, steps, channels)), dtype),
        ]
        params = [quantize(p, dtype) for p in _params(rng, n, 2 * channels, 4 * channels)]
        g_reads = quantize(rng.standard_normal((batch, steps, channels)), dtype)
        g_h, g_c = (quantize(rng.standard_normal(q[0].shape), dtype) for _ in range(2))
        a = [convert(name, x, dtype) for x in q]
        pa = ConvParams(*(convert(name, p, dtype) for p in params))
        ga = [convert(name, x, dtype) for x in (g_reads, g_h, g_c)]
        outs = tmcore.memory_scan(*a, pa)
        grads = tmcore.memory_scan_vjp(*a, pa, *ga)
        for got, want, what in zip(outs, ref.ref_memory_scan(*q, *params), ("reads", "h", "c"),
                                   strict=True):
            check(got, want, dtype, what)
        expected = ref.ref_memory_scan_vjp(*q, *params, g_reads, g_h, g_c)
        got = (*grads[:6], *grads.params)
        for k, (g_, want) in enumerate(zip(got, expected, strict=True)):
            check(g_, want, dtype, f"scan grad {k}")


# ----------------------------------------------------------------------------- mixed precision

HALF = [("torch", "float16"), ("torch", "bfloat16"), ("jax", "float16"), ("jax", "bfloat16")]


@pytest.mark.parametrize(("name", "dtype"), HALF)
def test_half_precision_computes_in_float32(name, dtype):
    pytest.importorskip(name, reason=f"{name} is not installed")
    rng = np.random.default_rng(7)
    shape = (3, 4, 3)
    volume = quantize(rng.standard_normal((2, 3, *shape)), dtype)
    coords = quantize(_smooth_coords(rng, 2, 2, shape), dtype)
    g = quantize(rng.standard_normal((2, 2, 3)), dtype)
    v, c, gg = (convert(name, x, dtype) for x in (volume, coords, g))
    out = tmcore.trilinear_sample(v, c)
    d_v, d_c = tmcore.trilinear_sample_vjp(v, c, gg)
    assert (out.dtype, d_v.dtype, d_c.dtype) == (v.dtype,) * 3
    check(out, ref.ref_trilinear_sample(volume, coords), dtype, "sample")
    for got, want in zip((d_v, d_c), ref.ref_trilinear_sample_vjp(volume, coords, g),
                         strict=True):
        check(got, want, dtype, "sample vjp")

    content = quantize(rng.standard_normal((2, 1, 3)), dtype)
    mu = quantize(rng.uniform(-0.8, 0.8, (2, 1, 3)), dtype)
    sigma = quantize(rng.uniform(0.2, 0.6, (2, 1)), dtype)
    gv = quantize(rng.standard_normal((2, 3, *shape)), dtype)
    a = [convert(name, x, dtype) for x in (content, mu, sigma, gv)]
    out = tmcore.gaussian_splat(*a[:3], shape)
    assert out.dtype == a[0].dtype
    check(out, ref.ref_gaussian_splat(content, mu, sigma, shape), dtype, "splat")
    for got, want, x in zip(tmcore.gaussian_splat_vjp(*a[:3], shape, a[3]),
                            ref.ref_gaussian_splat_vjp(content, mu, sigma, shape, gv), a,
                            strict=False):
        assert got.dtype == x.dtype
        check(got, want, dtype, "splat vjp")

    x = quantize(rng.standard_normal((2, 4, *shape)), dtype)
    params = [quantize(p, dtype) for p in _params(rng, 3, 4, 6)]
    gz = quantize(rng.standard_normal((2, 6, *shape)), dtype)
    xa, ga = convert(name, x, dtype), convert(name, gz, dtype)
    pa = ConvParams(*(convert(name, p, dtype) for p in params))
    out = tmcore.factorized_conv(xa, pa)
    assert out.dtype == xa.dtype
    check(out, ref.ref_factorized_conv(x, *params), dtype, "conv")
    d_x, d_p = tmcore.factorized_conv_vjp(xa, pa, ga)
    assert d_x.dtype == xa.dtype and all(d.dtype == p.dtype for d, p in zip(d_p, pa,
                                                                             strict=True))
    for got, want in zip((d_x, *d_p), ref.ref_factorized_conv_vjp(x, *params, gz), strict=True):
        check(got, want, dtype, "conv vjp")


# ----------------------------------------------------------------------------- torch natives


@pytest.fixture
def torch_mod():
    return pytest.importorskip("torch", reason="torch is not installed")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dense_volume_grad", [False, True])
def test_torch_sample_matches_grid_sample_autograd(torch_mod, monkeypatch, n, dense_volume_grad):
    """Against ``F.grid_sample`` and its autograd; ``dense_volume_grad`` runs the CUDA
    default (deterministic dense volume gradient) on the CPU."""
    torch = torch_mod
    from tmcore.backends.torch import sample

    if dense_volume_grad:
        monkeypatch.setattr(sample, "_atomic_ok", lambda volume: False)
    gen = torch.Generator().manual_seed(n)
    shape = (4, 5, 3)[:n]
    volume = torch.randn(2, 3, *shape, dtype=torch.float64, generator=gen, requires_grad=True)
    coords = (torch.rand(2, 7, n, dtype=torch.float64, generator=gen) * 2.4 - 1.2)
    coords.requires_grad_(True)
    grid = coords.reshape(2, *([1] * (n - 1)), 7, n)
    expected = torch.nn.functional.grid_sample(volume, grid, mode="bilinear",
                                               padding_mode="border", align_corners=True)
    expected = expected.reshape(2, 3, 7).transpose(1, 2)
    g = torch.randn(2, 7, 3, dtype=torch.float64, generator=gen)
    ref_dv, ref_dc = torch.autograd.grad(expected, (volume, coords), g)
    with torch.no_grad():
        out = tmcore.trilinear_sample(volume, coords)
        d_v, d_c = tmcore.trilinear_sample_vjp(volume, coords, g)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_v, ref_dv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_c, ref_dc, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spatial", [(3, 4, 5), (1, 2, 3), (4, 1, 1), (2, 3, 1)])
@pytest.mark.parametrize("kernel", ["grouped", "shifts"])
def test_torch_conv_matches_conv3d_autograd(torch_mod, monkeypatch, kernel, spatial):
    """Every depthwise kernel against a chain of ``conv3d`` calls and its autograd
    (size-1 and size-2 axes included)."""
    torch = torch_mod
    F = torch.nn.functional
    tmcore.options(depthwise=kernel)  # for this test only (conftest restores the options)
    gen = torch.Generator().manual_seed(3)
    c_in, c_out = 4, 6
    x = torch.randn(2, c_in, *spatial, dtype=torch.float64, generator=gen, requires_grad=True)
    leaves = [torch.randn(*s, dtype=torch.float64, generator=gen, requires_grad=True)
              for s in ((3, c_in, 3), (3, c_in), (c_out, c_in), (c_out,))]
    y = x
    for axis in range(3):
        kernel_shape = [1, 1, 1]
        kernel_shape[axis] = 3
        padding = [0, 0, 0]
        padding[axis] = 1
        y = F.conv3d(y, leaves[0][axis].reshape(c_in, 1, *kernel_shape), leaves[1][axis],
                     padding=tuple(padding), groups=c_in)
    expected = F.conv3d(y, leaves[2][:, :, None, None, None], leaves[3])
    g = torch.randn_like(expected)
    ref_grads = torch.autograd.grad(expected, (x, *leaves), g)
    params = ConvParams(*(p.detach() for p in leaves))
    out = tmcore.factorized_conv(x.detach(), params)
    d_x, d_p = tmcore.factorized_conv_vjp(x.detach(), params, g)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-10)
    for got, want in zip((d_x, *d_p), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_torch_fast_paths_are_differentiable_by_autograd(torch_mod):
    """The fast forwards are plain torch ops: autograd through them equals tmcore's VJPs."""
    torch = torch_mod
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 3, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    params = ConvParams(*(torch.randn(*s, dtype=torch.float64, generator=gen)
                          for s in ((3, 4, 3), (3, 4), (5, 4), (5,))))
    out = tmcore.factorized_conv(x, params)
    g = torch.randn_like(out)
    (auto,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(auto, tmcore.factorized_conv_vjp(x.detach(), params, g)[0])


# ----------------------------------------------------------------------------- jax natives


@pytest.mark.parametrize(("kernel", "x64"), [("grouped", False), ("grouped", True),
                                             ("shifts", False)])
def test_jax_matches_autodiff_of_generic_under_jit(monkeypatch, x64, kernel):
    """Fast VJPs (jitted) equal ``jax.vjp`` of the generic forward, 64-bit mode on and off."""
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import jax.numpy as jnp

    tmcore.options(depthwise=kernel)  # for this test only (conftest restores the options)
    rng = np.random.default_rng(11)
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        tol = 1e-10 if x64 else 2e-5
        shape = (3, 4, 3)

        def arr(*s, scale=1.0):
            return jnp.asarray(rng.standard_normal(s) * scale, dtype=dtype)

        volume = arr(2, 3, *shape)
        coords = jnp.asarray(_smooth_coords(rng, 2, 4, shape), dtype)
        x = arr(2, 4, *shape)
        params = ConvParams(arr(3, 4, 3), arr(3, 4), arr(6, 4, scale=0.5), arr(6))
        content, mu, sigma = arr(2, 1, 3), arr(2, 1, 3, scale=0.3), jnp.full((2, 1), 0.4, dtype)

        def generic(f):
            def run(*args):
                with tmcore.options(generic=True):
                    return f(*args)
            return run

        cases = [(tmcore.factorized_conv, tmcore.factorized_conv_vjp, (x, params))]
        if kernel == "generic":  # the read and write do not depend on the conv kernel
            cases += [
                (tmcore.trilinear_sample, tmcore.trilinear_sample_vjp, (volume, coords)),
                (lambda c, m, s: tmcore.gaussian_splat(c, m, s, shape),
                 lambda c, m, s, g: tmcore.gaussian_splat_vjp(c, m, s, shape, g),
                 (content, mu, sigma)),
            ]
        for forward, vjp, args in cases:
            out, pullback = jax.vjp(generic(forward), *args)
            g = jnp.asarray(rng.standard_normal(out.shape), dtype)
            expected = pullback(g)
            fast_out = jax.jit(forward)(*args)
            got = jax.jit(vjp)(*args, g)
            assert fast_out.dtype == dtype
            np.testing.assert_allclose(fast_out, out, rtol=tol, atol=tol)
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected),
                            strict=True):
                assert a.dtype == dtype
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol * 10)


# ----------------------------------------------------------------------------- dispatch


def test_import_tmcore_imports_no_framework():
    code = ("import sys, tmcore, tmcore.backends; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy', 'array_api_strict') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "TMCORE_GENERIC": ""})
    assert out.stdout.strip() == "[]"


def test_tables_are_cached_per_namespace_and_switchable():
    import array_api_compat.numpy as xp_numpy

    assert ops_for(xp_numpy) is ops_for(xp_numpy)
    assert backends.backend_name(xp_numpy) == "numpy"
    strict = pytest.importorskip("array_api_strict", reason="array_api_strict is not installed")
    assert backends.backend_name(strict) == "generic"
    assert ops_for(strict) is generic_ops()
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import array_api_compat.torch as xp_torch

    fast = ops_for(xp_torch)
    assert fast.sample_fwd is not generic_ops().sample_fwd
    with tmcore.options(generic=True):
        assert ops_for(xp_torch) is generic_ops()
        with tmcore.options(generic=False):
            assert ops_for(xp_torch) is fast
    assert ops_for(xp_torch) is fast
    assert torch.is_tensor(tmcore.trilinear_sample(torch.zeros(1, 1, 2, 2),
                                                   torch.zeros(1, 1, 2)))


def test_environment_variable_forces_generic():
    pytest.importorskip("torch", reason="torch is not installed")
    code = ("import torch, array_api_compat.torch as xp, tmcore, tmcore.backends as b; "
            "print(b.ops_for(xp) is b.generic_ops(), end=' ')\n"
            "with tmcore.options(generic=False): print(b.ops_for(xp) is b.generic_ops())")
    for value, expected in (("1", "True False"),):  # unset / "0": the in-process tests
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, backends.ENV_VAR: value})
        assert out.stdout.strip() == expected


def test_backend_is_not_imported_without_its_framework():
    """A namespace whose framework is not in ``sys.modules`` gets the generic table."""
    fake = types.ModuleType("cupy")
    if "cupy" in sys.modules:
        pytest.skip("cupy is imported in this process")
    assert backends.ops_for_namespace(fake, generic_ops()) is generic_ops()
    assert "tmcore.backends.cupy" not in sys.modules


def test_gpu_check_runs_on_cpu():
    """``benchmarks/gpu_check.py --device cpu`` on a tiny config: runs, checks, prints."""
    pytest.importorskip("torch", reason="torch is not installed")
    script = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks",
                          "gpu_check.py")
    out = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--configs", "tiny", "--budget", "0",
         "--frameworks", "numpy", "torch", "cupy", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cupy: skipped:" in out.stdout
    assert "torch-cpu   tiny   step vjp" in out.stdout
    assert "0 failures" in out.stdout
