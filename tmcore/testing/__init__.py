"""Ground truth and the backend kit (NumPy and hypothesis are allowed here only).

- :mod:`tmcore.testing.reference`: plain float64 NumPy references (loops).
- :mod:`tmcore.testing.finite_diff`: central differences, relative errors.
- :mod:`tmcore.testing.strategies`: hypothesis strategies for tmcore inputs.
- :mod:`tmcore.testing.properties`: the property suite, :data:`PROPERTIES`.
- :func:`check_namespace`: run the suite on any array namespace; also as a
  pytest plugin (``--tmcore-namespace``, ``--tmcore-max-examples``,
  ``--tmcore-time-budget``). :func:`require_float64` is its up-front check.

Names are loaded lazily, so the pytest plugin (registered for every pytest run
where tmcore is installed) costs nothing and needs neither NumPy nor
hypothesis until the suite is actually used.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "PROPERTIES",
    "NamespaceReport",
    "PropertyFailure",
    "check_namespace",
    "load_namespace",
    "require_float64",
    "run_property",
]

_HOME = {name: "tmcore.testing.kit" for name in __all__}
_HOME["PROPERTIES"] = "tmcore.testing.properties"


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'tmcore.testing' has no attribute {name!r}")
