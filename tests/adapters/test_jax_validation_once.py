"""One validation per call in the JAX adapter: ``apply`` checks its tokens (shape, dtype,
size) and its state once per layer call, not again inside the shared layer's
``forward`` / ``forward_stream`` (issue 49); and the adapter is a package of one-job
modules whose public names are theirs."""

from __future__ import annotations

import collections
import functools

import pytest
from _helpers import count_calls

jax = pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")

import jax.numpy as jnp  # noqa: E402

import tmcore.layer.layer as tl_layer  # noqa: E402
import tmcore.layer.state as tl_state  # noqa: E402
from tmcore.adapters import jax as tmj  # noqa: E402
from tmcore.adapters.jax import functional, nnx, stack  # noqa: E402

D, C, SHAPE, L = 4, 2, (3, 3), 4

#: every name under which the layer's token, state and mask checks are called: the
#: adapter's imports, the layer's, and tmcore.layer.state's own (stream_state checks a
#: StreamState's h, c and count there; check_mask checks every mask there)
CHECKS = [(functional, "check_tokens"), (tl_layer, "check_tokens"),
          (functional, "check_forward"), (tl_layer, "check_forward"),
          (functional, "check_state"), (tl_layer, "check_state"), (tl_state, "check_state"),
          (tl_state, "_check_count"), (tl_state, "check_bool_mask")]


def _per_mask(name, args):
    # the mask checks count per mask (reset, valid, ...), the others per name
    return f"{name}:{args[2]}" if name == "check_bool_mask" else name


@pytest.fixture
def calls(monkeypatch):
    return count_calls(monkeypatch, CHECKS, _per_mask)


@pytest.fixture(scope="module")
def params():
    return tmj.init(jax.random.key(0), D, C, SHAPE, L)


def _x(tokens, seed=1, batch=2):
    return jax.random.normal(jax.random.key(seed), (batch, tokens, D), jnp.float32)


def _fresh(calls):
    """Forget the compiled layer calls (a new trace runs the Python of the layer's call,
    where its checks are) and the counts so far."""
    functional._COMPILED.clear()
    calls.clear()


#: (state given, stream) -> the calls each check takes in ONE apply: tokens and their
#: size once; a given state once (a StreamState's h and c and its count), no state
#: check for None
EXPECTED = {
    (None, True): {"check_tokens": 1, "check_forward": 1},
    (None, False): {"check_tokens": 1, "check_forward": 1},
    ("pair", True): {"check_tokens": 1, "check_forward": 1, "check_state": 1},
    ("pair", False): {"check_tokens": 1, "check_forward": 1, "check_state": 1},
    ("stream", True): {"check_tokens": 1, "check_forward": 1, "check_state": 1,
                       "_check_count": 1},
}


def _state(kind, params):
    if kind == "pair":
        return tmj.init_state(2, C, SHAPE)
    if kind == "stream":  # a continuation: 3 tokens into the first chunk
        return tmj.apply(params, _x(3, seed=2))[1]
    return None


@pytest.mark.parametrize("kind, stream", list(EXPECTED))
def test_apply_checks_tokens_and_state_once(calls, params, kind, stream):
    state = _state(kind, params)
    _fresh(calls)
    out, _ = tmj.apply(params, _x(9), state, stream=stream)
    assert out.shape == (2, 9, D)
    assert dict(calls) == EXPECTED[kind, stream]


@pytest.mark.parametrize("kind, stream", [(None, True), ("pair", False), ("stream", True)])
def test_apply_with_reset_checks_each_input_once(calls, params, kind, stream):
    state = _state(kind, params)
    _fresh(calls)
    tmj.apply(params, _x(9), state, stream=stream,
              reset=jnp.array([True, False]))
    assert dict(calls) == {**EXPECTED[kind, stream], "check_bool_mask:reset": 1}


def test_a_decode_step_checks_once(calls, params):
    # one token: the layer's decode step (no chunk grid), from a StreamState
    state = _state("stream", params)
    _fresh(calls)
    tmj.apply(params, _x(1), state)
    assert dict(calls) == EXPECTED["stream", True]


def test_packed_documents_check_once(calls, params):
    # doc_starts: the layer checks the mask once (and plans the grid from it)
    state = _state("stream", params)
    calls.clear()
    tmj.apply(params, _x(9), state,
              doc_starts=tmj.doc_starts_from_offsets([[0, 5], [0]], 9))
    assert dict(calls) == {**EXPECTED["stream", True], "check_bool_mask:doc_starts": 1}


def test_packed_documents_with_max_documents_check_once(calls, params):
    # max_documents: the grid from arrays; the layer checks the mask once (and its bound)
    state = _state("stream", params)
    calls.clear()
    tmj.apply(params, _x(9), state, max_documents=2,
              doc_starts=tmj.doc_starts_from_offsets([[0, 5], [0]], 9))
    assert dict(calls) == {**EXPECTED["stream", True], "check_bool_mask:doc_starts": 1}


@pytest.mark.parametrize("mode", ["causal", "threaded"])
def test_stack_apply_checks_once_per_layer(calls, params, mode, monkeypatch):
    layers = [tmj.residual_init(jax.random.key(k), D, C, SHAPE, L) for k in range(3)]
    # the layers share one compiled call (one config and shape), traced once: run its
    # Python on every call instead, so that every layer's checks count
    monkeypatch.setattr(functional, "_compiled",
                        lambda static, shape, dtype: functools.partial(functional._call, static))
    calls.clear()
    tmj.stack_apply(layers, _x(9), mode=mode,
                    reset=jnp.array([False, True]))
    # layer 0 starts from zeros; the threaded layers 1, 2 from the state before them
    # (a pair, checked once each); causal layers all start from zeros here
    expected = collections.Counter({"check_tokens": 3, "check_forward": 3})
    if mode == "threaded":
        expected["check_state"] = 2
    expected["check_bool_mask:reset"] = 1 if mode == "threaded" else 3
    assert dict(calls) == dict(expected)


def test_the_package_reexports_its_modules_names():
    # tmcore.adapters.jax is a package of one-job modules (no import cycle among them:
    # tests/test_architecture.py); its public names are theirs
    assert tmj.apply is functional.apply and tmj.stack_apply is stack.stack_apply
    assert tmj.TensorMemory.__module__ == "tmcore.adapters.jax.nnx"
    assert tmj.TensorMemory is nnx.TensorMemory
    assert all(hasattr(tmj, name) for name in tmj.__all__)


def test_the_one_size_gate_sizes_the_compute_dtype(params, monkeypatch):
    # bfloat16 tokens into a float32 layer compute in float32: the one size gate (the
    # adapter's; the layer's call is told the inputs are checked) counts float32 bytes
    seen = []
    real = tl_state.check_forward

    def spy(xp, config, x, dtype=None):
        seen.append(jnp.dtype(x.dtype if dtype is None else dtype))
        return real(xp, config, x, dtype)

    monkeypatch.setattr(functional, "check_forward", spy)
    monkeypatch.setattr(tl_layer, "check_forward", spy)
    for stream in (True, False):
        _fresh(collections.Counter())
        out, _ = tmj.apply(params, _x(9).astype(jnp.bfloat16),
                           stream=stream)
        assert out.dtype == jnp.float32
    assert seen == [jnp.dtype(jnp.float32)] * 2
