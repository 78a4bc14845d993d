"""The JAX adapter: custom VJPs, the pure layer, modes, streaming, Flax NNX, state dicts.

Ground truth here is a plain-``jnp`` forward of the same math written from
docs/LAYER.md (tent weights, a dense Gaussian, pad-and-slice convolutions, a Python
loop over chunks) differentiated by ``jax.grad``; the adapter's gradients run
tmcore's hand-written VJPs. Float64 runs inside ``jax.enable_x64`` (module
fixture) so the global flag is untouched for other test files.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")

import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

from tmcore import layer as tl  # noqa: E402
from tmcore.adapters import jax as tmj  # noqa: E402
from tmcore.testing.finite_diff import relative_error  # noqa: E402

SHAPE = (3, 4, 2)
EMBED, CHANNELS, CHUNK = 5, 3, 3


@pytest.fixture(autouse=True, scope="module")
def x64():
    """Float64 for this module only (``jax.enable_x64`` is a context, not a global switch)."""
    with jax.enable_x64(True):
        yield


def _rel(a, b) -> float:
    return relative_error(np.asarray(a), np.asarray(b), floor=1e-300)


def _tree_rel(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(_rel, a, b)))


def _jit_vjp(f, args, cot):
    """``(f(*args), vjp(cot))``, compiled once (eager JAX dispatch is slow op by op)."""

    def run(args_, cot_):
        out, vjp = jax.vjp(f, *args_)
        return out, vjp(cot_)

    return jax.jit(run)(args, cot)


def _random_like(tree, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), tree)


# --------------------------------------------------------------------------- plain-jnp reference


def ref_sample(volume, coords):
    """Tent weights ``max(0, 1 - |clip(u) - i|)`` per axis, contracted with the volume."""
    shape = volume.shape[2:]
    n = len(shape)
    out = volume  # [B, C, *S] -> contract one spatial axis at a time, last first
    weights = []
    for axis in range(n):
        u = (coords[..., n - 1 - axis] + 1.0) * (shape[axis] - 1) / 2.0
        u = jnp.clip(u, 0.0, shape[axis] - 1.0)
        index = jnp.arange(shape[axis], dtype=coords.dtype)
        weights.append(jnp.maximum(0.0, 1.0 - jnp.abs(u[..., None] - index)))  # [B, Q, S_a]
    letters = "wxyz"[:n]
    dense = weights[0]
    for axis in range(1, n):
        dense = dense[..., None] * weights[axis].reshape(
            weights[axis].shape[:2] + (1,) * axis + (shape[axis],))
    del out
    return jnp.einsum(f"bq{letters},bc{letters}->bqc", dense, volume)


def ref_splat(content, mu, sigma, shape, eps=1e-6):
    """Dense isotropic Gaussian over the meshgrid of cell centres."""
    n = len(shape)
    grids = jnp.meshgrid(*[jnp.linspace(-1.0, 1.0, s) for s in shape], indexing="ij")
    dist2 = 0.0
    for axis in range(n):
        centre = mu[..., n - 1 - axis].reshape(mu.shape[:2] + (1,) * n)
        dist2 = dist2 + (grids[axis] - centre) ** 2
    w = jnp.exp(-dist2 / (2.0 * sigma.reshape(sigma.shape + (1,) * n) ** 2 + eps))
    letters = "wxyz"[:n]
    return jnp.einsum(f"bkc,bk{letters}->bc{letters}", content, w)


def ref_conv(x, cell):
    n = x.ndim - 2
    for axis in range(n):
        dim = axis + 2
        pad = [(0, 0)] * x.ndim
        pad[dim] = (1, 1)
        xp = jnp.pad(x, pad)
        size = x.shape[dim]
        prev = jax.lax.slice_in_dim(xp, 0, size, axis=dim)
        nxt = jax.lax.slice_in_dim(xp, 2, size + 2, axis=dim)
        view = (1, -1) + (1,) * n
        w = cell["depthwise_weight"][axis]
        x = (w[:, 0].reshape(view) * prev + w[:, 1].reshape(view) * x
             + w[:, 2].reshape(view) * nxt + cell["depthwise_bias"][axis].reshape(view))
    z = jnp.einsum("oi,bi...->bo...", cell["pointwise_weight"], x)
    return z + cell["pointwise_bias"].reshape((1, -1) + (1,) * n)


def ref_cell(x, h, c, cell):
    z = ref_conv(jnp.concatenate([x, h], axis=1), cell)
    i, f, o, g = jnp.split(z, 4, axis=1)
    c_new = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c_new), c_new


def ref_step(h, c, read_coord, write_coord, write_sigma, write_content, cell, eps=1e-6):
    """One chunk: read the state before the write, then splat and update."""
    read = ref_sample(h, read_coord[:, None])[:, 0]
    written = ref_splat(write_content[:, None], write_coord[:, None], write_sigma[:, None],
                        h.shape[2:], eps)
    return read, *ref_cell(written, h, c, cell)


def ref_scan(h, c, read_coords, write_coords, write_sigma, write_content, cell, eps=1e-6):
    def body(carry, step):
        read, h_, c_ = ref_step(*carry, *step, cell, eps)
        return (h_, c_), read

    steps = [jnp.moveaxis(a, 1, 0) for a in (read_coords, write_coords, write_sigma,
                                                write_content)]
    (h, c), reads = jax.lax.scan(body, (h, c), steps)
    return jnp.moveaxis(reads, 0, 1), h, c


def ref_apply(p, x, h, c, chunk, sigma_scale=1.0):
    """The layer straight from docs/LAYER.md's per-chunk math, a ``lax.scan`` over chunks."""
    lin = lambda q, v: v @ q["weight"].T + q["bias"]  # noqa: E731
    batch, tokens, d = x.shape
    steps = math.ceil(tokens / chunk)
    x_pad = jnp.concatenate([x, jnp.zeros((batch, steps * chunk - tokens, d), x.dtype)], 1)

    def body(carry, tokens_t):  # tokens_t [B, L, d]
        summary = lin(p["write_proj"], tokens_t.reshape(batch, chunk * d))
        sigma = (jax.nn.softplus(lin(p["sigma_net"], summary)[:, 0]) + 1e-4) * sigma_scale
        read, h_, c_ = ref_step(*carry, jnp.tanh(lin(p["coord_net"], tokens_t[:, 0])),
                                jnp.tanh(lin(p["coord_net"], summary)), sigma,
                                lin(p["content_net"], summary), p["cell"])
        return (h_, c_), lin(p["out_proj"], read)

    chunks = jnp.moveaxis(x_pad.reshape(batch, steps, chunk, d), 1, 0)
    (h, c), outs = jax.lax.scan(body, (h, c), chunks)  # outs [T, B, d]
    outs = jnp.repeat(jnp.moveaxis(outs, 0, 1), chunk, axis=1)
    return outs[:, :tokens], h, c


