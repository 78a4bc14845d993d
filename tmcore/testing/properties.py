"""The property suite: what every array namespace must satisfy to run tmcore.

Each property is a function ``(xp, case) -> None`` that raises
``AssertionError`` on a violation, paired with the hypothesis strategy that
draws its cases (float64 NumPy, converted with ``xp.asarray``) and a default
number of examples. :data:`PROPERTIES` maps names to them; the kit
(:func:`tmcore.testing.check_namespace`, the pytest plugin) and tmcore's own
tests run these same definitions.

Three checks per primitive: the forward equals the float64 reference in
:mod:`tmcore.testing.reference`; the VJP equals the reference VJP (for
sampling also at kinks: cell centres, exactly +-1 and beyond, with torch
grid_sample's convention); the VJP equals central differences where the
function is differentiable. The differences are taken through tmcore's NumPy
path (the first check ties every namespace's forward to the reference), which
keeps hundreds of forward calls cheap; the VJP under test runs in ``xp``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st

import tmcore
from tmcore.testing.finite_diff import central_difference_vjp
from tmcore.testing.reference import (
    ref_convlstm_step,
    ref_convlstm_step_vjp,
    ref_factorized_conv,
    ref_factorized_conv_vjp,
    ref_gaussian_splat,
    ref_gaussian_splat_vjp,
    ref_memory_scan,
    ref_memory_scan_vjp,
    ref_trilinear_sample,
    ref_trilinear_sample_vjp,
)
from tmcore.testing.strategies import (
    SCAN_INPUTS,
    assert_rel,
    conv_cases,
    fd_step_for_sigma,
    lstm_cases,
    sample_cases,
    scan_cases,
    splat_cases,
    to_numpy,
)

__all__ = ["PROPERTIES", "Property", "FWD_TOL", "VJP_TOL", "FD_TOL"]

FWD_TOL = 1e-12  # float64 forward vs reference (max-norm relative error)
VJP_TOL = 1e-11  # float64 VJP vs reference VJP (more summation-order freedom)
FD_TOL = 1e-6  # VJP vs central differences
FD_FLOOR = 1e-2  # gradients smaller than this are compared in absolute terms

PARAM_NAMES = ("depthwise_weight", "depthwise_bias", "pointwise_weight", "pointwise_bias")
SCAN_GRAD_NAMES = ("h0", "c0", "read_coords", "write_coords", "write_sigma", "write_content")


class Property(NamedTuple):
    """One property of the suite: ``check(xp, case)`` over cases drawn from ``strategy``.

    Parameters
    ----------
    check : callable
        ``check(xp, case)``: runs tmcore on the namespace ``xp`` with the case's
        float64 NumPy arrays converted by ``xp.asarray``, and raises
        ``AssertionError`` on a violation.
    strategy : hypothesis.strategies.SearchStrategy
        Draws the cases (dicts of float64 NumPy arrays and Python values).
    max_examples : int
        The default number of examples.
    needs_float64 : bool, default True
        Whether the check compares against the float64 references (the kit then
        refuses a namespace without float64 up front).
    """

    check: Callable[[ModuleType, dict], None]
    strategy: st.SearchStrategy
    max_examples: int
    needs_float64: bool = True  # compares against the float64 references


#: name -> :class:`Property`, in the order they are run.
PROPERTIES: dict[str, Property] = {}


def _property(max_examples: int, strategy: st.SearchStrategy, needs_float64: bool = True):
    def register(check: Callable[[ModuleType, dict], None]):
        PROPERTIES[check.__name__] = Property(check, strategy, max_examples, needs_float64)
        return check

    return register


def _asx(xp: ModuleType, a: np.ndarray) -> Any:
    return xp.asarray(a)


def _params_x(xp: ModuleType, params: list[np.ndarray]) -> tmcore.ConvParams:
    return tmcore.ConvParams(*(xp.asarray(p) for p in params))


def _assert_namespace(xp: ModuleType, *arrays: Any) -> None:
    kind = type(xp.asarray(0.0))
    for a in arrays:
        assert isinstance(a, kind), f"expected a {kind.__name__}, got {type(a).__name__}"


# ----------------------------------------------------------------------------- sampling


@_property(40, sample_cases())
def trilinear_matches_reference(xp: ModuleType, case: dict) -> None:
    volume, coords, g = case["volume"], case["coords"], case["g"]
    out = tmcore.trilinear_sample(_asx(xp, volume), _asx(xp, coords))
    _assert_namespace(xp, out)
    assert_rel(out, ref_trilinear_sample(volume, coords), FWD_TOL, "trilinear_sample")
    d_volume, d_coords = tmcore.trilinear_sample_vjp(_asx(xp, volume), _asx(xp, coords),
                                                     _asx(xp, g))
    _assert_namespace(xp, d_volume, d_coords)
    ref_dv, ref_dc = ref_trilinear_sample_vjp(volume, coords, g)
    assert_rel(d_volume, ref_dv, VJP_TOL, "d_volume")
    assert_rel(d_coords, ref_dc, VJP_TOL, "d_coords")


@_property(25, sample_cases(smooth=True, max_cells=12))
def trilinear_vjp_matches_central_differences(xp: ModuleType, case: dict) -> None:
    volume, coords, g = case["volume"], case["coords"], case["g"]

    def f(v, q):
        return tmcore.trilinear_sample(v, q)

    d_volume, d_coords = tmcore.trilinear_sample_vjp(_asx(xp, volume), _asx(xp, coords),
                                                     _asx(xp, g))
    fd_volume, fd_coords = central_difference_vjp(f, [volume, coords], g, [0, 1])
    assert_rel(d_volume, fd_volume, FD_TOL, "d_volume vs FD", floor=FD_FLOOR)
    assert_rel(d_coords, fd_coords, FD_TOL, "d_coords vs FD", floor=FD_FLOOR)


# ----------------------------------------------------------------------------- splat


@_property(40, splat_cases())
def splat_matches_reference(xp: ModuleType, case: dict) -> None:
    content, mu, sigma, shape, radius, g = (case[k] for k in
                                            ("content", "mu", "sigma", "shape", "radius", "g"))
    out = tmcore.gaussian_splat(_asx(xp, content), _asx(xp, mu), _asx(xp, sigma), shape,
                                radius=radius)
    _assert_namespace(xp, out)
    assert_rel(out, ref_gaussian_splat(content, mu, sigma, shape, radius=radius), FWD_TOL,
               "gaussian_splat")
    grads = tmcore.gaussian_splat_vjp(_asx(xp, content), _asx(xp, mu), _asx(xp, sigma), shape,
                                      _asx(xp, g), radius=radius)
    _assert_namespace(xp, *grads)
    ref = ref_gaussian_splat_vjp(content, mu, sigma, shape, g, radius=radius)
    for name, got, want in zip(("d_content", "d_mu", "d_sigma"), grads, ref, strict=True):
        assert_rel(got, want, VJP_TOL, name)


@_property(25, st.tuples(splat_cases(smooth=True, max_cells=12), st.sampled_from([1e-6, 1e-3]))
           .map(lambda t: {**t[0], "eps": t[1]}))
def splat_vjp_matches_central_differences(xp: ModuleType, case: dict) -> None:
    eps = case["eps"]
    content, mu, sigma, shape, radius, g = (case[k] for k in
                                            ("content", "mu", "sigma", "shape", "radius", "g"))

    def f(c, m, s):
        return tmcore.gaussian_splat(c, m, s, shape, eps=eps, radius=radius)

    grads = tmcore.gaussian_splat_vjp(_asx(xp, content), _asx(xp, mu), _asx(xp, sigma), shape,
                                      _asx(xp, g), eps=eps, radius=radius)
    fd = central_difference_vjp(f, [content, mu, sigma], g, [0, 1, 2],
                                step=fd_step_for_sigma(sigma, eps))
    for name, got, want in zip(("d_content", "d_mu", "d_sigma"), grads, fd, strict=True):
        assert_rel(got, want, FD_TOL, f"{name} vs FD", floor=FD_FLOOR)


# ----------------------------------------------------------------------------- conv


@_property(30, conv_cases())
def conv_matches_reference(xp: ModuleType, case: dict) -> None:
    x, params, g = case["x"], case["params"], case["g"]
    out = tmcore.factorized_conv(_asx(xp, x), _params_x(xp, params))
    _assert_namespace(xp, out)
    assert_rel(out, ref_factorized_conv(x, *params), FWD_TOL, "factorized_conv")
    d_x, d_params = tmcore.factorized_conv_vjp(_asx(xp, x), _params_x(xp, params), _asx(xp, g))
    assert isinstance(d_params, tmcore.ConvParams)
    _assert_namespace(xp, d_x, *d_params)
    ref_dx, *ref_dp = ref_factorized_conv_vjp(x, *params, g)
    assert_rel(d_x, ref_dx, VJP_TOL, "d_x")
    for name, got, want in zip(PARAM_NAMES, d_params, ref_dp, strict=True):
        assert_rel(got, want, VJP_TOL, f"d_params.{name}")


@_property(20, conv_cases(max_cells=10))
def conv_vjp_matches_central_differences(xp: ModuleType, case: dict) -> None:
    x, params, g = case["x"], case["params"], case["g"]

    def f(x_, *p):
        return tmcore.factorized_conv(x_, tmcore.ConvParams(*p))

    d_x, d_params = tmcore.factorized_conv_vjp(_asx(xp, x), _params_x(xp, params), _asx(xp, g))
    fd = central_difference_vjp(f, [x, *params], g, range(5))
    for name, got, want in zip(("x", *PARAM_NAMES), (d_x, *d_params), fd, strict=True):
        assert_rel(got, want, FD_TOL, f"d_{name} vs FD", floor=FD_FLOOR)


# ----------------------------------------------------------------------------- convlstm


@_property(30, lstm_cases(max_cells=16))
def convlstm_matches_reference(xp: ModuleType, case: dict) -> None:
    x, h, c, params = case["x"], case["h"], case["c"], case["params"]
    xs = [_asx(xp, a) for a in (x, h, c)]
    h_new, c_new = tmcore.convlstm_step(*xs, _params_x(xp, params))
    _assert_namespace(xp, h_new, c_new)
    ref_h, ref_c = ref_convlstm_step(x, h, c, *params)
    assert_rel(h_new, ref_h, FWD_TOL, "h_new")
    assert_rel(c_new, ref_c, FWD_TOL, "c_new")
    d_x, d_h, d_c, d_params = tmcore.convlstm_step_vjp(
        *xs, _params_x(xp, params), _asx(xp, case["g_h"]), _asx(xp, case["g_c"]))
    _assert_namespace(xp, d_x, d_h, d_c, *d_params)
    ref = ref_convlstm_step_vjp(x, h, c, *params, case["g_h"], case["g_c"])
    names = ("d_x", "d_h", "d_c", *(f"d_params.{p}" for p in PARAM_NAMES))
    for name, got, want in zip(names, (d_x, d_h, d_c, *d_params), ref, strict=True):
        assert_rel(got, want, VJP_TOL, name)


@_property(12, lstm_cases(max_cells=8, max_channels=2))
def convlstm_vjp_matches_central_differences(xp: ModuleType, case: dict) -> None:
    args = [case["x"], case["h"], case["c"], *case["params"]]

    def f(x_, h_, c_, *p):
        return tmcore.convlstm_step(x_, h_, c_, tmcore.ConvParams(*p))

    d_x, d_h, d_c, d_params = tmcore.convlstm_step_vjp(
        *(_asx(xp, a) for a in args[:3]), _params_x(xp, case["params"]),
        _asx(xp, case["g_h"]), _asx(xp, case["g_c"]))
    fd = central_difference_vjp(f, args, (case["g_h"], case["g_c"]), range(7))
    names = ("d_x", "d_h", "d_c", *(f"d_params.{p}" for p in PARAM_NAMES))
    for name, got, want in zip(names, (d_x, d_h, d_c, *d_params), fd, strict=True):
        assert_rel(got, want, FD_TOL, f"{name} vs FD", floor=FD_FLOOR)


# ----------------------------------------------------------------------------- scan


def _scan_call(xp, case, checkpoint_every: int | None = None):
    ins = [_asx(xp, case[k]) for k in SCAN_INPUTS]
    ce = case["checkpoint_every"] if checkpoint_every is None else checkpoint_every
    return ins, dict(radius=case["radius"], checkpoint_every=ce)


def _scan_vjp(xp, case, checkpoint_every: int | None = None):
    ins, kw = _scan_call(xp, case, checkpoint_every)
    grads = tmcore.memory_scan_vjp(
        *ins, _params_x(xp, case["params"]), _asx(xp, case["g_reads"]),
        _asx(xp, case["g_h"]), _asx(xp, case["g_c"]), **kw)
    assert len(grads) == 7
    *state_grads, d_params = grads
    _assert_namespace(xp, *state_grads, *d_params)
    return [*state_grads, *d_params]


_SCAN_GRAD_LABELS = (*(f"d_{k}" for k in SCAN_GRAD_NAMES),
                     *(f"d_params.{p}" for p in PARAM_NAMES))


@_property(25, scan_cases())
def memory_scan_matches_reference(xp: ModuleType, case: dict) -> None:
    ins, kw = _scan_call(xp, case)
    reads, h_t, c_t = tmcore.memory_scan(*ins, _params_x(xp, case["params"]), **kw)
    _assert_namespace(xp, reads, h_t, c_t)
    ref = ref_memory_scan(*(case[k] for k in SCAN_INPUTS), *case["params"],
                          radius=case["radius"])
    for name, got, want in zip(("reads", "h_T", "c_T"), (reads, h_t, c_t), ref, strict=True):
        assert_rel(got, want, FWD_TOL, name)
    grads = _scan_vjp(xp, case)
    ref_grads = ref_memory_scan_vjp(*(case[k] for k in SCAN_INPUTS), *case["params"],
                                    case["g_reads"], case["g_h"], case["g_c"],
                                    radius=case["radius"])
    for name, got, want in zip(_SCAN_GRAD_LABELS, grads, ref_grads, strict=True):
        assert_rel(got, want, VJP_TOL, name)


@_property(10, scan_cases(max_cells=12, max_steps=4))
def memory_scan_independent_of_checkpoint_every(xp: ModuleType, case: dict) -> None:
    base = _scan_vjp(xp, case, checkpoint_every=1)
    ins, _ = _scan_call(xp, case)
    base_fwd = tmcore.memory_scan(*ins, _params_x(xp, case["params"]), radius=case["radius"])
    for ce in (2, 3, 5):
        grads = _scan_vjp(xp, case, checkpoint_every=ce)
        for name, got, want in zip(_SCAN_GRAD_LABELS, grads, base, strict=True):
            assert_rel(got, to_numpy(want), 1e-13, f"{name} (checkpoint_every={ce})")
        fwd = tmcore.memory_scan(*ins, _params_x(xp, case["params"]), radius=case["radius"],
                                 checkpoint_every=ce)
        for name, got, want in zip(("reads", "h_T", "c_T"), fwd, base_fwd, strict=True):
            assert_rel(got, to_numpy(want), 1e-13, f"{name} (checkpoint_every={ce})")


@_property(8, scan_cases(smooth=True, max_cells=6, max_steps=3, max_channels=2))
def memory_scan_vjp_matches_central_differences(xp: ModuleType, case: dict) -> None:
    n_in = len(SCAN_INPUTS)
    args = [*(case[k] for k in SCAN_INPUTS), *case["params"]]

    def f(*a):
        return tmcore.memory_scan(*a[:n_in], tmcore.ConvParams(*a[n_in:]),
                                  radius=case["radius"], checkpoint_every=case["checkpoint_every"])

    grads = _scan_vjp(xp, case)
    fd = central_difference_vjp(f, args, (case["g_reads"], case["g_h"], case["g_c"]),
                                range(len(args)), step=fd_step_for_sigma(case["write_sigma"]))
    for name, got, want in zip(_SCAN_GRAD_LABELS, grads, fd, strict=True):
        assert_rel(got, want, FD_TOL, f"{name} vs FD", floor=FD_FLOOR)


@_property(15, scan_cases(max_steps=4))
def masked_scan_matches_reference(xp: ModuleType, case: dict) -> None:
    """The scan under per-step row masks (``reset``, ``active``: what streamed and packed
    layer calls pass) equals the reference run step by step with the masks applied; its VJP
    equals the generic path's."""
    ins, kw = _scan_call(xp, case)
    batch, steps = case["write_sigma"].shape
    rng = np.random.default_rng(batch * 101 + steps * 7 + case["h0"].size)
    reset, active = rng.random((batch, steps)) < 0.3, rng.random((batch, steps)) < 0.6
    masks = {"reset": xp.asarray(reset), "active": xp.asarray(active)}
    reads, h_t, c_t = tmcore.memory_scan(*ins, _params_x(xp, case["params"]), **kw, **masks)
    _assert_namespace(xp, reads, h_t, c_t)
    h, c, ref_reads = case["h0"], case["c0"], []
    for t in range(steps):
        rows = (-1,) + (1,) * (h.ndim - 1)
        h, c = (np.where(reset[:, t].reshape(rows), 0.0, v) for v in (h, c))
        read, h_new, c_new = ref_memory_scan(h, c, *(case[k][:, t:t + 1] for k in
                                                      SCAN_INPUTS[2:]), *case["params"],
                                             radius=case["radius"])
        keep = active[:, t].reshape(rows)
        h, c = np.where(keep, h_new, h), np.where(keep, c_new, c)
        ref_reads.append(read)
    for name, got, want in zip(("reads", "h_T", "c_T"), (reads, h_t, c_t),
                               (np.concatenate(ref_reads, axis=1), h, c), strict=True):
        assert_rel(got, want, FWD_TOL, name)

    def vjp():
        return tmcore.memory_scan_vjp(*ins, _params_x(xp, case["params"]),
                                      _asx(xp, case["g_reads"]), _asx(xp, case["g_h"]),
                                      _asx(xp, case["g_c"]), **kw, **masks)

    grads = vjp()
    with tmcore.options(generic=True):
        generic = vjp()
    for name, got, want in zip(_SCAN_GRAD_LABELS, [*grads[:6], *grads[6]],
                               [*generic[:6], *generic[6]], strict=True):
        assert_rel(got, to_numpy(want), VJP_TOL, f"{name} (masked) vs the generic path")


