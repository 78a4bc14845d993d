"""tmcore.layer: the framework-free layer (config, parameter plan, heads, chunking,
reset, modes, stored-grid check, forward) on NumPy and array_api_strict."""

from __future__ import annotations

import math

import array_api_compat.numpy as xp
import numpy as np
import pytest

import tmcore
from tmcore import layer as tl
from tmcore.layer.layer import chunk, unchunk
from tmcore.layer.state import check_state, check_tokens

CONFIG = tl.layer_config(6, 2, (3, 4), 3, sigma_scale=0.7, forget_bias=1.5)


def _params(config=CONFIG, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tl.init_params(xp, config, lambda s: rng.uniform(-s.bound, s.bound, s.shape)
                          .astype(dtype), dtype=dtype)


def _scan(config, params):
    def scan(h0, c0, inputs, **masks):
        return tmcore.memory_scan(h0, c0, *inputs, tl.cell_params(params), eps=config.eps,
                                  radius=config.radius, **masks)
    return scan


# --------------------------------------------------------------------------- config


def test_config_accepts_python_and_numpy_integers():
    config = tl.layer_config(np.int64(4), np.int32(2), (np.int64(3), 2), np.int16(2),
                             checkpoint_every=np.int64(2))
    assert config.embed_dim == 4 and type(config.embed_dim) is int
    assert config.memory_shape == (3, 2) and config.checkpoint_every == 2
    for bare in (5, np.int64(5)):  # a bare int is ambiguous ((5,) or (5, 5, 5)): refused
        with pytest.raises(TypeError, match=r"memory_shape.*\(5,\)"):
            tl.layer_config(4, 2, bare, 2)
    assert tl.layer_config(4, 2, (np.int64(5),), 2).memory_shape == (5,)


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"embed_dim": 2.0}, TypeError, "embed_dim: expected an int"),
    ({"embed_dim": True}, TypeError, "embed_dim: expected an int"),
    ({"embed_dim": 0}, ValueError, "embed_dim: expected an int"),
    ({"memory_channels": "2"}, TypeError, "memory_channels"),
    ({"chunk_size": 1.5}, TypeError, "chunk_size"),
    ({"memory_shape": (4.7, 5, 3)}, TypeError, "memory_shape"),
    ({"memory_shape": (4, 0)}, ValueError, "memory_shape"),
    ({"memory_shape": (2, 2, 2, 2, 2)}, ValueError, "memory_shape"),
    ({"memory_shape": "abc"}, TypeError, "memory_shape"),
    ({"sigma_scale": 0.0}, ValueError, "sigma_scale"),
    ({"sigma_scale": math.nan}, ValueError, "sigma_scale"),
    ({"sigma_scale": np.ones(1)}, TypeError, "sigma_scale"),
    ({"eps": -1.0}, ValueError, "eps: expected a finite number >= 0"),
    ({"radius": -1.0}, ValueError, "radius"),
    ({"radius": 0}, ValueError, "radius"),
    ({"forget_bias": math.inf}, ValueError, "forget_bias"),
    ({"checkpoint_every": 0}, ValueError, "checkpoint_every"),
])
def test_config_rejects(kwargs, error, fragment):
    args = {"embed_dim": 4, "memory_channels": 2, "memory_shape": (3, 3), "chunk_size": 2,
            **kwargs}
    with pytest.raises(error, match=fragment):
        tl.layer_config(**args)


# --------------------------------------------------------------------------- parameters