# --------------------------------------------------------------------------- fixtures


def _loss(p, x, state):
    """A scalar of the layer's output and final state."""
    out, new = tmj.apply(p, x, state)
    return jnp.sum(out ** 2) + jnp.sum(jnp.sin(new.h)) + jnp.sum(new.c)


def _with(p, **changes):
    """``p`` with its config changed (checked as layer_config checks it)."""
    return {**p, "config": p["config"].replace(**changes)}


# compiled once per shape and shared by the tests
_apply = jax.jit(tmj.apply)
_value_and_grad = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2)))


def _smooth_coords(rng, batch, count, shape):
    """Coordinates away from every cell centre and border (no kinks within 0.1 voxel)."""
    n = len(shape)
    out = np.empty((batch, count, n))
    for k in range(n):
        size = shape[n - 1 - k]
        u = rng.integers(0, size - 1, (batch, count)) + rng.uniform(0.1, 0.9, (batch, count))
        out[..., k] = 2.0 * u / (size - 1) - 1.0
    return jnp.asarray(out)


def _layer(seed=0, tokens=8, batch=2, dtype=jnp.float64):
    """Parameters, tokens and a non-zero state, drawn with NumPy (nothing to compile).

    Shapes come from ``init`` (``eval_shape``); the cell starts near its identity init.
    """
    shapes = jax.eval_shape(lambda k: tmj.init(k, EMBED, CHANNELS, SHAPE, CHUNK),
                            jax.random.key(0))
    rng = np.random.default_rng(seed)
    p = jax.tree.map(lambda a: jnp.asarray(rng.uniform(-0.5, 0.5, a.shape), dtype), shapes)
    p["cell"]["depthwise_weight"] = p["cell"]["depthwise_weight"].at[..., 1].add(1.0)
    x = jnp.asarray(rng.normal(size=(batch, tokens, EMBED)), dtype)
    state_shape = (batch, CHANNELS, *SHAPE)
    state = tmj.MemoryState(jnp.asarray(0.3 * rng.normal(size=state_shape), dtype),
                            jnp.asarray(0.3 * rng.normal(size=state_shape), dtype))
    return p, x, state


# --------------------------------------------------------------------------- primitives


