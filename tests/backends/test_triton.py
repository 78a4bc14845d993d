"""The fused Triton scan (tmcore.backends.triton.dense), on the CPU under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported, so the kernel
tests (``test_kernel_*``) run in a subprocess started by
:func:`test_triton_interpreter_suite` with ``TRITON_INTERPRET=1 TMCORE_TRITON=1``;
in the main process they skip. Shapes are tiny: every device-function call
costs milliseconds in the interpreter. ``n = 4`` grids are not fused (the
generic loop runs; tested). bfloat16 is not run through the interpreter (it
gives NaN there); half inputs decline to the per-primitive path anyway.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _helpers import run_interpreter_suite  # noqa: E402

import tmcore  # noqa: E402
from tmcore.types import ConvParams  # noqa: E402

# a kernel failure would fall back to the per-step path with a warning: fail instead
pytestmark = pytest.mark.filterwarnings("error:tmcore. the fused Triton scan failed")

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
inner = pytest.mark.skipif(
    not (INTERPRETING and HAS_TRITON and os.environ.get("TMCORE_TRITON") == "1"),
    reason="kernel test: runs in the interpreter subprocess of test_triton_interpreter_suite",
)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter run")
def test_triton_interpreter_suite():
    """Every ``test_kernel_*`` below, in a subprocess under Triton's interpreter."""
    run_interpreter_suite(__file__, TRITON_DEFAULT_FP_FUSION="1")


def test_cpu_tensors_need_the_switch():
    """Automatic mode never takes CPU tensors; ``triton=False`` never takes any."""
    from tmcore.backends.triton import launch

    x = torch.zeros(1, 2, 3)
    with tmcore.options(triton="auto"):
        assert not launch.usable(x)
    with tmcore.options(triton=False):
        assert not launch.usable(x)


def test_launch_count():
    from tmcore.backends.triton import dense

    assert dense.launches_per_step(1) == 3
    assert dense.launches_per_step(4) == 3.75


# --------------------------------------------------------------------------- kernels


def _case(batch, channels, shape, steps, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(shape)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=dtype) * scale

    def u(*s, lo, hi):
        return torch.rand(*s, generator=g, dtype=dtype) * (hi - lo) + lo

    inputs = dict(
        h0=r(batch, channels, *shape, scale=0.5), c0=r(batch, channels, *shape, scale=0.5),
        read_coords=u(batch, steps, n, lo=-1.2, hi=1.2),  # some clamped at the border
        write_coords=u(batch, steps, n, lo=-1.0, hi=1.0),
        write_sigma=u(batch, steps, lo=0.2, hi=0.8),
        write_content=r(batch, steps, channels),
    )
    params = ConvParams(r(n, 2 * channels, 3, scale=0.5), r(n, 2 * channels, scale=0.3),
                        r(4 * channels, 2 * channels, scale=0.3), r(4 * channels, scale=0.3))
    cot = dict(g_reads=r(batch, steps, channels), g_h=r(batch, channels, *shape),
               g_c=r(batch, channels, *shape))
    return inputs, params, cot


class _Calls:
    """Counts the fused loops that really ran (the entries may decline)."""

    def __init__(self, monkeypatch):
        from tmcore.backends.triton import dense

        self.fwd = self.bwd = 0
        fwd, bwd = dense._forward_loop, dense._backward_loop

        def count_fwd(*a, **k):
            self.fwd += 1
            return fwd(*a, **k)

        def count_bwd(*a, **k):
            self.bwd += 1
            return bwd(*a, **k)

        monkeypatch.setattr(dense, "_forward_loop", count_fwd)
        monkeypatch.setattr(dense, "_backward_loop", count_bwd)


def _flat(grads):
    return [*grads[:6], *grads.params]


def _close(got, want, rtol, atol):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b).to(a.dtype),
                                   rtol=rtol, atol=atol)