def test_param_plan_shapes_and_init():
    specs = {s.name: s for s in tl.param_specs(CONFIG)}
    d, c, n, length = 6, 2, 2, 3
    assert list(specs) == [
        "write_proj.weight", "write_proj.bias", "content_net.weight", "content_net.bias",
        "sigma_net.weight", "sigma_net.bias", "coord_net.weight", "coord_net.bias",
        "cell.depthwise_weight", "cell.depthwise_bias", "cell.pointwise_weight",
        "cell.pointwise_bias", "out_proj.weight", "out_proj.bias"]
    assert specs["write_proj.weight"].shape == (d, length * d)
    assert specs["write_proj.weight"].bound == pytest.approx(1 / math.sqrt(length * d))
    assert specs["cell.pointwise_weight"].bound == pytest.approx(math.sqrt(6 / (2 * c + 4 * c)))
    params = _params()
    tl.check_params(params, CONFIG)
    assert tl.sizes_from_params(params) == (d, c, n, length)
    np.testing.assert_array_equal(params["sigma_net"]["bias"], [1.0])
    np.testing.assert_array_equal(params["cell"]["depthwise_weight"][..., 1], 1.0)
    np.testing.assert_array_equal(params["cell"]["depthwise_weight"][..., ::2], 0.0)
    np.testing.assert_array_equal(params["cell"]["depthwise_bias"], 0.0)
    bias = params["cell"]["pointwise_bias"]
    np.testing.assert_array_equal(bias[c:2 * c], 1.5)
    np.testing.assert_array_equal(np.delete(bias, np.s_[c:2 * c]), 0.0)
    bound = specs["content_net.weight"].bound
    assert np.all(np.abs(params["content_net"]["weight"]) <= bound)


