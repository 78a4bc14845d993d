"""tmcore's property suite on NumPy and array_api_strict, run through the kit.

The properties themselves live in :mod:`tmcore.testing.properties` so that
people bringing a new namespace run exactly these checks
(``tmcore.testing.check_namespace(xp)`` or the pytest plugin). Here each one
runs on every namespace of the ``xp`` fixture. Plus: outputs keep the input
dtype and namespace, and ``import tmcore`` pulls in no framework.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tmcore.testing import PROPERTIES, run_property

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(PROPERTIES))
def test_property(xp: ModuleType, name: str) -> None:
    run_property(xp, name)


def _assert_namespace(xp: ModuleType, *arrays: Any) -> None:
    kind = type(xp.asarray(0.0))
    for a in arrays:
        assert isinstance(a, kind), f"expected a {kind.__name__}, got {type(a).__name__}"


# ----------------------------------------------------------------------------- imports

FRAMEWORKS = ("torch", "jax", "jaxlib", "cupy")


def test_import_tmcore_imports_no_framework():
    code = (
        "import sys, tmcore\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"import tmcore imported: {result.stdout.strip()}"


def _forbidden_imports(path: Path, forbidden: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        for name in names:
            if name.split(".")[0] in forbidden:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    return found


def test_tmcore_sources_import_only_the_array_api():
    """No file under tmcore/ (except tmcore/testing) imports a framework or NumPy."""
    forbidden = {"torch", "jax", "jaxlib", "cupy", "numpy"}
    files = [p for p in sorted((REPO / "tmcore").rglob("*.py"))
             if "testing" not in p.relative_to(REPO / "tmcore").parts]
    assert files, "no tmcore sources found"
    found = [hit for p in files for hit in _forbidden_imports(p, forbidden)]
    assert not found, "forbidden imports:\n" + "\n".join(found)


def test_tmcore_testing_imports_no_framework():
    """tmcore.testing may use NumPy and hypothesis, but never torch, jax or cupy."""
    files = sorted((REPO / "tmcore" / "testing").rglob("*.py"))
    found = [hit for p in files for hit in _forbidden_imports(p, set(FRAMEWORKS))]
    assert not found, "forbidden imports:\n" + "\n".join(found)