CASES = [  # batch, channels, grid, steps, checkpoint_every, radius
    pytest.param(1, 1, (5,), 1, 1, None, id="n1-C1-T1"),
    pytest.param(3, 32, (3,), 3, 2, None, id="n1-C32-B3-every2"),
    pytest.param(2, 3, (1, 4), 2, 1, 1.5, id="n2-wide1-radius"),
    pytest.param(2, 4, (1, 1), 2, 1, None, id="n2-1x1"),
    pytest.param(1, 2, (2, 1, 3), 2, 1, None, id="n3-wide1"),
    pytest.param(1, 17, (2,), 5, 3, None, id="n1-C17-T5-every3"),
]


@inner
@pytest.mark.parametrize("batch,channels,shape,steps,every,radius", CASES)
def test_kernel_scan_float64(monkeypatch, batch, channels, shape, steps, every, radius):
    """Forward and the VJP of every input (h0, c0 included) against the generic path and
    the float64 NumPy reference."""
    from tmcore.testing import reference as ref

    inputs, params, cot = _case(batch, channels, shape, steps, torch.float64)
    calls = _Calls(monkeypatch)
    kw = dict(radius=radius, checkpoint_every=every)
    out = tmcore.memory_scan(*inputs.values(), params, **kw)
    grads = tmcore.memory_scan_vjp(*inputs.values(), params, *cot.values(), **kw)
    assert (calls.fwd, calls.bwd) == (2, 1)  # memory_scan, the VJP's forward, its backward
    with tmcore.options(generic=True):
        out_generic = tmcore.memory_scan(*inputs.values(), params, **kw)
        grads_generic = tmcore.memory_scan_vjp(*inputs.values(), params, *cot.values(), **kw)
    assert (calls.fwd, calls.bwd) == (2, 1)
    _close(out, out_generic, 1e-10, 1e-12)
    _close(_flat(grads), _flat(grads_generic), 1e-10, 1e-12)
    arrays = [np.asarray(v) for v in (*inputs.values(), *params)]
    _close(out, [torch.from_numpy(a) for a in ref.ref_memory_scan(*arrays, radius=radius)],
           1e-9, 1e-11)
    want = ref.ref_memory_scan_vjp(*arrays, *(np.asarray(v) for v in cot.values()),
                                   radius=radius)
    _close(_flat(grads), [torch.from_numpy(a) for a in want], 1e-9, 1e-11)


@inner
def test_kernel_float32_matches_default_path(monkeypatch):
    """float32, n = 3 (2 x 2 x 2), against the default CPU path (C kernels)."""
    inputs, params, cot = _case(2, 4, (2, 2, 2), 2, torch.float32, seed=1)
    calls = _Calls(monkeypatch)
    grads = tmcore.memory_scan_vjp(*inputs.values(), params, *cot.values())
    out = tmcore.memory_scan(*inputs.values(), params)
    with tmcore.options(triton=False):
        grads_default = tmcore.memory_scan_vjp(*inputs.values(), params, *cot.values())
        out_default = tmcore.memory_scan(*inputs.values(), params)
    assert (calls.fwd, calls.bwd) == (2, 1)
    _close(out, out_default, 2e-5, 2e-6)
    _close(_flat(grads), _flat(grads_default), 2e-5, 2e-5)


@inner
def test_kernel_checkpoints_interchangeable_and_deterministic(monkeypatch):
    """Checkpoints of the fused forward feed the generic backward and back (same
    layout); two fused backwards are bitwise equal (no atomics)."""
    import array_api_compat

    from tmcore.scan import memory_scan_bwd, memory_scan_fwd

    xp = array_api_compat.array_namespace(torch.empty(0))
    inputs, params, cot = _case(2, 3, (4,), 3, torch.float64, seed=2)
    h0, c0, *rest = inputs.values()
    kw = dict(checkpoint_every=2)
    fused = memory_scan_fwd(xp, h0, c0, *rest, params, **kw)
    with tmcore.options(generic=True):
        generic = memory_scan_fwd(xp, h0, c0, *rest, params, **kw)
        back_generic = memory_scan_bwd(xp, *rest, params, *fused[3:], *cot.values(), **kw)
    back_fused = memory_scan_bwd(xp, *rest, params, *generic[3:], *cot.values(), **kw)
    again = memory_scan_bwd(xp, *rest, params, *generic[3:], *cot.values(), **kw)
    _close(fused, generic, 1e-10, 1e-12)
    _close(_flat(back_fused), _flat(back_generic), 1e-10, 1e-12)
    for a, b in zip(_flat(back_fused), _flat(again), strict=True):
        assert torch.equal(a, b)


