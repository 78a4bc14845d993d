"""Warped dynamics (tmcore.ops.warp): resampling the state at displaced cell centres.

Fixed cases on n = 1..3: zero displacement is the identity bit for bit; a whole-cell
shift is a roll with border clamping; values and VJPs equal tmcore.trilinear_sample at
the displaced centres; finite differences in float64; the shift path equals the flow
path with a zero flow. Plus the kit properties on every installed namespace, and errors.
"""

from __future__ import annotations

import numpy as np
import pytest

import tmcore
from tmcore.testing.finite_diff import central_difference_vjp
from tmcore.testing.kit import load_namespace, run_property

WARP_PROPERTIES = ["warp_matches_sampling", "warp_vjp_matches_sampling_and_central_differences"]
SHAPES = [(6,), (4, 5), (3, 4, 3)]


def _namespace(name: str):
    if name == "jax.numpy":
        jax = pytest.importorskip("jax", reason="jax is not installed")
        jax.config.update("jax_enable_x64", True)
    elif name != "numpy":
        pytest.importorskip(name, reason=f"{name} is not installed")
    xp = load_namespace(name)
    if name == "array_api_strict":
        xp.set_array_api_strict_flags(api_version="2023.12")
    return xp


# JAX compiles every op for every new shape eagerly (seconds per example): one example
BUDGETS = {"numpy": 3, "array_api_strict": 3, "torch": 2, "jax.numpy": 1}


@pytest.mark.parametrize("namespace", list(BUDGETS))
@pytest.mark.parametrize("name", WARP_PROPERTIES)
def test_kit_properties_on_namespace(namespace, name):
    run_property(_namespace(namespace), name, max_examples=BUDGETS[namespace])


def _state(shape, batch=2, channels=2, seed=0):
    rng = np.random.default_rng(seed)
    full = (batch, channels, *shape)
    return rng, rng.standard_normal(full), rng.standard_normal(full)


def _centres(shape):
    n = len(shape)
    grids = np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij")
    return np.stack([grids[n - 1 - k] for k in range(n)], axis=0)  # (n, *S), coordinate order


