"""The fused CPU cell kernels of the torch backend (``backends/native/kernels.c``).

Checked against the backend's own torch ops (the path they replace) and the
generic float64 math: every depthwise shape class (1 to 4 axes, axes of size 1
and 2), float32 and float64, NaN and saturated gates; when they must step
aside (autograd recording, functorch transforms, other dtypes); the build's
failure modes; the scan pieces that came with them (write blocks, the
per-scan workspace) against a step-by-step composition; and bad calls
(malformed shapes, the custom ops called directly, negative views and
ZeroTensors, allocation failures). The build cache: ``test_native_cache.py``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore  # noqa: E402
import tmcore.backends.native.build as native  # noqa: E402
from tmcore.backends.native import calls  # noqa: E402
from tmcore.backends.torch import conv, gates  # noqa: E402
from tmcore.runtime.options import reload_environment  # noqa: E402
from tmcore.scan import add_params, memory_scan_vjp, step_bwd, step_fwd  # noqa: E402
from tmcore.types import ConvParams, StepInputs  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the fused kernels cannot be built here (no C compiler)")

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _params(gen, n, c_in, c_out, dtype):
    shapes = ((n, c_in, 3), (n, c_in), (c_out, c_in), (c_out,))
    return ConvParams(*(torch.randn(*s, generator=gen, dtype=dtype) for s in shapes))


def _both_paths(fn, *args):
    """``fn(*args)`` on the fused path and on the torch ops it replaces."""
    assert calls.kernels_for(*[a for a in args if isinstance(a, torch.Tensor)]) is not None
    fused = fn(*args)
    with tmcore.options(native=False):
        plain = fn(*args)
    return fused, plain


def _close(a, b, dtype):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, equal_nan=True, **TOL[dtype])


spatial_shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)


def _no_worse(fused, plain, reference):
    """float32: the fused result is as close to the float64 reference as the torch ops'
    (sums of products round differently in another order, so not equal to theirs)."""
    for f, p, r in zip(fused, plain, reference, strict=True):
        scale = float(r.abs().max()) + 1e-30
        err_fused = float((f.double() - r).abs().max())
        err_plain = float((p.double() - r).abs().max())
        assert err_fused <= 4 * err_plain + 1e-6 * scale, (err_fused, err_plain, scale)


@settings(max_examples=25, deadline=None)
@given(spatial=spatial_shapes, channels=st.integers(1, 5), batch=st.integers(1, 3),
       double=st.booleans(), seed=st.integers(0, 2**16))
def test_depthwise_and_pointwise_match_the_torch_ops(spatial, channels, batch, double, seed):
    dtype = torch.float64 if double else torch.float32
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, *spatial, generator=gen, dtype=dtype)
    params = _params(gen, len(spatial), channels, 2 * channels, dtype)
    g = torch.randn(batch, 2 * channels, *spatial, generator=gen, dtype=dtype)
    (z_fused, res), (z_plain, _) = _both_paths(conv.conv_fwd, None, x, params)
    assert isinstance(res, conv._NativeConvResiduals)
    fused = conv.conv_bwd(None, res, params, g)
    plain = conv.conv_bwd(None, conv._depthwise_stages(x, params), params, g)
    fused, plain = (z_fused, fused[0], *fused[1]), (z_plain, plain[0], *plain[1])
    if double:
        _close(fused, plain, dtype)
        return
    x64, g64 = x.double(), g.double()
    p64 = ConvParams(*(t.double() for t in params))
    stages = conv._depthwise_stages(x64, p64)
    z64 = conv._pointwise(stages[-1], p64)
    d64 = conv.conv_bwd(None, stages, p64, g64)
    _no_worse(fused, plain, (z64, d64[0], *d64[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gates_match_the_torch_ops_with_nan_and_saturation(dtype):
    gen = torch.Generator().manual_seed(3)
    channels = 4
    z = torch.randn(2, 4 * channels, 3, 5, generator=gen, dtype=dtype) * 6
    c = torch.randn(2, channels, 3, 5, generator=gen, dtype=dtype) * 3
    z[0, 0, 0, 0] = float("nan")
    z[1, 1, 1, 1], z[1, 2, 1, 1], z[1, 3, 1, 2], z[0, 3, 2, 4] = 100.0, -100.0, 1e-6, -3e-5
    c[1, 0, 2, 2] = float("inf")
    (h_f, c_f, res), (h_p, c_p, res_p) = _both_paths(gates.gates_fwd, None, z, c)
    assert isinstance(res, gates._NativeGateResiduals)
    _close((h_f, c_f), (h_p, c_p), dtype)
    assert torch.isnan(h_f[0, 0, 0, 0]) and torch.isnan(c_f[0, 0, 0, 0])
    # near zero the float32 tanh keeps its relative accuracy (no 1 - 2/(e^2x + 1) cancellation)
    tiny = torch.tensor([1e-7, -3e-6, 1e-3, 0.3, 0.7, 5.0, 20.0], dtype=dtype)
    zz = torch.zeros(1, 4, tiny.numel(), dtype=dtype)
    zz[0, 3] = tiny
    zz[0, 0] = 30.0  # input gate ~1, so c' = tanh(tiny): h' = sigmoid(0) tanh(tanh(tiny))
    h_tiny, _, _ = gates.gates_fwd(None, zz, torch.zeros(1, 1, tiny.numel(), dtype=dtype))
    expected = 0.5 * torch.tanh(torch.tanh(tiny.double()))
    torch.testing.assert_close(h_tiny[0, 0].double(), expected, rtol=4e-7, atol=0)
    g_h, g_c = torch.randn_like(c), torch.randn_like(c)
    fused = gates.gates_bwd(None, res, g_h, g_c)
    plain = gates.gates_bwd(None, res_p, g_h, g_c)
    _close(fused, plain, dtype)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_the_fused_path_steps_aside_for_autograd_and_other_dtypes():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    params = _params(gen, 2, 3, 6, torch.float64)
    z, res = conv.conv_fwd(None, x, params)
    assert isinstance(res, list) and z.grad_fn is not None  # torch ops, recorded
    with torch.no_grad():
        assert isinstance(conv.conv_fwd(None, x, params)[1], conv._NativeConvResiduals)
    assert calls.kernels_for(x.detach().half()) is None
    assert calls.kernels_for(x.detach(), x.detach().float()) is None  # mixed dtypes
    # under a functorch transform the tensors are wrapped: torch ops again
    out = torch.func.vmap(lambda v: tmcore.factorized_conv(v, params))(x.detach()[:, None])
    torch.testing.assert_close(out[:, 0], tmcore.factorized_conv(x.detach(), params))
    # the residuals of the fused forward still work once autograd records the cotangent
    with torch.no_grad():
        _, native_res = conv.conv_fwd(None, x.detach(), params)
    g = torch.randn(2, 6, 4, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    d_x, _ = conv.conv_bwd(None, native_res, params, g)
    assert d_x.grad_fn is not None
    torch.testing.assert_close(d_x, conv.conv_bwd(None, conv._depthwise_stages(x.detach(), params),
                                                params, g.detach())[0])


def test_switches_and_a_failed_build(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_VAR, "0")
    reload_environment()
    assert native.library() is None
    monkeypatch.delenv(native.ENV_VAR)
    reload_environment()
    assert native.library() is not None
    # a machine without a usable compiler: one warning, then the torch ops
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setenv("CC", "tmcore-no-such-compiler")
    monkeypatch.setenv("TMCORE_CACHE_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="TMCORE_NATIVE=0"):
        assert native.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None  # warned once
    x = torch.randn(1, 2, 3)
    params = ConvParams(torch.randn(1, 2, 3), torch.zeros(1, 2), torch.randn(4, 2),
                        torch.zeros(4))
    assert isinstance(conv.conv_fwd(None, x, params)[1], list)


def test_a_fresh_cache_builds_and_loads(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setenv("TMCORE_CACHE_DIR", str(tmp_path))
    lib = native.library()
    assert lib is not None and len(list(tmp_path.glob("tmcore_cell-*.so"))) == 1
    before = sorted(p.name for p in tmp_path.iterdir())  # the build, its digest, pointers
    importlib.reload(native)  # a new process: loads the cached build
    monkeypatch.setenv("TMCORE_CACHE_DIR", str(tmp_path))
    assert native.library() is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _scan_case(steps, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    b, c, shape = 2, 3, (3, 4, 2)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    h0, c0 = r(b, c, *shape) * 0.5, r(b, c, *shape) * 0.5
    rc, wc = torch.tanh(r(b, steps, 3)), torch.tanh(r(b, steps, 3))
    ws = torch.rand(b, steps, generator=gen, dtype=dtype) * 0.4 + 0.2
    content = r(b, steps, c)
    params = ConvParams(r(3, 2 * c, 3) * 0.4, r(3, 2 * c) * 0.1, r(4 * c, 2 * c) * 0.3,
                        r(4 * c) * 0.1)
    return h0, c0, rc, wc, ws, content, params, r(b, steps, c), r(b, c, *shape), r(b, c, *shape)


@pytest.mark.parametrize("checkpoint_every", [1, 5, 40])
def test_scan_vjp_across_write_blocks_equals_the_step_by_step_composition(checkpoint_every):
    """T = 37 spans three write blocks (16 steps) and segments that straddle them."""
    h0, c0, rc, wc, ws, content, params, g_reads, g_h, g_c = _scan_case(37)
    got = memory_scan_vjp(h0, c0, rc, wc, ws, content, params, g_reads, g_h, g_c,
                          checkpoint_every=checkpoint_every)
    xp = array_api_compat.array_namespace(h0)
    states = [(h0, c0)]
    steps = [StepInputs(rc[:, t], wc[:, t], ws[:, t], content[:, t]) for t in range(37)]
    for t in range(36):
        states.append(step_fwd(xp, *states[-1], steps[t], params, 1e-6,
                                           None)[1:])
    d_h, d_c, d_steps, d_params = g_h, g_c, [None] * 37, None
    for t in reversed(range(37)):
        d_h, d_c, d_steps[t], p = step_bwd(xp, *states[t], steps[t], params,
                                           g_reads[:, t], d_h, d_c, 1e-6, None)
        d_params = p if d_params is None else add_params(d_params, p)
    expected = [d_h, d_c, *(torch.stack([d[k] for d in d_steps], 1) for k in range(4)),
                *d_params]
    for a, e in zip((*got[:6], *got.params), expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_scan_results_do_not_share_memory_with_the_workspace():
    """Scratch buffers are reused from step to step and call to call: nothing returned
    may alias them, so a second scan must leave the first one's results unchanged."""
    case = _scan_case(20, seed=1, dtype=torch.float32)
    first = memory_scan_vjp(*case)
    kept = [t.clone() for t in (*first[:6], *first.params)]
    memory_scan_vjp(*_scan_case(20, seed=2, dtype=torch.float32))
    for a, b in zip((*first[:6], *first.params), kept, strict=True):
        assert torch.equal(a, b)
    reads = tmcore.memory_scan(*case[:7])[0]
    assert not np.shares_memory(reads.numpy(), first.write_content.numpy())


