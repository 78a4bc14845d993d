"""The docs name only what exists: every module, op, API name and holding the README and
docs/ state is checked against the code (imported, looked up, parsed), not trusted.

What a page claims, and how it is checked:

- a dotted name ``tmcore.x.y`` (and ``tmj.f`` / ``hf.f``, the guides' aliases of
  ``tmcore.adapters.jax`` / ``.hf``): the longest importable module prefix, then getattr;
- an op ``torch.ops.tmcore.name`` or ``tmcore::name``: registered once the torch adapter is
  imported;
- a table under a heading that names a module (``## `tmcore.layer` API``): the names of
  each row's first cell are that module's (``.attr`` entries: of the row's class);
- a module followed by names in parentheses (```tmcore.scan.options` (`scan_fwd`, ...)``):
  each library name before the first ``:`` / ``;`` is an attribute of that module;
- ``Class.attr`` of a library class: the class has it (a dataclass / NamedTuple field, a
  method, or an attribute its ``__init__`` sets);
- ```file.py`'s `name``: the file defines or imports it; a table row or bullet that starts
  with a library file (``| `tmcore/layer/plan.py` | ...``,
  ``- `modules.py`: ...`` under a heading naming ``adapters/torch/``): every library name
  it lists outside parentheses is defined or imported in that file, every one inside them
  appears in that file (these rows say where a thing lives);
- ``python -m module``: the module exists; ``TMCORE_*``: a variable the code or the
  Makefile reads;
- a sentence that says the JAX scan unrolls its chunk loop: the jaxpr says it does not.

The CHANGELOG is history (it names what was removed) and is not checked. Repository paths
are checked by ``tests/test_docs.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md")
                                       if "_build" not in p.parts and p.name != "changelog.md")])
#: folder -> the package it installs as (the library, tmcore/testing included: it is public)
FOLDERS = {"tmcore": "tmcore", "backends": "tmcore.backends", "adapters": "tmcore.adapters"}
ALIASES = {"tmj": "tmcore.adapters.jax", "hf": "tmcore.adapters.hf"}
#: where a bare class name in ``Class.attr`` is looked up, in order
NAMESPACES = ("tmcore", "tmcore.layer", "tmcore.scan", "tmcore.types", "tmcore.adapters.torch",
              "tmcore.adapters.jax", "tmcore.adapters.hf", "tmcore.backends",
              "tmcore.runtime.options", "tmcore.runtime.dispatch", "tmcore.testing")

_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"```.*?```", re.S)


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _prose(text: str) -> str:
    """The page without its fenced code blocks (fragments with local names; dotted names
    and ops are read from them too)."""
    return _FENCE.sub("", text)


# --------------------------------------------------------------------------- resolving


class Missing(Exception):
    """A name the docs state that the code does not have."""


class Unavailable(Exception):
    """A name that needs a framework that is not installed (not checked here)."""


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name and not error.name.startswith("tmcore"):
            raise Unavailable(f"{module} needs {error.name}") from None
        raise


def resolve(dotted: str) -> Any:
    """The object ``dotted`` names (``tmcore.layer.Layer.forward``); ``Missing`` if none."""
    for alias, module in ALIASES.items():
        if dotted.startswith(alias + "."):
            dotted = module + dotted[len(alias):]
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        try:
            obj = _import(module)
        except ModuleNotFoundError:
            continue
        for index, attr in enumerate(parts[end:], start=end):
            obj = _attribute(obj, attr, ".".join(parts[:index]))
        return obj
    raise Missing(dotted)


def _attribute(obj: Any, attr: str, owner: str) -> Any:
    if hasattr(obj, attr):
        return getattr(obj, attr)
    if isinstance(obj, type) and attr in _init_attributes(obj):
        return None  # an attribute each instance gets in __init__
    raise Missing(f"{owner} has no {attr}")


def _init_attributes(cls: type) -> set[str]:
    """The ``self.<name> = ...`` assignments of ``cls.__init__`` (and its bases')."""
    import inspect

    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        try:
            tree = ast.parse(inspect.getsource(init).strip().replace("\n    ", "\n"))
        except (TypeError, OSError, SyntaxError):
            continue
        names |= {node.attr for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "self" and isinstance(node.ctx, ast.Store)}
    return names


@functools.cache
def library_files() -> dict[str, Path]:
    """Repository path -> file, for every Python file of the library."""
    return {path.relative_to(ROOT).as_posix(): path for folder in FOLDERS
            for path in sorted((ROOT / folder).rglob("*.py"))}


@functools.cache
def definitions(path: str) -> dict[str, set[str]]:
    """Top-level names ``path`` defines (functions, classes, assignments), each with the
    attributes of its body (a class's methods and fields)."""
    tree = ast.parse(library_files()[path].read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = getattr(node, "body", []) if isinstance(node, ast.ClassDef) else []
            found[node.name] = {n.name for n in body if isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))} | {
                t.id for n in body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    found[target.id] = set()
    return found


@functools.cache
def imported(path: str) -> set[str]:
    """The names ``path`` imports (``from a import b as c``: ``c``)."""
    tree = ast.parse(library_files()[path].read_text())
    return {alias.asname or alias.name.partition(".")[0] for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}


@functools.cache
def defined_anywhere() -> dict[str, set[str]]:
    """Top-level name -> the library files that define it."""
    where: dict[str, set[str]] = {}
    for path in library_files():
        for name in definitions(path):
            where.setdefault(name, set()).add(path)
    return where


def resolve_class_attribute(cls_name: str, attr: str) -> None:
    """``Missing`` unless a library class ``cls_name`` has ``attr``."""
    for namespace in NAMESPACES:
        try:
            module = _import(namespace)
        except Unavailable:
            continue
        cls = getattr(module, cls_name, None)
        if isinstance(cls, type):
            _attribute(cls, attr, cls_name)
            return
    homes = defined_anywhere().get(cls_name, set())
    if not any(attr in definitions(home)[cls_name] for home in homes):
        raise Missing(f"{cls_name}.{attr}")


# --------------------------------------------------------------------------- extracting

_DOTTED = re.compile(r"(?<![\w./-])((?:tmcore|tmj|hf)(?:\.[A-Za-z_]\w*)+)")
_OPS = re.compile(r"torch\.ops\.tmcore\.(\w+)|(?<![\w.])tmcore::(\w+)")
_CLASS_ATTR = re.compile(r"^([A-Z]\w*)\.([A-Za-z_]\w*)(?:\(.*\))?$")


_FILE_SUFFIXES = ("py", "md", "json", "c", "cc", "txt", "toml", "png")


def dotted_names(text: str) -> set[str]:
    """``tmcore.x.y`` / ``tmj.f`` / ``hf.f`` (a file name such as ``hf.py`` left out)."""
    return {m.group(1) for m in _DOTTED.finditer(text)
            if m.group(1).rpartition(".")[2] not in _FILE_SUFFIXES}


def op_names(text: str) -> set[str]:
    return {a or b for a, b in _OPS.findall(text)}


_MODULE_LIST = re.compile(r"`(tmcore(?:\.\w+)+)`\s*\(([^()]*)\)")


def module_members(text: str) -> set[str]:
    """``module.name`` for each library name listed in parentheses after a module (a
    name that is not the library's, or a module that does not resolve, is left to the
    other rules)."""
    import types

    found = set()
    for module, inside in _MODULE_LIST.findall(_prose(text)):
        try:
            if not isinstance(resolve(module), types.ModuleType):
                continue
        except (Missing, Unavailable, AttributeError, ModuleNotFoundError):
            continue
        for name in _identifiers(re.split(r"[:;]", inside)[0]):
            if name.partition(".")[0] in defined_anywhere():
                found.add(f"{module}.{name}")
    return found


def module_tables(text: str) -> set[str]:
    """``module.name`` for the first-cell names of the tables under a heading naming a
    module."""
    import types

    found: set[str] = set()
    module = None
    for line in _prose(text).splitlines():
        if line.startswith("#"):
            named = re.search(r"`(tmcore(?:\.\w+)*)`", line)
            try:
                module = named.group(1) if named and isinstance(
                    resolve(named.group(1)), types.ModuleType) else None
            except (Missing, Unavailable, AttributeError, ModuleNotFoundError):
                module = named.group(1)  # a heading naming a module that does not exist
            continue
        if module is None or not line.startswith("|"):
            continue
        owner = None
        for span in _CODE_SPAN.findall(line.split("|")[1]):
            span = span.split("(")[0].strip()
            if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)?", span):
                found.add(f"{module}.{span}")
                owner = owner or span.partition(".")[0]
            elif re.fullmatch(r"\.\w+", span) and owner:
                found.add(f"{module}.{owner}{span}")
    return found


