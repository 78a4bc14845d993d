"""The chunk grid of streamed calls (:mod:`tmcore.layer.plan`) in NumPy, against one token
at a time.

:meth:`Layer.forward_stream` plans rows at different counts, with skipped tokens and
packed documents, as ONE masked scan; the reference feeds each row's tokens one call per
token (the one-token step, planning nothing), restarting its state at each document start
(``reset``). Outputs and the whole returned state must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

import tmcore
from tmcore import layer as tl
from tmcore.layer.plan import plan_steps

L, D = 3, 5


def _layer(seed=0):
    config = tl.layer_config(D, 2, (3, 2), L)
    rng = np.random.default_rng(seed)
    params = tl.init_params(np, config, lambda s: rng.uniform(-s.bound, s.bound, s.shape))
    layer = tl.Layer(config)
    cell = tl.cell_params(params)
    steps_seen = []

    def scan(h, c, inputs, *, reset=None, active=None):
        steps_seen.append(inputs.read_coords.shape[1])
        return tmcore.memory_scan(h, c, *inputs, cell, reset=reset, active=active)

    def run(x, state=None, **kw):
        return layer.forward_stream(np, params, x, state, scan=scan, **kw)

    return run, steps_seen


def _reference(run, x, state, starts, valid):
    """Row by row, one token per call; a start on a skipped token moves to the next kept
    one (after the last, the row ends empty)."""
    outs, states = np.zeros(x.shape), []
    for b in range(x.shape[0]):
        st = tl.StreamState(*(np.asarray(v)[b:b + 1] for v in state))
        pending_start = False
        for n in range(x.shape[1]):
            pending_start |= bool(starts[b, n])
            if valid is not None and not valid[b, n]:
                continue
            out, st = run(x[b:b + 1, n:n + 1], st, reset=np.array([pending_start]))
            outs[b, n] = out[0, 0]
            pending_start = False
        if pending_start:
            st = run(x[b:b + 1, :0], st, reset=np.array([True]))[1]
        states.append(st)
    return outs, tl.StreamState(*(np.concatenate([np.asarray(getattr(s, f)) for s in states])
                                  for f in tl.StreamState._fields))


def _close(a, b):
    assert np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0) <= 1e-12


@pytest.mark.parametrize("seed", range(40))
def test_one_masked_scan_equals_one_token_at_a_time(seed):
    rng = np.random.default_rng(seed)
    run, steps_seen = _layer(seed)
    batch, tokens = 4, int(rng.integers(2, 12))
    prefix = rng.standard_normal((batch, 2 * L, D))   # rows at different counts
    rows = [run(prefix[b:b + 1, :int(rng.integers(1, 2 * L))])[1] for b in range(batch)]
    state = tl.StreamState(*(np.concatenate([np.asarray(getattr(r, f)) for r in rows])
                             for f in tl.StreamState._fields))
    x = rng.standard_normal((batch, tokens, D))
    starts = rng.random((batch, tokens)) < rng.uniform(0.0, 0.6) if seed % 4 else None
    valid = rng.random((batch, tokens)) < 0.75 if seed % 2 else None
    out, st = run(x, state, doc_starts=starts, valid=valid)
    ref_out, ref_st = _reference(run, x, state, np.zeros((batch, tokens), bool)
                                 if starts is None else starts, valid)
    _close(out, ref_out)
    for name in ("h", "c", "pending", "read"):
        _close(getattr(st, name), getattr(ref_st, name))
    assert np.array_equal(np.asarray(st.count), np.asarray(ref_st.count))
    documents = 0 if starts is None else int(starts.sum(axis=1).max())
    assert max(steps_seen[-batch * tokens - 1:]) <= plan_steps(tokens, L, L - 1, documents)


def test_max_documents_bounds_the_grid_and_is_checked():
    run, steps_seen = _layer()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, D))
    starts = np.zeros((2, 8), bool)
    starts[0, [0, 3, 4]] = True
    ref = run(x, doc_starts=starts)
    out, st = run(x, doc_starts=starts, max_documents=5)
    _close(out, ref[0])
    _close(st.h, ref[1].h)
    assert steps_seen[-1] == plan_steps(8, L, 0, 5)
    with pytest.raises(ValueError, match="max_documents: row 0 starts 3 documents"):
        run(x, doc_starts=starts, max_documents=2)
    with pytest.raises(ValueError, match="max_documents"):
        run(x, doc_starts=starts, max_documents=0)
    with pytest.raises(TypeError, match="max_documents"):
        run(x, doc_starts=starts, max_documents=1.5)


def test_the_bound_covers_every_grid():
    """``plan_steps`` is the most chunks any row can take: all stream splits."""
    for tokens in range(1, 9):
        for count in range(L):
            stream = count + tokens
            for cuts in range(1 << tokens):  # every set of starts among the new tokens
                starts = [count + n for n in range(tokens) if cuts >> n & 1]
                bounds = ([0, *starts, stream] if not starts or starts[0] > count
                          else [*starts, stream])
                chunks = sum(-(-(b - a) // L) for a, b in zip(bounds, bounds[1:],
                                                              strict=False))
                assert chunks <= plan_steps(tokens, L, count, len(starts)), (tokens, count)
