"""The fused step (``step_fwd``, ``backends/native/step.inc``): on small grids the torch
backend's scan forward runs each step as one native call (a decode step is one call),
against the generic array-API scan; larger grids keep the BLAS product (both paths here).

Tolerance: 64 ulps of the dtype (absolute and relative; the values here are of order 1).
The same bits are not feasible: the write makes the generic splat's operations in its
order, but its ``exp`` is libm's, which differs from torch's vectorized one in the last
bit for about 1 % of arguments, and the pointwise product adds its ``2C`` terms in another
order than BLAS. Each result is a chain of at most ``n`` profile factors, ``n`` depthwise
passes of 3 taps, ``2C`` products and the gates: under 40 roundings of terms of order 1
for the sizes here (``n <= 4``, ``C <= 4``).
"""

from __future__ import annotations

import array_api_compat
import pytest
from _helpers import torch_scan_inputs

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore  # noqa: E402
import tmcore.backends.native as native  # noqa: E402
from tmcore.backends.torch import memory  # noqa: E402
from tmcore.backends.torch import scan as torch_scan  # noqa: E402
from tmcore.scan import memory_scan_bwd, memory_scan_fwd  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the fused kernels cannot be built here (no C compiler)")

XP = array_api_compat.array_namespace(torch.empty(0))
B = 4
_MASKS = {
    "none": {},
    "active": {"active": torch.tensor([[True], [False], [True], [False]])},
    "reset": {"reset": torch.tensor([[False], [True], [True], [False]])},
    "both": {"reset": torch.tensor([[True], [True], [False], [False]]),
             "active": torch.tensor([[True], [False], [True], [False]])},
    "idle": {"active": torch.zeros(B, 1, dtype=torch.bool)},
}


def _tol(dtype):
    ulps = 64 * torch.finfo(dtype).eps
    return dict(rtol=ulps, atol=ulps, equal_nan=True)


def _case(shape, dtype, seed=0, channels=3, edges=False):
    (h0, c0, rc, wc, ws, content, params), _ = torch_scan_inputs(
        torch, shape, dtype, batch=B, channels=channels, steps=1, edges=edges, seed=seed)
    return h0, c0, rc, wc, ws, content, params


def _forward(case, generic=False, **kwargs):
    h0, c0, rc, wc, ws, content, params = case
    with torch.no_grad(), tmcore.options(generic=generic):
        return memory_scan_fwd(XP, h0, c0, rc, wc, ws, content, params, **kwargs)


