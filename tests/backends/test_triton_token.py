"""A decode token in Triton launches (tmcore.backends.triton.token), on the CPU under Triton's
interpreter, against the layer's path (torch ops: ``native=False, triton=False``) and one call
on the whole sequence.

As in tests/backends/test_triton.py, ``TRITON_INTERPRET=1`` must be set before ``triton`` is
imported: the kernel tests (``test_kernel_*``) run in a subprocess that
:func:`test_triton_token_interpreter_suite` starts with ``TRITON_INTERPRET=1
TMCORE_TRITON=1``; in the main process they skip. Shapes are tiny (every device-function call
costs milliseconds in the interpreter).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from _helpers import INTERPRETING_KERNELS, run_interpreter_suite  # noqa: E402
from _helpers import assert_all_close as _close  # noqa: E402
from _helpers import stream_tokens as _stream  # noqa: E402
from _helpers import token_module as _module  # noqa: E402

import tmcore  # noqa: E402

# a kernel failure would fall back to the layer's path with a warning: fail instead
pytestmark = pytest.mark.filterwarnings("error:tmcore. the fused Triton decode token failed")

HAS_TRITON = importlib.util.find_spec("triton") is not None
inner = pytest.mark.skipif(
    not (INTERPRETING_KERNELS and HAS_TRITON),
    reason="kernel test: runs in the interpreter subprocess of "
           "test_triton_token_interpreter_suite",
)
REFERENCE = {"native": False, "triton": False}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETING_KERNELS, reason="already inside the interpreter run")
def test_triton_token_interpreter_suite():
    """Every ``test_kernel_*`` below, in a subprocess under Triton's interpreter."""
    run_interpreter_suite(__file__)


def test_cpu_tokens_take_no_triton_launch_by_default():
    """Automatic mode sends no CPU token to Triton (the C kernel or the layer's path)."""
    from tmcore.backends.triton import launch

    x = torch.zeros(2, 3, 4)
    with tmcore.options(triton="auto"):
        assert not launch.usable(x)