def test_primitives_match_reference_and_finite_differences():
    rng = np.random.default_rng(1)
    volume = jnp.asarray(rng.normal(size=(2, 3, *SHAPE)))
    coords = _smooth_coords(rng, 2, 4, SHAPE)
    g = jnp.asarray(rng.normal(size=(2, 4, 3)))
    out, grads = _jit_vjp(tmj.trilinear_sample, (volume, coords), g)
    ref_out, ref_grads = _jit_vjp(ref_sample, (volume, coords), g)
    assert _rel(out, ref_out) < 1e-13
    assert _tree_rel(grads, ref_grads) < 1e-10
    check_grads(jax.jit(tmj.trilinear_sample), (volume, coords), order=2, modes=["rev"])

    content = jnp.asarray(rng.normal(size=(2, 3, 4)))
    mu = jnp.asarray(rng.uniform(-1, 1, (2, 3, 3)))
    sigma = jnp.asarray(rng.uniform(0.3, 0.8, (2, 3)))

    def splat(a, b, s):
        return tmj.gaussian_splat(a, b, s, SHAPE)

    def splat_ref(a, b, s):
        return ref_splat(a, b, s, SHAPE)

    gv = jnp.asarray(rng.normal(size=(2, 4, *SHAPE)))
    out, grads = _jit_vjp(splat, (content, mu, sigma), gv)
    ref_out, ref_grads = _jit_vjp(splat_ref, (content, mu, sigma), gv)
    assert _rel(out, ref_out) < 1e-13
    assert _tree_rel(grads, ref_grads) < 1e-10
    check_grads(jax.jit(splat), (content, mu, sigma), order=2, modes=["rev"])


def _scan_inputs(seed=2, steps=4):
    p, _, state = _layer(seed)
    rng = np.random.default_rng(seed)
    b = state.h.shape[0]
    inputs = (_smooth_coords(rng, b, steps, SHAPE), jnp.asarray(rng.uniform(-1, 1, (b, steps, 3))),
              jnp.asarray(rng.uniform(0.3, 0.8, (b, steps))),
              jnp.asarray(rng.normal(size=(b, steps, CHANNELS))))
    return state, inputs, p["cell"]


def test_scan_vjp_matches_autodiff_of_plain_forward():
    state, inputs, cell = _scan_inputs()

    def ours(h, c, *rest):
        *args, cell_ = rest
        return tmj.memory_scan(h, c, *args, tmj.conv_params(cell_))

    args = (*state, *inputs, cell)
    cot = _random_like(jax.eval_shape(ours, *args), 3)
    out, grads = _jit_vjp(ours, args, cot)
    ref_out, ref_grads = _jit_vjp(ref_scan, args, cot)
    assert _tree_rel(out, ref_out) < 1e-13
    err = _tree_rel(grads, ref_grads)
    assert err < 1e-10, err


def test_second_order_through_scan():
    """grad of grad (reverse over reverse): a Hessian-vector product of the scan equals the
    central difference of its (custom-VJP) gradient."""
    state, inputs, cell = _scan_inputs(steps=2)

    def loss(content):
        reads, h, _ = tmj.memory_scan(*state, *inputs[:3], content, tmj.conv_params(cell))
        return jnp.sum(reads ** 2) + jnp.sum(jnp.sin(h))

    direction = jnp.asarray(np.random.default_rng(6).normal(size=inputs[3].shape))
    grad = jax.jit(jax.grad(loss))
    hvp = jax.jit(jax.grad(lambda v: jnp.vdot(jax.grad(loss)(v), direction)))
    step = 1e-5
    finite = (grad(inputs[3] + step * direction) - grad(inputs[3] - step * direction)) / (2 * step)
    assert _rel(hvp(inputs[3]), finite) < 1e-7


# --------------------------------------------------------------------------- layer


def test_init_layout_and_distribution():
    p = tmj.init(jax.random.key(0), 64, 8, (4, 4, 4), 4)
    assert p.pop("config") == tl.layer_config(64, 8, (4, 4, 4), 4)  # the config travels
    shapes = jax.tree.map(lambda a: a.shape, p)
    assert shapes == {
        "write_proj": {"weight": (64, 256), "bias": (64,)},
        "content_net": {"weight": (8, 64), "bias": (8,)},
        "sigma_net": {"weight": (1, 64), "bias": (1,)},
        "coord_net": {"weight": (3, 64), "bias": (3,)},
        "cell": {"depthwise_weight": (3, 16, 3), "depthwise_bias": (3, 16),
                 "pointwise_weight": (32, 16), "pointwise_bias": (32,)},
        "out_proj": {"weight": (64, 8), "bias": (64,)},
    }
    assert float(p["sigma_net"]["bias"][0]) == 1.0
    np.testing.assert_array_equal(p["cell"]["depthwise_weight"][..., 1], 1.0)
    np.testing.assert_array_equal(p["cell"]["depthwise_weight"][..., ::2], 0.0)
    assert not np.any(p["cell"]["pointwise_bias"]) and not np.any(p["cell"]["depthwise_bias"])
    w = np.asarray(p["write_proj"]["weight"])
    assert np.abs(w).max() <= 1 / 16 and np.abs(w).max() > 0.9 / 16  # +-1/sqrt(256)
    bound = math.sqrt(6 / 48)
    assert np.abs(np.asarray(p["cell"]["pointwise_weight"])).max() <= bound