def class_attributes(text: str) -> set[tuple[str, str]]:
    """``Class.attr`` spans whose class the library defines (torch's, JAX's are not ours)."""
    spans = {m.group(1) for m in _CODE_SPAN.finditer(_prose(text))}
    found = set()
    for span in spans:
        for part in re.split(r"\s*/\s*", span):
            match = _CLASS_ATTR.match(part.strip())
            if match and match.group(1) in defined_anywhere():
                found.add((match.group(1), match.group(2)))
    return found


def _strip_parentheses(text: str) -> tuple[str, str]:
    """``(outside, inside)`` of the parentheses of ``text`` (nested ones count as inside)."""
    outside, inside, depth = [], [], 0
    for char in text:
        if char == "(":
            depth += 1
        if depth:
            inside.append(char)
        else:
            outside.append(char)
        if char == ")" and depth:
            depth -= 1
    return "".join(outside), "".join(inside)


def _identifiers(text: str) -> set[str]:
    """Backticked bare names and ``Class.attr`` spans (calls' arguments dropped)."""
    names = set()
    for span in _CODE_SPAN.findall(text):
        span = span.split("(")[0].strip()
        if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", span):
            names.add(span)
    return names


_HOLDER = re.compile(r"^\s*(?:\|\s*|[-*]\s+)`([\w/.-]+\.py)`\s*(?:\||:)(.*)$")
_HEADING_FOLDER = re.compile(r"^#+ .*`((?:tmcore|backends|adapters)/[\w/]*)`")


