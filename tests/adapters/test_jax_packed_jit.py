"""Packed documents (``doc_starts``) inside ``jax.jit`` with a static ``max_documents``.

The traced call plans the chunk grid with arrays (:func:`tmcore.layer.plan.plan_stream`)
and runs ONE ``lax.scan`` whose per-step masks reset and freeze rows; the reference feeds
each row's kept tokens one call per token, restarting at each document start (no chunk
grid at all). Float64 (``jax.enable_x64``): outputs and the whole returned state agree to
1e-12; gradients equal the eager call's (its bound read from the masks); a
finite-difference check on a tiny case; the compiled program does not grow with ``N``
(an op count of the jaxpr, not a timing).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from tmcore import layer as tl  # noqa: E402
from tmcore.adapters import jax as tmj  # noqa: E402
from tmcore.layer.plan import plan_steps  # noqa: E402

D, C, SHAPE, L = 4, 3, (3, 4), 4
TOL = 1e-12


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _params(seed=0, **kw):
    params = tmj.init(jax.random.key(seed), D, C, SHAPE, L, dtype=jnp.float64, **kw)
    rng = np.random.default_rng(seed)  # away from init's zeros: every path matters
    return jax.tree.map(lambda a: a + 0.1 * jnp.asarray(rng.normal(size=a.shape)), params)


def _apply(params, x, state=None, **kw):
    """``tmj.apply``, the layer's own keywords (``update``, ...) going to the config."""
    config = {k: kw.pop(k) for k in list(kw) if k in tl.LayerConfig.__dataclass_fields__}
    if config:
        params = {**params, "config": params["config"].replace(**config)}
    return tmj.apply(params, x, state, **kw)


def _err(a, b):
    return max((float(jnp.max(jnp.abs(jnp.asarray(u) - jnp.asarray(v))))
                for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
                if jnp.issubdtype(jnp.asarray(u).dtype, jnp.inexact)), default=0.0)


def _same_state(new, ref):
    for name in ("h", "c", "pending", "read"):
        assert _err(getattr(new, name), getattr(ref, name)) <= TOL, name
    assert np.array_equal(np.asarray(new.count), np.asarray(ref.count))


def _case(batch=5, tokens=13, seed=1, params=None, **kw):
    """Rows with 3, 2, 0, 4 and 1 document starts (mid-chunk, at token 0, none), a
    StreamState with 3, 1, 0, 2, 3 pending tokens, and valid padding (left, right,
    inside, and a start on a padded token)."""
    params = _params() if params is None else params
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (batch, tokens, D), jnp.float64)
    starts = np.zeros((batch, tokens), bool)
    starts[0, [0, 5, 6]] = True          # token 0, mid-chunk, next token
    starts[1, [2, 11]] = True            # the first on a padded token (moves to token 3)
    starts[3, [1, 3, 4, 9]] = True       # 4 documents (token 3 is padded)
    starts[4, [12]] = True               # the last token
    valid = np.ones((batch, tokens), bool)
    valid[1, :3] = False                 # left padding
    valid[2, -4:] = False                # right padding, no start
    valid[3, 3] = False
    prefix = jnp.asarray(np.random.default_rng(seed).normal(size=(batch, 7, D)))
    # per-row counts 3, 1, 0, 2, 3: rows continue from prefixes of other lengths
    rows = [_apply(params, prefix[b:b + 1, :n], **kw)[1]
            for b, n in enumerate([3, 5, 4, 6, 7])]
    state = tmj.StreamState(*(jnp.concatenate([getattr(r, f) for r in rows])
                              for f in tmj.StreamState._fields))
    assert list(np.asarray(state.count)) == [3, 1, 0, 2, 3]
    return params, x, state, starts, valid


