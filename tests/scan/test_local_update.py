"""Local updates (tmcore.scan.local): the window, the two paths, their VJPs, the local scan.

The kit properties (tmcore.testing.properties_local) check the definition, fast ==
masked and finite differences on drawn cases; here: the same on every installed
namespace with a few examples, plus fixed cases (n = 1..3), the fast path's work
confined to the box, the undo-log scan, in-place options, jit, and errors.
"""

from __future__ import annotations

import numpy as np
import pytest

import tmcore
from tmcore.ops import window as window_ops
from tmcore.scan import local as local
from tmcore.testing.finite_diff import central_difference_vjp
from tmcore.testing.kit import load_namespace, run_property
from tmcore.testing.properties_local import ref_local_update, ref_window_mask

LOCAL_PROPERTIES = ["local_update_matches_definition",
                    "local_update_vjp_matches_central_differences",
                    "local_scan_matches_reference", "local_scan_vjp_matches_central_differences",
                    "warped_layer_scan_matches_reference",
                    "local_memory_scan_in_every_dtype"]


def _namespace(name: str):
    if name == "jax.numpy":
        jax = pytest.importorskip("jax", reason="jax is not installed")
        jax.config.update("jax_enable_x64", True)
    elif name != "numpy":
        pytest.importorskip(name.partition(".")[0], reason=f"{name} is not installed")
    xp = load_namespace(name)
    if name == "array_api_strict":
        xp.set_array_api_strict_flags(api_version="2023.12")
    return xp


# examples per property and namespace. JAX compiles every op for every new shape
# eagerly (tens of seconds for one example here), so its run is marked slow
# (TMCORE_SLOW_TESTS=1); test_jax_under_jit_matches_eager checks JAX every time.
BUDGETS = {"numpy": 2, "array_api_strict": 2, "torch": 1, "jax.numpy": 1}


