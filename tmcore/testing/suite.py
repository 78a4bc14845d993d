"""The property suite as pytest items (see :mod:`tmcore.testing.pytest_plugin`)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tmcore.testing.kit import PROPERTIES, run_property, served_by


@pytest.mark.parametrize("name", list(PROPERTIES))
def test_tmcore_property(tmcore_namespace: ModuleType, tmcore_max_examples: int | None,
                         tmcore_time_budget: float | None, name: str) -> None:
    namespace = getattr(tmcore_namespace, "__name__", tmcore_namespace)
    print(f"{name} on {namespace}, served by {served_by(tmcore_namespace)}")
    run_property(tmcore_namespace, name, max_examples=tmcore_max_examples,
                 time_budget=tmcore_time_budget)
