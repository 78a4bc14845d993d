"""The torch backend's fused CPU scan (``backends/torch/scan.py``: the whole chunk loop over
the C kernels of ``backends/native/kernels.c``) against the generic per-step loop.

Every spatial rank (1 to 4, axes of size 1), float32 and float64, checkpoint
intervals that do and do not divide ``T``, write blocks of several steps, a
truncation radius, read coordinates on cell centres, on and beyond the borders,
infinite and NaN; and where it must step aside (native kernels off, a forced
depthwise kernel, autograd recording).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from _helpers import torch_scan_inputs  # noqa: E402

import tmcore  # noqa: E402
import tmcore.backends.native as native  # noqa: E402
from tmcore.backends.torch import scan  # noqa: E402
from tmcore.scan import memory_scan, memory_scan_vjp  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the fused kernels cannot be built here (no C compiler)")


def _inputs(shape, dtype, batch=2, channels=3, steps=7, edges=False, seed=0):
    return torch_scan_inputs(torch, shape, dtype, batch, channels, steps, edges, seed)


def _flat(values):
    for v in values:
        if isinstance(v, tuple):
            yield from _flat(v)
        else:
            yield v


def _both(args, cotangents, **kw):
    fused = (*memory_scan(*args, **kw), *memory_scan_vjp(*args, *cotangents, **kw))
    with tmcore.options(generic=True):
        generic = (*memory_scan(*args, **kw), *memory_scan_vjp(*args, *cotangents, **kw))
    return list(_flat(fused)), list(_flat(generic))


def _assert_agree(fused, generic, rtol):
    for a, b in zip(fused, generic, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        a, b = torch.nan_to_num(a), torch.nan_to_num(b)
        scale = float(b.abs().max()) + 1e-30
        assert float((a - b).abs().max()) <= rtol * scale


@pytest.fixture
def counted(monkeypatch):
    """The fused-scan steps taken: cell steps around BLAS, or one ``step_fwd`` call each."""
    calls = []
    step, call = scan.Cell.step, scan.call
    monkeypatch.setattr(scan.Cell, "step", lambda self, *a: (calls.append(1), step(self, *a)))
    monkeypatch.setattr(scan, "call", lambda kernels, name, *a: (
        calls.append(1) if name == "step_fwd" else None, call(kernels, name, *a)))
    return calls


@pytest.mark.parametrize("shape", [(4, 3, 5), (6,), (2, 5), (3, 1, 4), (2, 3, 1, 2)])
@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fused_step_max", [scan.FUSED_STEP_MAX, 0])
def test_fused_scan_matches_the_generic_loop(shape, every, dtype, fused_step_max, counted,
                                             monkeypatch):
    # both forwards: one step_fwd call per step (small grids), and the kernels around bmm
    monkeypatch.setattr(scan, "FUSED_STEP_MAX", fused_step_max)
    args, cotangents = _inputs(shape, dtype)
    fused, generic = _both(args, cotangents, checkpoint_every=every)
    assert counted, "the fused CPU scan did not run"
    _assert_agree(fused, generic, 1e-12 if dtype == torch.float64 else 2e-5)


@pytest.mark.parametrize("shape", [(5, 5, 5), (5,), (1, 5), (5, 1, 2), (2, 5, 1, 3)])
def test_fused_read_on_centres_borders_infinities_and_nan(shape, counted):
    args, cotangents = _inputs(shape, torch.float64, batch=3, steps=6, edges=True, seed=1)
    fused, generic = _both(args, cotangents)
    _assert_agree(fused, generic, 1e-12)
    args[2][1, 2, 0] = float("nan")  # NaN read: its read, gradients and batch's state NaN
    fused, generic = _both(args, cotangents)
    assert any(bool(torch.isnan(t).any()) for t in fused)
    _assert_agree(fused, generic, 1e-12)


def test_fused_scan_with_blocks_segments_and_a_radius(counted):
    # 40 steps: write blocks of 16 (the last ragged), segments of 7 crossing blocks
    args, cotangents = _inputs((3, 3), torch.float64, steps=40, seed=2)
    for every in (7, 40):
        _assert_agree(*_both(args, cotangents, checkpoint_every=every), 1e-12)
    _assert_agree(*_both(args, cotangents, radius=1.5), 1e-12)
    assert counted


def test_fused_scan_steps_aside(counted):
    args, cotangents = _inputs((3, 3), torch.float64, seed=3)
    with tmcore.options(native=False):
        memory_scan(*args)
    with tmcore.options(depthwise="shifts"):
        memory_scan(*args)
    assert not counted
    with torch.enable_grad():
        h0 = args[0].clone().requires_grad_(True)
        reads, _, _ = memory_scan(h0, *args[1:])
        assert reads.grad_fn is not None  # autograd saw the generic ops
    assert not counted


def test_fused_scan_rejects_malformed_shapes():
    args, _ = _inputs((3, 3), torch.float64, seed=4)
    fused = tmcore.runtime.dispatch.ops_for(_namespace()).scan_fwd
    bad = args[3][:, :, :1]  # write_coords (B, T, 1), expected (B, T, 2)
    with pytest.raises(ValueError, match="write_coords"):
        fused(_namespace(), args[0], args[1], args[2], bad, *args[4:], 1e-6, None, 1)


def _namespace():
    import array_api_compat

    return array_api_compat.array_namespace(torch.empty(0))


@pytest.mark.parametrize("shape", [(5, 5, 5), (5,), (1, 5), (5, 1, 2), (2, 5, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_query_read_by_the_read_kernel_matches_the_generic_read(shape, dtype,
                                                                     monkeypatch):
    """A read of one query per row (a decode step's) on the CPU runs the fused scan's read
    kernel: the generic read's values on centres, borders, beyond them, at infinities and
    NaN (which reads NaN)."""
    from tmcore.backends.torch import sample

    kernel_calls = []
    call = sample.call
    monkeypatch.setattr(sample, "call", lambda kernels, name, *a: (
        kernel_calls.append(name), call(kernels, name, *a)))
    n = len(shape)
    volume = torch.randn(7, 3, *shape, generator=torch.Generator().manual_seed(5), dtype=dtype)
    edges = torch.tensor([-1.0, 1.0, 0.0, 2.5, -7.0, float("inf"), -float("inf"), 0.3333,
                          -0.5], dtype=dtype)
    coords = torch.stack([edges[(torch.arange(7) + 2 * a) % len(edges)] for a in range(n)],
                         dim=-1)[:, None, :]
    coords[6, 0, n - 1] = float("nan")
    read = tmcore.trilinear_sample(volume, coords)
    assert kernel_calls == ["read_fwd"]
    with tmcore.options(generic=True):
        expected = tmcore.trilinear_sample(volume, coords)
    assert read.shape == expected.shape == (7, 1, 3) and read.dtype == dtype
    assert torch.isnan(read[6]).all() and not torch.isnan(read[:6]).any()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(read[:6], expected[:6], rtol=tolerance, atol=tolerance)
    with tmcore.options(native=False):  # and the op stays what grid_sample gives
        torch.testing.assert_close(tmcore.trilinear_sample(volume, coords)[:6], read[:6],
                                   rtol=tolerance, atol=tolerance)
