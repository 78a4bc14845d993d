"""Properties of the local update (:mod:`tmcore.scan.local`) and the warp (:mod:`tmcore.ops.warp`).

Registered into :data:`tmcore.testing.properties.PROPERTIES` on import (the kit imports
this module), so :func:`tmcore.testing.check_namespace` and the pytest plugin run them
on every namespace like the others:

- the local step equals its definition, computed here from the float64 references
  (dense splat cut to the window, dense ConvLSTM step, ``where(window, new, old)``), and
  keeps every cell outside the window bit for bit; the fast path equals the masked one
  in values and VJPs; the VJP equals central differences;
- the local scan equals a reference loop of reads and local steps, fast equals masked
  (values and VJPs), and the VJP equals central differences;
- the warp equals n-linear sampling at the displaced centres (the reference sampler),
  a zero displacement returns the state bit for bit, an integer shift of a whole number
  of cells is a roll with border clamping, and its VJP equals the reference sampler's
  VJP and central differences away from kinks;
- the layer's warped scan (:mod:`tmcore.scan.warped`, dense and local updates) equals a
  reference loop of reads, reference warps and steps; its local fast VJP equals the
  masked one.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

import tmcore
from tmcore.testing.finite_diff import central_difference_vjp
from tmcore.testing.properties import (
    FD_FLOOR,
    FD_TOL,
    FWD_TOL,
    PARAM_NAMES,
    VJP_TOL,
    _assert_namespace,
    _asx,
    _params_x,
    _property,
)
from tmcore.testing.reference import (
    ref_convlstm_step,
    ref_gaussian_splat,
    ref_trilinear_sample,
    ref_trilinear_sample_vjp,
)
from tmcore.testing.strategies import (
    _conv_params,
    assert_rel,
    coords_array,
    fd_step_for_sigma,
    grid_shapes,
    log_uniform_sigma,
    radii,
    seeds,
    smooth_coords_array,
    splat_margin_ok,
    to_numpy,
)

__all__ = ["local_cases", "warp_cases", "ref_window_mask", "ref_local_update",
           "ref_local_scan", "ref_warped_scan"]

METHODS = ("fast", "masked")
STEP_GRADS = ("d_h", "d_c", "d_write_coords", "d_write_sigma", "d_write_content",
              *(f"d_params.{p}" for p in PARAM_NAMES))
SCAN_GRADS = ("d_h0", "d_c0", "d_read_coords", "d_write_coords", "d_write_sigma",
              "d_write_content", *(f"d_params.{p}" for p in PARAM_NAMES))
_SCAN_KEYS = ("h0", "c0", "read_coords", "write_coords", "write_sigma", "write_content")


# ----------------------------------------------------------------------------- references


def ref_window_mask(coords: np.ndarray, shape: tuple[int, ...], window: int) -> np.ndarray:
    """``(B, 1, *S)`` bool: the window of writes at ``coords (B, n)`` (loops)."""
    n = len(shape)
    batch = coords.shape[0]
    mask = np.zeros((batch, 1, *shape), dtype=bool)
    for b in range(batch):
        ranges = []
        for a, size in enumerate(shape):
            w = min(window, size)
            u = (float(coords[b, n - 1 - a]) + 1.0) / 2.0 * (size - 1)
            u = 0.0 if math.isnan(u) else min(max(u, 0.0), size - 1.0)
            start = int(min(max(np.round(u) - w // 2, 0), size - w))
            ranges.append(range(start, start + w))
        for idx in np.ndindex(*shape):
            if all(i in r for i, r in zip(idx, ranges, strict=True)):
                mask[(b, 0, *idx)] = True
    return mask


def ref_local_update(h, c, write_coords, write_sigma, write_content, params, window,
                     radius=None, eps=1e-6):
    """The definition from the dense float64 references: ``(h', c')``."""
    shape = tuple(h.shape[2:])
    mask = ref_window_mask(write_coords, shape, window)
    x = ref_gaussian_splat(write_content[:, None, :], write_coords[:, None, :],
                           write_sigma[:, None], shape, eps=eps, radius=radius) * mask
    h_new, c_new = ref_convlstm_step(x, h, c, *params)
    return np.where(mask, h_new, h), np.where(mask, c_new, c)


def ref_local_scan(h0, c0, read_coords, write_coords, write_sigma, write_content, params,
                   window, radius=None, eps=1e-6):
    """Reads (reference sampler) and :func:`ref_local_update` steps: ``(reads, h_T, c_T)``."""
    h, c = np.array(h0, dtype=np.float64), np.array(c0, dtype=np.float64)
    reads = []
    for t in range(read_coords.shape[1]):
        reads.append(ref_trilinear_sample(h, read_coords[:, t : t + 1])[:, 0])
        h, c = ref_local_update(h, c, write_coords[:, t], write_sigma[:, t],
                                write_content[:, t], params, window, radius, eps)
    return np.stack(reads, axis=1), h, c


def _grid_centres(shape: tuple[int, ...]) -> np.ndarray:
    """``(n, *S)`` normalized cell centres in coordinate order."""
    n = len(shape)
    grids = np.meshgrid(*[np.linspace(-1.0, 1.0, s) for s in shape], indexing="ij")
    return np.stack([grids[n - 1 - k] for k in range(n)], axis=0)


def _displaced_queries(shape, shift, flow) -> np.ndarray:
    """``(B, P, n)``: every cell centre plus its displacement, as sampler queries."""
    batch, n = shift.shape
    disp = shift.reshape(batch, n, *([1] * n)) + (0.0 if flow is None else flow)
    q = _grid_centres(shape)[None] + disp
    return np.moveaxis(q.reshape(batch, n, -1), 1, 2)


# ----------------------------------------------------------------------------- strategies


@st.composite
def _smooth_write_coordinate(draw, size: int) -> float:
    """A write coordinate away from the window's jumps (half-integer voxel positions)."""
    if size == 1:
        return draw(st.floats(-1.5, 1.5))
    frac = draw(st.one_of(st.floats(0.05, 0.45), st.floats(0.55, 0.95)))
    u = draw(st.integers(0, size - 2)) + frac
    outside = st.tuples(st.sampled_from([-1.0, 1.0]), st.floats(1.001, 1.5)).map(
        lambda t: t[0] * t[1])
    return draw(st.one_of(st.just(2.0 * u / (size - 1) - 1.0), outside))