_POSSESSIVE = re.compile(r"`([\w/.-]+\.py)`'s\s+(`\w+`)")


def holdings(text: str) -> list[tuple[str, str, int]]:
    """``(library file, what the row / bullet says it holds, line)`` of each table row or
    bullet that starts with a file (a bullet goes on over its indented lines), and of each
    ```file.py`'s `name```."""
    found = [(path, name, text[:m.start()].count("\n") + 1)
             for m in _POSSESSIVE.finditer(_prose(text)) for path, name in [m.groups()]]
    folder = ""
    lines = _prose(text).splitlines()
    for number, line in enumerate(lines, start=1):
        heading = _HEADING_FOLDER.match(line)
        if heading:
            folder = heading.group(1).rstrip("/") + "/"
        elif line.startswith("#"):
            folder = ""
        match = _HOLDER.match(line)
        if not match:
            continue
        path, rest = match.groups()
        if path not in library_files():
            path = folder + path
        if line.lstrip().startswith(("-", "*")):
            for follow in lines[number:]:
                if not follow.startswith("  ") or _HOLDER.match(follow):
                    break
                rest += " " + follow.strip()
        found.append((path, rest, number))
    return found


def holding_errors(path: str, claim: str) -> list[str]:
    if path not in library_files():
        return [f"{path}: no such library file"]
    outside, inside = _strip_parentheses(claim)
    source = library_files()[path].read_text()
    errors = []
    for name in sorted(_identifiers(outside)):
        owner, _, attr = name.partition(".")
        if owner not in defined_anywhere():
            continue  # not a library name (an argument, torch's nn.Linear, ...)
        here = definitions(path)
        if owner not in here and owner not in imported(path):
            errors.append(f"{name} is neither defined nor imported in {path} (it is "
                          f"defined in {', '.join(sorted(defined_anywhere()[owner]))})")
        elif attr and attr not in here[owner]:
            errors.append(f"{owner} in {path} has no {attr}")
    for name in sorted(_identifiers(inside)):
        word = name.rpartition(".")[2]
        if name.partition(".")[0] in defined_anywhere() and not re.search(
                rf"\b{re.escape(word)}\b", source):
            errors.append(f"{name} does not appear in {path}")
    return errors