@inner
def test_kernel_declines(monkeypatch):
    """n = 4, float16, autograd-recorded inputs and ``triton=False`` take the per-step
    loop (same results); nothing reaches the kernels."""
    calls = _Calls(monkeypatch)
    inputs, params, _ = _case(1, 2, (2, 1, 1, 2), 1, torch.float64)
    with tmcore.options(triton=False):
        want = tmcore.memory_scan(*inputs.values(), params)
    _close(tmcore.memory_scan(*inputs.values(), params), want, 1e-12, 1e-14)
    inputs, params, _ = _case(1, 2, (3,), 1, torch.float16)
    tmcore.memory_scan(*inputs.values(), params)
    inputs, params, _ = _case(1, 2, (3,), 1, torch.float32)
    inputs["h0"].requires_grad_(True)
    tmcore.memory_scan(*inputs.values(), params)
    inputs["h0"].requires_grad_(False)
    with tmcore.options(triton=False):
        tmcore.memory_scan(*inputs.values(), params)
    assert (calls.fwd, calls.bwd) == (0, 0)


@inner
def test_kernel_torch_layer_with_and_without(monkeypatch):
    """The torch layer trains the same with the kernels (they run) and without."""
    from tmcore.adapters.torch import TensorMemory

    torch.manual_seed(0)
    layer = TensorMemory(8, 4, (2, 2, 2), 4)
    x = torch.randn(1, 7, 8, requires_grad=True)  # two chunks, the last one ragged
    calls = _Calls(monkeypatch)

    def run():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = layer(x, stream=False)  # one scan: the ragged chunk padded and written
        out.square().sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]

    fused = run()
    assert calls.fwd >= 1 and calls.bwd == 1
    with tmcore.options(triton=False):
        default = run()
    assert calls.bwd == 1
    _close(fused, default, 2e-5, 2e-5)


def test_gpu_benchmark_helpers_on_cpu():
    """``benchmarks/gpu.py``'s fused-path helpers run on the CPU: the agreement check
    (on the CPU it compares the fused CPU scan with the per-step path: float32
    rounding), no launch count off CUDA, and the Triton switch reported off."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    from benchmarks import gpu
    from benchmarks.common import TINY
    from benchmarks.layers import reference_params

    params = reference_params(TINY)
    assert gpu.fused_active("cpu") is False
    agreement = gpu.fused_agreement(TINY, params, "cpu")
    assert set(agreement) == {"output", "grads"}
    assert agreement["output"] <= 1e-5 and agreement["grads"] <= 1e-5, agreement
    _, train = gpu._torch_steps(TINY, params, "cpu", "torch", triton=False)
    assert gpu.launches_per_step(train, TINY, "cpu") is None
    assert gpu.prewarm([TINY], "cpu", print) == {}
    gpu.warm_one(2, (3,), "cpu")
    from tmcore.backends.triton import launch

    assert launch.graph_cache_bytes() == 0  # no graphs off CUDA


def test_cupy_table_has_the_bridged_scan():
    """The CuPy table's whole-scan entries are the DLPack bridge to the Triton kernels."""
    from tmcore.backends import cupy as _cupy
    from tmcore.runtime.dispatch import generic_ops

    ops = _cupy.make_ops(generic_ops(), tmcore.get_options())
    assert ops.scan_fwd is _cupy.bridged_scan_fwd and ops.scan_bwd is _cupy.bridged_scan_bwd
    with tmcore.options(triton=False):  # off: declines without importing anything
        assert _cupy.bridged_scan_fwd(np, *([None] * 7), 1e-6, None, 1) is None