@st.composite
def _write_coords(draw, batch: int, steps: int, shape: tuple[int, ...], smooth: bool):
    n = len(shape)
    if not smooth:
        return draw(coords_array(batch, steps, shape))
    values = [[[draw(_smooth_write_coordinate(shape[n - 1 - k])) for k in range(n)]
               for _ in range(steps)] for _ in range(batch)]
    return np.asarray(values, dtype=np.float64).reshape(batch, steps, n)


@st.composite
def local_cases(draw, steps: int | None = None, smooth: bool = False, max_ndim: int = 3,
                max_cells: int = 24, max_channels: int = 2) -> dict:
    """A local step (``steps=None``: arrays without a T axis) or scan of ``1..steps`` steps."""
    shape = draw(grid_shapes(max_ndim=max_ndim, max_cells=max_cells))
    batch, channels = draw(st.integers(1, 2)), draw(st.integers(1, max_channels))
    count = 1 if steps is None else draw(st.integers(1, steps))
    rng = np.random.default_rng(draw(seeds))
    write_coords = draw(_write_coords(batch, count, shape, smooth))
    sigma = np.asarray(draw(st.lists(log_uniform_sigma, min_size=batch * count,
                                     max_size=batch * count))).reshape(batch, count)
    if smooth:
        sigma = np.maximum(sigma, 0.05)  # keeps the central differences well conditioned
    radius = draw(radii)
    if smooth:
        assume(splat_margin_ok(shape, write_coords, sigma, radius))
    state = (batch, channels, *shape)
    make = smooth_coords_array if smooth else coords_array
    case = dict(
        shape=shape, window=draw(st.integers(1, 4)), radius=radius,
        h0=rng.standard_normal(state) * 0.5, c0=rng.standard_normal(state) * 0.5,
        read_coords=draw(make(batch, count, shape)), write_coords=write_coords,
        write_sigma=sigma, write_content=rng.standard_normal((batch, count, channels)),
        params=_conv_params(rng, len(shape), 2 * channels, 4 * channels),
        g_reads=rng.standard_normal((batch, count, channels)),
        g_h=rng.standard_normal(state), g_c=rng.standard_normal(state),
    )
    if steps is None:
        for key in ("read_coords", "write_coords", "write_sigma", "write_content", "g_reads"):
            case[key] = case[key][:, 0, ...]
    return case