def _one_at_a_time(params, x, state, starts, valid=None, reset=None, **kw):
    """Each row's kept tokens one call per token, its state restarted at each document
    start (a start on a skipped token at the next kept one; after the last, the row ends
    empty)."""
    batch, tokens = x.shape[:2]
    outs, rows = np.zeros(x.shape), []
    for b in range(batch):
        st = tmj.StreamState(*(v[b:b + 1] for v in state)) if state is not None else None
        start = bool(reset[b]) if reset is not None else False
        for n in range(tokens):
            start |= bool(starts[b, n])
            if valid is not None and not valid[b, n]:
                continue
            out, st = _apply(params, x[b:b + 1, n:n + 1], st, reset=np.array([start]), **kw)
            outs[b, n] = np.asarray(out[0, 0])
            start = False
        if st is None or start:
            st = _apply(params, x[b:b + 1, :0], st, reset=np.array([True]), **kw)[1]
        rows.append(st)
    return jnp.asarray(outs), tmj.StreamState(*(jnp.concatenate([getattr(r, f) for r in rows])
                                                for f in tmj.StreamState._fields))


def _jitted(documents, **static):
    @jax.jit
    def run(params, x, state, starts, valid=None, reset=None):
        return _apply(params, x, state, doc_starts=starts, valid=valid, reset=reset,
                      max_documents=documents, **static)
    return run


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("masks", ["none", "valid", "valid+reset", "reset"])
def test_traced_doc_starts_equal_one_token_at_a_time(masks):
    params, x, state, starts, valid = _case()
    kw = {}
    if "valid" in masks:
        kw["valid"] = valid
    if "reset" in masks:
        kw["reset"] = np.array([False, True, True, False, True])
    ref_out, ref = _one_at_a_time(params, x, state, starts, **kw)
    out, new = _jitted(4)(params, x, state, starts, **{k: jnp.asarray(v) for k, v in kw.items()})
    assert _err(out, ref_out) <= TOL
    _same_state(new, ref)
    # the documents run alone (a sanity check of the reference itself): row 0, no padding
    if masks == "none":
        alone, alone_state = _apply(params, x[:1, 6:])
        assert _err(out[:1, 6:], alone) <= TOL
        assert _err(new.h[:1], alone_state.h) <= TOL


def test_eager_max_documents_equals_one_token_at_a_time_and_a_larger_bound():
    params, x, state, starts, valid = _case()
    ref_out, ref = _one_at_a_time(params, x, state, starts, valid)
    for documents in (4, 9, 100):  # beyond N the bound is capped at N
        out, new = _apply(params, x, state, doc_starts=starts, valid=valid,
                          max_documents=documents)
        assert _err(out, ref_out) <= TOL
        _same_state(new, ref)


@pytest.mark.parametrize("seed", range(4))
def test_random_masks_equal_one_token_at_a_time(seed):
    rng = np.random.default_rng(100 + seed)
    batch, tokens = 6, 11
    params = _params(seed)
    x = jnp.asarray(rng.normal(size=(batch, tokens, D)))
    counts = rng.integers(0, L, size=batch)
    prefix = jnp.asarray(rng.normal(size=(batch, 2 * L, D)))
    rows = [_apply(params, prefix[b:b + 1, :L + int(k)])[1] for b, k in enumerate(counts)]
    state = tmj.StreamState(*(jnp.concatenate([getattr(r, f) for r in rows])
                              for f in tmj.StreamState._fields))
    starts = rng.random((batch, tokens)) < 0.3
    valid = rng.random((batch, tokens)) < 0.8
    reset = rng.random(batch) < 0.3
    bound = int(starts.sum(axis=1).max()) + 1
    ref_out, ref = _one_at_a_time(params, x, state, starts, valid, reset)
    out, new = _jitted(bound)(params, x, state, jnp.asarray(starts), jnp.asarray(valid),
                              jnp.asarray(reset))
    assert _err(out, ref_out) <= TOL
    _same_state(new, ref)


def test_pieces_of_a_packed_stream_under_jit_equal_one_call():
    # a training-style loop: the state carried through jitted packed pieces
    params, x, _, starts, _ = _case(tokens=16)
    ref_out, ref = _one_at_a_time(params, x, None, starts)
    run = _jitted(4)
    out1, st = run(params, x[:, :7], None, jnp.asarray(starts[:, :7]))
    out2, st = run(params, x[:, 7:], st, jnp.asarray(starts[:, 7:]))
    assert _err(jnp.concatenate([out1, out2], axis=1), ref_out) <= TOL
    _same_state(st, ref)