# ----------------------------------------------------------------------------- JAX (XLA FFI)


@pytest.fixture(scope="module")
def jax_native():
    jax = pytest.importorskip("jax", reason="jax is not installed")
    if jax.default_backend() != "cpu":
        pytest.skip("the JAX kernels serve the CPU backend only")
    if native.jax_library() is None:
        pytest.skip("the JAX kernels cannot be built here (no C++ compiler or FFI headers)")
    return jax


def _generic(f):
    def run(*args):
        with tmcore.options(generic=True):
            return f(*args)
    return run


@pytest.mark.parametrize("x64", [False, True])
def test_jax_kernels_match_the_generic_math_under_jit_grad_and_vmap(jax_native, x64):
    jax = jax_native
    import jax.numpy as jnp

    from tmcore.backends import jax as jb

    rng = np.random.default_rng(7)
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        tol = 1e-10 if x64 else 3e-5

        def arr(*s, scale=1.0):
            return jnp.asarray(rng.standard_normal(s) * scale, dtype=dtype)

        shape = (3, 4, 2)
        x, h, c = arr(2, 4, *shape), arr(2, 2, *shape), arr(2, 2, *shape)
        conv = ConvParams(arr(3, 4, 3), arr(3, 4), arr(6, 4, scale=0.5), arr(6))
        cell = ConvParams(arr(3, 4, 3), arr(3, 4), arr(8, 4, scale=0.5), arr(8))
        assert jb._native_suffix(x) == ("f64" if x64 else "f32")
        cases = [
            (tmcore.factorized_conv, tmcore.factorized_conv_vjp, (x, conv)),
            (lambda x_, h_, c_, p: tmcore.convlstm_step(x_, h_, c_, p),
             lambda x_, h_, c_, p, g: tmcore.convlstm_step_vjp(x_, h_, c_, p, *g),
             (h, h, c, cell)),
        ]
        for forward, vjp, args in cases:
            out, pullback = jax.vjp(_generic(forward), *args)
            g = jax.tree_util.tree_map(lambda o: jnp.asarray(rng.standard_normal(o.shape),
                                                             dtype), out)
            expected = jax.tree_util.tree_leaves(pullback(g))
            got_out = jax.jit(forward)(*args)
            got_vjp = jax.tree_util.tree_leaves(jax.jit(vjp)(*args, g))
            # autodiff through the fused forwards (their custom_vjp rules)
            got_ad = jax.tree_util.tree_leaves(jax.vjp(jax.jit(forward), *args)[1](g))
            for a, b in zip(jax.tree_util.tree_leaves(got_out), jax.tree_util.tree_leaves(out),
                            strict=True):
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
            for a, b, e in zip(got_vjp, got_ad, expected, strict=True):
                assert a.dtype == e.dtype == dtype
                np.testing.assert_allclose(a, e, rtol=tol, atol=10 * tol)
                np.testing.assert_allclose(b, e, rtol=tol, atol=10 * tol)
        # vmap runs the custom calls one slice at a time
        batched = jax.vmap(lambda v: tmcore.factorized_conv(v, conv))(x[:, None])
        np.testing.assert_allclose(batched[:, 0], _generic(tmcore.factorized_conv)(x, conv),
                                   rtol=tol, atol=tol)