@st.composite
def warp_cases(draw, smooth: bool = False, max_ndim: int = 3, max_cells: int = 24) -> dict:
    """A warp: state, shift (zero, whole cells, or any), optional flow, cotangents.

    ``smooth``: every displaced position at least 0.05 cells from a cell centre or border,
    where the sampler is differentiable.
    """
    shape = draw(grid_shapes(max_ndim=max_ndim, max_cells=max_cells))
    n = len(shape)
    batch, channels = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(seeds))
    half = np.asarray([(shape[n - 1 - k] - 1) / 2.0 for k in range(n)])  # per component
    scale = np.where(half > 0, 1.0 / np.maximum(half, 1e-300), 0.0)  # voxel -> normalized
    use_flow = draw(st.booleans())
    if smooth:
        shift_vox = rng.integers(-2, 3, (batch, n)) + rng.uniform(0.05, 0.95, (batch, n))
        shift = shift_vox * scale
        flow = None
        if use_flow:
            total = (rng.integers(-2, 3, (batch, n, *shape))
                     + rng.uniform(0.05, 0.95, (batch, n, *shape)))
            flow = (total - shift_vox.reshape(batch, n, *([1] * n))) \
                * scale.reshape(1, n, *([1] * n))
    else:
        kind = draw(st.sampled_from(["zero", "cells", "any"]))
        if kind == "zero":
            shift = np.zeros((batch, n))
        elif kind == "cells":
            shift = rng.integers(-3, 4, (batch, n)) * scale
        else:
            shift = rng.uniform(-1.5, 1.5, (batch, n))
        flow = (rng.uniform(-0.6, 0.6, (batch, n, *shape)) if kind == "any" else
                np.zeros((batch, n, *shape))) if use_flow else None
    state = (batch, channels, *shape)
    return dict(h=rng.standard_normal(state), c=rng.standard_normal(state), shift=shift,
                flow=flow, g_h=rng.standard_normal(state), g_c=rng.standard_normal(state))


# ----------------------------------------------------------------------------- helpers


def _step_args(xp: ModuleType, case: dict, h_key: str = "h0", c_key: str = "c0") -> list[Any]:
    return [_asx(xp, case[k]) for k in (h_key, c_key, "write_coords", "write_sigma",
                                        "write_content")]


def _step_vjp(xp: ModuleType, case: dict, method: str) -> list[Any]:
    *grads, d_params = tmcore.local_update_vjp(
        *_step_args(xp, case), _params_x(xp, case["params"]), _asx(xp, case["g_h"]),
        _asx(xp, case["g_c"]), window=case["window"], radius=case["radius"], method=method)
    _assert_namespace(xp, *grads, *d_params)
    return [*grads, *d_params]


def _scan_vjp(xp: ModuleType, case: dict, method: str) -> list[Any]:
    grads = tmcore.local_memory_scan_vjp(
        *(_asx(xp, case[k]) for k in _SCAN_KEYS), _params_x(xp, case["params"]),
        _asx(xp, case["g_reads"]), _asx(xp, case["g_h"]), _asx(xp, case["g_c"]),
        window=case["window"], radius=case["radius"], method=method)
    *state_grads, d_params = grads
    _assert_namespace(xp, *state_grads, *d_params)
    return [*state_grads, *d_params]


