"""The documentation builds clean, and the Examples in the algebra's docstrings run.

The Sphinx build (``make docs``) turns every warning into an error: a broken
cross-reference, a docstring that numpydoc cannot parse or that fails its validation
(``numpydoc_validation_checks`` in docs/conf.py), a guide missing from the toctree.
It writes into a temporary folder (the generated API stubs go to docs/generated,
which git ignores).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Modules whose docstring Examples run here (as doctests).
DOCTEST_MODULES = ("tmcore.ops.sample", "tmcore.ops.splat", "tmcore.scan", "tmcore.ops.conv",
                   "tmcore.ops.cell", "tmcore.ops.addressing", "tmcore.testing.finite_diff")


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def test_docs_build_with_warnings_as_errors(tmp_path):
    missing = _missing("sphinx", "numpydoc", "myst_parser")
    if missing:
        pytest.skip(f"building the docs needs {', '.join(missing)} (the docs extra)")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-6000:]
    html = tmp_path / "html"
    for page in ("index.html", "api.html", "generated/tmcore.trilinear_sample.html",
                 "guides/conventions.html", "guides/pytorch.html", "changelog.html"):
        assert (html / page).is_file(), page
    text = (html / "generated" / "tmcore.trilinear_sample.html").read_text()
    assert "Parameters" in text and "Raises" in text and "Examples" in text


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_the_main_functions_have_examples():
    import tmcore

    for fn in (tmcore.trilinear_sample, tmcore.gaussian_splat, tmcore.memory_scan):
        assert ">>> " in (fn.__doc__ or ""), fn.__name__


def test_every_repository_path_the_docs_name_exists():
    """A guide that names a file (`tmcore/layer/plan.py`, `tests/scan/`) names one that
    exists: the re-layout moved many; this catches the next move a guide misses."""
    import re

    pattern = re.compile(r"`((?:tmcore|backends|adapters|tests|examples|benchmarks|docs)"
                         r"/[\w./-]*[\w/])(?:::\w+)?`")
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS.rglob("*.md"),
             *(ROOT / "examples").rglob("README.md")]
    named = [(page.relative_to(ROOT), path) for page in pages if page.exists()
             for path in pattern.findall(page.read_text())
             if "*" not in path and not path.startswith("docs/_build")]
    assert len(named) > 50
    missing = [f"{page}: {path}" for page, path in named if not (ROOT / path).exists()]
    assert not missing, missing
