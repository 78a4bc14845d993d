"""The fused Triton local scan (tmcore.backends.triton.local), on the CPU under the interpreter.

As in tests/backends/test_triton.py, ``TRITON_INTERPRET=1`` must be set before ``triton``
is imported, so the kernel tests (``test_kernel_*``) run in a subprocess started
by :func:`test_triton_local_interpreter_suite` with ``TRITON_INTERPRET=1
TMCORE_TRITON=1``; in the main process they skip. Every result is compared with
the generic fast path (``tmcore.options(generic=True)``): values, final state,
the undo-log residuals and every gradient, and the mixes (a fused forward's
residuals into the generic backward and the reverse). Shapes are tiny: the
interpreter runs every tile of every step in Python.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

import array_api_compat  # noqa: E402
from _helpers import run_interpreter_suite  # noqa: E402

import tmcore  # noqa: E402
from tmcore.scan.local import local_scan_bwd, local_scan_fwd  # noqa: E402
from tmcore.types import ConvParams  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error:tmcore. the fused Triton local scan failed")

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
inner = pytest.mark.skipif(
    not (INTERPRETING and HAS_TRITON and os.environ.get("TMCORE_TRITON") == "1"),
    reason="kernel test: runs in the interpreter subprocess of "
           "test_triton_local_interpreter_suite",
)
XP = array_api_compat.array_namespace(torch.empty(0))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter run")
def test_triton_local_interpreter_suite():
    """Every ``test_kernel_*`` below, in a subprocess under Triton's interpreter."""
    run_interpreter_suite(__file__, OMP_NUM_THREADS="1")


def test_launch_count():
    from tmcore.backends.triton import local as _triton_local

    assert _triton_local.launches_per_step() == 2  # one forward, one backward


def test_cpu_tensors_need_the_switch():
    """Automatic mode never takes CPU tensors (the generic or CPU-kernel loop runs)."""
    from tmcore.backends.triton import local as _triton_local

    inputs, params, _ = _case(1, 2, (3,), 1, torch.float64)
    with tmcore.options(triton="auto"):
        assert _triton_local.scan_fwd(XP, *inputs, params, 2, 1e-6, None, False,
                                      options=None) is None
    with tmcore.options(triton=False):
        assert _triton_local.scan_fwd(XP, *inputs, params, 2, 1e-6, None, False,
                                      options=None) is None