def test_layer_matches_reference_values_and_gradients():
    p, x, state = _layer(tokens=8)  # 3 chunks, the last one ragged

    def ours(p_, x_, s_):
        return tmj.apply(_with(p_, sigma_scale=0.7), x_, s_, stream=False)

    def ref(p_, x_, s_):
        out, h, c = ref_apply(p_, x_, *s_, CHUNK, sigma_scale=0.7)
        return out, tmj.MemoryState(h, c)

    cot = _random_like(jax.eval_shape(ours, p, x, state), 4)
    out, grads = _jit_vjp(ours, (p, x, state), cot)
    ref_out, ref_grads = _jit_vjp(ref, (p, x, state), cot)
    assert out[0].shape == x.shape
    assert _tree_rel(out, ref_out) < 1e-13
    err = _tree_rel(grads, ref_grads)
    assert err < 1e-10, f"custom-VJP vs autodiff of the plain forward: {err:.3g}"


def test_layer_check_grads():
    p, x, state = _layer(tokens=6)
    check_grads(jax.jit(lambda p_, x_, s_: tmj.apply(p_, x_, s_)[0]), (p, x, state), order=1,
                modes=["rev"])


def test_jit_equals_eager():
    p, x, state = _layer(tokens=6)
    eager = jax.value_and_grad(_loss, argnums=(0, 1, 2))(p, x, state)
    assert _tree_rel(_value_and_grad(p, x, state), eager) < 1e-12


def test_vmap_over_parameter_ensemble_and_batch():
    p0, x, state = _layer(seed=0, tokens=6)
    p1, _, _ = _layer(seed=1, tokens=6)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), p0, p1)
    grads = jax.jit(jax.vmap(jax.grad(_loss), in_axes=(0, None, None)))(stacked, x, state)
    for index, p_ in enumerate((p0, p1)):
        expected = _value_and_grad(p_, x, state)[1][0]
        assert _tree_rel(jax.tree.map(lambda a, i=index: a[i], grads), expected) < 1e-12
    # vmap over an extra leading batch axis of x and the state
    xs = jnp.stack([x, 2.0 * x])
    states = jax.tree.map(lambda a: jnp.stack([a, -a]), state)
    out = jax.jit(jax.vmap(tmj.apply, in_axes=(None, 0, 0)))(p0, xs, states)
    expected = _apply(p0, 2.0 * x, jax.tree.map(jnp.negative, state))
    assert _tree_rel(jax.tree.map(lambda a: a[1], out), expected) < 1e-12


def test_float32_without_x64():
    p64, x64_, state64 = _layer(tokens=6)
    with jax.enable_x64(False):
        to32 = partial(jax.tree.map, lambda a: jnp.asarray(np.asarray(a), jnp.float32))
        value, grads = _value_and_grad(*to32((p64, x64_, state64)))
        assert value.dtype == jnp.float32
        assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
        grads = jax.tree.map(np.asarray, grads)
    assert _tree_rel(grads, _value_and_grad(p64, x64_, state64)[1]) < 1e-4


# --------------------------------------------------------------------------- modes, streaming


def _stack(gate_init=0.0):
    keys = jax.random.split(jax.random.key(7), 2)
    layers = [tmj.residual_init(k, EMBED, CHANNELS, SHAPE, CHUNK, gate_init=gate_init,
                                dtype=jnp.float64) for k in keys]
    w = jnp.asarray(np.random.default_rng(8).normal(size=(EMBED, EMBED)) / 3)
    blocks = [lambda v: v + jnp.tanh(v @ w), lambda v: v - jnp.tanh(v @ w.T)]
    return layers, blocks


def test_causal_mode_is_causal_and_threaded_is_not():
    layers, blocks = _stack()
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.normal(size=(2, 12, EMBED)))
    run = jax.jit(lambda v, mode: tmj.stack_apply(layers, v, mode=mode, blocks=blocks)[0],
                  static_argnums=1)
    for p in (3, 4, 7):  # a chunk's first token, inside a chunk, a chunk's last token
        changed = x.at[:, p + 1:].set(jnp.asarray(rng.normal(size=(2, 12 - p - 1, EMBED))))
        causal, causal_changed = run(x, "causal"), run(changed, "causal")
        np.testing.assert_array_equal(causal[:, :p + 1], causal_changed[:, :p + 1])
        assert not np.allclose(causal[:, p + 1:], causal_changed[:, p + 1:])
        threaded, threaded_changed = run(x, "threaded"), run(changed, "threaded")
        leak = np.abs(threaded[:, :p + 1] - threaded_changed[:, :p + 1]).max()
        assert leak > 1e-6, "threaded mode reads the state after the whole segment"


