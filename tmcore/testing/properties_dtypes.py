"""Every public function in every floating dtype of the namespace, by value.

One property per function of :data:`CALLS` (``<name>_in_every_dtype``: forward and VJP
of the read, write, conv, ConvLSTM step, scan, one-step write, local step and scan,
warp), on cases away from the kinks where rounding could move a position across a cell
or window edge. For each dtype the namespace has (float64, float32, float16, bfloat16)
the inputs are rounded to that dtype, and every output must keep the dtype and the
namespace and equal the float64 reference on the same rounded inputs within the dtype's
:class:`Precision`; the reference is tmcore's generic path on NumPy in float64, which
the other properties tie to the loops of :mod:`tmcore.testing.reference`. Where a
backend serves the namespace, its fast path and the generic path (forced with
``tmcore.options(generic=True)``) are both checked, and against each other.

They need no float64 in the namespace (the references are NumPy's): on a namespace
without it they are the ones to run.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import array_api_compat
import numpy as np
from hypothesis import strategies as st

import tmcore
from tmcore.testing.properties import _property
from tmcore.testing.properties_local import local_cases, warp_cases
from tmcore.testing.strategies import (
    SCAN_INPUTS,
    assert_rel,
    conv_cases,
    lstm_cases,
    sample_cases,
    scan_cases,
    serving_backend,
    splat_cases,
    to_numpy,
)

__all__ = ["CALLS", "HALF_MIN_SIGMA", "TOLERANCES", "Call", "Precision"]


class Precision(NamedTuple):
    """How closely a dtype's outputs must match the float64 reference on the same inputs.

    The error allowed is ``tol`` times the largest expected value (``floor`` where that
    is smaller), plus ``spread`` times how far the reference moves when every input moves
    by the dtype's ``eps`` (relative, random signs): the error a correct computation in
    that dtype may have where the function amplifies rounding (a near-zero sum of large
    terms, a narrow Gaussian's slope). A ``half`` dtype is checked only on writes of sigma
    >= :data:`HALF_MIN_SIGMA` without truncation (a narrower Gaussian's derivatives leave
    float16's range; a truncation edge moves by the rounding of a distance).
    """

    eps: float
    tol: float
    floor: float
    spread: float
    half: bool = False


HALF_MIN_SIGMA = 0.05
#: dtype name -> :class:`Precision`
TOLERANCES = {"float64": Precision(2.0**-52, 1e-11, 1.0, 64.0),
              "float32": Precision(2.0**-23, 1e-5, 1.0, 64.0),
              "float16": Precision(2.0**-10, 2e-2, 1.0, 64.0, half=True),
              "bfloat16": Precision(2.0**-7, 1e-1, 1.0, 64.0, half=True)}


class Call(NamedTuple):
    """A public function (forward and VJP) on one drawn case.

    ``run(xp, case)`` gets the case's arrays as arrays of ``xp`` (the namespace) and
    returns ``{label: output}``; ``strategy`` draws the case (float64 NumPy arrays);
    ``examples`` is its property's default number of examples.
    """

    run: Callable[[Any, dict], dict[str, Any]]
    strategy: st.SearchStrategy
    examples: int = 5


def _params(case: dict) -> tmcore.ConvParams:
    return tmcore.ConvParams(*case["params"])


def _sample(xp, case):
    volume, coords, g = case["volume"], case["coords"], case["g"]
    d_volume, d_coords = tmcore.trilinear_sample_vjp(volume, coords, g)
    return {"out": tmcore.trilinear_sample(volume, coords), "d_volume": d_volume,
            "d_coords": d_coords}


def _splat(xp, case):
    args = (case["content"], case["mu"], case["sigma"], case["shape"])
    grads = tmcore.gaussian_splat_vjp(*args, case["g"], radius=case["radius"])
    return {"out": tmcore.gaussian_splat(*args, radius=case["radius"]),
            **dict(zip(("d_content", "d_mu", "d_sigma"), grads, strict=True))}


def _conv(xp, case):
    d_x, d_params = tmcore.factorized_conv_vjp(case["x"], _params(case), case["g"])
    return {"out": tmcore.factorized_conv(case["x"], _params(case)), "d_x": d_x,
            **{f"d_params.{k}": v for k, v in d_params._asdict().items()}}


def _convlstm(xp, case):
    state = (case["x"], case["h"], case["c"])
    h, c = tmcore.convlstm_step(*state, _params(case))
    *grads, d_params = tmcore.convlstm_step_vjp(*state, _params(case), case["g_h"], case["g_c"])
    return {"h'": h, "c'": c, **dict(zip(("d_x", "d_h", "d_c"), grads, strict=True)),
            **{f"d_params.{k}": v for k, v in d_params._asdict().items()}}


def _scan(xp, case):
    ins = [case[k] for k in SCAN_INPUTS]
    kw = dict(radius=case["radius"], checkpoint_every=case["checkpoint_every"])
    reads, h, c = tmcore.memory_scan(*ins, _params(case), **kw)
    grads = tmcore.memory_scan_vjp(*ins, _params(case), case["g_reads"], case["g_h"],
                                   case["g_c"], **kw)
    return {"reads": reads, "h_T": h, "c_T": c,
            **{f"d_{k}": v for k, v in zip(SCAN_INPUTS, grads[:6], strict=True)},
            **{f"d_params.{k}": v for k, v in grads[6]._asdict().items()}}


def _local(xp, case, scan: bool):
    ins = [case[k] for k in SCAN_INPUTS]
    out = {}
    for method in ("fast", "masked"):
        kw = dict(window=case["window"], radius=case["radius"], method=method)
        if scan:
            values = tmcore.local_memory_scan(*ins, _params(case), **kw)
            grads = tmcore.local_memory_scan_vjp(*ins, _params(case), case["g_reads"],
                                                 case["g_h"], case["g_c"], **kw)
            names = ("reads", "h_T", "c_T", *(f"d_{k}" for k in SCAN_INPUTS))
        else:
            step = [ins[0], ins[1], *ins[3:]]
            values = tmcore.local_update(*step, _params(case), **kw)
            grads = tmcore.local_update_vjp(*step, _params(case), case["g_h"], case["g_c"],
                                            **kw)
            names = ("h'", "c'", "d_h", "d_c", "d_write_coords", "d_write_sigma",
                     "d_write_content")
        *arrays, d_params = [*values, *grads]
        out.update({f"{name} ({method})": v for name, v in zip(names, arrays, strict=True)})
        out.update({f"d_params.{k} ({method})": v for k, v in d_params._asdict().items()})
    return out


def _warp(xp, case):
    args = (case["h"], case["c"], case["shift"], case["flow"])
    h, c = tmcore.warp_state(*args)
    grads = tmcore.warp_state_vjp(*args, case["g_h"], case["g_c"])
    names = ("d_h", "d_c", "d_shift", "d_flow")
    return {"h_w": h, "c_w": c, **{k: v for k, v in zip(names, grads, strict=True)
                                   if v is not None}}


_SMALL = dict(max_cells=12)
#: name -> :class:`Call`: the public functions the ``<name>_in_every_dtype`` properties run.
CALLS: dict[str, Call] = {
    "trilinear_sample": Call(_sample, sample_cases(smooth=True, **_SMALL)),
    "gaussian_splat": Call(_splat, splat_cases(smooth=True, **_SMALL)),
    "factorized_conv": Call(_conv, conv_cases(**_SMALL)),
    "convlstm_step": Call(_convlstm, lstm_cases(max_channels=2, **_SMALL)),
    "memory_scan": Call(_scan, scan_cases(smooth=True, max_steps=3, max_channels=2, **_SMALL)),
    "local_update": Call(lambda xp, case: _local(xp, case, scan=False),
                         local_cases(smooth=True, **_SMALL)),
    "local_memory_scan": Call(lambda xp, case: _local(xp, case, scan=True),
                              local_cases(steps=3, smooth=True, max_cells=8)),
    "warp_state": Call(_warp, warp_cases(smooth=True, **_SMALL)),
}


def _round_bfloat16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


_ROUND = {"float64": lambda a: a, "float32": lambda a: a.astype(np.float32),
          "float16": lambda a: a.astype(np.float16), "bfloat16": _round_bfloat16}


def _map_arrays(fn: Callable[[np.ndarray], Any], case: Any) -> Any:
    if isinstance(case, np.ndarray):
        return fn(case)
    if isinstance(case, dict):
        return {k: _map_arrays(fn, v) for k, v in case.items()}
    if isinstance(case, list):
        return [_map_arrays(fn, v) for v in case]
    return case


def _in_dtype(xp: ModuleType, dtype: Any, a: np.ndarray) -> Any:
    """``a`` (already representable in ``dtype``) as an array of ``xp`` of that dtype."""
    if a.dtype == np.float64:
        return xp.asarray(a)
    x = xp.asarray(a.astype(np.float32))
    return array_api_compat.array_namespace(x).astype(x, dtype)


def _read(xp: ModuleType, x: Any) -> np.ndarray:
    if x.dtype not in (getattr(xp, "float32", None), getattr(xp, "float64", None)):
        x = array_api_compat.array_namespace(x).astype(x, xp.float32)  # NumPy reads no bfloat16
    return to_numpy(x)


def _holds(xp: ModuleType, name: str) -> bool:
    """Whether ``xp`` has the dtype ``name`` (and keeps float64 data float64: JAX's x64)."""
    dtype = getattr(xp, name, None)
    if dtype is None or name != "float64":
        return dtype is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX warns, then narrows
        return xp.asarray(np.zeros(1)).dtype == dtype


def _dtypes(xp: ModuleType, case: dict) -> list[str]:
    """The dtypes of ``xp`` to check ``case`` in (see :class:`Precision`)."""
    sigma = min([float(np.min(case[k])) for k in ("sigma", "write_sigma") if k in case],
                default=np.inf)
    halves = sigma >= HALF_MIN_SIGMA and case.get("radius") is None
    return [name for name, precision in TOLERANCES.items()
            if _holds(xp, name) and (halves or not precision.half)]


class _Reference:
    """A call's float64 reference on inputs rounded to a dtype, and the comparison with it."""

    def __init__(self, call: Call, rounded: dict, precision: Precision):
        self.call, self.rounded, self.precision = call, rounded, precision
        self.want = self._run(lambda a: np.asarray(a, np.float64))
        self.floors: dict[str, float] | None = None

    def _run(self, convert: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
        with tmcore.options(generic=True):
            out = self.call.run(np, _map_arrays(convert, self.rounded))
        return {label: to_numpy(v) for label, v in out.items()}

    def _spread_floors(self) -> dict[str, float]:
        """Per output, the ``floor`` that allows what :class:`Precision` says."""
        rng, eps = np.random.default_rng(0), self.precision.eps
        moved = self._run(lambda a: np.asarray(a, np.float64) * (
            1.0 + eps * rng.choice((-1.0, 1.0), np.shape(a))))
        scale = self.precision.spread / self.precision.tol
        return {label: max(self.precision.floor, scale * float(np.max(
            np.abs(moved[label] - want), initial=0.0))) for label, want in self.want.items()}

    def check(self, got: np.ndarray, label: str, tol: float, what: str,
              expected: np.ndarray | None = None) -> None:
        """:func:`assert_rel` against the reference (or ``expected``) within the precision."""
        expected = self.want[label] if expected is None else expected
        try:
            assert_rel(got, expected, tol, what, floor=self.precision.floor)
        except AssertionError:  # allow what rounding amplifies (computed when needed)
            self.floors = self.floors or self._spread_floors()
            assert_rel(got, expected, tol, what, floor=self.floors[label])


def _check_every_dtype(name: str, call: Call, xp: ModuleType, case: dict) -> None:
    backend = serving_backend(xp)
    served = None if backend is None else f"{backend.name} ({backend.module})"
    for dtype_name in _dtypes(xp, case):
        dtype, precision = getattr(xp, dtype_name), TOLERANCES[dtype_name]
        rounded = _map_arrays(_ROUND[dtype_name], case)
        reference = _Reference(call, rounded, precision)
        arrays = _map_arrays(lambda a, dtype=dtype: _in_dtype(xp, dtype, a), rounded)
        paths = {"fast path" if served else "generic path": call.run(xp, arrays)}
        if served:
            with tmcore.options(generic=True):
                paths["generic path"] = call.run(xp, arrays)
        for path, outputs in paths.items():
            where = f"{dtype_name}, {path}" + (f" served by {served}" if path == "fast path"
                                               else "")
            for label, value in outputs.items():
                assert isinstance(value, type(xp.asarray(0.0))) and value.dtype == dtype, \
                    f"{name} {label} ({where}): {type(value).__name__} of {value.dtype}"
                reference.check(_read(xp, value), label, precision.tol,
                                f"{name} {label} ({where})")
        if served:
            for label, value in paths["fast path"].items():
                reference.check(_read(xp, value), label, 2 * precision.tol,
                                f"{name} {label} ({dtype_name}): fast path served by {served} "
                                "vs generic path", _read(xp, paths["generic path"][label]))


for _name, _call in CALLS.items():
    _check = functools.partial(_check_every_dtype, _name, _call)
    _check.__name__ = f"{_name}_in_every_dtype"
    _property(_call.examples, _call.strategy, needs_float64=False)(_check)