@pytest.mark.filterwarnings("default")
def test_failing_kernels_fall_back_with_one_warning(monkeypatch):
    """A shape whose kernels fail warns once and declines from then on (the generic loop
    runs, same results)."""
    from tmcore.backends.triton import launch
    from tmcore.backends.triton import local as _triton_local

    def fail(*args, **kwargs):
        raise RuntimeError("no kernels here")

    monkeypatch.setattr(launch, "_BROKEN", set())
    monkeypatch.setattr(launch, "usable", lambda *tensors: True)
    monkeypatch.setattr(_triton_local, "_kernels", lambda: object())
    monkeypatch.setattr(_triton_local, "_forward", fail)
    inputs, params, _ = _case(1, 2, (4,), 2, torch.float64)
    args = (XP, *inputs, params, 2, 1e-6, None, False)
    with pytest.warns(RuntimeWarning, match="fused Triton local scan failed"):
        assert _triton_local.scan_fwd(*args, options=None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert _triton_local.scan_fwd(*args, options=None) is None
    assert len(launch._BROKEN) == 1


def test_entry_checks_name_the_argument(monkeypatch):
    """Shapes are checked before anything is launched: a ValueError naming the argument."""
    from tmcore.backends.triton import launch
    from tmcore.backends.triton import local as _triton_local

    monkeypatch.setattr(launch, "usable", lambda *tensors: True)
    monkeypatch.setattr(_triton_local, "_kernels", lambda: object())
    inputs, params, cot = _case(1, 2, (4,), 2, torch.float64)
    bad = list(inputs)
    bad[5] = bad[5][:, :, :1]
    with pytest.raises(ValueError, match="write_content"):
        _triton_local.scan_fwd(XP, *bad, params, 2, 1e-6, None, False, options=None)
    with tmcore.options(generic=True):
        *_, residuals = local_scan_fwd(XP, *inputs, params, window=2)
    short = residuals._replace(h_boxes=residuals.h_boxes[:1])
    with pytest.raises(ValueError, match="residuals.h_boxes"):
        _triton_local.scan_bwd(XP, short, *inputs[2:], params, *cot, 2, 1e-6, None,
                               options=None)


# --------------------------------------------------------------------------- kernels


def _case(batch, channels, shape, steps, dtype, seed=0):
    """``(inputs, params, (g_reads, g_h, g_c))``; writes on and outside the border."""
    g = torch.Generator().manual_seed(seed)
    n = len(shape)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=dtype) * scale

    def u(*s, lo, hi):
        return torch.rand(*s, generator=g, dtype=dtype) * (hi - lo) + lo

    inputs = [r(batch, channels, *shape, scale=0.5), r(batch, channels, *shape, scale=0.5),
              u(batch, steps, n, lo=-1.2, hi=1.2), u(batch, steps, n, lo=-1.4, hi=1.4),
              u(batch, steps, lo=0.2, hi=0.8), r(batch, steps, channels)]
    inputs[3][0, 0] = 1.0  # a write exactly on the border
    params = ConvParams(r(n, 2 * channels, 3, scale=0.5), r(n, 2 * channels, scale=0.3),
                        r(4 * channels, 2 * channels, scale=0.3), r(4 * channels, scale=0.3))
    cot = (r(batch, steps, channels), r(batch, channels, *shape), r(batch, channels, *shape))
    return inputs, params, cot


class _Launches:
    """The kernels module, counting the launches of each kernel."""

    def __init__(self, kernels):
        self.counts = {"local_fwd_kernel": 0, "local_bwd_kernel": 0}
        self._kernels = kernels

    def __getattr__(self, name):
        kernel = getattr(self._kernels, name)
        counts = self.counts

        class _Counted:
            def __getitem__(self, grid):
                counts[name] += 1
                return kernel[grid]
        return _Counted()


class _Calls:
    """Counts the fused loops that really ran (the entries may decline) and the kernel
    launches (``launches``: per kernel name)."""

    def __init__(self, monkeypatch):
        from tmcore.backends.triton import local as _triton_local

        self.fwd = self.bwd = 0
        fwd, bwd = _triton_local._forward, _triton_local._backward
        if INTERPRETING:
            kernels = _Launches(_triton_local._kernels())
            monkeypatch.setattr(_triton_local, "_kernels", lambda: kernels)
            self.launches = kernels.counts

        def count_fwd(*a, **k):
            self.fwd += 1
            return fwd(*a, **k)

        def count_bwd(*a, **k):
            self.bwd += 1
            return bwd(*a, **k)

        monkeypatch.setattr(_triton_local, "_forward", count_fwd)
        monkeypatch.setattr(_triton_local, "_backward", count_bwd)


def _flat(grads):
    return [*grads[:6], *grads.params]


def _close(got, want, tol):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


CASES = [  # batch, channels, grid, window, steps, radius, overwrite
    pytest.param(1, 4, (5, 4, 6), 2, 2, None, False, id="n3-w2"),
    pytest.param(2, 3, (7,), 3, 3, None, True, id="n1-w3-overwrite"),
    pytest.param(1, 2, (3, 5), 4, 2, 1.5, False, id="n2-window-wider-than-axis-radius"),
    pytest.param(2, 2, (1, 4), 2, 2, None, True, id="n2-1-cell-axis"),
]