def test_streaming_in_pieces_equals_one_call():
    """Pieces equal one call to rounding (the heads run once over each call's chunks)."""
    p, x, state = _layer(tokens=12)

    def close(a, b):
        assert _tree_rel(a, b) <= 1e-12

    whole, final = _apply(p, x, state)
    a, s = _apply(p, x[:, :3], state)
    b, s = _apply(p, x[:, 3:], s)
    close(jnp.concatenate([a, b], axis=1), whole)
    for name in ("h", "c", "pending", "read"):
        close(getattr(s, name), getattr(final, name))
    # eagerly too
    a, s = tmj.apply(p, x[:, :6], state)
    b, s = tmj.apply(p, x[:, 6:], s)
    close(jnp.concatenate([a, b], axis=1), tmj.apply(p, x, state)[0])

    layers, blocks = _stack()
    run = jax.jit(partial(tmj.stack_apply, layers, mode="causal", blocks=blocks))
    whole, states = run(x, (state, state))
    first, s = run(x[:, :6], (state, state))
    second, s = run(x[:, 6:], s)
    close(jnp.concatenate([first, second], axis=1), whole)
    assert len(s) == 2
    for ours, ref in zip(s, states, strict=True):
        close(ours.h, ref.h)
        assert np.array_equal(ours.count, ref.count)


def test_reset_mask_and_detach():
    p, x, state = _layer(tokens=6)
    out = _apply(p, x, state, reset=jnp.asarray([True, False]))[0]
    fresh = _apply(p, x, jax.tree.map(jnp.zeros_like, state), reset=jnp.asarray([False, False]))[0]
    carried = _apply(p, x, state, reset=jnp.asarray([False, False]))[0]
    np.testing.assert_array_equal(out[0], fresh[0])
    np.testing.assert_array_equal(out[1], carried[1])

    def second_piece_losses(x_first):
        _, s = tmj.apply(p, x_first, state)
        return jnp.stack([jnp.sum(tmj.apply(p, x, s_)[0] ** 2)
                          for s_ in (s, tmj.detach_state(s))])

    through, detached = jax.jit(jax.jacrev(second_piece_losses))(x)
    assert np.abs(through).max() > 0
    np.testing.assert_array_equal(detached, 0.0)


def test_forget_bias_option():
    """``forget_bias`` sets the forget quarter of the pointwise bias, as in the torch layer."""
    p = tmj.init(jax.random.key(0), 16, 4, (3, 3), 2, forget_bias=3.0)
    bias = np.asarray(p["cell"]["pointwise_bias"])
    np.testing.assert_array_equal(bias[4:8], 3.0)
    assert not bias[:4].any() and not bias[8:].any()
    r = tmj.residual_init(jax.random.key(0), 16, 4, (3, 3), 2, forget_bias=-1.0)
    np.testing.assert_array_equal(r["memory"]["cell"]["pointwise_bias"][4:8], -1.0)
    with pytest.raises(ValueError, match="forget_bias"):
        tmj.init(jax.random.key(0), 16, 4, (3, 3), 2, forget_bias=float("nan"))
    from flax import nnx

    flax_layer = tmj.MemoryResidual(16, 4, (3, 3), 2, rngs=nnx.Rngs(0), forget_bias=2.0)
    np.testing.assert_array_equal(
        tmj.params_from_module(flax_layer.memory)["cell"]["pointwise_bias"][4:8], 2.0)


def test_gated_residual_gate_init():
    _, x, state = _layer(tokens=6)
    zeros = jax.tree.map(jnp.zeros_like, state)
    residual = jax.jit(tmj.residual_apply)
    for gate in (0.0, -2.0):
        params = tmj.residual_init(jax.random.key(0), EMBED, CHANNELS, SHAPE, CHUNK,
                                   gate_init=gate, dtype=jnp.float64)
        assert params["gate"].shape == (1,) and float(params["gate"][0]) == gate
        out, _ = residual(params, x, zeros)
        mean = jnp.mean(x, -1, keepdims=True)
        normed = (x - mean) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5)
        mem, _ = _apply(params["memory"], normed, zeros)
        np.testing.assert_allclose(out, x + jax.nn.sigmoid(gate) * mem, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- Flax, state dicts


def test_flax_module_runs_converts_and_trains_one_step():
    optax = pytest.importorskip("optax")
    from flax import nnx

    model = tmj.TensorMemory(EMBED, CHANNELS, SHAPE, CHUNK, sigma_scale=0.5, rngs=nnx.Rngs(0),
                             dtype=jnp.float64)
    params = tmj.params_from_module(model)
    assert jax.tree.structure(params) == jax.tree.structure(
        tmj.init(jax.random.key(0), EMBED, CHANNELS, SHAPE, CHUNK, 0.5))
    _, x, state = _layer(tokens=6)
    out, final = model(x)
    assert params["config"].sigma_scale == 0.5
    ref, _ = _apply(params, x, jax.tree.map(jnp.zeros_like, state))
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-15)
    assert final.h.shape == (2, CHANNELS, *SHAPE)

    target = jnp.asarray(np.random.default_rng(5).normal(size=x.shape))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    def loss_fn(m):
        return jnp.mean((m(x)[0] - target) ** 2)

    @nnx.jit
    def train_step(m, opt):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        opt.update(m, grads)
        return loss

    before = train_step(model, optimizer)
    after = train_step(model, optimizer)  # the loss before the second update
    assert float(after) < float(before)

    swapped = jax.tree.map(lambda a: a * 0.5, params)
    tmj.load_params(model, swapped)
    assert _tree_rel(tmj.params_from_module(model), swapped) == 0.0

    residual = tmj.MemoryResidual(EMBED, CHANNELS, SHAPE, CHUNK, gate_init=-2.0,
                                  rngs=nnx.Rngs(1), dtype=jnp.float64)
    out, _ = residual(x, state)
    ref, _ = jax.jit(tmj.residual_apply)(tmj.params_from_module(residual), x, state)
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-15)


