"""Old module paths kept for one release: each forwards to the module that now holds its
names, with a ``DeprecationWarning`` naming the new path and the removal version."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["REMOVAL", "forward"]

#: The release that removes the old paths.
REMOVAL = "0.3.0"


def forward(old: str, *new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old`` that finds each name in the modules ``new``."""

    def __getattr__(name: str) -> Any:
        for path in new:
            module = importlib.import_module(path)
            if hasattr(module, name):
                warnings.warn(f"{old} is deprecated: import {name} from {path} (the old path "
                              f"is removed in tmcore {REMOVAL})", DeprecationWarning,
                              stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