@pytest.fixture
def step_calls(monkeypatch):
    """The names of the native kernels the torch scan calls."""
    names = []
    call = torch_scan.call

    def counted(kernels, name, *args):
        names.append(name)
        return call(kernels, name, *args)

    monkeypatch.setattr(torch_scan, "call", counted)
    return names


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(5,), (1, 4), (3, 4, 2), (2, 1, 3, 2)])
@pytest.mark.parametrize("masks", sorted(_MASKS))
@pytest.mark.parametrize("radius", [None, 1.5, float("inf")])
def test_one_step_equals_the_generic_step(dtype, shape, masks, radius, step_calls):
    """Reads, state and checkpoints of the one native call equal the generic step, on every
    rank with axes of size 1, under every mask and truncation; the checkpoints are the
    entering state bit for bit and rows that keep no update keep their entering state bit
    for bit."""
    case = _case(shape, dtype, seed=len(shape), edges=True)
    fused = _forward(case, radius=radius, **_MASKS[masks])
    assert step_calls == ["step_fwd"]
    generic = _forward(case, generic=True, radius=radius, **_MASKS[masks])
    for a, b in zip(fused, generic, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **_tol(dtype))
    h0, c0 = case[:2]
    assert torch.equal(fused[3][0], h0) and torch.equal(fused[4][0], c0)
    active = _MASKS[masks].get("active", torch.ones(B, 1, dtype=torch.bool))[:, 0]
    reset = _MASKS[masks].get("reset", torch.zeros(B, 1, dtype=torch.bool))[:, 0]
    for b in range(B):
        if not active[b]:
            entered = (torch.zeros_like(h0[b]), torch.zeros_like(c0[b])) if reset[b] \
                else (h0[b], c0[b])
            assert torch.equal(fused[1][b], entered[0]) and torch.equal(fused[2][b], entered[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_degenerate_spread_equals_the_generic_limit(dtype):
    """``eps = 0`` with spreads whose ``2 sigma^2`` underflows: the generic splat's limit (a
    weight of 1 on a centre hit exactly, 0 elsewhere) with the same kernel."""
    h0, c0, rc, wc, ws, content, params = _case((3, 5), dtype)
    wc = torch.tensor([[[0.0, 1.0]], [[0.5, -1.0]], [[0.3, 0.2]], [[0.0, 0.0]]], dtype=dtype)
    ws = torch.full_like(ws, torch.finfo(dtype).tiny)
    case = (h0, c0, rc, wc, ws, content, params)
    for a, b in zip(_forward(case, eps=0.0), _forward(case, generic=True, eps=0.0),
                    strict=True):
        torch.testing.assert_close(a, b, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nan_inputs_stay_in_their_row(dtype):
    """A NaN read coordinate makes its row's read NaN, a NaN write its row's state NaN; the
    other rows are untouched, and an inactive row keeps its state whatever it wrote."""
    h0, c0, rc, wc, ws, content, params = _case((3, 4, 2), dtype)
    rc, wc = rc.clone(), wc.clone()
    rc[0, 0, 1] = float("nan")
    wc[1, 0, 0] = float("nan")
    wc[3, 0, 2] = float("nan")
    case = (h0, c0, rc, wc, ws, content, params)
    active = torch.tensor([[True], [True], [True], [False]])
    fused = _forward(case, active=active)
    generic = _forward(case, generic=True, active=active)
    for a, b in zip(fused, generic, strict=True):
        torch.testing.assert_close(a, b, **_tol(dtype))
    reads, h, c = fused[:3]
    assert reads[0].isnan().all() and not reads[1:].isnan().any()
    assert h[1].isnan().all() and c[1].isnan().all()
    assert not (h[[0, 2, 3]].isnan().any() or c[[0, 2, 3]].isnan().any())
    assert torch.equal(h[3], h0[3]) and torch.equal(c[3], c0[3])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_result_is_written_whole(dtype, monkeypatch):
    """Results allocated as NaN (as poisoned memory would be) give the same bits: the kernel
    writes every element of every result, masked rows included."""
    case = _case((2, 3, 2), dtype)
    masks = _MASKS["both"]
    clean = _forward(case, **masks)
    uninitialized = memory.uninitialized
    monkeypatch.setattr(memory, "uninitialized",
                        lambda *a, **k: uninitialized(*a, **k).fill_(float("nan")))
    poisoned = _forward(case, **masks)
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.equal(a, b)


def test_strided_rows_and_broadcast_masks_are_read_in_place():
    """Step inputs that are views (a step of a longer scan's inputs, coordinates whose last
    axis is strided) and masks broadcast over the batch give the bits of contiguous
    copies."""
    h0, c0, rc, wc, ws, content, params = torch_scan_inputs(
        torch, (3, 4), torch.float64, batch=B, steps=3, seed=5)[0]
    scattered = rc[:, 1:2].permute(2, 0, 1).contiguous().permute(1, 2, 0)  # last axis strided
    views = (scattered, wc[:, 2:3], ws[:, 1:2], content[:, 0:1])
    assert scattered.stride(-1) == B and not any(v.is_contiguous() for v in views[1:])
    active = torch.tensor([True]).expand(B, 1)
    reset = torch.tensor([[False, True]]).expand(B // 2, 2).reshape(B, 1)
    strided = _forward((h0, c0, *views, params), active=active, reset=reset)
    copies = _forward((h0, c0, *(v.contiguous() for v in views), params),
                      active=active.contiguous(), reset=reset.contiguous())
    for a, b in zip(strided, copies, strict=True):
        assert torch.equal(a, b)


def test_threads_change_no_bit():
    """One or several OpenMP threads: the same bits (no sum crosses threads)."""
    case = _case((4, 4, 4), torch.float32, channels=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _forward(case, **_MASKS["active"])
        torch.set_num_threads(max(2, threads))
        several = _forward(case, **_MASKS["active"])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, several, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("masks", ["none", "both"])
def test_the_backward_from_its_checkpoints_equals_the_generic_one(masks):
    """The one-step forward's checkpoints serve the scan's backward: float64 gradients equal
    the generic forward and backward's."""
    (h0, c0, rc, wc, ws, content, params), (g_reads, g_h, g_c) = torch_scan_inputs(
        torch, (3, 2, 2), torch.float64, batch=B, steps=1, seed=3)
    grads = {}
    for generic in (False, True):
        with tmcore.options(generic=generic):
            *_, hk, ck = memory_scan_fwd(XP, h0, c0, rc, wc, ws, content, params,
                                         **_MASKS[masks])
            out = memory_scan_bwd(XP, rc, wc, ws, content, params, hk, ck, g_reads, g_h, g_c,
                                  **_MASKS[masks])
        grads[generic] = [*out[:6], *out.params]
    for a, b in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.fixture(params=["fused steps", "bmm steps"])
def path(request, monkeypatch):
    """The two forwards of the fused CPU scan: one ``step_fwd`` call per step (small grids)
    and the kernels around BLAS's ``bmm`` (larger grids), chosen by the shapes."""
    if request.param == "bmm steps":
        monkeypatch.setattr(torch_scan, "FUSED_STEP_MAX", 0)
    return request.param


@pytest.mark.parametrize("checkpoint_every", [1, 3, 10])
def test_a_scan_of_many_steps_equals_the_generic_scan(path, checkpoint_every, step_calls):
    """Reads, state and every checkpoint of a 7-step scan under per-step masks equal the
    generic scan's; the fused path calls ``step_fwd`` once per step and nothing else."""
    (h0, c0, rc, wc, ws, content, params), _ = torch_scan_inputs(
        torch, (3, 4, 2), torch.float64, batch=B, steps=7, seed=9)
    masks = {"reset": torch.rand(B, 7, generator=torch.Generator().manual_seed(1)) < 0.3,
             "active": torch.rand(B, 7, generator=torch.Generator().manual_seed(2)) < 0.7}
    case = (h0, c0, rc, wc, ws, content, params)
    fused = _forward(case, checkpoint_every=checkpoint_every, **masks)
    assert (step_calls == ["step_fwd"] * 7) == (path == "fused steps")
    generic = _forward(case, generic=True, checkpoint_every=checkpoint_every, **masks)
    for a, b in zip(fused, generic, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **_tol(torch.float64))


def test_any_split_of_a_scan_gives_the_same_bits(path):
    """The path is chosen by the shapes, never by the number of steps: a scan cut into
    pieces of 1, 2 and 4 steps gives the bits of one call."""
    (h0, c0, rc, wc, ws, content, params), _ = torch_scan_inputs(
        torch, (3, 4, 2), torch.float32, batch=B, steps=7, seed=4)
    whole = _forward((h0, c0, rc, wc, ws, content, params))
    h, c, reads = h0, c0, []
    for start, stop in ((0, 1), (1, 3), (3, 7)):
        piece = _forward((h, c, *(t[:, start:stop] for t in (rc, wc, ws, content)), params))
        reads.append(piece[0])
        h, c = piece[1:3]
    assert torch.equal(torch.cat(reads, 1), whole[0])
    assert torch.equal(h, whole[1]) and torch.equal(c, whole[2])
