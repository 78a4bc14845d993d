"""The backend kit: run tmcore's whole property suite against any array namespace.

>>> from tmcore.testing import check_namespace
>>> print(check_namespace("array_api_strict"))               # doctest: +SKIP
>>> print(check_namespace("numpy", backend="mypkg.ops:make_ops"))  # doctest: +SKIP

Each property of :data:`tmcore.testing.properties.PROPERTIES` is run under hypothesis
(no example database is written); a failure is shrunk to a minimal example, and the
report names the property, the backend that served the namespace, the whole error (the
values compared and where; file and line for an error that is not an assertion) and the
example, for each distinct failure. The suite needs float64 in the namespace except
for the properties marked ``needs_float64=False`` (:func:`require_float64`).

Budget: ``max_examples`` caps the examples per property and ``time_budget`` (seconds,
for the whole run) stops each property once its share is spent, its shrinking too;
every property runs at least one example, and the report says how many ran.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import math
import pickle
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import array_api_compat
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis.configuration import set_hypothesis_home_dir

from tmcore.backends import Backend, register_backend, unregister_backend
from tmcore.testing import properties_dtypes, properties_local  # noqa: F401  (register theirs)
from tmcore.testing.properties import PROPERTIES
from tmcore.testing.strategies import namespace_of, serving_backend, to_numpy

__all__ = ["check_namespace", "run_property", "NamespaceReport", "PropertyFailure",
           "load_namespace", "load_make_ops", "registered_backend", "served_by",
           "require_float64"]

# 1 + 2**-40 is not a float32; a namespace that narrows float64 loses it.
_FLOAT64_PROBE = np.asarray([1.0, 1.0 + 2.0**-40, -3.5])
_JAX_X64_HINT = (' JAX keeps 64-bit types off by default: call jax.config.update('
                 '"jax_enable_x64", True) before creating any array (or set the '
                 'environment variable JAX_ENABLE_X64=1).')


def load_namespace(name_or_module: str | ModuleType) -> ModuleType:
    """Import the namespace module of a dotted name (``"array_api_strict"``, ``"mlx.core"``).

    ``"marray.<backend>"`` (e.g. ``"marray.numpy"``, the name marray gives it)
    is ``marray.masked_namespace(<backend>)``: marray builds its namespaces on
    demand, so there is no module of that name to import.

    Parameters
    ----------
    name_or_module : str or module
        A dotted module name, or a namespace module (returned as it is).

    Returns
    -------
    module
        The array namespace.

    Raises
    ------
    TypeError
        If ``name_or_module`` is neither a string nor a module.
    ImportError
        If the module cannot be imported.
    """
    if isinstance(name_or_module, ModuleType):
        return name_or_module
    if not isinstance(name_or_module, str):
        raise TypeError(f"xp: expected a namespace module or its dotted name, "
                        f"got {type(name_or_module).__name__}")
    head, _, backend = name_or_module.partition(".")
    if head == "marray" and backend:
        marray = importlib.import_module("marray")
        return marray.masked_namespace(importlib.import_module(backend))
    return importlib.import_module(name_or_module)


def _namespace_name(xp: ModuleType) -> str:
    return getattr(xp, "__name__", repr(xp))


def require_float64(xp: ModuleType) -> None:
    """Check that ``xp`` holds float64 exactly, before any property runs.

    Checks that ``xp.float64`` exists and that ``xp.asarray`` of float64 NumPy
    data (with and without ``dtype=xp.float64``, as the properties call it)
    keeps dtype float64 and every bit of the values.

    Parameters
    ----------
    xp : module
        The array namespace.

    Raises
    ------
    ValueError
        If float64 is missing or narrowed; the message says how to turn it on
        where that is known (JAX).
    """
    name = _namespace_name(xp)
    problem = None
    f64 = getattr(xp, "float64", None)
    if f64 is None:
        problem = "it has no float64 dtype"
    else:
        for kwargs in ({"dtype": f64}, {}):
            call = "xp.asarray(float64 data" + (", dtype=xp.float64)" if kwargs else ")")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # JAX warns, then narrows
                    a = xp.asarray(_FLOAT64_PROBE, **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported with its message
                problem = f"{call} raised {type(exc).__name__}: {exc}"
                break
            if a.dtype != f64:
                problem = f"{call} gives dtype {a.dtype}"
                break
            if not np.array_equal(to_numpy(a), _FLOAT64_PROBE):
                problem = f"{call} does not keep float64 values exactly"
                break
    if problem is None:
        return
    hint = _JAX_X64_HINT if array_api_compat.is_jax_namespace(xp) or name.startswith("jax") else ""
    without = [n for n, prop in PROPERTIES.items() if not prop.needs_float64]
    raise ValueError(
        f"xp: float64 is off or missing in {name} ({problem}). The property suite compares "
        f"against float64 references, so it cannot run without float64.{hint} To check "
        f"the other dtypes alone, pass properties={without}.")


def load_make_ops(spec: str | Callable) -> Callable:
    """Give the ``make_ops`` named by ``"module:function"`` (a callable is returned as it is).

    Parameters
    ----------
    spec : str or callable
        ``"package.module:make_ops"``, or the function itself.

    Returns
    -------
    callable
        ``make_ops(generic, options) -> Ops``.

    Raises
    ------
    ValueError
        If ``spec`` is not ``"module:function"`` or does not name a callable.
    ImportError
        If the module cannot be imported.
    """
    if callable(spec):
        return spec
    module, _, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module or not attr:
        raise ValueError(f"backend: expected 'module:function' or a callable, got {spec!r}")
    found = getattr(importlib.import_module(module), attr, None)
    if not callable(found):
        raise ValueError(f"backend: {module} has no callable {attr!r}")
    return found


@contextlib.contextmanager
def registered_backend(xp: ModuleType, make_ops: str | Callable) -> Iterator[Backend]:
    """Register ``make_ops`` for ``xp``'s arrays alone, inside a ``with`` block.

    Parameters
    ----------
    xp : module
        The array namespace.
    make_ops : str or callable
        As in :func:`load_make_ops`.

    Yields
    ------
    Backend
        The registered backend (named ``"module:function"``); unregistered on exit.
    """
    make_ops = load_make_ops(make_ops)
    target = namespace_of(xp)
    name = f"{make_ops.__module__}:{getattr(make_ops, '__qualname__', make_ops)}"
    backend = register_backend(name, lambda ns: ns is target, make_ops)
    try:
        yield backend
    finally:
        unregister_backend(name)


def served_by(xp: ModuleType) -> str:
    """Say what serves ``xp``'s arrays now.

    Parameters
    ----------
    xp : module
        The array namespace.

    Returns
    -------
    str
        ``"name (module)"`` of the registered backend, or ``"generic (tmcore.ops)"``
        (none registered, or ``tmcore.options(generic=True)``).
    """
    backend = serving_backend(xp)
    return "generic (tmcore.ops)" if backend is None else f"{backend.name} ({backend.module})"


class _BudgetSpent(BaseException):
    """Stops a property once its time is spent. A ``BaseException`` on purpose:
    hypothesis lets it through at once instead of shrinking it as a failure."""


def _digest(case: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(case, protocol=4)).digest()


def run_property(xp: ModuleType, name: str, *, max_examples: int | None = None,
                 derandomize: bool | None = None, time_budget: float | None = None) -> int:
    """Run one property of the suite against ``xp``.

    Parameters
    ----------
    xp : module
        The array namespace.
    name : str
        A key of :data:`PROPERTIES`.
    max_examples : int, optional
        The number of examples (default: the property's own budget).
    derandomize : bool, optional
        Deterministic examples (default: the active hypothesis profile's
        setting).
    time_budget : float, optional
        Seconds after which no new example starts; the first one always runs. A
        failure is shrunk until then (and at least once): afterwards hypothesis
        reports the smallest failing example found so far.

    Returns
    -------
    int
        The number of examples that ran and passed.

    Raises
    ------
    ValueError
        If ``name`` is unknown, a budget is not positive, or the property needs
        float64 and ``xp`` lacks it.
    Exception
        The property's own error (an ``AssertionError`` for a wrong value) on
        hypothesis' shrunk minimal failing example (an exception group when it
        found several distinct ones).
    """
    if name not in PROPERTIES:
        raise ValueError(f"name: unknown property {name!r}; expected one of {sorted(PROPERTIES)}")
    _check_budget(max_examples, time_budget)
    prop = PROPERTIES[name]
    if prop.needs_float64:
        require_float64(xp)
    overrides = dict(
        max_examples=prop.max_examples if max_examples is None else max_examples,
        deadline=None,
        database=None,  # nothing written to the author's working folder (_storage_elsewhere)
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much],
    )
    if derandomize is not None:
        overrides["derandomize"] = derandomize
    stop_at = None if time_budget is None else time.monotonic() + time_budget
    passed = [0]
    failing: set[bytes] = set()  # the cases that failed: replayed even when time is up

    @settings(**overrides)
    @given(case=prop.strategy)
    def check(case: dict) -> None:
        if stop_at is not None and passed[0] + len(failing) and time.monotonic() >= stop_at:
            if not failing:
                raise _BudgetSpent
            if _digest(case) not in failing:
                return  # time is up: shrinking stops at the smallest failure found so far
        try:
            prop.check(xp, case)
        except Exception:
            failing.add(_digest(case))
            raise
        passed[0] += 1

    check.__name__ = name
    try:
        with _storage_elsewhere():
            check()
    except _BudgetSpent:
        pass
    return passed[0]


@contextlib.contextmanager
def _storage_elsewhere() -> Iterator[None]:
    """Hypothesis caches what it reads of the source under ``.hypothesis/`` of the working
    folder even without a database: a temporary folder takes it instead."""
    with tempfile.TemporaryDirectory(prefix="tmcore-kit-") as home:
        set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            set_hypothesis_home_dir(None)  # back to its default: $HYPOTHESIS_STORAGE_DIRECTORY


def _check_budget(max_examples: int | None, time_budget: float | None) -> None:
    if max_examples is not None and (isinstance(max_examples, bool)
                                     or not isinstance(max_examples, int) or max_examples < 1):
        raise ValueError(f"max_examples: expected a positive int or None, got {max_examples!r}")
    if time_budget is not None and (isinstance(time_budget, bool)
                                    or not isinstance(time_budget, (int, float))
                                    or not math.isfinite(time_budget) or time_budget <= 0):
        raise ValueError(f"time_budget: expected a positive number of seconds or None, "
                         f"got {time_budget!r}")


@dataclass
class PropertyFailure:
    """A violated property: its name, the whole error and hypothesis' minimal example.

    Parameters
    ----------
    name : str
        The property's name.
    error : str
        The error it raised, whole (an assertion's values; where any other error was
        raised).
    minimal_example : str
        The shrunk example hypothesis reported, indented.
    """

    name: str
    error: str
    minimal_example: str

    def __str__(self) -> str:
        error = "\n  ".join(self.error.splitlines())
        return f"FAILED {self.name}\n  {error}\n  minimal example:\n{self.minimal_example}"


@dataclass
class NamespaceReport:
    """Outcome of :func:`check_namespace`; truthy when every property held.

    Parameters
    ----------
    namespace : str
        The name of the namespace that was checked.
    served_by : str
        What served its arrays (:func:`served_by`).
    passed : list of str
        The properties that held.
    failures : list of PropertyFailure
        One per distinct failure (a property may have several).
    examples : dict of str to int
        How many examples ran and passed, per passed property.
    """

    namespace: str
    served_by: str = ""
    passed: list[str] = field(default_factory=list)
    failures: list[PropertyFailure] = field(default_factory=list)
    examples: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        failed = len({failure.name for failure in self.failures})
        lines = [f"tmcore property suite on {self.namespace}, served by {self.served_by}: "
                 f"{len(self.passed)} passed, {failed} failed"]
        for name in self.passed:
            count = self.examples.get(name)
            noun = "example" if count == 1 else "examples"
            lines.append(f"  ok      {name}" + ("" if count is None else f" ({count} {noun})"))
        lines += [str(failure) for failure in self.failures]
        return "\n".join(lines)


def _describe_failures(name: str, exc: BaseException) -> list[PropertyFailure]:
    """One :class:`PropertyFailure` per distinct failure hypothesis found in ``exc``."""
    group = getattr(exc, "exceptions", None)
    if group:
        found = [f for sub in group for f in _describe_failures(name, sub)]
        for i, failure in enumerate(found, 1):
            failure.error = f"(distinct failure {i} of {len(found)}) {failure.error}"
        return found
    notes = [n for n in getattr(exc, "__notes__", []) if n.strip()]
    example = "\n".join(f"    {line}" for note in notes for line in note.splitlines())
    error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__  # no notes
    if not isinstance(exc, AssertionError):
        frames = traceback.extract_tb(exc.__traceback__)[-3:]
        error += "\nraised at (innermost last):\n" + "".join(traceback.format_list(frames))
    return [PropertyFailure(name, error.rstrip(), example or "    (no example recorded)")]


def check_namespace(xp: str | ModuleType, *, properties: list[str] | None = None,
                    max_examples: int | None = None, time_budget: float | None = None,
                    derandomize: bool = True, raise_on_failure: bool = False,
                    backend: str | Callable | None = None) -> NamespaceReport:
    """Run the property suite on ``xp`` (a module or its dotted name), optionally with a backend.

    Every forward and VJP is compared with the float64 NumPy references and central
    differences on hypothesis-drawn shapes, coordinates and sigmas, and in every dtype
    the namespace has (the fast path and the generic path).

    Parameters
    ----------
    xp : str or module
        The array namespace, e.g. ``array_api_strict`` or ``"mlx.core"``.
    properties : list of str, optional
        The names to run (default: all of :data:`PROPERTIES`).
    max_examples : int, optional
        The per-property example budget (default: each property's own).
    time_budget : float, optional
        Seconds for the whole run (default: none). Each property gets an equal
        share of what is left when it starts (time a fast property leaves over
        goes to the later ones), shrinking included; it always runs at least one
        example, so the run can overshoot by about one example per property.
    derandomize : bool, default True
        Deterministic examples, for reproducible reports.
    raise_on_failure : bool, default False
        Raise an ``AssertionError`` with the report if anything failed.
    backend : str or callable, optional
        A ``make_ops`` (or ``"module:function"`` naming it) to serve ``xp``'s
        arrays during the run (:func:`registered_backend`); default: whatever is
        registered (the built-in backends, installed packages' entry points).

    Returns
    -------
    NamespaceReport
        What served the namespace, the passed properties (with how many examples
        ran) and the failures with their minimal examples.

    Raises
    ------
    ValueError
        For unknown property names, a bad budget or ``backend``, or (before
        anything runs) a namespace without float64 when a selected property needs it.
    AssertionError
        With ``raise_on_failure``, if a property failed.
    """
    names = list(PROPERTIES) if properties is None else list(properties)
    unknown = sorted(set(names) - set(PROPERTIES))
    if unknown:
        raise ValueError(f"properties: unknown property {unknown}; expected names from "
                         f"{sorted(PROPERTIES)}")
    _check_budget(max_examples, time_budget)
    module = load_namespace(xp)
    with registered_backend(module, backend) if backend is not None else contextlib.nullcontext():
        if any(PROPERTIES[name].needs_float64 for name in names):
            require_float64(module)  # fail fast, not after minutes of rounding "failures"
        report = NamespaceReport(_namespace_name(module), served_by(module))
        deadline = None if time_budget is None else time.monotonic() + time_budget
        for i, name in enumerate(names):
            share = None
            if deadline is not None:
                # never 0: run_property rejects it, and one example always runs anyway
                share = max(deadline - time.monotonic(), 1e-3) / (len(names) - i)
            try:
                count = run_property(module, name, max_examples=max_examples,
                                     derandomize=derandomize, time_budget=share)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
                report.failures += _describe_failures(name, exc)
            else:
                report.passed.append(name)
                report.examples[name] = count
    if raise_on_failure and report.failures:
        raise AssertionError(str(report))
    return report
