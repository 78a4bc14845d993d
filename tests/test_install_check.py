"""A checkout used without installing fails loudly at ``import tmcore`` (not a silent
generic-only tmcore whose adapters cannot be imported)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
