"""The backend kit: run tmcore's whole property suite against any array namespace.

>>> import array_api_strict
>>> from tmcore.testing import check_namespace
>>> report = check_namespace(array_api_strict)      # doctest: +SKIP
>>> print(report)                                    # doctest: +SKIP

Each property of :data:`tmcore.testing.properties.PROPERTIES` is run under
hypothesis; a failure is shrunk to a minimal example, and the report names
the property, the assertion and that example. The suite needs float64 in the
namespace (the references are float64) plus float32 for the dtype check.
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass, field
from types import ModuleType

from hypothesis import HealthCheck, given, settings

from tmcore.testing.properties import PROPERTIES

__all__ = ["check_namespace", "run_property", "NamespaceReport", "PropertyFailure",
           "load_namespace"]


def load_namespace(name_or_module: str | ModuleType) -> ModuleType:
    """The namespace module for a dotted name (``"array_api_strict"``, ``"mlx.core"``)."""
    if isinstance(name_or_module, ModuleType):
        return name_or_module
    return importlib.import_module(name_or_module)


def run_property(xp: ModuleType, name: str, *, max_examples: int | None = None,
                 derandomize: bool | None = None) -> None:
    """Run one property against ``xp``; raises on the (shrunk) minimal failing case.

    ``max_examples`` defaults to the property's own budget; ``derandomize``
    defaults to the active hypothesis profile's setting.
    """
    if name not in PROPERTIES:
        raise ValueError(f"name: unknown property {name!r}; expected one of {sorted(PROPERTIES)}")
    prop = PROPERTIES[name]
    overrides = dict(
        max_examples=prop.max_examples if max_examples is None else max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much],
    )
    if derandomize is not None:
        overrides["derandomize"] = derandomize

    @settings(**overrides)
    @given(case=prop.strategy)
    def check(case: dict) -> None:
        prop.check(xp, case)

    check.__name__ = name
    check()


@dataclass
class PropertyFailure:
    """A violated property: its name, the error and hypothesis' minimal example."""

    name: str
    error: str
    minimal_example: str

    def __str__(self) -> str:
        return f"FAILED {self.name}\n  {self.error}\n  minimal example:\n{self.minimal_example}"


@dataclass
class NamespaceReport:
    """Outcome of :func:`check_namespace`; truthy when every property held."""

    namespace: str
    passed: list[str] = field(default_factory=list)
    failures: list[PropertyFailure] = field(default_factory=list)

    def __bool__(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        lines = [f"tmcore property suite on {self.namespace}: {len(self.passed)} passed, "
                 f"{len(self.failures)} failed"]
        lines += [f"  ok      {name}" for name in self.passed]
        lines += [str(failure) for failure in self.failures]
        return "\n".join(lines)


def _describe_failure(name: str, exc: BaseException) -> PropertyFailure:
    notes = [n for n in getattr(exc, "__notes__", []) if n.strip()]
    example = "\n".join(f"    {line}" for note in notes for line in note.splitlines())
    message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    first_line = message.splitlines()[0] if message else type(exc).__name__
    return PropertyFailure(name, first_line, example or "    (no example recorded)")


def check_namespace(xp: str | ModuleType, *, properties: list[str] | None = None,
                    max_examples: int | None = None, derandomize: bool = True,
                    raise_on_failure: bool = False) -> NamespaceReport:
    """Run the property suite on ``xp`` (a module or its dotted name).

    Parameters
    ----------
    xp : the array namespace, e.g. ``array_api_strict`` or ``"mlx.core"``.
    properties : names to run (default: all of :data:`PROPERTIES`).
    max_examples : per-property example budget (default: each property's own).
    derandomize : deterministic examples (default) for reproducible reports.
    raise_on_failure : raise ``AssertionError`` with the report if anything failed.

    Returns
    -------
    :class:`NamespaceReport` listing passed properties and failures with their
    minimal examples.
    """
    names = list(PROPERTIES) if properties is None else list(properties)
    unknown = sorted(set(names) - set(PROPERTIES))
    if unknown:
        raise ValueError(f"properties: unknown property {unknown}; expected names from "
                         f"{sorted(PROPERTIES)}")
    module = load_namespace(xp)
    report = NamespaceReport(getattr(module, "__name__", repr(module)))
    for name in names:
        try:
            run_property(module, name, max_examples=max_examples, derandomize=derandomize)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
            report.failures.append(_describe_failure(name, exc))
        else:
            report.passed.append(name)
    if raise_on_failure and report.failures:
        raise AssertionError(str(report))
    return report
