"""The README's environment-variable table lists every variable tmcore reads, and only
those: the switches' variables, the process settings, the other tools' variables the
library asks for, and the tests' own."""

from __future__ import annotations

import re
from pathlib import Path

from tmcore.runtime import options

ROOT = Path(__file__).resolve().parents[2]


def _table() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Environment variables"):]
    section = section[:section.index("\n## ")]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row)}


def _read_by_code() -> set[str]:
    names = set(options.ENV_VARS.values())
    names |= {options.MEMORY_LIMIT_ENV_VAR, options.TIMEOUT_ENV_VAR}
    library = [*(ROOT / "tmcore").rglob("*.py"), *(ROOT / "backends").rglob("*.py"),
               *(ROOT / "adapters").rglob("*.py")]
    tests = [*(ROOT / "tests").rglob("*.py")]
    for path in library:
        text = path.read_text()
        # reads only: os.environ.get("X") or os.environ["X"] not followed by an assignment
        names |= set(re.findall(r"os\.environ(?:\.get\(|\[)\"([A-Z][A-Z0-9_]+)\"(?!\]\s*=[^=])",
                                text))
        names |= set(re.findall(r"environment\(\"([A-Z][A-Z0-9_]+)\"", text))
        names |= set(re.findall(r"\(\"([A-Z]+)\", \"[\w+]+\"\)", text))  # (CC, cc) tool pairs
    for path in tests:  # the tests' own switches
        names |= set(re.findall(r"\"(TMCORE_(?:SLOW_TESTS|TEST_[A-Z_]+))\"", path.read_text()))
    return names


def test_every_variable_read_is_in_the_readme_table():
    read = _read_by_code()
    assert {"TMCORE_TRITON_TF32", "TMCORE_CUDA_GRAPHS", "TMCORE_MEMORY_LIMIT", "CC",
            "TRITON_INTERPRET", "XDG_CACHE_HOME", "TMCORE_SLOW_TESTS"} <= read
    missing = read - _table()
    assert not missing, sorted(missing)


def test_the_table_lists_nothing_the_code_does_not_read():
    extra = _table() - _read_by_code()
    assert not extra, sorted(extra)