@pytest.mark.parametrize("namespace", [
    "numpy", "array_api_strict", "torch",
    pytest.param("jax.numpy", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", LOCAL_PROPERTIES)
def test_kit_properties_on_namespace(namespace, name):
    run_property(_namespace(namespace), name, max_examples=BUDGETS[namespace])


def _case(shape, batch=2, channels=2, steps=None, seed=0, inside=False):
    rng = np.random.default_rng(seed)
    n = len(shape)
    lead = (batch,) if steps is None else (batch, steps)
    span = 0.9 if inside else 1.2
    state = (batch, channels, *shape)
    return dict(
        h=rng.standard_normal(state) * 0.5, c=rng.standard_normal(state) * 0.5,
        read_coords=rng.uniform(-0.9, 0.9, (*lead, n)),
        write_coords=rng.uniform(-span, span, (*lead, n)),
        write_sigma=rng.uniform(0.2, 0.6, lead),
        write_content=rng.standard_normal((*lead, channels)),
        params=tmcore.ConvParams(rng.standard_normal((n, 2 * channels, 3)) * 0.6,
                                 rng.standard_normal((n, 2 * channels)) * 0.3,
                                 rng.standard_normal((4 * channels, 2 * channels)) * 0.5,
                                 rng.standard_normal(4 * channels) * 0.3),
        g_reads=rng.standard_normal((*lead, channels)),
        g_h=rng.standard_normal(state), g_c=rng.standard_normal(state))


def _step_args(case):
    return (case["h"], case["c"], case["write_coords"], case["write_sigma"],
            case["write_content"], case["params"])


def _scan_args(case):
    return (case["h"], case["c"], case["read_coords"], case["write_coords"],
            case["write_sigma"], case["write_content"], case["params"])


# ----------------------------------------------------------------------------- the window


def test_window_geometry_at_the_borders_and_inside():
    shape = (8, 5, 3)
    # coordinate order: component 0 -> last axis (3 cells), 2 -> first axis (8 cells)
    coords = np.asarray([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0],
                         [5.0, -7.0, 0.2]])
    g = window_ops.window_geometry(np, coords, shape, 4)
    assert g.size == (4, 4, 3) and g.box == (6, 5, 3)
    # axis 0 (8 cells, u = 3.5 at 0.0 rounds to 4 (half to even) -> 4 - 2 = 2)
    np.testing.assert_array_equal(g.start[:, 0], [0, 4, 2, 2])
    np.testing.assert_array_equal(g.box_start[:, 0], [0, 2, 1, 1])
    # axis 1 (5 cells): whole box, window 0 or 1; axis 2 (3 cells): the whole axis
    np.testing.assert_array_equal(g.start[:, 1], [0, 1, 0, 0])
    np.testing.assert_array_equal(g.start[:, 2], [0, 0, 0, 0])
    np.testing.assert_array_equal(g.box_start[:, 1:], 0)
    mask = window_ops.window_mask(np, g, shape)
    np.testing.assert_array_equal(mask, ref_window_mask(coords, shape, 4))
    assert mask.sum(axis=(1, 2, 3, 4)).tolist() == [48, 48, 48, 48]


def test_nan_write_coordinate_puts_the_window_at_zero():
    g = window_ops.window_geometry(np, np.asarray([[np.nan, 0.5]]), (6, 6), 2)
    assert g.start[0].tolist() == [3, 0]  # u = 3.75 -> 4 - 1 on axis 0; NaN -> 0 on axis 1


@pytest.mark.parametrize("shape", [(9,), (6, 7), (5, 4, 6)])
@pytest.mark.parametrize("method", window_ops.METHODS)
def test_matches_definition_and_keeps_outside_bit_for_bit(shape, method):
    for seed in range(3):
        case = _case(shape, seed=seed)
        want = ref_local_update(*_step_args(case)[:5], case["params"], 3)
        h_new, c_new = tmcore.local_update(*_step_args(case), window=3, method=method)
        np.testing.assert_allclose(h_new, want[0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(c_new, want[1], rtol=0, atol=1e-12)
        outside = ~np.broadcast_to(ref_window_mask(case["write_coords"], shape, 3),
                                   case["h"].shape)
        assert np.array_equal(h_new[outside], case["h"][outside])
        assert np.array_equal(c_new[outside], case["c"][outside])
        assert not np.array_equal(h_new, case["h"])  # the window did change


@pytest.mark.parametrize("shape", [(6,), (4, 5), (3, 4, 3)])
def test_window_covering_the_grid_is_the_dense_step(shape):
    case = _case(shape, seed=4)
    written = tmcore.gaussian_splat(case["write_content"][:, None], case["write_coords"][:, None],
                                    case["write_sigma"][:, None], shape)
    want = tmcore.convlstm_step(written, case["h"], case["c"], case["params"])
    for method in window_ops.METHODS:
        got = tmcore.local_update(*_step_args(case), window=max(shape), method=method)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_fast_path_works_on_the_box_only(monkeypatch):
    """On a 40^3 grid the ConvLSTM runs on (w + 2)^n cells and at most w^n cells change."""
    shape, window = (40, 40, 40), 4
    case = _case(shape, batch=1, channels=1, seed=5)
    seen = []
    real_cell_fwd = window_ops.cell_fwd

    def cell_fwd(xp, x, h, c, params):
        seen.append(tuple(h.shape))
        return real_cell_fwd(xp, x, h, c, params)

    monkeypatch.setattr(window_ops, "cell_fwd", cell_fwd)
    h_new, _ = tmcore.local_update(*_step_args(case), window=window)
    assert seen == [(1, 1, 6, 6, 6)]
    changed = np.argwhere(h_new != case["h"])
    assert 0 < len(changed) <= window**3
    seen.clear()
    tmcore.local_memory_scan(case["h"], case["c"], case["write_coords"][:, None],
                             case["write_coords"][:, None], case["write_sigma"][:, None],
                             case["write_content"][:, None], case["params"], window=window)
    assert seen == [(1, 1, 6, 6, 6)]


# ----------------------------------------------------------------------------- VJPs


def _smooth_write(case, shape):
    """Move write coordinates off half-integer voxel positions (the window's jumps)."""
    n = len(shape)
    coords = case["write_coords"]
    for k in range(n):
        size = shape[n - 1 - k]
        u = (np.clip(coords[..., k], -1, 1) + 1) / 2 * (size - 1)
        frac = u - np.floor(u)
        u = np.where(np.abs(frac - 0.5) < 0.1, np.floor(u) + 0.25, u)
        coords[..., k] = np.where(np.abs(coords[..., k]) > 1, coords[..., k],
                                  2 * u / (size - 1) - 1)
    return case


@pytest.mark.parametrize("shape", [(7,), (5, 4), (4, 3, 3)])
def test_step_vjp_matches_masked_and_central_differences(shape):
    case = _smooth_write(_case(shape, batch=2, channels=1, seed=6), shape)
    fast = tmcore.local_update_vjp(*_step_args(case), case["g_h"], case["g_c"], window=2)
    masked = tmcore.local_update_vjp(*_step_args(case), case["g_h"], case["g_c"], window=2,
                                     method="masked")
    flat_fast = [*fast[:5], *fast[5]]
    for a, b in zip(flat_fast, [*masked[:5], *masked[5]], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)

    def f(*a):
        return tmcore.local_update(*a[:5], tmcore.ConvParams(*a[5:]), window=2)

    args = [*_step_args(case)[:5], *case["params"]]
    fd = central_difference_vjp(f, args, (case["g_h"], case["g_c"]), range(len(args)))
    for got, want in zip(flat_fast, fd, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(6,), (4, 5), (3, 4, 3)])
def test_scan_vjp_matches_masked_and_central_differences(shape):
    case = _smooth_write(_case(shape, batch=1, channels=1, steps=2, seed=7), shape)
    fast = tmcore.local_memory_scan_vjp(*_scan_args(case), case["g_reads"], case["g_h"],
                                        case["g_c"], window=2)
    masked = tmcore.local_memory_scan_vjp(*_scan_args(case), case["g_reads"], case["g_h"],
                                          case["g_c"], window=2, method="masked")
    flat_fast = [*fast[:6], *fast[6]]
    for a, b in zip(flat_fast, [*masked[:6], *masked[6]], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)

    def f(*a):
        return tmcore.local_memory_scan(*a[:6], tmcore.ConvParams(*a[6:]), window=2)

    args = [*_scan_args(case)[:6], *case["params"]]
    fd = central_difference_vjp(f, args, (case["g_reads"], case["g_h"], case["g_c"]),
                                range(len(args)))
    for got, want in zip(flat_fast, fd, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_scan_without_final_cotangents_and_dense_scan_at_full_window():
    """g_h = g_c = None mean zero; with the window covering the grid the local scan is
    the dense memory_scan (forward and VJP)."""
    shape = (4, 3, 5)
    case = _case(shape, steps=3, seed=8)
    dense = tmcore.memory_scan(*_scan_args(case))
    dense_g = tmcore.memory_scan_vjp(*_scan_args(case), case["g_reads"])
    for method in window_ops.METHODS:
        out = tmcore.local_memory_scan(*_scan_args(case), window=5, method=method)
        for a, b in zip(out, dense, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
        grads = tmcore.local_memory_scan_vjp(*_scan_args(case), case["g_reads"], window=5,
                                             method=method)
        for a, b in zip([*grads[:6], *grads[6]], [*dense_g[:6], *dense_g[6]], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-11)


# ----------------------------------------------------------------------------- buffers


def test_inputs_are_not_modified_unless_asked():
    shape = (5, 6)
    case = _case(shape, steps=4, seed=9)
    saved = {k: np.array(v) for k, v in case.items() if isinstance(v, np.ndarray)}
    want = tmcore.local_memory_scan(*_scan_args(case), window=2)
    tmcore.local_update(*_step_args({**case, "write_coords": case["write_coords"][:, 0],
                                     "write_sigma": case["write_sigma"][:, 0],
                                     "write_content": case["write_content"][:, 0]}),
                        window=2)
    tmcore.local_memory_scan_vjp(*_scan_args(case), case["g_reads"], case["g_h"], case["g_c"],
                                 window=2)
    for k, v in saved.items():
        assert np.array_equal(case[k], v), f"{k} was modified"
    h0, c0 = np.array(case["h"]), np.array(case["c"])
    got = tmcore.local_memory_scan(h0, c0, *_scan_args(case)[2:], window=2, overwrite_state=True)
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(h0, want[1]) and np.array_equal(c0, want[2])  # updated in place
    with pytest.raises(TypeError, match="overwrite_state"):
        tmcore.local_memory_scan(*_scan_args(case), window=2, overwrite_state=1)


def test_torch_matches_numpy_and_keeps_inputs():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    shape = (4, 5, 3)
    case = _case(shape, steps=3, seed=10)
    want = tmcore.local_memory_scan_vjp(*_scan_args(case), case["g_reads"], case["g_h"],
                                        case["g_c"], window=3)
    t = {k: (torch.asarray(v) if isinstance(v, np.ndarray) else
             tmcore.ConvParams(*(torch.asarray(p) for p in v)) if k == "params" else v)
         for k, v in case.items()}
    h_before = t["h"].clone()
    got = tmcore.local_memory_scan_vjp(*_scan_args(t), t["g_reads"], t["g_h"], t["g_c"],
                                       window=3)
    assert torch.equal(t["h"], h_before)
    for a, b in zip([*got[:6], *got[6]], [*want[:6], *want[6]], strict=True):
        np.testing.assert_allclose(a.numpy(), b, rtol=0, atol=1e-12)


def test_jax_under_jit_matches_eager():
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import jax.numpy as jnp

    with jax.enable_x64(True):
        shape = (5,)
        case = _case(shape, batch=1, channels=1, steps=2, seed=11)
        args = [jnp.asarray(a) for a in _scan_args(case)[:6]]
        params = tmcore.ConvParams(*(jnp.asarray(p) for p in case["params"]))

        def run(*a):
            return tmcore.local_memory_scan(*a, params, window=2)

        def grads(*a):
            return tmcore.local_memory_scan_vjp(*a, params, jnp.asarray(case["g_reads"]),
                                                window=2)

        for eager, jitted in ((run(*args), jax.jit(run)(*args)),
                              (grads(*args), jax.jit(grads)(*args))):
            for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted),
                            strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-12)
        want = tmcore.local_memory_scan(*_scan_args(case), window=2)
        for a, b in zip(run(*args), want, strict=True):
            np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    case = _case((4, 5), seed=12)
    args = _step_args(case)
    with pytest.raises(ValueError, match="window"):
        tmcore.local_update(*args, window=0)
    with pytest.raises(TypeError, match="window"):
        tmcore.local_update(*args, window=2.0)
    with pytest.raises(ValueError, match="method"):
        tmcore.local_update(*args, window=2, method="sparse")
    with pytest.raises(ValueError, match="write_coords"):
        tmcore.local_update(args[0], args[1], args[2][:, :1], *args[3:], window=2)
    with pytest.raises(ValueError, match="write_content"):
        tmcore.local_update(*args[:4], args[4][:, :1], args[5], window=2)
    with pytest.raises(ValueError, match="g_h"):
        tmcore.local_update_vjp(*args, case["g_h"][:, :1], case["g_c"], window=2)
    with pytest.raises(TypeError, match="g_c"):
        tmcore.local_update_vjp(*args, case["g_h"], None, window=2)
    scan = _case((4, 5), steps=2, seed=12)
    with pytest.raises(ValueError, match="write_sigma"):
        tmcore.local_memory_scan(*_scan_args(scan)[:4], scan["write_sigma"][:, :1],
                                 *_scan_args(scan)[5:], window=2)
    with pytest.raises(ValueError, match="method"):
        tmcore.local_memory_scan(*_scan_args(scan), window=2, method="dense")



def test_benchmark_measures_and_renders_a_tiny_grid():
    """benchmarks/local_update.py at a tiny size, in this process (no timing asserted)."""
    pytest.importorskip("torch", reason="the benchmark needs torch")
    from benchmarks import local_update as bench

    rows = []
    for grid in (4, 6):
        for method in bench.METHODS:
            row = bench.measure(method, grid, batch=1, channels=2, window=2, min_seconds=0.01)
            assert row["ms_min"] > 0 and row["reps"] >= 3
            rows.append({"method": method, "grid": grid, **row})
    text = bench.table({"config": {"grids": [4, 6]}, "rows": rows})
    assert "| dense / local |" in text and "6^3 / 4^3" in text and "MiB" in text