@inner
@pytest.mark.parametrize("batch,channels,shape,window,steps,radius,overwrite", CASES)
def test_kernel_local_scan_float64(monkeypatch, batch, channels, shape, window, steps, radius,
                                   overwrite):
    """Forward, residuals and every gradient equal the generic fast path's; a fused
    forward's residuals feed the generic backward and the reverse; h0 / c0 are updated
    in place only with overwrite_state, g_h / g_c never."""
    inputs, params, cot = _case(batch, channels, shape, steps, torch.float64)
    kw = dict(window=window, radius=radius)
    with tmcore.options(generic=True):
        want = local_scan_fwd(XP, *inputs, params, **kw)
        want_grads = local_scan_bwd(XP, want[3], *inputs[2:], params, *cot, **kw)
    calls = _Calls(monkeypatch)
    h0, c0 = inputs[0].clone(), inputs[1].clone()
    saved_cot = [x.clone() for x in cot]
    got = local_scan_fwd(XP, *inputs, params, overwrite_state=overwrite, **kw)
    assert (calls.fwd, calls.bwd) == (1, 0)
    if overwrite:
        assert got[1] is inputs[0] and got[2] is inputs[1]
    else:
        assert torch.equal(inputs[0], h0) and torch.equal(inputs[1], c0)
    inputs[0], inputs[1] = h0, c0
    _close([*got[:3], *got[3]], [*want[:3], *want[3]], 1e-12)
    grads = local_scan_bwd(XP, want[3], *inputs[2:], params, *cot, **kw)  # generic residuals
    assert (calls.fwd, calls.bwd) == (1, 1)
    assert all(torch.equal(a, b) for a, b in zip(cot, saved_cot, strict=True))
    _close(_flat(grads), _flat(want_grads), 1e-12)
    with tmcore.options(generic=True):  # the fused forward's residuals, generic backward
        mixed = local_scan_bwd(XP, got[3], *inputs[2:], params, *cot, **kw)
    _close(_flat(mixed), _flat(want_grads), 1e-12)
    # one launch per step each way (the generic fast path: ~740 torch ops per step)
    assert calls.launches == {"local_fwd_kernel": steps, "local_bwd_kernel": steps}


@inner
def test_kernel_float32_and_deterministic(monkeypatch):
    """float32 (n = 2) within 1e-5 of the generic path; two fused backwards are bitwise
    equal (per-row partial sums, no atomics)."""
    inputs, params, cot = _case(2, 3, (4, 5), 2, torch.float32, seed=1)
    kw = dict(window=2)
    with tmcore.options(generic=True):
        want = local_scan_fwd(XP, *inputs, params, **kw)
        want_grads = local_scan_bwd(XP, want[3], *inputs[2:], params, *cot, **kw)
    calls = _Calls(monkeypatch)
    got = local_scan_fwd(XP, *inputs, params, **kw)
    grads = local_scan_bwd(XP, got[3], *inputs[2:], params, *cot, **kw)
    again = local_scan_bwd(XP, got[3], *inputs[2:], params, *cot, **kw)
    assert (calls.fwd, calls.bwd) == (1, 2)
    _close([*got[:3], *got[3]], [*want[:3], *want[3]], 1e-5)
    _close(_flat(grads), _flat(want_grads), 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(_flat(grads), _flat(again), strict=True))