def test_state_dict_round_trip():
    p, x, state = _layer()
    sd = tmj.state_dict_from_params(p, prefix="blocks.0.memory.")
    assert sd["blocks.0.memory.cell.pointwise_weight"].shape == (4 * CHANNELS, 2 * CHANNELS)
    assert all(isinstance(v, np.ndarray) for v in sd.values())
    sd["other.weight"] = np.zeros(3)
    back = tmj.params_from_state_dict(sd)  # prefix inferred
    assert _tree_rel(back, p) == 0.0
    residual = tmj.residual_init(jax.random.key(0), EMBED, CHANNELS, SHAPE, CHUNK,
                                 dtype=jnp.float64)
    back = tmj.params_from_state_dict(tmj.state_dict_from_params(residual, "layers.1."))
    assert _tree_rel(back, residual) == 0.0
    del sd["blocks.0.memory.sigma_net.bias"]
    with pytest.raises(KeyError, match="sigma_net.bias"):
        tmj.params_from_state_dict(sd)


def test_errors_name_the_argument():
    p, x, state = _layer()
    with pytest.raises(TypeError, match="params: expected the parameter pytree init"):
        tmj.apply({k: v for k, v in p.items() if k != "config"}, x)
    with pytest.raises(ValueError, match=r"params.write_proj.weight: expected shape"):
        tmj.apply(_with(p, chunk_size=CHUNK + 1), x, state)
    with pytest.raises(ValueError, match=r"state.h: expected shape"):
        tmj.apply(_with(p, memory_shape=(2, 2, 2)), x, state)
    with pytest.raises(ValueError, match="x: expected shape"):
        tmj.apply(p, x[0], state)
    with pytest.raises(ValueError, match="reset"):
        tmj.apply(p, x, state, reset=jnp.asarray([True]))
    with pytest.raises(ValueError, match="mode"):
        tmj.stack_apply([], x, mode="bidirectional")
    with pytest.raises(ValueError, match="write_content"):
        tmj.memory_scan(*state, jnp.zeros((2, 4, 3)), jnp.zeros((2, 4, 3)), jnp.ones((2, 4)),
                        jnp.zeros((2, 4, CHANNELS + 1)), tmj.conv_params(p["cell"]))


# --------------------------------------------------------------------------- one scan, checkpoints


@pytest.mark.parametrize("every", [2, 3, 7])
def test_checkpoint_every_same_gradients_fewer_states(every):
    """The layer and memory_scan share one checkpointing scan: gradients do not depend on
    ``checkpoint_every``, and the forward saves ``ceil(T / k)`` states for the backward."""
    from tmcore.adapters.jax import bridge

    p, x, state = _layer(tokens=20)  # 7 chunks, the last ragged

    def loss(p_, x_, s_, k):
        out, (h, c, *_) = tmj.apply(_with(p_, checkpoint_every=k), x_, s_)
        return jnp.sum(out ** 2) + jnp.sum(h * c)

    grads = [jax.jit(jax.value_and_grad(partial(loss, k=k), argnums=(0, 1, 2)))(p, x, state)
             for k in (1, every)]
    assert _tree_rel(grads[0], grads[1]) < 1e-12
    state_scan, inputs, cell = _scan_inputs(steps=7)
    cell = tmj.conv_params(cell)
    cot = _random_like(jax.eval_shape(lambda *a: tmj.memory_scan(*a, cell), *state_scan,
                                      *inputs), 5)
    runs = [_jit_vjp(lambda *a, k=k: tmj.memory_scan(*a, cell, checkpoint_every=k),
                     (*state_scan, *inputs), cot) for k in (1, every)]
    assert _tree_rel(runs[0], runs[1]) < 1e-12
    static = bridge.ScanStatic(DenseStep(1e-6, None), every, bridge.options_key())
    residuals = jax.eval_shape(lambda *a: bridge._scan_fwd(static, *a)[1], cell,
                               tmcore_step_inputs(inputs), *state_scan)
    full, tail = divmod(7, every)
    assert residuals[2][0].shape == (full, *state_scan[0].shape)  # h checkpoints
    assert (residuals[3] is not None) == bool(tail)  # the ragged last segment's start


