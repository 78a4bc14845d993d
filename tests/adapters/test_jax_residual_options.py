"""The functional JAX residual with the layer options (``residual_init`` / ``residual_apply``).

Contract (tmcore.adapters.jax): ``residual_init`` takes ``init``'s option keywords
(``dynamics``, ``flow``, ``update``, ``window``) and makes the memory's ``warp_net`` /
``warp_flow`` groups and config as ``init`` and the NNX ``MemoryResidual`` do (same key:
same tree, same values); ``update`` / ``window`` add no parameter. ``residual_apply`` runs
the memory's config: at init (zero displacement) the warp + flow residual is the default
one, and its jitted gradient matches finite differences (float64). Bad option values raise
the layer's errors, naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest

from tmcore import layer as tl

jax = pytest.importorskip("jax", reason="jax is not installed")
nnx = pytest.importorskip("flax.nnx", reason="flax is not installed")
import jax.numpy as jnp  # noqa: E402

from tmcore.adapters import jax as tj  # noqa: E402

D, C, S, L = 5, 2, (4, 3), 2
PARAM_OPTIONS = {
    "default": {},
    "warp": {"dynamics": "warp"},
    "warp+flow": {"dynamics": "warp", "flow": True},
}


def _paths(tree):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.parametrize("name", list(PARAM_OPTIONS))
def test_residual_init_equals_the_nnx_residual_with_each_option(name):
    """Same key (``nnx.Rngs(0)``'s first ``params`` key): the same tree, values, dtypes."""
    options = PARAM_OPTIONS[name]
    key = nnx.Rngs(0).params()
    params = tj.residual_init(key, D, C, S, L, gate_init=-2.0, forget_bias=1.0, **options)
    module = tj.MemoryResidual(D, C, S, L, gate_init=-2.0, forget_bias=1.0,
                               rngs=nnx.Rngs(0), **options)
    expected = tj.params_from_module(module)
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    assert _paths(params) == _paths(expected)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    # the memory is init's with the same key and options (warp groups last, as specified)
    memory = tj.init(key, D, C, S, L, forget_bias=1.0, **options)
    assert list(params["memory"]) == list(memory)
    config = tl.layer_config(D, C, S, L, forget_bias=1.0, **options)
    assert params["memory"]["config"] == config
    assert list(params["memory"]) == [*tl.param_groups(config), "config"]
    for spec in tl.param_specs(config):
        leaf = params["memory"][spec.group][spec.leaf]
        assert leaf.shape == spec.shape
        np.testing.assert_array_equal(leaf, memory[spec.group][spec.leaf])
    if "dynamics" in options:  # zero displacement at init: the shift head is zero
        assert not np.any(params["memory"][tl.WARP_GROUP]["weight"])
        assert not np.any(params["memory"][tl.WARP_GROUP]["bias"])
    if options.get("flow"):  # identity taps, zero pointwise map
        flow = params["memory"][tl.FLOW_GROUP]
        np.testing.assert_array_equal(flow["depthwise_weight"][..., 1], 1.0)
        assert not np.any(flow["depthwise_weight"][..., ::2])
        assert not np.any(flow["pointwise_weight"]) and not np.any(flow["pointwise_bias"])
    else:
        assert tl.FLOW_GROUP not in params["memory"]


def test_residual_init_defaults_are_inits_and_local_adds_no_parameter():
    key = jax.random.key(3)
    plain = tj.residual_init(key, D, C, S, L)
    explicit = tj.residual_init(key, D, C, S, L, dynamics="none", flow=False)
    assert _paths(plain) == _paths(explicit)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(plain),
                                                     jax.tree.leaves(explicit), strict=True))
    assert set(plain["memory"]) == {*tl.GROUPS, "config"}
    local = tj.MemoryResidual(D, C, S, L, rngs=nnx.Rngs(0), update="local", window=2)
    same = tj.residual_init(nnx.Rngs(0).params(), D, C, S, L)
    got = tj.params_from_module(local)
    assert _paths(got) == _paths(same)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got),
                                                     jax.tree.leaves(same), strict=True))


@pytest.mark.parametrize("kwargs, error, word", [
    ({"dynamics": "flow"}, ValueError, "dynamics"),
    ({"dynamics": None}, TypeError, "dynamics"),
    ({"flow": True}, ValueError, "flow"),
    ({"dynamics": "warp", "flow": 1}, TypeError, "flow"),
    ({"dynamics": "warp", "flow": "yes"}, TypeError, "flow"),
])
def test_residual_init_bad_options_are_named(kwargs, error, word):
    with pytest.raises(error, match=word):
        tj.residual_init(jax.random.key(0), D, C, S, L, **kwargs)
    with pytest.raises(error, match=word):  # the same errors as init
        tj.init(jax.random.key(0), D, C, S, L, **kwargs)


def _with(params, **changes):
    """A residual's parameters with its memory's config changed."""
    memory = params["memory"]
    return {**params, "memory": {**memory, "config": memory["config"].replace(**changes)}}


