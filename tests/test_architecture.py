"""The layout's rules, checked on the source: no import cycle among tmcore's modules, no
module importing another package's private names, no environment variable read outside
the options module.

Imports are read from the source: every ``import`` / ``from`` statement, those inside
functions and those under ``if TYPE_CHECKING:`` included (a type-only edge is still a
dependency a reader follows), and every ``importlib.import_module("literal")``. Importing
``a.b.c`` also runs the ``__init__`` of ``a.b``, so that counts as an import of ``a.b``
too (the root ``tmcore`` package, the public facade that imports its subpackages,
excepted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: folder -> the package it installs as
FOLDERS = {"tmcore": "tmcore", "backends": "tmcore.backends", "adapters": "tmcore.adapters"}
#: the one module that may read the environment
OPTIONS_MODULE = "tmcore.runtime.options"


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts and parts[0] == "testing":
                continue  # the kit for backend authors: not the library
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _package_of(name: str) -> str:
    return name if _is_package(name) else name.rpartition(".")[0]


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every import of ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package_of(name).split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out += [(base, alias.name, node.lineno) for alias in node.names]
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, None, node.lineno))
    return out


def _targets(importer: str, module: str, item: str | None) -> list[str]:
    """The library modules an import runs: the module (or ``module.item`` when that is a
    module) and the packages above it, except the root facade and the importer's own
    packages (already initializing when one of their modules runs)."""
    full = f"{module}.{item}" if item and f"{module}.{item}" in MODULES else module
    if full not in MODULES:
        return []
    parts = full.split(".")
    prefixes = [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
    return [p for p in prefixes if p in MODULES and p != importer
            and not (p != full and (importer + ".").startswith(p + "."))]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for module, item, _ in _imports(name):
            graph[name].update(_targets(name, module, item))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_layout():
    # a guard against a walk that finds nothing (and so passes everything)
    assert {"tmcore.layer.layer", "tmcore.scan.dense", "tmcore.ops.sample",
            "tmcore.runtime.options", "tmcore.adapters.hf"} <= set(MODULES)
    assert "tmcore.runtime.dispatch" in _graph()["tmcore.ops.sample"]


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_type_checking_and_by_name_imports_are_edges(tmp_path, monkeypatch):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nimport importlib\n"
                    "if TYPE_CHECKING:\n    from tmcore.layer import state\n"
                    "importlib.import_module('tmcore.ops')\n")
    monkeypatch.setitem(MODULES, "tmcore.planted", path)
    assert {m for m, _, _ in _imports("tmcore.planted")} >= {"tmcore.layer", "tmcore.ops"}


def test_cycle_detection_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_private_name_crosses_a_package():
    bad = []
    for name in MODULES:
        for module, item, line in _imports(name):
            if not module.startswith("tmcore") or module == "tmcore":
                continue
            owner = _package_of(module) if module in MODULES else module.rpartition(".")[0]
            private = [part for part in module.split(".") if part.startswith("_")
                       and not part.startswith("__")]
            if item and item.startswith("_") and not item.startswith("__"):
                private.append(item)
            if private and owner != _package_of(name):
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{line}: {module}"
                           + (f" import {item}" if item else ""))
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_environment_read_only_by_the_options_module(name):
    if name == OPTIONS_MODULE:
        return
    tree = ast.parse(MODULES[name].read_text())
    reads = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
             and isinstance(node.value, ast.Name) and node.value.id == "os"]
    assert not reads, f"{name} reads the environment at lines {reads}: use tmcore.options"


def test_options_read_no_private_interpreter_state():
    text = MODULES[OPTIONS_MODULE].read_text()
    assert "_data" not in text and "encodekey" not in text