@inner
def test_kernel_nan_coordinates(monkeypatch):
    """A NaN write centre (its window at 0) and a NaN read coordinate give the generic
    path's NaNs, in the same places, forward and backward."""
    inputs, params, cot = _case(2, 2, (6,), 2, torch.float64, seed=3)
    inputs[3][1, 0, 0] = float("nan")
    inputs[2][0, 1, 0] = float("nan")
    with tmcore.options(generic=True):
        want = local_scan_fwd(XP, *inputs, params, window=2)
        want_grads = local_scan_bwd(XP, want[3], *inputs[2:], params, *cot, window=2)
    calls = _Calls(monkeypatch)
    got = local_scan_fwd(XP, *inputs, params, window=2)
    grads = local_scan_bwd(XP, got[3], *inputs[2:], params, *cot, window=2)
    assert (calls.fwd, calls.bwd) == (1, 1)
    for a, b in zip([*got[:3], *got[3], *_flat(grads)], [*want[:3], *want[3], *_flat(want_grads)],
                    strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


@inner
def test_kernel_declines(monkeypatch):
    """n = 4, float16, autograd-recorded inputs and ``triton=False`` take the generic loop;
    nothing reaches the kernels."""
    calls = _Calls(monkeypatch)
    inputs, params, _ = _case(1, 2, (2, 1, 1, 2), 1, torch.float64)
    local_scan_fwd(XP, *inputs, params, window=1)
    inputs, params, _ = _case(1, 2, (3,), 1, torch.float16)
    local_scan_fwd(XP, *inputs, params, window=1)
    inputs, params, _ = _case(1, 2, (3,), 1, torch.float32)
    inputs[0].requires_grad_(True)
    local_scan_fwd(XP, *inputs, params, window=1)
    inputs[0].requires_grad_(False)
    with tmcore.options(triton=False):
        local_scan_fwd(XP, *inputs, params, window=1)
    assert (calls.fwd, calls.bwd) == (0, 0)


@inner
def test_kernel_torch_layer_local_update(monkeypatch):
    """The torch layer with ``update="local"`` trains the same with the kernels (they run)
    and without."""
    from tmcore.adapters.torch import TensorMemory

    torch.manual_seed(0)
    layer = TensorMemory(8, 4, (3, 4), 4, update="local", window=2)
    x = torch.randn(1, 5, 8)
    calls = _Calls(monkeypatch)

    def run():
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x, stream=False)
        out.square().sum().backward()
        return [out.detach(), *(p.grad for p in layer.parameters() if p.grad is not None)]

    fused = run()
    assert calls.fwd >= 1 and calls.bwd == 1
    with tmcore.options(triton=False):
        default = run()
    assert calls.bwd == 1
    _close(fused, default, 2e-5)


def test_gpu_benchmark_local_section_on_cpu():
    """``benchmarks/gpu.py``'s local-update section runs on the CPU at its tiny size (the
    fused row is the C kernels there): every row timed, the fused row equal to the
    generic one to float32 rounding, no kernel counts off CUDA."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    from benchmarks import gpu

    out = gpu.local_scan("cpu", tiny=True, reps=1)
    assert out["launches_per_step_fused"] == 2
    for rows in out["grids"].values():
        for name in ("dense", "local-generic", "local-fused"):
            assert rows[name]["fwd_ms"] > 0 and rows[name]["train_ms"] > 0, rows
            assert rows[name]["kernels_per_step"] is None
        assert rows["fused_vs_generic"] <= 1e-5, rows


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETING, reason="the interpreter replaces the compiler")
@pytest.mark.parametrize("shape,channels,window", [((9,), 4, 3), ((6, 6, 6), 16, 4)])
def test_kernels_build_for_sm90(shape, channels, window):
    """Both kernels compile for sm_90 with Triton's own LLVM and ptxas (no GPU needed): the
    interpreter does not check what only the compiler rejects (loop-carried types, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from tmcore.backends.triton import local as _triton_local
    from tmcore.backends.triton import local_kernels as k

    class _Shape:  # the geometry reads the shape only
        def __init__(self, shape):
            self.shape = shape

    geo = _triton_local._Geometry(_Shape((2, channels, *shape)), window)
    runtime = {"t", "B", "T", "C", "G0", "G1", "G2"}
    for fn in (k.local_fwd_kernel, k.local_bwd_kernel):
        consts = {a: v for a, v in geo.constexprs("ieee").items()
                  if a not in runtime and a != "num_warps"}
        signature = {a: ("constexpr" if a in consts else "i32" if a in runtime
                         else "*i32" if a == "geo_ptr" else "*fp32") for a in fn.arg_names}
        compiled = triton.compile(
            triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": geo.num_warps})
        assert compiled.asm["ptx"]
