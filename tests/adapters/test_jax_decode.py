"""Decoding that traces in JAX: a one-token streaming step under ``jax.jit``, ``lax.scan``,
``lax.fori_loop`` and ``nnx.jit`` equals teacher forcing (one call over the whole
sequence), compiles once, and a :class:`StreamState` is data (``vmap``, ``tree.map``).

Prompts and decode lengths are not chunk multiples, so every step lands at another
position of the unfinished chunk. Float64 runs inside ``jax.enable_x64`` (<= 1e-12),
float32 outside (<= 1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402

import tmcore  # noqa: E402
from tmcore.adapters import jax as tmj  # noqa: E402

D, C, SHAPE, L = 6, 2, (3, 2), 3
PROMPT, STEPS = 5, 7                 # neither a multiple of L
TOL = {"float64": 1e-12, "float32": 1e-6}


@pytest.fixture(params=["float64", "float32"])
def dtype(request):
    if request.param == "float64":
        with jax.enable_x64(True):
            yield jnp.float64
    else:
        yield jnp.float32


def _setup(dtype, batch=2, seed=0):
    params = tmj.init(jax.random.key(seed), D, C, SHAPE, L, dtype=dtype)
    x = jax.random.normal(jax.random.key(seed + 1), (batch, PROMPT + STEPS, D), dtype)
    return params, x


def _apply(params, x, state=None, **kw):
    return tmj.apply(params, x, state, **kw)


def _err(a, b):
    return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))


def _check(out, state, ref_out, ref_state, dtype):
    tol = TOL[jnp.dtype(dtype).name]
    assert _err(out, ref_out) <= tol
    for name in ("h", "c", "pending", "read"):
        assert _err(getattr(state, name), getattr(ref_state, name)) <= tol, name
    assert np.array_equal(np.asarray(state.count), np.asarray(ref_state.count))


def test_jit_step_equals_teacher_forcing_and_compiles_once(dtype):
    params, x = _setup(dtype)
    ref_out, ref_state = _apply(params, x)
    traces = []

    @jax.jit
    def step(state, token):
        traces.append(1)                      # runs once per trace
        return _apply(params, token, state)

    prefill = jax.jit(lambda p: _apply(params, p))
    out, state = prefill(x[:, :PROMPT])
    outs = [out]
    for t in range(PROMPT, PROMPT + STEPS):
        out, state = step(state, x[:, t:t + 1])
        outs.append(out)
    _check(jnp.concatenate(outs, axis=1), state, ref_out, ref_state, dtype)
    assert len(traces) == 1 and step._cache_size() == 1


def test_lax_scan_decode_equals_teacher_forcing(dtype):
    params, x = _setup(dtype)
    ref_out, ref_state = _apply(params, x)

    @jax.jit
    def generate(x):
        out, state = _apply(params, x[:, :PROMPT])

        def body(state, token):                # token (B, d)
            y, state = _apply(params, token[:, None, :], state)
            return state, y[:, 0, :]

        state, ys = lax.scan(body, state, jnp.moveaxis(x[:, PROMPT:], 1, 0))
        return jnp.concatenate([out, jnp.moveaxis(ys, 0, 1)], axis=1), state

    out, state = generate(x)
    _check(out, state, ref_out, ref_state, dtype)


def test_fori_loop_decode_equals_teacher_forcing():
    dtype = jnp.float32
    params, x = _setup(dtype)
    ref_out, ref_state = _apply(params, x)
    _, start = _apply(params, x[:, :PROMPT])

    def body(t, carry):
        state, outs = carry
        token = lax.dynamic_slice_in_dim(x, t, 1, axis=1)
        y, state = _apply(params, token, state)
        return state, lax.dynamic_update_slice_in_dim(outs, y, t, axis=1)

    state, outs = jax.jit(lambda s: lax.fori_loop(PROMPT, PROMPT + STEPS, body,
                                                  (s, jnp.zeros_like(x))))(start)
    tol = TOL[jnp.dtype(dtype).name]
    assert _err(outs[:, PROMPT:], ref_out[:, PROMPT:]) <= tol
    _check(ref_out, state, ref_out, ref_state, dtype)


def test_nnx_jit_decode_equals_teacher_forcing():
    dtype = jnp.float32
    module = tmj.MemoryResidual(D, C, SHAPE, L, rngs=nnx.Rngs(0), dtype=dtype)
    x = jax.random.normal(jax.random.key(3), (1, PROMPT + STEPS, D), dtype)
    ref_out, ref_state = module(x)
    traces = []

    @nnx.jit
    def step(module, state, token):
        traces.append(1)
        return module(token, state)

    out, state = nnx.jit(lambda m, p: m(p))(module, x[:, :PROMPT])
    outs = [out]
    for t in range(PROMPT, PROMPT + STEPS):
        out, state = step(module, state, x[:, t:t + 1])
        outs.append(out)
    _check(jnp.concatenate(outs, axis=1), state, ref_out, ref_state, dtype)
    assert len(traces) == 1


def test_pieces_of_any_split_equal_one_call_by_default():
    """No silent trap: the state a call returns continues the sequence for ANY split
    (the default streams); the old zero-padded behaviour only under stream=False."""
    params, x = _setup(jnp.float32, batch=1)
    full, ref = _apply(params, x)
    assert isinstance(ref, tmj.StreamState)
    for splits in ([1] * 12, [2, 5, 4, 1]):
        state, outs, i = None, [], 0
        for n in splits:
            out, state = _apply(params, x[:, i:i + n], state)
            outs.append(out)
            i += n
        _check(jnp.concatenate(outs, axis=1), state, full, ref, jnp.float32)
    # stream=False: pads the ragged last chunk with zeros and writes it into the state
    old, pair = _apply(params, x, stream=False)
    assert isinstance(pair, tmj.MemoryState) and _err(old, full) <= 1e-6
    module = tmj.TensorMemory(D, C, SHAPE, L, rngs=nnx.Rngs(1))
    whole, _ = module(x)
    y1, s = module(x[:, :4])
    y2, s = module(x[:, 4:], s)
    assert _err(jnp.concatenate([y1, y2], axis=1), whole) <= 1e-6


def test_vmap_and_tree_map_over_states():
    params, x = _setup(jnp.float32, batch=1)
    xs = jax.random.normal(jax.random.key(5), (3, 1, PROMPT, D), jnp.float32)  # 3 streams
    states = jax.vmap(lambda xi: _apply(params, xi)[1])(xs)
    assert states.count.shape == (3, 1)
    step = jax.vmap(lambda s, t: _apply(params, t, s))
    out, new = step(states, xs[:, :, :1])
    for i in range(3):
        _, alone = _apply(params, xs[i])
        ref_out, ref = _apply(params, xs[i, :, :1], alone)
        assert _err(out[i], ref_out) <= 1e-6 and _err(new.h[i], ref.h) <= 1e-6
        assert int(new.count[i, 0]) == int(ref.count[0])
    zeros = jax.tree.map(jnp.zeros_like, new)
    assert isinstance(zeros, tmj.StreamState) and not jnp.any(zeros.count)
    cut = tmj.detach_state(new)
    assert np.array_equal(np.asarray(cut.count), np.asarray(new.count))


def test_reset_traced_under_jit_and_packed_documents():
    params, x = _setup(jnp.float32)
    _, state = _apply(params, x[:, :4])
    reset = jnp.array([True, False])
    out, new = jax.jit(lambda s, r: _apply(params, x[:, 4:], s, reset=r))(state, reset)
    alone, alone_state = _apply(params, x[:1, 4:])
    cont, cont_state = _apply(params, x[1:, 4:], tmj.StreamState(
        *(v[1:] for v in state)))
    assert _err(out[:1], alone) <= 1e-6 and _err(out[1:], cont) <= 1e-6
    assert _err(new.h[:1], alone_state.h) <= 1e-6 and _err(new.h[1:], cont_state.h) <= 1e-6
    # packed documents: a concrete mask closed over works inside jit (each document alone);
    # a traced one without max_documents is refused, and with it runs: both in
    # tests/adapters/test_jax_packed_jit.py
    starts = tmj.doc_starts_from_offsets([[0, 5, 7], [0, 2]], 12)
    packed = jax.jit(lambda x_: _apply(params, x_, doc_starts=np.asarray(starts))[0])(x)
    for row, offsets in enumerate([[0, 5, 7], [0, 2]]):
        for a, b in zip(offsets, [*offsets[1:], 12], strict=True):
            doc, _ = _apply(params, x[row:row + 1, a:b])
            assert _err(packed[row:row + 1, a:b], doc) <= 1e-6


def test_valid_traced_under_jit():
    params, x = _setup(jnp.float32)
    valid = jnp.array([[False, False] + [True] * 10, [True] * 9 + [False] * 3])
    out, state = jax.jit(lambda v: _apply(params, x, valid=v))(valid)
    for row in range(2):
        keep = np.asarray(valid[row])
        alone, ref = _apply(params, x[row:row + 1][:, keep])
        assert _err(out[row][keep], alone[0]) <= 1e-6
        assert _err(state.h[row], ref.h[0]) <= 1e-6 and _err(state.read[row], ref.read[0]) <= 1e-6
        assert int(state.count[row]) == int(ref.count[0])


def test_bad_states_and_arguments_are_refused():
    params, x = _setup(jnp.float32)
    _, state = _apply(params, x[:, :4])
    for name, bad in (("pending", state.pending.astype(jnp.int32)),
                      ("read", state.read.astype(bool)),
                      ("read", state.read.astype(jnp.complex64))):
        with pytest.raises(TypeError, match=f"state.{name}"):
            _apply(params, x, state._replace(**{name: bad}))
    with pytest.raises(TypeError, match="state.count"):
        _apply(params, x, state._replace(count=state.count.astype(jnp.float32)))
    with pytest.raises(ValueError, match="state.count"):
        _apply(params, x, state._replace(count=state.count[:1]))
    with pytest.raises(TypeError, match=r"memory_shape.*\(4,\)"):
        tmj.init(jax.random.key(0), D, C, 4, L)
    with pytest.raises(ValueError, match="StreamState"):
        _apply(params, x, state, stream=False)


def test_raw_functions_under_forward_mode_carry_the_hint():
    h = jnp.zeros((1, C, *SHAPE))
    coords = jnp.zeros((1, 2, len(SHAPE)))
    cell = tmj.conv_params(tmj.init(jax.random.key(0), D, C, SHAPE, L)["cell"])

    def f(h):
        return tmcore.memory_scan(h, h, coords, coords, jnp.ones((1, 2)), jnp.ones((1, 2, C)),
                                  cell)[1]

    with tmcore.options(native=True):
        try:                                  # eagerly (under jit JAX defers its error)
            jax.jvp(f, (h,), (h,))
        except TypeError as error:            # the fused CPU kernels: the hint
            assert "tmcore" in str(error) and "native=False" in str(error)
    with tmcore.options(native=False):        # forward mode through the generic math
        jax.jit(lambda h: jax.jvp(f, (h,), (h,)))(h)


def test_gradients_through_one_token_steps_equal_one_call():
    """The decode step skips the grid update of tokens that complete no chunk
    (``lax.cond``); gradients through such steps equal the one-call gradients."""
    with jax.enable_x64(True):
        params, x = _setup(jnp.float64)

        def loss(p, pieces):
            state, outs, i = None, [], 0
            for n in pieces:
                out, state = _apply(p, x[:, i:i + n], state)
                outs.append(out)
                i += n
            out = jnp.concatenate(outs, axis=1)
            return jnp.sum(out ** 2) + jnp.sum(state.h * state.c) + jnp.sum(state.read)

        one = jax.jit(jax.grad(lambda p: loss(p, [12])))(params)
        steps = jax.jit(jax.grad(lambda p: loss(p, [PROMPT] + [1] * STEPS)))(params)
        errors = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), one, steps)
        assert max(jax.tree.leaves(errors)) <= 1e-12