def _assert_outside_kept(got: Any, before: np.ndarray, mask: np.ndarray, what: str) -> None:
    got = to_numpy(got)
    outside = np.broadcast_to(~mask, before.shape)
    assert np.array_equal(got[outside], before[outside]), \
        f"{what}: a cell outside the window changed"


# ----------------------------------------------------------------------------- local step


@_property(15, local_cases(max_ndim=4))
def local_update_matches_definition(xp: ModuleType, case: dict) -> None:
    """Both paths equal the definition and keep every cell outside the window exactly."""
    want = ref_local_update(case["h0"], case["c0"], case["write_coords"], case["write_sigma"],
                            case["write_content"], case["params"], case["window"],
                            case["radius"])
    mask = ref_window_mask(case["write_coords"], case["shape"], case["window"])
    outputs = {}
    for method in METHODS:
        h_new, c_new = tmcore.local_update(*_step_args(xp, case), _params_x(xp, case["params"]),
                                           window=case["window"], radius=case["radius"],
                                           method=method)
        _assert_namespace(xp, h_new, c_new)
        for name, got, ref, before in (("h'", h_new, want[0], case["h0"]),
                                       ("c'", c_new, want[1], case["c0"])):
            assert_rel(got, ref, FWD_TOL, f"{name} ({method})")
            _assert_outside_kept(got, before, mask, f"{name} ({method})")
        outputs[method] = (h_new, c_new)
    for got, want_masked in zip(outputs["fast"], outputs["masked"], strict=True):
        assert_rel(got, to_numpy(want_masked), 1e-12, "fast vs masked")
    fast, masked = _step_vjp(xp, case, "fast"), _step_vjp(xp, case, "masked")
    for name, got, want_masked in zip(STEP_GRADS, fast, masked, strict=True):
        assert_rel(got, to_numpy(want_masked), VJP_TOL, f"{name} (fast vs masked)")


@_property(6, local_cases(smooth=True, max_cells=10))
def local_update_vjp_matches_central_differences(xp: ModuleType, case: dict) -> None:
    args = [case[k] for k in ("h0", "c0", "write_coords", "write_sigma", "write_content")]

    def f(*a):
        return tmcore.local_update(*a[:5], tmcore.ConvParams(*a[5:]), window=case["window"],
                                   radius=case["radius"])

    grads = _step_vjp(xp, case, "fast")
    fd = central_difference_vjp(f, [*args, *case["params"]], (case["g_h"], case["g_c"]),
                                range(9), step=fd_step_for_sigma(case["write_sigma"]))
    for name, got, want in zip(STEP_GRADS, grads, fd, strict=True):
        assert_rel(got, want, FD_TOL, f"{name} vs FD", floor=FD_FLOOR)


# ----------------------------------------------------------------------------- local scan


@_property(10, local_cases(steps=4, max_cells=16))
def local_scan_matches_reference(xp: ModuleType, case: dict) -> None:
    want = ref_local_scan(*(case[k] for k in _SCAN_KEYS), case["params"], case["window"],
                          case["radius"])
    results = {}
    for method in METHODS:
        out = tmcore.local_memory_scan(*(_asx(xp, case[k]) for k in _SCAN_KEYS),
                                       _params_x(xp, case["params"]), window=case["window"],
                                       radius=case["radius"], method=method)
        _assert_namespace(xp, *out)
        for name, got, ref in zip(("reads", "h_T", "c_T"), out, want, strict=True):
            assert_rel(got, ref, FWD_TOL, f"{name} ({method})")
        results[method] = _scan_vjp(xp, case, method)
    for name, got, masked in zip(SCAN_GRADS, results["fast"], results["masked"], strict=True):
        assert_rel(got, to_numpy(masked), VJP_TOL, f"{name} (fast vs masked)")


