"""The Python examples of the README and the guides run as written (those whose framework
is installed)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The README and the guides its sections moved to: their ```python blocks are whole
#: programs. (Other guides show fragments of a longer program in their blocks.)
MOVED = ("conventions", "pytorch", "jax", "streaming", "modes", "distributed", "backends",
         "adding-a-backend", "experiments", "benchmarks")
PAGES = [README, *(ROOT / "docs" / "guides" / f"{name}.md" for name in MOVED),
         ROOT / "docs" / "LAYER.md"]
BLOCKS = [(page, index, block) for page in PAGES if page.exists()
          for index, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(),
                                                   flags=re.S))]


def _needs(block: str) -> list[str]:
    return [m for m in ("torch", "jax", "flax", "cupy", "transformers")
            if re.search(rf"^\s*(import|from) {m}\b", block, flags=re.M)]


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}[{i}]" for p, i, _ in BLOCKS])
def test_python_block_runs(page: Path, index: int, block: str) -> None:
    for module in _needs(block):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{page.name} block {index} needs {module}, which is not installed")
    namespace: dict = {}
    code = compile(block, f"{page.relative_to(ROOT)}[python block {index}]", "exec")
    if "jax" in _needs(block):  # as in a fresh process: other tests may have enabled x64
        import jax

        with jax.enable_x64(False):
            exec(code, namespace)
        return
    exec(code, namespace)


def test_readme_has_examples() -> None:
    assert any(page == README for page, _, _ in BLOCKS), "README lost its runnable examples"


def test_readme_suite_figures_are_rendered_from_the_results_file() -> None:
    """The README's suite time and test count are ``suite_time.json`` rendered (by
    ``python -m benchmarks.suite_time --render``), not typed in."""
    import json

    from benchmarks.suite_time import MARKERS, OUT, render, render_readme

    result = json.loads(OUT.read_text())
    assert result["returncode"] == 0 and result["commit"]
    text = README.read_text()
    assert render_readme(result) == text, "run python -m benchmarks.suite_time --render"
    start, end = (text.index(marker) for marker in MARKERS)
    assert text[start + len(MARKERS[0]):end].strip() == render(result)
    passed = re.search(r"(\d+) passed", result["pytest_summary"]).group(1)
    assert f"{int(passed):,} tests passed" in render(result)
    assert not re.search(r"\d[\d,]* tests\b", text[:start] + text[end:]), \
        "a test count outside the rendered line"