def test_gpu_benchmark_decode_section_runs_on_the_cpu():
    """``benchmarks/gpu.py``'s decode section at its tiny size on the CPU: both rows timed,
    no kernel count off CUDA, the two paths' outputs equal to rounding."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    from benchmarks import gpu

    result = gpu.decode("cpu", tiny=True, reps=1)
    assert result["default_us_per_token"] > 0 and result["layer_us_per_token"] > 0
    assert result["default_kernels_per_chunk"] is None
    assert result["max_abs_diff"] <= 1e-5


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETING_KERNELS, reason="the interpreter replaces the compiler")
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_token_kernels_build_for_sm90_without_spills(dtype):
    """The token kernels compile for sm_90 with Triton's own LLVM and ptxas (no GPU needed:
    the interpreter does not check what only the compiler rejects), at the launch's tiles
    for d = 512, C = 16 on 4^3, with no register spill (``ptxas -v``); so does the scan's step
    kernel with its row mask."""
    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir,
                                    "benchmarks"))
    from benchmarks.gpu_check import _ptxas_usage
    from tmcore.backends.triton import token_kernels as k

    scalars = {"x_stride": "i32", "d": "i32", "C": "i32", "L": "i32", "norm_eps": dtype,
               "min_sigma": dtype, "sigma_scale": dtype, "threshold": dtype,
               "count_ptr": "*i32", "count_out": "*i32"}
    grid = {"N": 3, "S0": 4, "S1": 4, "S2": 4, "CB": 16}
    for fn, consts in ((k.token_kernel, {"LAYER_NORM": True, "NORM_W": True, "NORM_B": True,
                                         "RESIDUAL": True, **grid, "BD": 512, "BT": 64}),
                       (k.summary_kernel, {"BO": 32, "BI": 64}),
                       (k.heads_kernel, {"N": 3, "CB": 16, "BD": 512, "BT": 64})):
        signature = {a: "constexpr" if a in consts else scalars.get(a, f"*{dtype}")
                     for a in fn.arg_names}
        compiled = triton.compile(
            triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert "spill stores/loads 0/0 B" in _ptxas_usage(compiled.asm["ptx"], 90), fn
    # the scan's step kernel with a row mask (the token's completions); with none it is the
    # scan's own, which benchmarks/gpu_check.py --triton-compile builds
    from tmcore.backends.triton import dense
    from tmcore.backends.triton import dense_kernels as kd

    geo = dense._Geometry(torch.empty(2, 16, 4, 4, 4))
    consts = {**geo.constexprs(True), "WRITE_READ": False, "PRECISION": "ieee",
              "HAS_ACTIVE": True}
    signature = {a: "constexpr" if a in consts else "i32" if a in ("t", "T", "C")
                 else dtype if a in ("eps", "radius") else "*i8" if a == "active_ptr"
                 else f"*{dtype}" for a in kd.step_fwd_kernel.arg_names}
    compiled = triton.compile(
        triton.compiler.ASTSource(fn=kd.step_fwd_kernel, signature=signature, constexprs=consts),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": geo.fwd_warps})
    assert compiled.asm["ptx"]


# --------------------------------------------------------------------------- kernels


class _Launches:
    """Counts the decode token's kernel launches (each kernel's ``[grid](...)``)."""

    def __init__(self, monkeypatch):
        from tmcore.backends.triton import launch

        self.count = 0
        kernels = launch.kernels

        def counted(name):
            module = kernels(name)
            return _Counting(module, self)

        monkeypatch.setattr(launch, "kernels", counted)


class _Counting:
    def __init__(self, module, owner):
        self.module, self.owner = module, owner

    def __getattr__(self, name):
        kernel = getattr(self.module, name)
        owner = self.owner

        class Launcher:
            def __getitem__(self, grid):
                owner.count += 1
                return kernel[grid]

        return Launcher()


@inner
@pytest.mark.parametrize("shape", [(5,), (3, 4), (3, 4, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 3])
def test_kernel_token_equals_the_layers_path_and_one_call(shape, dtype, chunk, monkeypatch):
    launches = _Launches(monkeypatch)
    module = _module(shape, dtype, chunk, sigma_scale=1.5, radius=2.0)
    torch.manual_seed(1)
    x = torch.randn(3, 2 * chunk + 3, 8, dtype=dtype)
    with torch.no_grad():
        _, start = module(x[:, :2])  # a prefill (the layer's path), then one token per call
        launches.count = 0
        out, state = _stream(module, x[:, 2:], start)
        tokens = x.shape[1] - 2
        completions = sum((2 + t) % chunk == chunk - 1 for t in range(tokens))
        assert launches.count == tokens + 3 * completions  # 1 per token, 4 at a completion
        with tmcore.options(**REFERENCE):
            ref_out, ref_state = _stream(module, x[:, 2:], start)
            whole_out, whole_state = module(x)
    _close([out, *state], [ref_out, *ref_state], TOLERANCE[dtype])
    _close([out, *state], [whole_out[:, 2:], *whole_state], TOLERANCE[dtype])


@inner
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_token_of_a_width_of_several_tiles(dtype, monkeypatch):
    """d = 70: two tiles of the read-out and of the content head, three programs of the
    summary product with two input tiles per slot, a masked tail in each."""
    launches = _Launches(monkeypatch)
    module = _module((3, 4), dtype, 2, width=70)
    x = torch.randn(2, 6, 70, dtype=dtype)
    with torch.no_grad():
        _, start = module(x[:, :1])
        launches.count = 0
        out, state = _stream(module, x[:, 1:], start)
        assert launches.count == 5 + 3 * 3
        with tmcore.options(**REFERENCE):
            ref_out, ref_state = _stream(module, x[:, 1:], start)
    _close([out, *state], [ref_out, *ref_state], TOLERANCE[dtype])


@inner
@pytest.mark.parametrize("norm", ["identity", "plain"])
def test_kernel_no_norm_a_plain_layernorm_and_the_memory_alone(norm, monkeypatch):
    for module in (_module((3, 4), torch.float64, 2, norm=norm),
                   _module((3, 4), torch.float64, 2, residual=False)):
        launches = _Launches(monkeypatch)
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        with torch.no_grad():
            out, state = _stream(module, x)
            assert launches.count == 4 + 3 * 2  # (the first token starts from no state)
            with tmcore.options(**REFERENCE):
                ref = _stream(module, x)
        _close([out, *state], [ref[0], *ref[1]], 1e-12)


@inner
def test_kernel_rows_at_different_slots(monkeypatch):
    """A padded batch: rows at different slots share the launches; where a token completes
    some rows' chunks, the scan step updates those rows and the others keep their state;
    every token equals the layer's path, and each row its real tokens alone."""
    launches = _Launches(monkeypatch)
    module = _module((3, 4, 2), torch.float64, 3)
    x = torch.randn(3, 10, 8, dtype=torch.float64)
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[1, :1] = valid[2, :2] = False  # left padding of 0, 1, 2 tokens
    with torch.no_grad():
        _, start = module(x[:, :4], valid=valid)
        assert sorted(start.count.tolist()) == [0, 1, 2]
        launches.count = 0
        out, state = _stream(module, x[:, 4:], start)
        assert launches.count == 4 * 6  # (every token completes one row's chunk)
        with tmcore.options(**REFERENCE):
            ref_out, ref_state = _stream(module, x[:, 4:], start)
    _close([out, *state], [ref_out, *ref_state], 1e-12)
    for row, pad in enumerate((0, 1, 2)):
        with torch.no_grad(), tmcore.options(**REFERENCE):
            alone, alone_state = module(x[row:row + 1, pad:])
        _close([out[row:row + 1], alone_state.h], [alone[:, 4 - pad:], state.h[row:row + 1]],
               1e-12)
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[2, :1] = False  # slots 1, 1, 0: the next token starts one row, continues two
    with torch.no_grad():
        _, start = module(x[:, :4], valid=valid)
        launches.count = 0
        out, state = module(x[:, 4:5], start)
        assert launches.count == 1
        with tmcore.options(**REFERENCE):
            ref_out, ref_state = module(x[:, 4:5], start)
    _close([out, *state], [ref_out, *ref_state], 1e-12)