@inner
def test_kernel_dlpack_bridge_on_numpy(monkeypatch):
    """The bridge CuPy uses, run on NumPy arrays (DLPack to CPU torch, the interpreted
    kernels, back): same forward and VJP as NumPy's generic scan."""
    import array_api_compat

    from tmcore.backends import cupy as _cupy
    from tmcore.scan import memory_scan_bwd, memory_scan_fwd

    xp = array_api_compat.array_namespace(np.empty(0))
    inputs, params, cot = _case(2, 3, (3, 2), 2, torch.float64, seed=3)
    h0, c0, *rest = (v.numpy() for v in inputs.values())
    params = ConvParams(*(p.numpy() for p in params))
    g_reads, g_h, g_c = (v.numpy() for v in cot.values())
    calls = _Calls(monkeypatch)
    out = _cupy.bridged_scan_fwd(xp, h0, c0, *rest, params, 1e-6, None, 1)
    grads = _cupy.bridged_scan_bwd(xp, *rest, params, *out[3:], g_reads, g_h, g_c, 1e-6,
                                   None, 1)
    assert (calls.fwd, calls.bwd) == (1, 1)
    assert all(isinstance(a, np.ndarray) for a in (*out, *_flat(grads)))
    want = memory_scan_fwd(xp, h0, c0, *rest, params)
    want_grads = memory_scan_bwd(xp, *rest, params, *want[3:], g_reads, g_h, g_c)
    _close([torch.from_numpy(a) for a in out], [torch.from_numpy(a) for a in want],
           1e-10, 1e-12)
    _close([torch.from_numpy(a) for a in _flat(grads)],
           [torch.from_numpy(a) for a in _flat(want_grads)], 1e-10, 1e-12)


def test_entry_checks_name_the_argument():
    """The kernels index by the shapes: a mismatch is a ValueError naming the argument
    (checked before anything is launched, so no interpreter is needed)."""
    from tmcore.backends.triton import launch

    inputs, params, cot = _case(1, 2, (3,), 2, torch.float32)
    bad = dict(inputs, write_content=inputs["write_content"][:, :, :1])
    with pytest.raises(ValueError, match="write_content"):
        launch.check_shapes(bad["h0"], bad["read_coords"],
                             {"write_content": bad["write_content"]}, params)
    with pytest.raises(ValueError, match="params.pointwise_weight"):
        launch.check_shapes(inputs["h0"], inputs["read_coords"], {},
                             params._replace(pointwise_weight=params.pointwise_weight.T))
    launch.check_shapes(inputs["h0"], inputs["read_coords"], {"g_c": cot["g_c"]}, params)


@pytest.mark.filterwarnings("default")
def test_failing_kernels_fall_back_with_one_warning(monkeypatch):
    """A shape whose kernels fail (e.g. a Triton too old to build them) warns once and
    runs the per-step path, with the same results, from then on."""
    from tmcore.backends.triton import dense, launch

    def fail(*args, **kwargs):
        raise RuntimeError("no kernels here")

    monkeypatch.setattr(launch, "_BROKEN", set())
    monkeypatch.setattr(launch, "usable", lambda *tensors: True)
    monkeypatch.setattr(dense, "_forward_loop", fail)
    inputs, params, _ = _case(1, 2, (3,), 2, torch.float64)
    with tmcore.options(triton=True):  # forced: the fused CPU scan steps aside for Triton
        with pytest.warns(RuntimeWarning, match="fused Triton scan failed"):
            got = tmcore.memory_scan(*inputs.values(), params)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            again = tmcore.memory_scan(*inputs.values(), params)
    with tmcore.options(triton=False):  # the fused CPU scan: equal to rounding
        want = tmcore.memory_scan(*inputs.values(), params)
    _close(got, want, 1e-12, 1e-12)
    _close(again, want, 1e-12, 1e-12)
    assert len(launch._BROKEN) == 1