def DenseStep(eps, radius):  # noqa: N802
    from tmcore.scan.dense import DenseStep as step

    return step(eps, radius)


def tmcore_step_inputs(inputs):
    from tmcore.types import StepInputs

    return StepInputs(*(jnp.moveaxis(a, 1, 0) for a in inputs))


# --------------------------------------------------------------------------- issue 13 defects


def _kernel_targets(fn) -> set[str]:
    """The fused-kernel custom calls in a fresh trace of ``fn`` (a new lambda each time:
    make_jaxpr caches by function)."""
    import re

    return set(re.findall(r"tmcore_\w+", str(jax.make_jaxpr(fn)())))


def _require_kernels():
    from tmcore.backends import native as _native

    if not _native.enabled() or _native.jax_library() is None:
        pytest.skip("the fused CPU kernels for JAX are not built here (no compiler)")


def test_options_apply_after_the_first_trace_and_per_thread():
    import threading

    import tmcore

    _require_kernels()
    p, _, _ = _layer()
    x = jnp.ones((3, 7, EMBED))  # a shape no other test traces

    def call():
        return lambda: tmj.apply(p, x)[0]

    assert _kernel_targets(call()), "the default trace should use the fused kernels"
    with tmcore.options(generic=True):
        assert not _kernel_targets(call())
    with tmcore.options(native=False):
        assert not _kernel_targets(call())
    assert _kernel_targets(call())
    # another thread's setting does not leak into this one, nor this one's into it
    seen = {}

    def worker():
        with jax.enable_x64(True), tmcore.options(generic=True):
            seen["thread"] = _kernel_targets(call())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["thread"] == set()
    assert _kernel_targets(call())


def test_validate_mode_reaches_apply_and_primitives():
    import tmcore

    p, x, state = _layer(tokens=6)
    bad = x.at[0, 1, 2].set(jnp.nan)
    tmj.apply(p, bad, state)  # off by default: no check
    with tmcore.options(validate=True):
        with pytest.raises(ValueError, match="x: expected finite"):
            tmj.apply(p, bad, state)
        with pytest.raises(ValueError, match="state.h: expected finite"):
            tmj.apply(p, x, (state.h.at[0, 0, 0, 0, 0].set(jnp.inf), state.c))
        content = jnp.ones((1, 2, CHANNELS))
        mu = jnp.zeros((1, 2, 3))
        with pytest.raises(ValueError, match="sigma"):
            tmj.gaussian_splat(content, mu, jnp.asarray([[0.5, -1.0]]), SHAPE)
        with pytest.raises(ValueError, match="coords: expected finite"):
            tmj.trilinear_sample(state.h, jnp.full((2, 1, 3), jnp.nan))
        # under jit the values are not concrete: no check, no error
        jax.jit(lambda a: tmj.apply(p, a, state)[0])(bad)


def test_empty_batch():
    p, _, _ = _layer()
    out, (h, c, *_) = tmj.apply(p, jnp.zeros((0, 6, EMBED)))
    assert out.shape == (0, 6, EMBED) and h.shape == c.shape == (0, CHANNELS, *SHAPE)
    grad = jax.grad(lambda a: jnp.sum(tmj.apply(p, a)[0]))(
        jnp.zeros((0, 6, EMBED)))
    assert grad.shape == (0, 6, EMBED)


def test_mixed_dtypes_promote():
    p, x, state = _layer(tokens=6)
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    for x_low in (x.astype(jnp.float16), x.astype(jnp.bfloat16)):
        out, (h, c, *_) = tmj.apply(p32, x_low)  # zero state
        assert out.dtype == h.dtype == c.dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(out)))
        expected = tmj.apply(p32, x_low.astype(jnp.float32))[0]
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)
        grads = jax.grad(lambda p_, a: jnp.sum(tmj.apply(p_, a)[0]),
                         argnums=(0, 1))(p32, x_low)
        assert grads[1].dtype == x_low.dtype
        assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads[0]))
    # h float64 with c float32: promoted, equal to the all-float64 run
    mixed = (state.h, state.c.astype(jnp.float32))
    out, (h, c, *_) = tmj.apply(p, x, mixed)
    assert h.dtype == c.dtype == jnp.float64
    assert _rel(out, tmj.apply(p, x, (state.h, mixed[1].astype(jnp.float64)))[0]) < 1e-15
    state_scan, inputs, cell = _scan_inputs(steps=2)
    reads, h, _ = tmj.memory_scan(state_scan[0], state_scan[1].astype(jnp.float32), *inputs,
                                  tmj.conv_params(cell))
    assert reads.dtype == h.dtype == jnp.float64