def test_jax_kernels_switch_off(jax_native, monkeypatch):
    import jax.numpy as jnp

    from tmcore.backends import jax as jb

    x = jnp.ones((1, 2, 3), jnp.float32)
    assert jb._native_suffix(x) == "f32"
    assert jb._native_suffix(x.astype(jnp.float16)) is None
    with tmcore.options(native=False):
        assert jb._native_suffix(x) is None
    monkeypatch.setenv(native.ENV_VAR, "0")
    reload_environment()
    assert jb._native_suffix(x) is None


# ----------------------------------------------------------------------------- bad calls


def _cell_case(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, c, shape = 2, 3, (3, 4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return r(b, 2 * c, *shape), _params(gen, 2, 2 * c, 4 * c, dtype), r(b, 4 * c, *shape), \
        r(b, c, *shape)


def test_every_native_entry_checks_the_shapes_it_indexes_by():
    """The kernels index every buffer by the shape of x / c: a malformed call (the low
    level functions validate nothing) raises instead of reading or writing out of
    bounds."""
    x, params, z, c = _cell_case()
    bad_taps = params._replace(depthwise_weight=params.depthwise_weight[:, :1])  # (n, 1, 3)
    bad_bias = params._replace(depthwise_bias=params.depthwise_bias[:1])
    with torch.no_grad():
        for bad, name in ((bad_taps, "depthwise_weight"), (bad_bias, "depthwise_bias")):
            with pytest.raises(ValueError, match=name):
                conv.conv_fwd(None, x, bad)
        _, residuals = conv.conv_fwd(None, x, params)
        g = torch.randn(2, 12, 3, 4, dtype=torch.float64)
        with pytest.raises(ValueError, match="depthwise_weight"):
            conv.conv_bwd(None, residuals, bad_taps, g)
        with pytest.raises(ValueError, match="g: expected shape"):
            conv.conv_bwd(None, residuals, params, g[..., :3])
        with pytest.raises(ValueError, match=r"z: expected shape \(B, 4C, \*S\)"):
            gates.gates_fwd(None, z[:, :9], c)  # pointwise weights (3C, 2C)
        with pytest.raises(ValueError, match="z: expected"):
            gates.gates_residuals(None, z[:, :9], c)
        res = gates.gates_residuals(None, z, c)
        with pytest.raises(ValueError, match="g_c: expected"):
            gates.gates_bwd(None, res, torch.ones_like(c), torch.ones(2, 3, 3, 3,
                                                                  dtype=torch.float64))


def _scan_op_args():
    h0, c0, rc, wc, ws, content, params, g_reads, g_h, g_c = _scan_case(5)
    return [h0, c0, rc, wc, ws, content], list(params), [g_reads, g_h, g_c]


@pytest.mark.parametrize("case", ["taps (n, 1, 3)", "pointwise (3C, 2C)", "checkpoint_every 0"])
def test_the_custom_ops_validate_their_arguments_in_eager_mode(case):
    """torch.ops.tmcore.memory_scan (and its backward op) called directly run the public
    checks: malformed parameters raise a clear error (they read and wrote out of
    bounds, gave wrong output, or ZeroDivisionError)."""
    import tmcore.adapters.torch  # noqa: F401  (registers the ops)

    primals, params, cotangents = _scan_op_args()
    k = 1
    if case.startswith("taps"):
        params[0], params[1] = params[0][:, :1].contiguous(), params[1][:, :1].contiguous()
        match = "depthwise_weight"
    elif case.startswith("pointwise"):
        params[2], params[3] = params[2][:9].contiguous(), params[3][:9].contiguous()
        match = r"pointwise_weight: expected shape \(4C, 2C\)"
    else:
        k, match = 0, "checkpoint_every"
    with pytest.raises(ValueError, match=match):
        torch.ops.tmcore.memory_scan(*primals, *params, 1e-6, None, k)
    _, _, _, h_ckpt, c_ckpt = torch.ops.tmcore.memory_scan(*primals, *_scan_op_args()[1],
                                                           1e-6, None, 1)
    with pytest.raises(ValueError, match=match):
        torch.ops.tmcore.memory_scan_backward(*primals, *params, h_ckpt, c_ckpt, *cotangents,
                                              1e-6, None, k)


def _neg(t):
    """A negative view: its memory holds ``-t``'s values negated (the neg bit set)."""
    view = torch._neg_view(-t)
    assert view.is_neg() and torch.equal(view, t)
    return view


def _zero(like):
    z = torch._efficientzerotensor(like.shape, dtype=like.dtype)
    assert z._is_zerotensor() and z.data_ptr() == 0
    return z


def test_negative_views_and_zero_tensors_give_the_plain_results():
    """Negative views (memory holds the un-negated values) and ZeroTensors (no memory,
    data pointer 0: a segfault) are materialized before the C kernels see them."""
    x, params, z, c = _cell_case()
    g = torch.randn(2, 12, 3, 4, dtype=torch.float64)
    g_h, g_c = torch.randn_like(c), torch.randn_like(c)
    with torch.no_grad():
        z_plain, res_plain = conv.conv_fwd(None, x, params)
        neg_params = ConvParams(*(_neg(p) for p in params))
        z_neg, res_neg = conv.conv_fwd(None, _neg(x), neg_params)
        assert isinstance(res_neg, conv._NativeConvResiduals)
        torch.testing.assert_close(z_neg, z_plain, rtol=0, atol=0)
        plain = conv.conv_bwd(None, res_plain, params, g)
        _close((plain[0], *plain[1]), (lambda d: (d[0], *d[1]))(
            conv.conv_bwd(None, res_neg, neg_params, _neg(g))), torch.float64)
        zero = conv.conv_bwd(None, res_plain, params, _zero(g))
        expected = conv.conv_bwd(None, res_plain, params, torch.zeros_like(g))
        _close((zero[0], *zero[1]), (expected[0], *expected[1]), torch.float64)
        fwd_plain = gates.gates_fwd(None, z, c)
        fwd_neg = gates.gates_fwd(None, _neg(z), _neg(c))
        _close(fwd_neg[:2], fwd_plain[:2], torch.float64)
        for gh, gc in ((_neg(g_h), _neg(g_c)), (_zero(c), g_c), (g_h, _zero(c))):
            want = gates.gates_bwd(None, fwd_plain[2], gh.clone(), gc.clone())
            _close(gates.gates_bwd(None, fwd_neg[2], gh, gc), want, torch.float64)
    # through a public function: a ZeroTensor cotangent, as autograd may hand one
    h = torch.randn_like(c)
    got = tmcore.convlstm_step_vjp(h, h, c, params, _zero(c), g_c)
    want = tmcore.convlstm_step_vjp(h, h, c, params, torch.zeros_like(c), g_c)
    for a, b in zip((*got[:3], *got[3]), (*want[:3], *want[3]), strict=True):
        torch.testing.assert_close(a, b)


_OOM_SCRIPT = r"""
import resource, sys
import torch, tmcore
import tmcore.backends.native as native
from tmcore.ops.conv import ConvParams
assert native.library() is not None
params = ConvParams(torch.zeros(4, 1, 3), torch.zeros(4, 1), torch.ones(1, 1), torch.zeros(1))
tmcore.factorized_conv(torch.zeros(1, 1, 2, 2, 2, 2), params)  # threads and arenas exist
x = torch.zeros(1, 1, 64, 64, 64, 64)  # 64 MiB; the kernel's scratch is 8x that
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))
try:
    tmcore.factorized_conv(x, params)
except MemoryError as exc:
    print("MemoryError:", exc)
    sys.exit(0)
sys.exit(3)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_failed_allocation_in_a_kernel_raises_memory_error():
    """Under a memory limit the kernel's scratch allocation fails: MemoryError (it
    segfaulted on the unchecked NULL)."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    result = subprocess.run([sys.executable, "-c", _OOM_SCRIPT], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-2000:])
    assert "fused CPU kernel dw_fwd could not allocate" in result.stdout


def test_the_jax_handlers_refuse_buffers_of_the_wrong_size(jax_native):
    """Called directly with taps (n, 1, 3), the FFI handler returns an error instead of
    reading out of bounds."""
    jax = jax_native
    import jax.numpy as jnp

    x = jnp.ones((2, 3, 4, 5), jnp.float32)
    taps, bias = jnp.ones((2, 1, 3), jnp.float32), jnp.ones((2, 3), jnp.float32)
    call = jax.ffi.ffi_call("tmcore_dw_fwd_f32", jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(Exception, match="size does not match"):
        jax.block_until_ready(call(x, taps, bias))


_JAX_OOM_SCRIPT = r"""
import resource, sys
import jax, jax.numpy as jnp, tmcore
import tmcore.backends.native as native
from tmcore.ops.conv import ConvParams
if native.jax_library() is None:
    sys.exit(4)
params = ConvParams(jnp.zeros((4, 1, 3)), jnp.zeros((4, 1)), jnp.ones((1, 1)), jnp.zeros(1))
f = jax.jit(tmcore.factorized_conv)
jax.block_until_ready(f(jnp.zeros((1, 1, 2, 2, 2, 2)), params))
x = jnp.zeros((1, 1, 64, 64, 64, 64))
compiled = f.lower(x, params).compile()
with open("/proc/self/status") as fh:
    vm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 400 * 2**20, resource.RLIM_INFINITY))
try:
    jax.block_until_ready(compiled(x, params))
except Exception as exc:
    print(type(exc).__name__, exc)
    sys.exit(0)
sys.exit(3)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_failed_allocation_in_a_jax_kernel_is_an_error_not_a_crash(jax_native):
    """The FFI handler turns the kernel's failed allocation into RESOURCE_EXHAUSTED."""
    result = subprocess.run([sys.executable, "-c", _JAX_OOM_SCRIPT], capture_output=True,
                            text=True, timeout=300)
    if result.returncode == 4:
        pytest.skip("the JAX kernels cannot be built in a subprocess here")
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-2000:])
    assert "RESOURCE_EXHAUSTED: tmcore dw_fwd: out of memory" in result.stdout