# --------------------------------------------------------------------------- the checks


def _check(page: Path, claims: set, check) -> tuple[list[str], list[str]]:
    missing, unchecked = [], []
    for claim in sorted(claims):
        try:
            check(claim)
        except Unavailable as why:
            unchecked.append(f"{claim}: {why}")
        except (Missing, AttributeError, ModuleNotFoundError) as why:
            missing.append(f"{_rel(page)}: {claim}: {why}")
    return missing, unchecked


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_modules_and_api_names_exist(page: Path) -> None:
    text = page.read_text()
    missing, unchecked = _check(
        page, dotted_names(text) | module_members(text) | module_tables(text), resolve)
    more, skipped = _check(page, class_attributes(text),
                           lambda claim: resolve_class_attribute(*claim))
    assert not missing + more, "\n".join(missing + more)
    if unchecked + skipped and not missing + more:
        pytest.skip("; ".join(unchecked + skipped)[:500])


def test_every_page_is_read_and_names_are_found() -> None:
    """The extraction finds what the pages state (a regex that finds nothing passes all)."""
    names = set().union(*(dotted_names(p.read_text()) for p in PAGES))
    assert {"tmcore.options", "tmcore.adapters.torch", "tmj.apply", "hf.attach_memory"} <= names
    assert len(names) > 60
    assert ("TensorMemory", "forward") in set().union(
        *(class_attributes(p.read_text()) for p in PAGES))
    assert len([h for p in PAGES for h in holdings(p.read_text())]) >= 15
    layer = (ROOT / "docs" / "LAYER.md").read_text()
    assert {"tmcore.layer.Layer.heads", "tmcore.layer.doc_starts_from_offsets"} <= \
        module_tables(layer)
    assert ("adapters/jax/bridge.py", "`checkpoint_scan`") in {
        h[:2] for h in holdings((ROOT / "docs" / "guides" / "architecture.md").read_text())}


def test_named_ops_are_registered() -> None:
    pytest.importorskip("torch", reason="the ops are torch's")
    import torch

    import tmcore.adapters.torch  # noqa: F401  (registers the ops)

    named = [(page, name) for page in PAGES for name in op_names(page.read_text())]
    assert len(named) >= 5
    missing = [f"{_rel(page)}: tmcore::{name}" for page, name in named
               if not hasattr(torch.ops.tmcore, name)]
    assert not missing, missing


def test_files_hold_what_the_docs_say() -> None:
    errors = [f"{_rel(page)}:{line}: {error}" for page in PAGES
              for path, claim, line in holdings(page.read_text())
              for error in holding_errors(path, claim)]
    assert not errors, "\n".join(errors)


