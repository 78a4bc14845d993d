"""The array planner of packed documents (:func:`tmcore.layer.plan.packed_plan`) in NumPy.

A scan taking per-step masks (``scan.masks``; here a reference one, step by step) runs
:meth:`Layer.forward_stream` with ``max_documents`` through the array plan; it must equal
the host plan (:func:`tmcore.layer.plan.host_plan`) on random masks: outputs and the
whole returned state. A scan without masks keeps the host plan, checking the bound.
"""

from __future__ import annotations

import numpy as np
import pytest

import tmcore
from tmcore import layer as tl
from tmcore.layer.plan import packed_steps

L, D = 3, 5


def _layer(seed=0):
    config = tl.layer_config(D, 2, (3, 2), L)
    rng = np.random.default_rng(seed)
    params = tl.init_params(np, config, lambda s: rng.uniform(-s.bound, s.bound, s.shape))
    layer = tl.Layer(config)
    cell = tl.cell_params(params)
    steps_seen = []

    def scan(h, c, inputs):
        return tmcore.memory_scan(h, c, *inputs, cell)

    def masked(h, c, inputs, reset=None, active=None):
        """The masks' meaning, one step at a time."""
        steps_seen.append(inputs.read_coords.shape[1])
        reads = []
        for t in range(inputs.read_coords.shape[1]):
            zero = reset[:, t].reshape(-1, 1, 1, 1)
            h, c = np.where(zero, 0.0, h), np.where(zero, 0.0, c)
            read, h1, c1 = tmcore.memory_scan(h, c, *(v[:, t:t + 1] for v in inputs), cell)
            keep = active[:, t].reshape(-1, 1, 1, 1)
            h, c = np.where(keep, h1, h), np.where(keep, c1, c)
            reads.append(read)
        return np.concatenate(reads, axis=1), h, c

    masked.masks = True

    def run(x, state=None, masks=False, **kw):
        return layer.forward_stream(np, params, x, state, scan=masked if masks else scan,
                                    **kw)

    return run, steps_seen


def _close(a, b):
    assert np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0) <= 1e-12


def _same(result, ref):
    (out, st), (ref_out, ref_st) = result, ref
    _close(out, ref_out)
    for name in ("h", "c", "pending", "read"):
        _close(getattr(st, name), getattr(ref_st, name))
    assert np.array_equal(np.asarray(st.count), np.asarray(ref_st.count))


@pytest.mark.parametrize("seed", range(40))
def test_the_array_plan_equals_the_host_plan(seed):
    rng = np.random.default_rng(seed)
    run, steps_seen = _layer(seed)
    batch, tokens = 4, int(rng.integers(1, 12))
    prefix = rng.standard_normal((batch, 2 * L, D))   # rows at different counts
    rows = [run(prefix[b:b + 1, :int(rng.integers(1, 2 * L))])[1] for b in range(batch)]
    state = tl.StreamState(*(np.concatenate([np.asarray(getattr(r, f)) for r in rows])
                             for f in tl.StreamState._fields))
    x = rng.standard_normal((batch, tokens, D))
    starts = rng.random((batch, tokens)) < rng.uniform(0.1, 0.6)
    valid = rng.random((batch, tokens)) < 0.75 if seed % 2 else None
    reset = rng.random(batch) < 0.3 if seed % 3 else None
    bound = int(starts.sum(axis=1).max()) + 1
    ref = run(x, state, doc_starts=starts, valid=valid, reset=reset)
    _same(run(x, state, masks=True, doc_starts=starts, valid=valid, reset=reset,
              max_documents=bound), ref)
    assert steps_seen[-1] == packed_steps(tokens, L, bound)


def test_a_scan_without_masks_keeps_the_host_plan_and_checks_the_bound():
    run, _ = _layer()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, D))
    starts = np.zeros((2, 8), bool)
    starts[0, [0, 3, 4]] = True
    ref = run(x, doc_starts=starts)
    out, st = run(x, doc_starts=starts, max_documents=3)
    assert np.array_equal(out, ref[0]) and np.array_equal(st.h, ref[1].h)  # the same plan
    with pytest.raises(ValueError, match="max_documents: row 0 starts 3 documents"):
        run(x, doc_starts=starts, max_documents=2)
    with pytest.raises(ValueError, match="max_documents: row 0 starts 3 documents"):
        run(x, masks=True, doc_starts=starts, max_documents=2)
    with pytest.raises(ValueError, match="max_documents"):
        run(x, doc_starts=starts, max_documents=0)
    with pytest.raises(TypeError, match="max_documents"):
        run(x, doc_starts=starts, max_documents=1.5)


def test_the_bound_covers_every_grid():
    """``packed_steps`` is the most chunks any row can take: all stream splits."""
    for tokens in range(1, 9):
        for count in range(L):
            stream = count + tokens
            for cuts in range(1 << tokens):  # every set of starts among the new tokens
                starts = [count + n for n in range(tokens) if cuts >> n & 1]
                bounds = ([0, *starts, stream] if not starts or starts[0] > count
                          else [*starts, stream])
                chunks = sum(-(-(b - a) // L) for a, b in zip(bounds, bounds[1:],
                                                              strict=False))
                assert chunks <= packed_steps(tokens, L, len(starts)), (tokens, count, cuts)
