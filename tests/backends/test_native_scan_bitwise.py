"""The fused CPU scan's buffer pool (``backends/torch/memory.py``: ``_Pool``) never changes a
result: calls are bitwise reproducible whatever ran before them (other shapes and
values, no-grad then grad, other ``B`` / ``T``), a pooled buffer is never handed out
while a tensor still refers to it, every pooled buffer is written before it is read
(pooled memory poisoned with NaN between calls changes nothing), deterministic mode
(whose ``torch.empty`` fills with NaN) gives the same bits, and the pool stays bounded.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import array_api_compat  # noqa: E402
from _helpers import torch_scan_inputs  # noqa: E402

import tmcore  # noqa: E402
import tmcore.backends.native as native  # noqa: E402
from tmcore.backends.torch import memory  # noqa: E402
from tmcore.scan import memory_scan_bwd, memory_scan_fwd  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the fused kernels cannot be built here (no C compiler)")

_XP = array_api_compat.array_namespace(torch.empty(0))


def _inputs(shape=(3, 4, 2), dtype=torch.float64, batch=2, channels=3, steps=5, seed=0):
    return torch_scan_inputs(torch, shape, dtype, batch, channels, steps, seed=seed)


def _run(inputs, every=1, generic=False):
    """Forward and backward of the scan: every output, residual and gradient, cloned."""
    (h0, c0, rc, wc, ws, content, params), (g_reads, g_h, g_c) = inputs
    with tmcore.options(generic=generic):
        reads, h, c, hk, ck = memory_scan_fwd(_XP, h0, c0, rc, wc, ws, content, params,
                                              checkpoint_every=every)
        grads = memory_scan_bwd(_XP, rc, wc, ws, content, params, hk, ck, g_reads, g_h, g_c,
                                checkpoint_every=every)
    out = [reads, h, c, hk, ck, *grads[:6], *grads.params]
    return [t.clone() for t in out]


def _equal(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape
                                    and torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    """An empty pool that takes even these small test buffers."""
    monkeypatch.setattr(memory, "_SMALL", 0)
    memory.release_scan_buffers()
    yield
    memory.release_scan_buffers()


def test_small_buffers_are_not_pooled(monkeypatch):
    """Below ``_SMALL`` bytes (a decode step's buffers) a fresh one costs less than a
    search: nothing is pooled."""
    monkeypatch.setattr(memory, "_SMALL", 1 << 18)
    _run(_inputs())
    assert memory._POOL.blocks == []


def _poison_free_blocks():
    """NaN into every pooled block nothing refers to (what a later call may get)."""
    poisoned = 0
    for block in memory._POOL.blocks:
        if memory._POOL._free(block):
            storage = block[0]
            torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).fill_(255)
            poisoned += 1  # 0xFF... is a NaN in float32 and float64
    return poisoned


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the fused scan takes (pooled or fresh) starts as NaN."""
    take, uninitialized = memory._POOL.take, memory.uninitialized
    count = []

    def nan(t):
        count.append(1)
        return t.fill_(float("nan"))

    monkeypatch.setattr(memory._POOL, "take", lambda *a, **k: nan(take(*a, **k)))
    monkeypatch.setattr(memory, "uninitialized", lambda *a, **k: nan(uninitialized(*a, **k)))
    return count


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("every", [1, 2])
def test_fused_scan_matches_generic_and_repeats_bitwise(dtype, every):
    inputs = _inputs(dtype=dtype, steps=5)
    first = _run(inputs, every)
    generic = _run(inputs, every, generic=True)
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for a, b in zip(first, generic, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert float((a - b).abs().max()) <= tol * (float(b.abs().max()) + 1e-30)
    assert memory._POOL.blocks, "the fused scan took nothing from the pool"
    for _ in range(2):
        assert _equal(_run(inputs, every), first)


def test_other_shapes_and_values_in_between_change_nothing():
    a = _inputs(shape=(3, 4, 2), batch=2, steps=5, seed=0)
    ref = _run(a)
    others = [_inputs(shape=(3, 4, 2), batch=2, steps=5, seed=1),   # same shapes
              _inputs(shape=(3, 4, 2), batch=3, steps=5, seed=2),   # other B
              _inputs(shape=(3, 4, 2), batch=2, steps=9, seed=3),   # other T
              _inputs(shape=(3, 4, 2), batch=2, steps=3, seed=4),   # smaller T
              _inputs(shape=(5, 2), batch=4, channels=2, steps=7, seed=5)]
    other_refs = [_run(o) for o in others]
    for o, o_ref in zip(others, other_refs, strict=True):
        assert _equal(_run(a), ref)
        assert _equal(_run(o), o_ref)
        assert _equal(_run(o, every=2), _run(o, every=2))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_buffer_is_written_before_it_is_read(dtype, request):
    inputs = _inputs(dtype=dtype, batch=3, steps=6)
    refs = {every: _run(inputs, every) for every in (1, 2, 4)}
    count = request.getfixturevalue("poisoned")
    for every, ref in refs.items():
        assert _equal(_run(inputs, every), ref)
    assert count
    memory.release_scan_buffers()
    for every, ref in refs.items():  # also on fresh blocks
        assert _equal(_run(inputs, every), ref)
        _poison_free_blocks()


def test_a_block_in_use_is_never_handed_out():
    (h0, c0, rc, wc, ws, content, params), _ = _inputs(batch=2, steps=6)
    kept = memory_scan_fwd(_XP, h0, c0, rc, wc, ws, content, params)
    copies = [t.clone() for t in kept]
    ptrs = {t.untyped_storage().data_ptr() for t in kept}
    for seed in range(3):  # more scans of the same shapes while the outputs are alive
        (h1, c1, rc1, wc1, ws1, content1, _), _ = _inputs(batch=2, steps=6, seed=seed + 1)
        again = memory_scan_fwd(_XP, h1, c1, rc1, wc1, ws1, content1, params)
        assert not ptrs & {t.untyped_storage().data_ptr() for t in again}
        del again
    assert _equal(list(kept), copies)
    views = [kept[3][1:], kept[4][2]]  # only views of the checkpoints left alive
    view_copies = [v.clone() for v in views]
    del kept
    memory_scan_fwd(_XP, h0 + 1, c0, rc, wc, ws, content, params)
    assert _equal(views, view_copies)


def test_returned_tensors_own_storage_of_their_size():
    inputs = _inputs(batch=2, steps=9)
    _run(_inputs(batch=2, steps=9, seed=1))
    (h0, c0, rc, wc, ws, content, params), (g_reads, g_h, g_c) = inputs
    reads, h, c, hk, ck = memory_scan_fwd(_XP, h0, c0, rc, wc, ws, content, params)
    grads = memory_scan_bwd(_XP, rc, wc, ws, content, params, hk, ck, g_reads, g_h, g_c)
    for t in (reads, h, c, *grads[:6]):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_no_grad_then_grad_through_the_torch_layer():
    pytest.importorskip("tmcore.adapters.torch", reason="the torch adapter is not importable")
    from tmcore.adapters.torch import TensorMemory

    torch.manual_seed(0)
    layer = TensorMemory(8, 3, (3, 2, 4), 2, dtype=torch.float64)
    x = torch.randn(2, 10, 8, dtype=torch.float64, requires_grad=True)

    def train():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x, stream=False)[0]
        (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        return [out.detach().clone(), x.grad.clone(),
                *(p.grad.clone() for p in layer.parameters())]

    first = train()
    with torch.no_grad():
        plain = layer(x, stream=False)[0].clone()
        layer(torch.randn(3, 14, 8, dtype=torch.float64), stream=False)  # other B and T
    assert _poison_free_blocks() > 0
    assert _equal(train(), first)
    with torch.no_grad():
        assert _equal([layer(x, stream=False)[0]], [plain])


def test_deterministic_mode_gives_the_same_bits():
    inputs = _inputs(batch=2, steps=5)
    ref = _run(inputs)
    memory.release_scan_buffers()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert _equal(_run(inputs), ref)
        assert _equal(_run(inputs), ref)
    finally:
        torch.use_deterministic_algorithms(was)


def test_without_storage_use_counts_nothing_is_pooled(monkeypatch):
    inputs = _inputs(batch=2, steps=5)
    ref = _run(inputs)
    memory.release_scan_buffers()
    monkeypatch.setattr(memory, "_storage_use_count", None)
    assert _equal(_run(inputs), ref)
    assert memory._POOL.blocks == []


def test_the_pool_stays_bounded():
    for steps in (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20):
        _run(_inputs(batch=2, steps=steps))
    pool = memory._POOL
    pool.begin()  # what the next call starts with: trimmed to twice the biggest recent call
    free = sum(b[1] for b in pool.blocks if pool._free(b))
    assert 0 < free <= 2 * max(pool.taken)
    assert all(b[2] > pool.calls - memory._POOL_AGE for b in pool.blocks)
    held = sum(b[1] for b in pool.blocks)
    for _ in range(memory._POOL_AGE + 1):  # small calls only: the big blocks age out
        _run(_inputs(batch=1, steps=2))
    assert sum(b[1] for b in pool.blocks) < held
    memory.release_scan_buffers()
    assert pool.blocks == []


def test_the_public_release_empties_the_pool_and_changes_no_result():
    inputs = _inputs(batch=2, steps=4)
    first = _run(inputs)
    assert memory._POOL.blocks  # the scan kept its buffers for the next call
    tmcore.backends.release_scan_buffers()
    assert memory._POOL.blocks == []
    assert _equal(_run(inputs), first)  # fresh buffers, the same bits