def test_layer_md_table_matches_the_plan():
    """docs/LAYER.md's parameter table lists every ParamSpec with its layout and init
    (the default plan and the warp_net / warp_flow groups of dynamics="warp", flow=True)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "LAYER.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    warp = tl.layer_config(6, 2, (3, 4), 3, dynamics="warp", flow=True)
    specs = tl.param_specs(CONFIG) + tl.param_specs(warp)
    assert {s.group for s in specs} >= {tl.WARP_GROUP, tl.FLOW_GROUP}
    for spec in specs:
        row = next((r for r in rows if f"`{spec.group}.{spec.leaf}`" in r
                    or (spec.leaf == "bias" and f"`{spec.group}.weight`, `.bias`" in r)), None)
        assert row is not None, spec.name
        assert f"`{spec.layout}`" in row, (spec.name, row)
        word = {"uniform": "uniform", "xavier_uniform": "Xavier", "identity_taps": "identity",
                "forget_bias": "forget_bias"}.get(spec.init)
        if word is not None:
            assert word in row, (spec.name, row)
        if spec.init == "constant" and spec.value == 0.0 and spec.leaf != "bias":
            assert "| 0" in row, (spec.name, row)  # zero-initialized weights say so


def test_check_params_names_the_leaf():
    params = _params()
    params["cell"]["pointwise_bias"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"params.cell.pointwise_bias: expected shape \(4C,\)"):
        tl.check_params(params, CONFIG)
    params = _params()
    del params["out_proj"]["bias"]
    with pytest.raises(KeyError, match="out_proj.bias"):
        tl.check_params(params, CONFIG)
    params = _params()
    params["coord_net"]["weight"] = params["coord_net"]["weight"].astype(np.int32)
    with pytest.raises(TypeError, match="params.coord_net.weight: expected a real floating"):
        tl.check_params(params, CONFIG)


# --------------------------------------------------------------------------- heads, chunks


def _linear(p, x):
    return x @ p["weight"].T + p["bias"]


def test_heads_match_the_layer_math():
    params = _params()
    rng = np.random.default_rng(1)
    chunk = rng.normal(size=(2, 3, 6))
    out = tl.Layer(CONFIG).heads(xp, params, chunk)
    summary = _linear(params["write_proj"], chunk.reshape(2, 18))
    np.testing.assert_allclose(out.read_coords, np.tanh(_linear(params["coord_net"],
                                                                chunk[:, 0])))
    np.testing.assert_allclose(out.write_coords, np.tanh(_linear(params["coord_net"], summary)))
    np.testing.assert_allclose(out.write_content, _linear(params["content_net"], summary))
    logit = _linear(params["sigma_net"], summary)[:, 0]
    np.testing.assert_allclose(out.write_sigma, (np.log1p(np.exp(logit)) + 1e-4) * 0.7)
    # a stack of chunks (B, T, L, d) gives the per-chunk results stacked
    stacked = tl.Layer(CONFIG).heads(xp, params, np.stack([chunk, 2 * chunk], 1))
    np.testing.assert_allclose(stacked.write_sigma[:, 0], out.write_sigma)
    assert stacked.read_coords.shape == (2, 2, 2)


@pytest.mark.parametrize("tokens", [1, 3, 7, 9])
def test_chunk_pads_and_unchunk_trims(tokens):
    x = np.arange(2 * tokens * 6, dtype=np.float64).reshape(2, tokens, 6) + 1
    chunks = chunk(xp, x, 3)
    steps = -(-tokens // 3)
    assert chunks.shape == (2, steps, 3, 6)
    np.testing.assert_array_equal(chunks.reshape(2, -1, 6)[:, :tokens], x)
    np.testing.assert_array_equal(chunks.reshape(2, -1, 6)[:, tokens:], 0.0)
    per_chunk = np.random.default_rng(0).normal(size=(2, steps, 6))
    out = unchunk(xp, per_chunk, tokens, 3)
    assert out.shape == (2, tokens, 6)
    for n in range(tokens):
        np.testing.assert_array_equal(out[:, n], per_chunk[:, n // 3])


# --------------------------------------------------------------------------- state, modes


def test_reset_by_bool_mask_only():
    h = np.ones((3, 2, 3, 4))
    c = 2 * np.ones((3, 2, 3, 4))
    params = _params(CONFIG)

    def reset(mask):  # a call with no token returns the reset state
        return tl.Layer(CONFIG).forward(xp, params, np.zeros((3, 0, 6)), (h, c),
                                        scan=_scan(CONFIG, params), reset=mask)[1]

    h2, c2 = reset(np.array([True, False, True]))
    assert h2[0].sum() == 0 and c2[2].sum() == 0 and h2[1].sum() == 24 and c2[1].sum() == 48
    with pytest.raises(TypeError, match="reset: expected a bool mask.*float64"):
        reset(np.array([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"reset: expected a bool mask of shape \(B,\) = \(3,\)"):
        reset(np.array([True, False]))


def test_check_state_and_tokens():
    with pytest.raises(ValueError, match=r"state.h: expected shape \(B, C, \*S\) = \(2, 2, 3, 4\)"):
        check_state(xp, (np.zeros((2, 2, 3, 3)), np.zeros((2, 2, 3, 4))), 2, CONFIG)
    with pytest.raises(ValueError, match="state: expected a pair"):
        check_state(xp, np.zeros((2, 2, 3, 4)), 2, CONFIG)
    with pytest.raises(TypeError, match="state.c: expected a real floating dtype"):
        check_state(xp, (np.zeros((2, 2, 3, 4)), np.zeros((2, 2, 3, 4), int)), 2, CONFIG)
    with pytest.raises(ValueError, match=r"d = 6 \(embed_dim = 6\)"):
        check_tokens(xp, np.zeros((2, 3, 5)), CONFIG)
    with pytest.raises(TypeError, match="x: expected a real floating dtype"):
        check_tokens(xp, np.zeros((2, 3, 6), int), CONFIG)


def test_modes():
    s = (np.zeros(1), np.zeros(1))
    t = (np.ones(1), np.ones(1))
    assert tl.check_mode("causal") == "causal"
    with pytest.raises(ValueError, match="mode: expected one of"):
        tl.check_mode("bidirectional")
    assert tl.segment_states("causal", None, 3) == [None] * 3
    assert tl.segment_states("causal", s, 2) == [s, s]
    assert tl.segment_states("causal", [s, t], 2) == [s, t]
    with pytest.raises(ValueError, match="expected 3 per-layer"):
        tl.segment_states("causal", [s, t], 3)
    assert tl.segment_states("threaded", [s, t], 2) is t
    assert tl.start_state("causal", 1, [s, t], s) == (t, True)
    assert tl.start_state("threaded", 0, s, None) == (s, True)
    assert tl.start_state("threaded", 1, s, t) == (t, False)
    assert tl.final_state("causal", [s, t]) == (s, t)
    assert tl.final_state("threaded", [s, t]) is t


def test_stored_grid_error():
    assert tl.stored_grid_error(np.array([3, 4], np.int32), (3, 4), "k") is None
    assert tl.stored_grid_error([3, 4], (3, 4), "k") is None
    assert "saved from a grid (3, 5)" in tl.stored_grid_error(np.array([3, 5]), (3, 4), "k")
    for bad in (np.array([3.0, 4.0]), np.zeros((1, 2), int), "34", [True, 4], 7):
        assert "should hold a grid shape" in tl.stored_grid_error(bad, (3, 4), "k")


# --------------------------------------------------------------------------- forward


def test_forward_on_numpy_equals_a_hand_loop():
    params = _params()
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 7, 6))
    layer = tl.Layer(CONFIG)
    out, (h, c) = layer.forward(xp, params, x, None, scan=_scan(CONFIG, params))
    assert out.shape == x.shape and h.shape == (2, 2, 3, 4)
    # hand loop: chunk by chunk, one-step scans
    state = tl.zero_state(xp, CONFIG, 2, dtype=x.dtype)
    chunks = chunk(xp, x, 3)
    rows = []
    for t in range(chunks.shape[1]):
        inputs = tl.Layer(CONFIG).heads(xp, params, chunks[:, t])
        reads, *state = _scan(CONFIG, params)(*state, tmcore.StepInputs(
            *(v[:, None] for v in inputs)))
        rows.append(tl.Layer(CONFIG).read_out(xp, params, reads[:, 0]))
    expected = np.repeat(np.stack(rows, 1), 3, axis=1)[:, :7]
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(h, state[0], rtol=1e-12, atol=1e-12)
    # empty input: zeros and the (reset) state
    empty, kept = layer.forward(xp, params, x[:, :0], (h, c), scan=_scan(CONFIG, params),
                                reset=np.array([True, False]))
    assert empty.shape == (2, 0, 6) and kept[0][0].sum() == 0
    np.testing.assert_array_equal(kept[0][1], h[1])


def test_a_variant_overrides_the_heads():
    params = _params()

    class FixedRead(tl.Layer):
        def heads(self, xp, params, chunk):
            inputs = super().heads(xp, params, chunk)
            return inputs._replace(read_coords=xp.zeros_like(inputs.read_coords))

    x = np.random.default_rng(3).normal(size=(1, 6, 6))
    plain, _ = tl.Layer(CONFIG).forward(xp, params, x, None, scan=_scan(CONFIG, params))
    fixed, _ = FixedRead(CONFIG).forward(xp, params, x, None, scan=_scan(CONFIG, params))
    np.testing.assert_array_equal(plain[:, :3], fixed[:, :3])  # chunk 0 reads zeros anyway
    assert not np.allclose(plain[:, 3:], fixed[:, 3:])


def test_forward_on_array_api_strict():
    strict = pytest.importorskip("array_api_strict", reason="array_api_strict is not installed")
    params = _params()
    sparams = {g: {k: strict.asarray(v) for k, v in leaves.items()} for g, leaves in params.items()}
    x = np.random.default_rng(4).normal(size=(2, 5, 6))
    ref, _ = tl.Layer(CONFIG).forward(xp, params, x, None, scan=_scan(CONFIG, params))
    out, _ = tl.Layer(CONFIG).forward(strict, sparams, strict.asarray(x), None,
                                      scan=_scan(CONFIG, sparams))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-12, atol=1e-12)
