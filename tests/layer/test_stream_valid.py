"""Per-token ``valid`` masks in :func:`tmcore.layer.Layer.forward_stream` (padding skipped).

Contract: tokens where ``valid`` is False never enter the state nor the chunk grid, their
outputs are zeros, and each row (outputs and returned state) equals that row's valid
tokens run alone -- left padding, right padding and holes, continued by later calls.
"""

from __future__ import annotations

import numpy as np
import pytest

import tmcore
from tmcore import layer as tl

L = 3


def _layer(seed=0):
    config = tl.layer_config(5, 2, (3, 2), L)
    rng = np.random.default_rng(seed)
    params = tl.init_params(np, config, lambda s: rng.uniform(-s.bound, s.bound, s.shape))
    layer = tl.Layer(config)

    def scan(h, c, inputs, **masks):
        return tmcore.memory_scan(h, c, *inputs, tl.cell_params(params), **masks)

    def run(x, state=None, **kw):
        return layer.forward_stream(np, params, x, state, scan=scan, **kw)

    return run


def _masks(tokens):
    left = np.array([[False] * 4 + [True] * (tokens - 4), [True] * tokens])
    right = np.array([[True] * (tokens - 5) + [False] * 5, [True] * (tokens - 1) + [False]])
    holes = np.random.default_rng(1).random((2, tokens)) < 0.6
    holes[1] = False   # a row with no valid token at all
    return {"left": left, "right": right, "holes": holes}


def _close(a, b):
    assert np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0) <= 1e-12


def _same_state(s, ref, row):
    assert int(np.asarray(s.count)[row]) == int(np.asarray(ref.count)[0])
    for name in ("h", "c", "pending", "read"):
        _close(getattr(s, name)[row], getattr(ref, name)[0])


@pytest.mark.parametrize("kind", ["left", "right", "holes"])
def test_each_row_equals_its_valid_tokens_alone(kind):
    run = _layer()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 11, 5))
    more = rng.standard_normal((2, 4, 5))
    _, start = run(rng.standard_normal((2, 5, 5)))        # rows mid-chunk (count 2)
    valid = _masks(11)[kind]
    out, state = run(x, start, valid=valid)
    assert np.all(out[~valid] == 0)
    out2, state2 = run(more, state)                        # streaming continues
    for row in range(2):
        row_start = tl.StreamState(*(v[row:row + 1] for v in start[:3]),
                                   np.asarray(start.count)[row:row + 1], start.read[row:row + 1])
        alone, alone_state = run(x[row:row + 1][:, valid[row]], row_start)
        _close(out[row][valid[row]], alone[0])
        _same_state(state, alone_state, row)
        alone2, alone_state2 = run(more[row:row + 1], alone_state)
        _close(out2[row], alone2[0])
        _same_state(state2, alone_state2, row)


def test_valid_with_doc_starts_and_pieces():
    run = _layer(1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 13, 5))
    valid = np.ones((1, 13), bool)
    valid[0, [2, 3, 7]] = False
    starts = np.zeros((1, 13), bool)
    starts[0, [0, 7]] = True                               # the second start is on a skipped token
    out, state = run(x, doc_starts=starts, valid=valid)
    first, _ = run(x[:, [0, 1, 4, 5, 6]])
    second, ref = run(x[:, 8:])
    _close(out[0, [0, 1, 4, 5, 6]], first[0])
    _close(out[0, 8:], second[0])
    _same_state(state, ref, 0)
    # the same in pieces of any lengths
    outs, s = [], None
    for a, b in ((0, 1), (1, 6), (6, 8), (8, 13)):
        o, s = run(x[:, a:b], s, doc_starts=starts[:, a:b], valid=valid[:, a:b])
        outs.append(o)
    _close(np.concatenate(outs, axis=1), out)
    _same_state(s, state, 0)


def test_bad_valid_is_named():
    run = _layer()
    x = np.zeros((2, 4, 5))
    with pytest.raises(TypeError, match="valid"):
        run(x, valid=np.ones((2, 4)))
    with pytest.raises(ValueError, match="valid"):
        run(x, valid=np.ones((2, 3), bool))


def test_jax_apply_takes_valid():
    jax = pytest.importorskip("jax")
    pytest.importorskip("flax")
    from tmcore.adapters import jax as tmj

    params = tmj.init(jax.random.key(0), 5, 2, (3, 2), L)
    x = jax.random.normal(jax.random.key(1), (2, 7, 5), jax.numpy.float32)
    valid = np.array([[False, False, True, True, True, True, True], [True] * 6 + [False]])
    out, state = tmj.apply(params, x, valid=valid)
    assert isinstance(state, tmj.StreamState)
    for row in range(2):
        alone, ref = tmj.apply(params, x[row:row + 1][:, valid[row]], stream=True)
        assert float(np.max(np.abs(np.asarray(out[row][valid[row]]) - alone[0]))) <= 1e-5
        assert float(np.max(np.abs(state.h[row] - ref.h[0]))) <= 1e-5
    assert not np.any(np.asarray(out)[~valid])
