"""Refuse, at ``import tmcore``, a checkout that is not installed.

``tmcore.backends`` and ``tmcore.adapters`` are the repository's ``backends/``
and ``adapters/`` folders, which only the install maps to those names
(setuptools ``package-dir``; an editable install maps them too). Imported from
a bare checkout (the repository root on ``sys.path``), ``tmcore`` alone would
be found: every fast path would silently be missing and the adapters could not
be imported. This module turns that into one clear ``ImportError``. It looks
the subpackage up without importing it, so no framework is imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__: list[str] = []

if importlib.util.find_spec("tmcore.backends") is None:
    _here = Path(__file__).resolve().parent
    raise ImportError(
        f"tmcore is imported from {_here} without being installed, so tmcore.backends and "
        "tmcore.adapters (the folders backends/ and adapters/ beside it, mapped to those "
        f"names by the install) cannot be found. Install the checkout: pip install -e "
        f"{_here.parent} (then import tmcore from anywhere)."
    )