def _sampled(volume, shift, flow):
    """tmcore.trilinear_sample of ``volume`` at every centre plus its displacement."""
    batch, n = shift.shape
    shape = volume.shape[2:]
    disp = shift.reshape(batch, n, *([1] * n)) + (0.0 if flow is None else flow)
    queries = np.moveaxis((_centres(shape)[None] + disp).reshape(batch, n, -1), 1, 2)
    return queries, np.moveaxis(tmcore.trilinear_sample(volume, queries), 1, 2).reshape(
        volume.shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("namespace", ["numpy", "array_api_strict", "torch"])
def test_zero_displacement_is_the_identity_bit_for_bit(shape, namespace):
    xp = _namespace(namespace)
    _, h, c = _state(shape, seed=1)
    n = len(shape)
    for flow in (None, np.zeros((2, n, *shape))):
        got = tmcore.warp_state(xp.asarray(h), xp.asarray(c), xp.asarray(np.zeros((2, n))),
                                None if flow is None else xp.asarray(flow))
        assert np.array_equal(np.asarray(got[0]), h) and np.array_equal(np.asarray(got[1]), c)


@pytest.mark.parametrize("shape", SHAPES)
def test_whole_cell_shift_is_a_roll_with_border_clamping(shape):
    _, h, c = _state(shape, seed=2)
    n = len(shape)
    cells = np.asarray([[1, -2, 3][:n], [-1, 0, 2][:n]])  # per coordinate component
    half = np.asarray([(shape[n - 1 - k] - 1) / 2 for k in range(n)])
    for flow in (None, np.zeros((2, n, *shape))):
        h_w, _ = tmcore.warp_state(h, c, cells / half, flow)
        for b in range(2):
            want = h[b]
            for axis in range(n):
                index = np.clip(np.arange(shape[axis]) + cells[b, n - 1 - axis], 0,
                                shape[axis] - 1)
                want = np.take(want, index, axis=axis + 1)
            np.testing.assert_allclose(h_w[b], want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_flow", [False, True])
def test_equals_trilinear_sample_at_displaced_centres(shape, with_flow):
    rng, h, c = _state(shape, seed=3)
    n = len(shape)
    shift = rng.uniform(-0.7, 0.7, (2, n))
    flow = rng.uniform(-0.4, 0.4, (2, n, *shape)) if with_flow else None
    g_h, g_c = rng.standard_normal(h.shape), rng.standard_normal(h.shape)
    volume = np.concatenate([h, c], axis=1)
    queries, want = _sampled(volume, shift, flow)
    h_w, c_w = tmcore.warp_state(h, c, shift, flow)
    np.testing.assert_allclose(np.concatenate([h_w, c_w], 1), want, rtol=0, atol=1e-13)
    g = np.concatenate([g_h, g_c], axis=1)
    d_volume, d_queries = tmcore.trilinear_sample_vjp(
        volume, queries, np.moveaxis(g.reshape(2, 4, -1), 1, 2))
    d_h, d_c, d_shift, d_flow = tmcore.warp_state_vjp(h, c, shift, flow, g_h, g_c)
    np.testing.assert_allclose(np.concatenate([d_h, d_c], 1), d_volume, rtol=0, atol=1e-12)
    per_cell = np.moveaxis(d_queries, 1, 2).reshape(2, n, *shape)
    np.testing.assert_allclose(d_shift, per_cell.reshape(2, n, -1).sum(-1), rtol=0, atol=1e-12)
    if with_flow:
        np.testing.assert_allclose(d_flow, per_cell, rtol=0, atol=1e-12)
    else:
        assert d_flow is None


@pytest.mark.parametrize("shape", SHAPES)
def test_shift_path_equals_flow_path_with_zero_flow(shape):
    rng, h, c = _state(shape, seed=4)
    n = len(shape)
    shift = rng.uniform(-1.3, 1.3, (2, n))
    g_h, g_c = rng.standard_normal(h.shape), rng.standard_normal(h.shape)
    a = tmcore.warp_state_vjp(h, c, shift, None, g_h, g_c)
    b = tmcore.warp_state_vjp(h, c, shift, np.zeros((2, n, *shape)), g_h, g_c)
    for x, y in zip(a[:3], b[:3], strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)
    for x, y in zip(tmcore.warp_state(h, c, shift), tmcore.warp_state(h, c, shift, b[3] * 0),
                    strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-13)


def _off_kinks(shape, batch, rng, with_flow):
    """Displacements whose every position is >= 0.1 cells from a centre or border."""
    n = len(shape)
    half = np.asarray([(shape[n - 1 - k] - 1) / 2 for k in range(n)])
    shift_cells = rng.integers(-1, 2, (batch, n)) + rng.uniform(0.1, 0.9, (batch, n))
    if not with_flow:
        return shift_cells / half, None
    view = (1, n, *([1] * n))
    total = rng.integers(-1, 2, (batch, n, *shape)) + rng.uniform(0.1, 0.9, (batch, n, *shape))
    return shift_cells / half, (total - shift_cells.reshape(batch, n, *([1] * n))) \
        / half.reshape(view)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_flow", [False, True])
def test_vjp_matches_central_differences(shape, with_flow):
    rng, h, c = _state(shape, batch=1, channels=1, seed=5)
    shift, flow = _off_kinks(shape, 1, rng, with_flow)
    g_h, g_c = rng.standard_normal(h.shape), rng.standard_normal(h.shape)
    grads = tmcore.warp_state_vjp(h, c, shift, flow, g_h, g_c)
    args = [h, c, shift] + ([flow] if with_flow else [])
    fd = central_difference_vjp(lambda *a: tmcore.warp_state(*a), args, (g_h, g_c),
                                range(len(args)))
    for got, want in zip(grads[:len(fd)], fd, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-8)
    assert np.any(grads[2] != 0)  # the displacement gradient is not trivially zero


def test_large_and_non_finite_displacements_read_the_border():
    _, h, c = _state((5, 4), seed=6)
    far = tmcore.warp_state(h, c, np.asarray([[1e30, -np.inf], [np.inf, 3.0]]))[0]
    np.testing.assert_array_equal(far[0], np.broadcast_to(h[0, :, :1, -1:], (2, 5, 4)))
    np.testing.assert_array_equal(far[1], np.broadcast_to(h[1, :, -1:, -1:], (2, 5, 4)))
    d = tmcore.warp_state_vjp(h, c, np.asarray([[1e30, -np.inf], [np.inf, 3.0]]), None, h, c)
    np.testing.assert_array_equal(d[2], 0.0)
    nan = tmcore.warp_state(h, c, np.asarray([[np.nan, 0.0], [0.0, 0.0]]))[0]
    assert np.all(np.isnan(nan[0])) and np.array_equal(nan[1], h[1])


def test_errors_name_the_argument():
    _, h, c = _state((4, 5), seed=7)
    with pytest.raises(ValueError, match="shift"):
        tmcore.warp_state(h, c, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="shift"):
        tmcore.warp_state(h, c, np.zeros((1, 2)))
    with pytest.raises(ValueError, match="flow"):
        tmcore.warp_state(h, c, np.zeros((2, 2)), np.zeros((2, 2, 4, 4)))
    with pytest.raises(ValueError, match="c"):
        tmcore.warp_state(h, c[:, :1], np.zeros((2, 2)))
    with pytest.raises(ValueError, match="g_c"):
        tmcore.warp_state_vjp(h, c, np.zeros((2, 2)), None, h, c[:1])
    with pytest.raises(TypeError, match="g_h"):
        tmcore.warp_state_vjp(h, c, np.zeros((2, 2)), None, None, c)
    with pytest.raises(TypeError, match="shift"):
        tmcore.warp_state(h, c, [[0.0, 0.0], [0.0, 0.0]])


def test_jax_under_jit_matches_numpy():
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import jax.numpy as jnp

    with jax.enable_x64(True):
        rng, h, c = _state((4, 3), batch=1, channels=1, seed=8)
        shift = rng.uniform(-0.5, 0.5, (1, 2))
        flow = rng.uniform(-0.3, 0.3, (1, 2, 4, 3))
        for fl in (None, flow):
            want = tmcore.warp_state_vjp(h, c, shift, fl, h, c)

            def run(h_, c_, s_, f_):
                return tmcore.warp_state_vjp(h_, c_, s_, f_, h_, c_)

            args = [jnp.asarray(a) for a in (h, c, shift)] + [None if fl is None
                                                              else jnp.asarray(fl)]
            got = jax.jit(run)(*args)
            for a, b in zip(got, want, strict=True):
                if b is None:
                    assert a is None
                else:
                    np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-12)


# -- the flow VJP's scatter-add fast path (torch, JAX) against the generic tile contraction --

FAST_SHAPES = [(7,), (5, 3), (3, 5, 3)]  # odd sizes, n = 1..3


def _fast_namespace(name: str):
    """``(xp, asarray, context)``: the namespace with a scatter-add, float64 on JAX."""
    import contextlib

    if name == "torch":
        torch = pytest.importorskip("torch", reason="torch is not installed")
        import array_api_compat.torch as xp

        return xp, lambda a: torch.asarray(a, dtype=torch.float64), contextlib.nullcontext()
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import jax.numpy as jnp

    if not hasattr(jax, "enable_x64"):
        pytest.skip("this jax has no enable_x64 context (float64 needed for the 1e-12 check)")
    return jnp, lambda a: jnp.asarray(a, dtype=jnp.float64), jax.enable_x64(True)


def _flow_case(shape, seed, channels=3):
    """B = 2, ``(B, channels, *S)``; shift + flow reach past the border (and past +-2,
    clipped)."""
    rng = np.random.default_rng(seed)
    n = len(shape)
    volume = rng.standard_normal((2, channels, *shape))
    shift = rng.uniform(-0.8, 0.8, (2, n))
    flow = rng.uniform(-2.5, 2.5, (2, n, *shape))
    return volume, shift, flow, rng.standard_normal(volume.shape)


@pytest.mark.parametrize("shape", FAST_SHAPES)
@pytest.mark.parametrize("namespace", ["torch", "jax"])
def test_flow_scatter_equals_the_generic_tile_contraction(shape, namespace):
    from tmcore.ops import warp as warp
    from tmcore.runtime.dispatch import ops_for

    xp, asarray, x64 = _fast_namespace(namespace)
    volume, shift, flow, g = _flow_case(shape, seed=9 + len(shape))
    with x64:
        volume, shift, flow, g = (asarray(a) for a in (volume, shift, flow, g))
        _, residuals = warp.warp_fwd(xp, volume, shift, flow)
        slopes = [np.asarray(slope) for _, _, slope in residuals.axes]
        # some positions clamp at a border (zero slope there), some do not
        assert any(np.any(s == 0) for s in slopes) and any(np.any(s != 0) for s in slopes)
        scatter_add = ops_for(xp).scatter_add
        assert scatter_add is not None
        corners = list(warp._corner_indices(xp, volume, residuals.axes))
        fast = warp._flow_volume_scatter(xp, residuals, g, corners, scatter_add)
        generic = warp._flow_volume_grad(xp, residuals, g)
        assert fast.dtype == generic.dtype == volume.dtype
        np.testing.assert_allclose(np.asarray(fast), np.asarray(generic), rtol=0, atol=1e-12)
        assert np.max(np.abs(np.asarray(generic))) > 0.1  # not trivially zero
        # the public VJP: default dispatch vs the generic table, every output
        d_fast = warp.warp_bwd(xp, residuals, g)
        with tmcore.options(generic=True):
            d_generic = warp.warp_bwd(xp, residuals, g)
        for a, b in zip(d_fast, d_generic, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-12)


class _Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("namespace", ["torch", "jax", "numpy"])
def test_default_dispatch_takes_the_scatter_path_where_there_is_one(namespace, monkeypatch):
    from tmcore.ops import warp as warp

    if namespace == "numpy":
        import contextlib

        xp_name, asarray, x64 = "numpy", np.asarray, contextlib.nullcontext()
    else:
        _, asarray, x64 = _fast_namespace(namespace)
        xp_name = namespace
    scatter = _Counter(warp._flow_volume_scatter)
    tiles = _Counter(warp._flow_volume_grad)
    monkeypatch.setattr(warp, "_flow_volume_scatter", scatter)
    monkeypatch.setattr(warp, "_flow_volume_grad", tiles)
    volume, shift, flow, g = _flow_case((3, 4), seed=20, channels=6)  # h, c: C = 3
    with x64:
        h, c, shift, flow, g_h, g_c = (asarray(a) for a in (
            volume[:, :3], volume[:, 3:], shift, flow, g[:, :3], g[:, 3:]))
        want = "tiles" if xp_name == "numpy" else "scatter"
        tmcore.warp_state_vjp(h, c, shift, flow, g_h, g_c)
        assert (scatter.calls, tiles.calls) == ((1, 0) if want == "scatter" else (0, 1))
        tmcore.warp_state_vjp(h, c, shift, None, g_h, g_c)  # no flow: neither
        assert scatter.calls + tiles.calls == 1
        with tmcore.options(generic=True):
            tmcore.warp_state_vjp(h, c, shift, flow, g_h, g_c)
        assert tiles.calls == (1 if want == "scatter" else 2)


@pytest.mark.parametrize("namespace", ["torch", "jax"])
def test_flow_scatter_makes_a_nan_displacement_nan_like_the_generic_path(namespace):
    xp, asarray, x64 = _fast_namespace(namespace)
    volume, shift, flow, g = _flow_case((4, 3), seed=21, channels=6)
    flow[0, 1, 2, 1] = np.nan
    with x64:
        args = [asarray(a) for a in (volume[:, :3], volume[:, 3:], shift, flow, g[:, :3],
                                     g[:, 3:])]
        fast = tmcore.warp_state_vjp(*args)
        with tmcore.options(generic=True):
            generic = tmcore.warp_state_vjp(*args)
    for a, b in zip(fast, generic, strict=True):
        np.testing.assert_array_equal(np.isnan(np.asarray(a)), np.isnan(np.asarray(b)))
    assert np.all(np.isnan(np.asarray(fast[0])[0])) and not np.any(np.isnan(np.asarray(fast[0])[1]))