def test_residual_config_bad_options_are_named():
    params = tj.residual_init(jax.random.key(0), D, C, S, L)
    x = jnp.ones((1, 4, D))
    with pytest.raises(ValueError, match="window"):
        _with(params, update="local")
    with pytest.raises(ValueError, match="update"):
        _with(params, update="sparse")
    with pytest.raises(ValueError, match="window"):
        _with(params, update="local", window=5)
    with pytest.raises(ValueError, match="flow"):
        _with(params, flow=True)
    with pytest.raises(KeyError, match="warp_net"):  # the groups come from residual_init
        tj.residual_apply(_with(params, dynamics="warp"), x)
    warp = tj.residual_init(jax.random.key(0), D, C, S, L, dynamics="warp")
    with pytest.raises(KeyError, match="warp_flow"):
        tj.residual_apply(_with(warp, flow=True), x)


def _inputs(dtype):
    x = jax.random.normal(jax.random.key(7), (2, 5, D), dtype)
    h = 0.5 * jax.random.normal(jax.random.key(8), (2, C, *S), dtype)
    c = 0.5 * jax.random.normal(jax.random.key(9), (2, C, *S), dtype)
    return x, (h, c)


def test_warp_flow_residual_at_init_is_the_default_residual():
    """Zero displacement at init: the warp + flow residual (and with a local window
    covering the grid) gives the default residual's output and state, float64."""
    with jax.enable_x64(True):
        key = jax.random.key(1)
        x, state = _inputs(jnp.float64)
        default = tj.residual_init(key, D, C, S, L, gate_init=1.0, dtype=jnp.float64)
        warp = tj.residual_init(key, D, C, S, L, gate_init=1.0, dtype=jnp.float64,
                                dynamics="warp", flow=True)
        for group in tl.GROUPS:  # the default's parameters, unchanged
            for leaf, value in default["memory"][group].items():
                np.testing.assert_array_equal(warp["memory"][group][leaf], value)
        want, want_state = tj.residual_apply(default, x, state, stream=False)
        for options in ({}, {"update": "local", "window": max(S)}):
            got, got_state = tj.residual_apply(_with(warp, **options), x, state, stream=False)
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
            np.testing.assert_allclose(got_state.h, want_state.h, rtol=0, atol=1e-12)
            np.testing.assert_allclose(got_state.c, want_state.c, rtol=0, atol=1e-12)
        # the NNX residual with the same options and key computes the same
        module = tj.MemoryResidual(D, C, S, L, gate_init=1.0, rngs=nnx.Rngs(0),
                                   dtype=jnp.float64, dynamics="warp", flow=True)
        params = tj.residual_init(nnx.Rngs(0).params(), D, C, S, L, gate_init=1.0,
                                  dtype=jnp.float64, dynamics="warp", flow=True)
        out, _ = module(x, state, stream=False)
        ref, _ = tj.residual_apply(params, x, state, stream=False)
        np.testing.assert_array_equal(out, ref)


def test_jitted_residual_gradient_with_warp_flow_matches_finite_differences():
    """A moving warp (non-zero shift head and flow map): the jitted gradient is finite
    and equals central differences on one leaf of warp_net, warp_flow and the gate."""
    with jax.enable_x64(True):
        params = tj.residual_init(jax.random.key(2), D, C, S, L, dtype=jnp.float64,
                                  dynamics="warp", flow=True)
        memory = params["memory"]
        memory[tl.WARP_GROUP]["weight"] = 0.3 * jax.random.normal(
            jax.random.key(4), (len(S), D), jnp.float64)
        memory[tl.FLOW_GROUP]["pointwise_weight"] = 0.2 * jax.random.normal(
            jax.random.key(5), (len(S), C), jnp.float64)
        x, state = _inputs(jnp.float64)
        weights = jax.random.normal(jax.random.key(6), x.shape, jnp.float64)

        def loss(p):
            out, (h, c) = tj.residual_apply(p, x, state, stream=False)
            return jnp.sum(out * weights) + jnp.sum(h * c)

        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
        default = _with({**params, "memory": {k: v for k, v in memory.items()
                                              if k not in (tl.WARP_GROUP, tl.FLOW_GROUP)}},
                        dynamics="none", flow=False)
        plain, _ = tj.residual_apply(default, x, state, stream=False)  # the warp moves
        out, _ = tj.residual_apply(params, x, state, stream=False)
        assert float(jnp.max(jnp.abs(out - plain))) > 1e-6
        compiled = jax.jit(loss)
        np.testing.assert_allclose(compiled(params), value, rtol=1e-13)
        step = 1e-6
        for path in (("memory", tl.WARP_GROUP, "weight", (0, 1)),
                     ("memory", tl.FLOW_GROUP, "pointwise_weight", (1, 0)),
                     ("gate", None, None, (0,))):
            def shifted(delta, path=path):
                p = jax.tree.map(lambda a: a, params)  # a fresh tree of the same arrays
                leaf_holder, leaf_name = _holder(p, path)
                leaf_holder[leaf_name] = leaf_holder[leaf_name].at[path[-1]].add(delta)
                return compiled(p)

            numeric = (shifted(step) - shifted(-step)) / (2 * step)
            holder, leaf_name = _holder(grads, path)
            analytic = holder[leaf_name][path[-1]]
            assert abs(float(analytic)) > 1e-6  # the leaf matters
            np.testing.assert_allclose(float(analytic), float(numeric), rtol=1e-6, atol=1e-8)


def _holder(tree, path):
    """The dict holding the leaf at ``path`` (group names; ``None`` ends it) and its key."""
    names = [name for name in path[:-1] if name is not None]
    node = tree
    for name in names[:-1]:
        node = node[name]
    return node, names[-1]
