"""JAX adapter hardening (issues 51, 63): configs are checked where they are made, dtypes,
parameter groups and states of another grid are refused when they do not match, hostile
counts never mix rows, empty states and eager compiles are bounded."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from tmcore import layer as tl  # noqa: E402
from tmcore.adapters import jax as tmj  # noqa: E402

D, C, SHAPE, L = 4, 2, (4, 4, 4), 4


@pytest.fixture(scope="module")
def params():
    return tmj.init(jax.random.key(0), D, C, SHAPE, L)


def _x(batch=2, tokens=6, dtype=jnp.float32, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, tokens, D), dtype)


@pytest.mark.parametrize("good, bad, name", [
    ({"update": "local", "window": 2}, {"update": "local", "window": 2.0}, "window"),
    ({"checkpoint_every": 1}, {"checkpoint_every": True}, "checkpoint_every"),
    ({"sigma_scale": 1}, {"sigma_scale": True}, "sigma_scale"),
    ({"memory_shape": (4, 4, 4)}, {"memory_shape": (4.0, 4, 4)}, "memory_shape"),
    ({"eps": 0}, {"eps": False}, "eps"),
])
def test_a_config_is_checked_by_type_and_value_where_it_is_made(params, good, bad, name):
    good_config = params["config"].replace(**good)  # a valid one first
    tmj.apply({**params, "config": good_config}, _x())
    with pytest.raises((TypeError, ValueError), match=name):
        good_config.replace(**bad)
    with pytest.raises((TypeError, ValueError), match=name):
        tmj.init(jax.random.key(0), D, C, **{"memory_shape": SHAPE, "chunk_size": L, **bad})


def test_wider_input_or_state_is_refused(params):
    """A float64 input or state into a float32 layer is refused, naming it (narrower
    ones still promote to the parameters' dtype)."""
    with jax.enable_x64(True):
        x = _x()
        _, state = tmj.apply(params, x)
        with pytest.raises(TypeError, match=r"^x: dtype float64 is wider .*float32"):
            tmj.apply(params, x.astype(jnp.float64))
        for field in ("h", "c", "pending", "read"):
            wide = state._replace(**{field: getattr(state, field).astype(jnp.float64)})
            with pytest.raises(TypeError, match=rf"^state\.{field}: dtype float64"):
                tmj.apply(params, x, wide)
        with pytest.raises(TypeError, match=r"^state\.h: dtype float64"):
            tmj.apply(params, x, (state.h.astype(jnp.float64), state.c), stream=False)
        out, _ = tmj.apply(params, x.astype(jnp.bfloat16), state)  # narrower: promoted
        assert out.dtype == jnp.float32


@pytest.mark.parametrize("stream", [True, False])
def test_a_state_of_another_grid_is_refused_naming_both(params, stream):
    """Issue 63, item 3: the grid the parameters were made for is consulted (it was taken
    from the state when no memory_shape was passed)."""
    x = _x()
    other = tmj.init(jax.random.key(0), D, C, (2, 2, 2), L)
    _, state = tmj.apply(other, x, stream=stream)
    with pytest.raises(ValueError, match=r"state\.h: expected shape \(B, C, \*S\) = "
                                         r"\(2, 2, 4, 4, 4\).* got \(2, 2, 2, 2, 2\)"):
        tmj.apply(params, x, state, stream=stream)


@pytest.mark.parametrize("options, group", [({"dynamics": "warp"}, "warp_net"),
                                            ({"dynamics": "warp", "flow": True},
                                             "warp_flow")])
def test_option_groups_without_their_options_are_refused(options, group):
    warp = tmj.init(jax.random.key(0), D, C, SHAPE, L, **options)
    plain = warp["config"].replace(dynamics="none", flow=False)
    with pytest.raises(ValueError, match=rf"params: the groups \[.*'{group}'.*\] are not "
                                         rf"parameters of its config"):
        tmj.apply({**warp, "config": plain}, _x())
    if group == "warp_flow":
        with pytest.raises(ValueError, match=r"groups \['warp_flow'\]"):
            tmj.apply({**warp, "config": plain.replace(dynamics="warp")}, _x())
    tmj.apply(warp, _x())  # with them: fine


@pytest.mark.parametrize("tokens", [1, 3, 6])
@pytest.mark.parametrize("hostile", [13, -1, L, 2**31 - 1])
def test_hostile_count_under_jit_never_reads_another_row(params, tokens, hostile):
    """Row 0's count is out of range; under jit its outputs and state must not depend on
    row 1's data (they equal restarting row 0's unfinished chunk)."""
    x = _x(tokens=7)
    _, state = tmj.apply(params, x)        # count 3 in every row
    bad = state._replace(count=jnp.asarray([hostile, 2], jnp.int32))
    step = jax.jit(lambda s, t: tmj.apply(params, t, s))
    piece = _x(tokens=tokens, seed=2)
    out_a, st_a = step(bad, piece)
    other = jax.tree.map(lambda a: a.at[1].set(a[1] * -3.0 + 1.0)
                         if jnp.issubdtype(a.dtype, jnp.floating) else a, bad)
    out_b, st_b = step(other, piece.at[1].set(piece[1] * 5.0))
    np.testing.assert_array_equal(np.asarray(out_a[0]), np.asarray(out_b[0]))
    for name in ("h", "c", "pending", "read", "count"):
        np.testing.assert_array_equal(np.asarray(getattr(st_a, name)[0]),
                                      np.asarray(getattr(st_b, name)[0]), err_msg=name)
    # the defined behaviour: row 0 restarts its unfinished chunk (h, c kept)
    restart = state._replace(count=jnp.asarray([0, 2], jnp.int32),
                             pending=state.pending.at[0].set(0.0),
                             read=state.read.at[0].set(0.0))
    out_r, _ = step(restart, piece)
    np.testing.assert_allclose(np.asarray(out_a[0]), np.asarray(out_r[0]), rtol=0, atol=0)
    assert np.all(np.isfinite(np.asarray(out_a)))


def test_empty_stream_state_is_a_scan_carry(params):
    """Issue 50, item 11: a public empty StreamState; lax.scan over one token at a time
    from it equals one call over the whole sequence."""
    x = _x(tokens=9)
    empty = tmj.empty_stream_state(params, 2)
    assert isinstance(empty, tmj.StreamState) and empty.count.dtype == jnp.int32
    assert empty.h.shape == (2, C, *SHAPE) and empty.pending.shape == (2, L, D)
    assert empty.h.dtype == jnp.float32

    def body(state, token):
        out, state = tmj.apply(params, token[:, None, :], state)
        return state, out[:, 0, :]

    final, outs = jax.jit(lambda s, xs: lax.scan(body, s, xs))(empty, jnp.moveaxis(x, 1, 0))
    ref, ref_state = tmj.apply(params, x)
    np.testing.assert_allclose(np.asarray(jnp.moveaxis(outs, 0, 1)), np.asarray(ref),
                               rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(final) == jax.tree.structure(empty)
    np.testing.assert_array_equal(np.asarray(final.count), np.asarray(ref_state.count))
    config = tmj.empty_stream_state(tl.LayerConfig(D, C, SHAPE, L), 3)
    assert config.h.shape == (3, C, *SHAPE)
    with pytest.raises(TypeError, match="batch"):
        tmj.empty_stream_state(params, 2.0)
    for dtype in (jnp.int32, jnp.bool_, jnp.complex64):  # issue 63, item 1
        for source in (params, params["config"]):
            with pytest.raises(TypeError, match=r"dtype: expected a real floating dtype"):
                tmj.empty_stream_state(source, 2, dtype=dtype)


def test_an_empty_state_too_big_is_refused_before_allocating():
    """Issue 63, item 1: ``empty_stream_state(params, 10**9)`` under a 2 GiB address limit
    killed the process (std::bad_alloc from XLA); it is refused naming ``batch``."""
    import subprocess
    import sys

    script = (
        "import resource\n"
        "import jax\n"
        "from tmcore.adapters import jax as tmj\n"
        "from tmcore.layer import layer_config\n"
        "config = layer_config(4, 2, (4, 4, 4), 4)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.RLIM_INFINITY))\n"
        "for batch in (10**9, 10**18, 10**30):\n"
        "    try:\n"
        "        tmj.empty_stream_state(config, batch)\n"
        "    except (MemoryError, ValueError) as error:\n"
        "        print(type(error).__name__, str(error).split(':')[0])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["MemoryError", "batch", "ValueError", "batch",
                                   "ValueError", "batch"], done.stdout


def test_eager_streaming_keeps_at_most_the_bound_of_compiled_functions():
    """Issue 51, item 3: 80 piece lengths streamed eagerly keep at most
    STREAM_CACHE_SIZE compiled functions (one compiled program each)."""
    from tmcore.adapters.jax import functional as module

    tiny = tmj.init(jax.random.key(0), 2, 1, (2,), 2)
    module._COMPILED.clear()
    state = None
    for tokens in range(2, 82):
        x = jnp.ones((1, tokens, 2), jnp.float32)
        _, state = tmj.apply(tiny, x, state)
    functions = list(module._COMPILED.values())
    assert 0 < len(functions) <= tmj.STREAM_CACHE_SIZE == 32
    assert sum(f._cache_size() for f in functions) <= tmj.STREAM_CACHE_SIZE


def test_an_eager_call_of_a_new_length_compiles_one_program():
    """Issue 63, item 4: an eager call of a new length compiled the layer call and, before
    it, an op of that length (the zero state sliced from x) that no bound dropped; now it
    compiles the one function the bounded cache holds, and a dropped one is cleared."""
    from jax import monitoring

    from tmcore.adapters.jax import functional as module

    tiny = tmj.init(jax.random.key(0), 2, 1, (2,), 2)
    tmj.apply(tiny, jax.device_put(np.ones((1, 2, 2), np.float32)))  # what any call compiles
    compiles = []

    def listen(event, *_, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        for tokens in range(3, 3 + tmj.STREAM_CACHE_SIZE + 4):
            x = jax.device_put(np.ones((1, tokens, 2), np.float32))
            before = len(compiles)
            first = list(module._COMPILED.values())[0] if module._COMPILED else None
            tmj.apply(tiny, x)
            assert len(compiles) - before == 1, tokens
            if first is not None and first not in module._COMPILED.values():
                assert first._cache_size() == 0  # the dropped one holds no program
    finally:
        monitoring.unregister_event_duration_listener(listen)


def test_layer_scan_checks_its_bytes_before_allocating(params, monkeypatch):
    """Issue 51, item 3: the JAX scan calls check_scan_bytes (steps, the backward's
    checkpoints) before it runs; a bound below what it needs refuses, naming h0."""
    from tmcore.adapters.jax import bridge
    from tmcore.runtime import options as runtime_options

    calls = []
    real = bridge.check_scan_bytes
    monkeypatch.setattr(bridge, "check_scan_bytes",
                        lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    tmj.apply(params, _x(tokens=12), stream=False)
    assert calls == [3]                       # T = 12 / L chunks, checked once
    # the real check with a bound the scan (not the layer's earlier gate) exceeds
    monkeypatch.setenv(runtime_options.MEMORY_LIMIT_ENV_VAR, "1KiB")
    with pytest.raises(MemoryError, match="h0"):
        real(jnp, bridge.LayerScan(*_scan_parts(params)).step,
             jnp.zeros((2, C, *SHAPE)), 3, 1, True, False)
    # a refusal stops the scan before it runs
    scans = []
    monkeypatch.setattr(bridge, "check_scan_bytes", _refuse)
    monkeypatch.setattr(bridge, "checkpoint_scan", lambda *a: scans.append(a))
    monkeypatch.delenv(runtime_options.MEMORY_LIMIT_ENV_VAR)
    with pytest.raises(MemoryError, match="h0: refused"):  # (a new shape: traced again)
        tmj.apply(params, _x(tokens=16, seed=3), stream=False)
    assert scans == []


def _refuse(*args, **kwargs):
    raise MemoryError("h0: refused")


def _scan_parts(params):
    from tmcore.adapters.jax import functional as module

    config = tl.LayerConfig(D, C, SHAPE, L)
    scan = module._layer_scan(config, tmj.conv_params(params["cell"]))
    return scan.step, scan.params, scan.checkpoint_every