def test_no_tokens_and_a_traced_reset():
    params, x, state, _, _ = _case()
    reset = jnp.array([True, False, True, False, False])
    out, new = _jitted(2)(params, x[:, :0], state, jnp.zeros((5, 0), bool), None, reset)
    ref_out, ref = _apply(params, x[:, :0], state, doc_starts=np.zeros((5, 0), bool),
                          reset=np.asarray(reset))
    assert out.shape == (5, 0, D)
    _same_state(new, ref)


def test_nnx_module_and_local_update():
    module = tmj.TensorMemory(D, C, SHAPE, L, rngs=nnx.Rngs(0), dtype=jnp.float64)
    _, x, state, starts, valid = _case()
    ref_out, ref = module(x, state, doc_starts=starts, valid=valid)  # eager: D from the masks

    @nnx.jit
    def run(m, x_, s_, starts_, valid_):
        return m(x_, s_, doc_starts=starts_, valid=valid_, max_documents=4)

    out, new = run(module, x, state, jnp.asarray(starts), jnp.asarray(valid))
    assert _err(out, ref_out) <= TOL
    _same_state(new, ref)
    residual = tmj.MemoryResidual(D, C, SHAPE, L, rngs=nnx.Rngs(1), dtype=jnp.float64)
    ref_out, ref = residual(x, state, doc_starts=starts)
    out, new = run(residual, x, state, jnp.asarray(starts), None)
    assert _err(out, ref_out) <= TOL
    _same_state(new, ref)
    # update="local" (its fast path's backward is the undo log: policy "log")
    params = _params()
    kw = dict(update="local", window=2)
    ref_out, ref = _one_at_a_time(params, x, state, starts, valid, **kw)
    out, new = _jitted(4, **kw)(params, x, state, jnp.asarray(starts), jnp.asarray(valid))
    assert _err(out, ref_out) <= TOL
    _same_state(new, ref)


# --------------------------------------------------------------------------- gradients


def _loss(params, x, state, starts, documents=None, **kw):
    out, new = _apply(params, x, state, doc_starts=starts, max_documents=documents, **kw)
    return (jnp.sum(jnp.sin(out)) + jnp.sum(new.h * new.c) + jnp.sum(new.pending ** 2)
            + jnp.sum(new.read))


@pytest.mark.parametrize("options", [{}, {"checkpoint_every": 3},
                                     {"update": "local", "window": 2},
                                     {"dynamics": "warp"}])
def test_gradient_under_jit_equals_the_eager_call(options):
    warp = {"dynamics": "warp"} if options.get("dynamics") == "warp" else {}
    params, x, state, starts, valid = _case(params=_params(**warp), **warp)
    reset = np.array([False, True, False, False, True])

    def grads(documents, jit):
        def f(p, x_, h, c, pending, read):
            st = state._replace(h=h, c=c, pending=pending, read=read)
            kw = dict(valid=jnp.asarray(valid), reset=jnp.asarray(reset)) if jit else dict(
                valid=valid, reset=reset)
            return _loss(p, x_, st, jnp.asarray(starts) if jit else starts, documents,
                         **kw, **options)

        g = jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5))
        args = (params, x, state.h, state.c, state.pending, state.read)
        return (jax.jit(g) if jit else g)(*args)

    value_ref, g_ref = grads(None, False)
    value, g = grads(4, True)
    assert abs(float(value - value_ref)) <= TOL * max(1.0, abs(float(value_ref)))
    assert _err(g, g_ref) <= 1e-11
    assert max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(g)) > 0


def test_gradient_finite_differences():
    params = _params()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 7, D)))
    prefix = jnp.asarray(rng.normal(size=(2, 5, D)))
    rows = [_apply(params, prefix[b:b + 1, :n])[1] for b, n in enumerate([2, 5])]
    state = tmj.StreamState(*(jnp.concatenate([getattr(r, f) for r in rows])
                              for f in tmj.StreamState._fields))   # counts 2 and 1
    starts = np.zeros((2, 7), bool)
    starts[0, 2] = starts[1, [0, 5]] = True
    f = jax.jit(lambda x_, h: _loss(params, x_, state._replace(h=h), jnp.asarray(starts), 2))
    g_x, g_h = jax.grad(f, argnums=(0, 1))(x, state.h)
    for value, grad, arg in ((x, g_x, 0), (state.h, g_h, 1)):
        for _ in range(6):
            direction = jnp.asarray(rng.normal(size=value.shape))
            eps = 1e-6

            def at(s, value=value, direction=direction, arg=arg):
                moved = value + s * direction
                return f(moved, state.h) if arg == 0 else f(x, moved)

            numeric = (at(eps) - at(-eps)) / (2 * eps)
            exact = float(jnp.sum(grad * direction))
            assert abs(float(numeric) - exact) <= 1e-6 * max(1.0, abs(exact))