@inner
def test_kernel_nan_and_infinite_tokens_read_as_the_layers_path(monkeypatch):
    """A NaN or infinite token spreads where the layer's path spreads it and nowhere else
    (a completed chunk's pending tokens and read are zeros, not 0 * NaN)."""
    launches = _Launches(monkeypatch)
    module = _module((3, 4, 2), torch.float64, 2)
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    x[0, 2, 1], x[1, 3, :] = float("nan"), float("inf")
    with torch.no_grad():
        out, state = _stream(module, x)
        with tmcore.options(**REFERENCE):
            ref = _stream(module, x)
    assert launches.count == 5 + 3 * 3
    for u, v in zip([out, *state], [ref[0], *ref[1]], strict=True):
        assert torch.equal(u.isnan(), v.isnan())
        assert torch.allclose(u.nan_to_num(), v.nan_to_num(), rtol=1e-12, atol=1e-12)


@inner
def test_kernel_a_four_axis_grid_takes_the_layers_path(monkeypatch):
    launches = _Launches(monkeypatch)
    module = _module((2, 3, 2, 2), torch.float64, 2)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        out, state = _stream(module, x)
        with tmcore.options(**REFERENCE):
            ref = _stream(module, x)
    assert launches.count == 0
    _close([out, *state], [ref[0], *ref[1]], 1e-12)