@_property(4, local_cases(steps=3, smooth=True, max_cells=6))
def local_scan_vjp_matches_central_differences(xp: ModuleType, case: dict) -> None:
    n_in = len(_SCAN_KEYS)

    def f(*a):
        return tmcore.local_memory_scan(*a[:n_in], tmcore.ConvParams(*a[n_in:]),
                                        window=case["window"], radius=case["radius"])

    grads = _scan_vjp(xp, case, "fast")
    args = [*(case[k] for k in _SCAN_KEYS), *case["params"]]
    fd = central_difference_vjp(f, args, (case["g_reads"], case["g_h"], case["g_c"]),
                                range(len(args)), step=fd_step_for_sigma(case["write_sigma"]))
    for name, got, want in zip(SCAN_GRADS, grads, fd, strict=True):
        assert_rel(got, want, FD_TOL, f"{name} vs FD", floor=FD_FLOOR)


# ----------------------------------------------------------------------------- warp


def _warp_args(xp: ModuleType, case: dict) -> list[Any]:
    flow = None if case["flow"] is None else _asx(xp, case["flow"])
    return [_asx(xp, case["h"]), _asx(xp, case["c"]), _asx(xp, case["shift"]), flow]


@_property(20, warp_cases())
def warp_matches_sampling(xp: ModuleType, case: dict) -> None:
    """Values equal the reference sampler at the displaced centres; a zero displacement is
    the identity and a whole-cell shift a border-clamped roll, bit for bit."""
    h, c, shift, flow = case["h"], case["c"], case["shift"], case["flow"]
    shape = tuple(h.shape[2:])
    h_w, c_w = tmcore.warp_state(*_warp_args(xp, case))
    _assert_namespace(xp, h_w, c_w)
    queries = _displaced_queries(shape, shift, flow)
    for name, got, state in (("h_w", h_w, h), ("c_w", c_w, c)):
        want = np.moveaxis(ref_trilinear_sample(state, queries), 1, 2).reshape(state.shape)
        assert_rel(got, want, FWD_TOL, name)
    flat_flow = flow is None or not np.any(flow)
    if not np.any(shift) and flat_flow:
        assert np.array_equal(to_numpy(h_w), h) and np.array_equal(to_numpy(c_w), c), \
            "zero displacement must return the state exactly"
    n = len(shape)
    half = np.asarray([(shape[n - 1 - k] - 1) / 2.0 for k in range(n)])
    cells = shift * half
    if flat_flow and np.allclose(cells, np.round(cells), atol=1e-12):
        rolled = np.array(h)
        for a in range(n):
            rolled = np.stack([np.take(rolled[b], np.clip(np.arange(shape[a])
                                                          + int(np.round(cells[b, n - 1 - a])),
                                                          0, shape[a] - 1), axis=a + 1)
                               for b in range(h.shape[0])])
        assert_rel(h_w, rolled, 1e-12, "whole-cell shift vs clamped roll")


@_property(8, warp_cases(smooth=True, max_cells=12))
def warp_vjp_matches_sampling_and_central_differences(xp: ModuleType, case: dict) -> None:
    h, c, shift, flow = case["h"], case["c"], case["shift"], case["flow"]
    shape = tuple(h.shape[2:])
    batch, n = shift.shape
    grads = tmcore.warp_state_vjp(*_warp_args(xp, case), _asx(xp, case["g_h"]),
                                  _asx(xp, case["g_c"]))
    d_h, d_c, d_shift, d_flow = grads
    assert (d_flow is None) == (flow is None), "d_flow must be None exactly without a flow"
    _assert_namespace(xp, *(g for g in grads if g is not None))
    # reference: the sampler's VJP at the displaced centres (h and c as one volume)
    queries = _displaced_queries(shape, shift, flow)
    volume = np.concatenate([h, c], axis=1)
    g = np.concatenate([case["g_h"], case["g_c"]], axis=1)
    ref_dv, ref_dq = ref_trilinear_sample_vjp(volume, queries,
                                              np.moveaxis(g.reshape(batch, g.shape[1], -1), 1, 2))
    channels = h.shape[1]
    ref_flow = np.moveaxis(ref_dq, 1, 2).reshape(batch, n, *shape)
    assert_rel(d_h, ref_dv[:, :channels], VJP_TOL, "d_h")
    assert_rel(d_c, ref_dv[:, channels:], VJP_TOL, "d_c")
    assert_rel(d_shift, ref_flow.reshape(batch, n, -1).sum(-1), VJP_TOL, "d_shift")
    if flow is not None:
        assert_rel(d_flow, ref_flow, VJP_TOL, "d_flow")

    def f(*a):
        return tmcore.warp_state(*a)

    args = [h, c, shift] + ([] if flow is None else [flow])
    fd = central_difference_vjp(f, args, (case["g_h"], case["g_c"]), range(len(args)))
    names = ("d_h", "d_c", "d_shift", "d_flow")[:len(fd)]
    for name, got, want in zip(names, grads[:len(fd)], fd, strict=True):
        assert_rel(got, want, FD_TOL, f"{name} vs FD", floor=FD_FLOOR)