# --------------------------------------------------------------------------- compile size


def _subjaxprs(params):
    core = getattr(getattr(jax, "extend", None), "core", None)
    return (core if hasattr(core, "jaxprs_in_params") else jax.core).jaxprs_in_params(params)


def _primitives(jaxpr, name):
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for sub in _subjaxprs(eqn.params):
            count += _primitives(sub, name)
    return count


def _ops(jaxpr):
    return sum(1 + sum(_ops(sub) for sub in _subjaxprs(e.params))
               for e in jaxpr.eqns)


def test_the_program_does_not_grow_with_the_tokens():
    params = _params()
    counts = {}
    for tokens in (16, 64):
        x = jnp.zeros((3, tokens, D))
        starts = jnp.zeros((3, tokens), bool)
        grad = jax.grad(lambda p, x_, m: _loss(p, x_, None, m, 5), argnums=(0, 1))
        jaxpr = jax.make_jaxpr(grad)(params, x, starts).jaxpr
        counts[tokens] = (_primitives(jaxpr, "while"), _primitives(jaxpr, "scan"),
                          _ops(jaxpr))
        # the grid: T = ceil((L - 1 + N) / L) + D chunks, in one scan
        assert plan_steps(tokens, L, L - 1, 5) == -(-(L - 1 + tokens) // L) + 5
    assert counts[16] == counts[64], counts
    assert counts[16][0] + counts[16][1] >= 1  # the scan is there


# --------------------------------------------------------------------------- refusals


def test_traced_doc_starts_need_max_documents_and_other_traced_masks_do_not():
    params, x, state, starts, _ = _case()
    with pytest.raises(TypeError, match="doc_starts: traced.*max_documents"):
        jax.jit(lambda m: _apply(params, x, doc_starts=m)[0])(starts)
    # the grid's bound comes from the concrete doc_starts: a traced reset or state is data
    reset = np.array([True, False, False, False, False])
    ref = _apply(params, x, state, doc_starts=starts, reset=reset)[0]
    out = jax.jit(lambda r, s: _apply(params, x, s, doc_starts=starts, reset=r)[0])(
        jnp.asarray(reset), state)
    assert _err(out, ref) <= TOL


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError),
                                        (True, TypeError), (2.0, TypeError),
                                        ("3", TypeError)])
def test_max_documents_is_validated(bad, error):
    params, x, state, starts, _ = _case()
    with pytest.raises(error, match="max_documents"):
        _apply(params, x, state, doc_starts=starts, max_documents=bad)
    with pytest.raises(error, match="max_documents"):  # named without doc_starts too
        _apply(params, x, state, max_documents=bad)


def test_eager_overflow_is_an_error_and_jit_ignores_the_extra_starts():
    params, x, state, starts, valid = _case()
    with pytest.raises(ValueError, match=r"max_documents: row 3 starts 4 documents.*3"):
        _apply(params, x, state, doc_starts=starts, max_documents=3)
    # a reset is applied before the grid (the row's stream restarts): not a start it counts
    one = np.zeros_like(starts)
    one[:, 4] = True
    reset = np.array([False, False, True, False, False])
    out, new = _apply(params, x, state, doc_starts=one, max_documents=1, reset=reset)
    ref_out, ref = _one_at_a_time(params, x, state, one, reset=reset)
    assert _err(out, ref_out) <= TOL
    _same_state(new, ref)
    # under jit nothing can be checked: row 3's starts after its first 3 are ignored
    out, new = _jitted(3)(params, x, state, jnp.asarray(starts))
    fewer = starts.copy()
    fewer[3, 9] = False
    ref_out, ref = _one_at_a_time(params, x, state, fewer)
    assert _err(out, ref_out) <= TOL
    _same_state(new, ref)
