"""The README's Python examples run as written (those whose framework is installed)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _needs(block: str) -> list[str]:
    return [m for m in ("torch", "jax", "flax", "cupy") if re.search(rf"^\s*(import|from) {m}\b",
                                                                 block, flags=re.M)]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int) -> None:
    block = BLOCKS[index]
    for module in _needs(block):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"README block {index} needs {module}, which is not installed")
    namespace: dict = {}
    exec(compile(block, f"README.md[python block {index}]", "exec"), namespace)


def test_readme_has_examples() -> None:
    assert BLOCKS, "README lost its runnable examples"