def test_nnx_module_mixed_precision():
    from flax import nnx

    module = tmj.TensorMemory(EMBED, CHANNELS, SHAPE, CHUNK, rngs=nnx.Rngs(0),
                              dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, EMBED)), jnp.bfloat16)
    out, state = module(x)
    assert out.dtype == state.h.dtype == jnp.float32
    out, state = module(x, state)  # the float32 state streams on with bfloat16 tokens
    assert np.all(np.isfinite(np.asarray(out)))


def test_state_dict_conversion_is_strict_and_differentiable():
    p, x, state = _layer(tokens=6)
    sd = tmj.state_dict_from_params(p)
    np.testing.assert_array_equal(sd.pop("_extra_state"), SHAPE)  # the config's grid
    sd["_extra_state"] = np.asarray(SHAPE)  # as torch stores it (int64)
    params = tmj.params_from_state_dict(sd)
    assert params["config"] == p["config"]
    assert not any(jnp.issubdtype(a.dtype, jnp.integer) for a in jax.tree.leaves(params))
    grads = jax.grad(lambda p_: jnp.sum(tmj.apply(p_, x, state)[0]))(params)  # no int leaf
    assert _tree_rel(grads, jax.grad(lambda p_: jnp.sum(tmj.apply(p_, x, state)[0]))(p)) \
        < 1e-15
    optax = pytest.importorskip("optax", reason="optax is not installed")
    optimizer = optax.adam(1e-3)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    optax.apply_updates(params, updates)
    assert set(tmj.state_dict_from_params(params)) == set(sd)  # the grid shape written back
    np.testing.assert_array_equal(tmj.state_dict_from_params(params)["_extra_state"], SHAPE)
    with pytest.raises(ValueError, match="memory_shape"):  # the stored grid is checked
        tmj.params_from_state_dict(sd, config=_with(p, memory_shape=(2, 2, 2))["config"])
    with pytest.raises(ValueError, match="config: the state dict stores no grid"):
        tmj.params_from_state_dict({k: v for k, v in sd.items() if k != "_extra_state"})
    with pytest.raises(ValueError, match="write_proj.wieght"):
        tmj.params_from_state_dict({**sd, "write_proj.wieght": sd["write_proj.weight"]})
    with pytest.raises(TypeError, match="content_net.weight"):
        tmj.params_from_state_dict({**sd, "content_net.weight":
                                    sd["content_net.weight"].astype(np.int32)})


def test_load_params_keeps_dtypes_and_refuses_integers():
    from flax import nnx

    module = tmj.TensorMemory(EMBED, CHANNELS, SHAPE, CHUNK, rngs=nnx.Rngs(0),
                              dtype=jnp.float32)
    p, _, _ = _layer()  # float64
    tmj.load_params(module, p)
    loaded = tmj.params_from_module(module)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(loaded))
    assert _tree_rel(loaded, p) < 1e-6
    ints = jax.tree.map(lambda a: jnp.round(a).astype(jnp.int32), p)
    with pytest.raises(ValueError, match="floating"):
        tmj.load_params(module, ints)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(tmj.params_from_module(module)))


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_forward_mode_error_names_tmcore_and_the_workaround(transform):
    p, x, state = _layer(tokens=3, batch=1)

    def f(a):
        return jnp.sum(tmj.apply(p, a, state)[0])

    with pytest.raises(TypeError, match="TMCORE_NATIVE=0") as info:
        if transform == "jvp":
            jax.jvp(f, (x,), (x,))
        else:
            getattr(jax, transform)(f)(x)
    assert "tmcore" in str(info.value) and "jacrev" in str(info.value)


def test_float_sizes_are_type_errors():
    with pytest.raises(TypeError, match="embed_dim"):
        tmj.init(jax.random.key(0), 2.0, CHANNELS, SHAPE, CHUNK)
    with pytest.raises(TypeError, match="chunk_size"):
        tmj.init(jax.random.key(0), EMBED, CHANNELS, SHAPE, True)
    p = tmj.init(jax.random.key(0), np.int64(EMBED), np.int32(CHANNELS), SHAPE, CHUNK)
    assert p["out_proj"]["weight"].shape == (EMBED, CHANNELS)




def test_jitted_training_step_does_not_grow_with_the_chunks():
    """``benchmarks/compile_dynamic.py``'s JAX half at 2 and 16 chunks: the optimized HLO
    of a jitted value-and-grad step has the same size (the chunk loop is a ``lax.scan``;
    only printed shapes differ), so compile cost does not grow with the sequence."""
    from benchmarks.compile_dynamic import jax_compile  # (torch only in its torch half)

    rows = jax_compile([2, 16])
    sizes = [row["hlo_chars"] for row in rows]
    assert [row["chunks"] for row in rows] == [2, 16]
    assert max(sizes) < 1.02 * min(sizes), sizes
