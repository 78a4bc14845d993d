"""A checkout used without installing fails loudly at ``import tmcore`` (not a silent
generic-only tmcore whose adapters cannot be imported)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Drops the install's mapping (an editable install's finder; a regular install is shadowed
# by the checkout first on sys.path), so only the bare folders of the checkout are seen.
_BARE = f"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, {str(ROOT)!r})
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_a_bare_checkout_is_refused_with_the_install_command():
    result = _run(_BARE + "import tmcore\n")
    assert result.returncode != 0
    assert "ImportError: tmcore is imported from" in result.stderr
    assert "without being installed" in result.stderr and "pip install -e" in result.stderr
    assert str(ROOT) in result.stderr


def test_the_installed_package_imports_its_backends_without_a_framework():
    result = _run("import sys, tmcore, tmcore.backends\n"
                  "print(tmcore.backends.__name__, 'torch' in sys.modules, 'jax' in sys.modules)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["tmcore.backends", "False", "False"]


def test_pyproject_lists_every_package_folder():
    # the install's package list is explicit: a subpackage missing from it (a module
    # turned into a package, e.g. tmcore.adapters.jax) would be left out of the wheel
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"tmcore": "tmcore", "backends": "tmcore.backends", "adapters": "tmcore.adapters"}
    found = set()
    for folder, package in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert {"tmcore.adapters.torch", "tmcore.adapters.jax"} <= found  # the walk sees them
    assert sorted(found - set(setup["packages"])) == []