# ----------------------------------------------------------------------------- layer scan


def ref_warped_scan(h0, c0, read_coords, write_coords, write_sigma, write_content, shift,
                    params, window, radius=None, eps=1e-6):
    """The layer's warped scan from the references: per step read, warp (the reference
    sampler at the displaced centres), then :func:`ref_local_update` (``window=None``:
    the dense step). ``(reads, h_T, c_T)``."""
    h, c = np.array(h0, dtype=np.float64), np.array(c0, dtype=np.float64)
    shape = tuple(h.shape[2:])
    reads = []
    for t in range(read_coords.shape[1]):
        reads.append(ref_trilinear_sample(h, read_coords[:, t : t + 1])[:, 0])
        queries = _displaced_queries(shape, shift[:, t], None)
        h, c = (np.moveaxis(ref_trilinear_sample(v, queries), 1, 2).reshape(v.shape)
                for v in (h, c))
        h, c = ref_local_update(h, c, write_coords[:, t], write_sigma[:, t],
                                write_content[:, t], params,
                                max(shape) if window is None else window, radius, eps)
    return np.stack(reads, axis=1), h, c


@_property(6, local_cases(steps=3, max_cells=12))
def warped_layer_scan_matches_reference(xp: ModuleType, case: dict) -> None:
    """:func:`tmcore.scan.warped.dynamic_memory_scan` with a shift equals the reference loop
    (dense and local updates); the local fast path's VJP equals the masked one's."""
    import tmcore.scan as dynamics

    rng = np.random.default_rng(int(case["h0"].size))
    shift = rng.uniform(-0.4, 0.4, case["read_coords"].shape)
    arrays = [_asx(xp, case[k]) for k in _SCAN_KEYS]
    inputs = dynamics.WarpInputs(*arrays[2:], _asx(xp, shift))
    params = _params_x(xp, case["params"])
    grads = {}
    for update, method in (("dense", "fast"), ("local", "fast"), ("local", "masked")):
        window = case["window"] if update == "local" else None
        want = ref_warped_scan(*(case[k] for k in _SCAN_KEYS), shift, case["params"], window,
                               case["radius"])
        kw = dict(update=update, window=window, radius=case["radius"], method=method)
        out = dynamics.dynamic_memory_scan(arrays[0], arrays[1], inputs, params, **kw)
        _assert_namespace(xp, *out)
        for name, got, ref in zip(("reads", "h_T", "c_T"), out, want, strict=True):
            assert_rel(got, ref, FWD_TOL, f"{name} ({update}, {method})")
        d_h, d_c, d_inputs, d_params = dynamics.dynamic_memory_scan_vjp(
            arrays[0], arrays[1], inputs, params, _asx(xp, case["g_reads"]),
            _asx(xp, case["g_h"]), _asx(xp, case["g_c"]), **kw)
        grads[(update, method)] = [d_h, d_c, *d_inputs, *d_params]
    for got, masked in zip(grads[("local", "fast")], grads[("local", "masked")], strict=True):
        assert_rel(got, to_numpy(masked), VJP_TOL, "warped local scan VJP (fast vs masked)")
