"""Ground truth and the backend kit (NumPy and hypothesis are allowed here only).

- :mod:`tmcore.testing.reference`: plain float64 NumPy references (loops).
- :mod:`tmcore.testing.finite_diff`: central differences, relative errors.
- :mod:`tmcore.testing.strategies`: hypothesis strategies for tmcore inputs.
- :mod:`tmcore.testing.properties`: the property suite, :data:`PROPERTIES`.
- :mod:`tmcore.testing.properties_dtypes`: every public function in every dtype.
- :func:`check_namespace`: run the suite on any array namespace, with the backends
  registered or with yours (``backend="module:make_ops"``); also as a pytest plugin
  (``--tmcore-namespace``, ``--tmcore-backend``, ``--tmcore-max-examples``,
  ``--tmcore-time-budget``) and ``python -m tmcore.testing``.

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
    "load_make_ops",
    "load_namespace",
    "registered_backend",
    "require_float64",
    "run_property",
    "served_by",
]

_HOME = {name: "tmcore.testing.kit" for name in __all__}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'tmcore.testing' has no attribute {name!r}")