def test_the_extractors_catch_a_stale_claim() -> None:
    """Each rule fails on a false claim of the kind it exists for."""
    with pytest.raises(Missing):
        resolve("tmcore.adapters._torch_local")
    with pytest.raises((Missing, AttributeError)):
        resolve("tmj.no_such_function")
    with pytest.raises(Missing):
        resolve_class_attribute("LayerConfig", "no_such_method")
    row = "- `modules.py`: `TensorMemory` (runs `Layer.forward`), `MemoryHandle`."
    (path, claim, _), = holdings("## PyTorch (`adapters/torch/`)\n\n" + row)
    assert path == "adapters/torch/modules.py"
    assert holding_errors(path, claim) == [
        "MemoryHandle is neither defined nor imported in adapters/torch/modules.py (it is "
        "defined in adapters/torch/attach.py)"]
    assert holding_errors(path, "`TensorMemory` (a `MemoryHandle`)") == [
        "MemoryHandle does not appear in adapters/torch/modules.py"]
    assert module_tables("## `tmcore.layer` API\n\n| `Layer(config)`: `.scan` |") == {
        "tmcore.layer.Layer", "tmcore.layer.Layer.scan"}
    with pytest.raises(Missing):
        resolve("tmcore.layer.Layer.scan")
    assert module_members("`tmcore.scan.warped` (`dynamic_memory_scan`: the scan)") == {
        "tmcore.scan.warped.dynamic_memory_scan"}
    with pytest.raises(Missing):
        resolve("tmcore.scan.warped.dynamic_memory_scan")
    assert op_names("`tmcore::dynamic_scan` and `torch.ops.tmcore.memory_scan`") == {
        "dynamic_scan", "memory_scan"}


def test_named_commands_and_environment_variables_exist() -> None:
    from tmcore.runtime.options import ENV_VARS

    code = "\n".join([(ROOT / "Makefile").read_text(), *(
        p.read_text() for folder in ("tmcore", "backends", "adapters", "tests")
        for p in (ROOT / folder).rglob("*.py"))])
    known = set(re.findall(r"\bTMCORE_\w+", code)) | set(ENV_VARS.values())
    missing = []
    for page in PAGES:
        text = page.read_text()
        missing += [f"{_rel(page)}: python -m {m}" for m in set(re.findall(
            r"python -m ([\w.]+)", text)) if importlib.util.find_spec(m) is None]
        missing += [f"{_rel(page)}: {v}" for v in set(re.findall(r"\bTMCORE_\w+", text))
                    if v not in known]
    assert not missing, missing


_UNROLL = re.compile(r"[^.]*\bunroll\w*[^.]*\.", re.I)


def test_the_jax_scan_is_one_loop_as_the_docs_say() -> None:
    """No page says the JAX adapter unrolls the chunk loop, and it does not: a jitted
    ``apply`` of ``T`` chunks (dense, local, warped) holds one ``scan`` of length ``T``."""
    sentences = [f"{_rel(p)}: {s.strip()}" for p in PAGES for s in _UNROLL.findall(
        _prose(p.read_text())) if "jax" in s.lower() or "jit" in s.lower()]
    unrolled = [s for s in sentences if not re.search(r"\bnot unroll|does not unroll", s)]
    assert not unrolled, unrolled
    jax = pytest.importorskip("jax", reason="the JAX adapter needs jax")
    from tmcore.adapters import jax as tmj

    chunks = 5
    x = jax.numpy.zeros((1, 4 * chunks, 8))
    for options in ({}, {"update": "local", "window": 2}, {"dynamics": "warp"}):
        params = tmj.init(jax.random.key(0), 8, 2, (3, 3), 4, **options)
        jaxpr = jax.make_jaxpr(lambda p, x: tmj.apply(p, x)[0])(params, x)
        lengths = [eqn.params["length"] for eqn in _equations(jaxpr.jaxpr)
                   if eqn.primitive.name == "scan"]
        assert lengths == [chunks], (options, lengths)


def _equations(jaxpr: Any) -> list:
    """Every equation of ``jaxpr`` and of the jaxprs it calls (a scan's body not)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        if eqn.primitive.name == "scan":
            continue
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                out += _equations(inner)
            elif hasattr(value, "eqns"):
                out += _equations(value)
    return out
