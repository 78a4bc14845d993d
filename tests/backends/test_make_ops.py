"""The public backend registry: ``tmcore.backends.register_backend`` and its inverse.

A backend written outside tmcore registers the way the built-in ones do, serves its
namespace at once (the dispatch cache is emptied on every registration; nobody touches a
private table), is imported lazily when given by name, and comes back out. Installed
packages register through the ``tmcore.backends`` entry-point group, read on the first
lookup (subprocesses with a hand-made distribution on ``sys.path``). The dispatch finds
backends by push, not by importing ``tmcore.backends`` or ``tmcore.ops`` by name.
"""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import array_api_compat
import numpy as np
import pytest

import tmcore
import tmcore.backends as backends
from tmcore.runtime.dispatch import generic_ops, ops_for

REPO = Path(__file__).resolve().parents[2]
XP = array_api_compat.array_namespace(np.empty(0))


@pytest.fixture
def counting_backend():
    """A NumPy backend defined here: the generic table with a read that counts its calls."""
    reads = []

    def make_ops(generic, options):
        def sample_fwd(xp, volume, coords):
            reads.append(coords.shape[1])
            return generic.sample_fwd(xp, volume, coords)

        return generic._replace(sample_fwd=sample_fwd)

    backend = backends.register_backend("counting", array_api_compat.is_numpy_namespace,
                                        make_ops)
    yield backend, reads
    with contextlib.suppress(ValueError):  # the test may have unregistered it already
        backends.unregister_backend("counting")


def _read(n_queries: int = 5) -> np.ndarray:
    rng = np.random.default_rng(1)
    volume = rng.standard_normal((1, 2, 3, 4))  # (B, C, *S), n = 2
    coords = rng.uniform(-1.2, 1.2, (1, n_queries, 2))  # (B, Q, n), some beyond the border
    out = tmcore.trilinear_sample(volume, coords)
    np.testing.assert_allclose(out, generic_ops().sample_fwd(XP, volume, coords), rtol=1e-15)
    return out


def test_a_registered_backend_serves_numpy_at_once_and_unregisters(counting_backend):
    backend, reads = counting_backend
    assert backends.backend_name(XP) == "counting"
    assert backends.backend_for(XP) is backend and backend.module == __name__
    _read(5)
    assert reads == [5]  # its entry ran: the cached built-in table was forgotten
    assert ops_for(XP).sample_bwd is generic_ops().sample_bwd
    with tmcore.options(generic=True):
        _read(5)  # forced generic bypasses it
    assert reads == [5]
    assert backends.unregister_backend("counting") is backend
    assert backends.backend_name(XP) == "numpy"
    _read(3)
    assert reads == [5]  # gone from the dispatch too
    assert backends.backend_for(XP).make_ops == "tmcore.backends.numpy:make_ops"


def test_registering_a_name_again_replaces_it(counting_backend):
    backend, reads = counting_backend
    again = backends.register_backend("counting", array_api_compat.is_numpy_namespace,
                                      lambda generic, options: generic)
    assert backends.backend_for(XP) is again
    _read()
    assert reads == []
    assert backends.unregister_backend("counting") is again
    assert backends.backend_name(XP) == "numpy"  # one registration, one removal


def test_a_backend_named_by_string_is_imported_when_its_arrays_arrive(tmp_path, monkeypatch):
    (tmp_path / "lazy_backend.py").write_text(textwrap.dedent("""
        CALLS = []

        def make_ops(generic, options):
            CALLS.append(options)
            return generic
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    backends.register_backend("lazy", array_api_compat.is_numpy_namespace,
                              "lazy_backend:make_ops")
    try:
        assert "lazy_backend" not in sys.modules
        assert backends.backend_for(XP).module == "lazy_backend"
        _read()
        assert sys.modules["lazy_backend"].CALLS == [tmcore.get_options()]
    finally:
        backends.unregister_backend("lazy")
        sys.modules.pop("lazy_backend", None)


def test_a_backend_whose_framework_is_not_imported_serves_nothing(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "never_imported.py").write_text("raise AssertionError('imported')\n")
    backends.register_backend("absent", array_api_compat.is_numpy_namespace,
                              "never_imported:make_ops", requires="no_such_framework")
    try:
        assert backends.backend_for(XP) is None and backends.backend_name(XP) == "generic"
        assert ops_for(XP) is generic_ops()
        _read()
        assert "never_imported" not in sys.modules
    finally:
        backends.unregister_backend("absent")


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), [
    (("", array_api_compat.is_numpy_namespace, "m:f"), {}, ValueError, "name"),
    ((3, array_api_compat.is_numpy_namespace, "m:f"), {}, TypeError, "name"),
    (("x", "numpy", "m:f"), {}, TypeError, "is_namespace"),
    (("x", array_api_compat.is_numpy_namespace, "module_without_function"), {}, ValueError,
     "make_ops: expected 'module:function'"),
    (("x", array_api_compat.is_numpy_namespace, 3), {}, TypeError, "make_ops"),
    (("x", array_api_compat.is_numpy_namespace, "m:f"), {"requires": 1}, TypeError, "requires"),
])
def test_bad_registrations_name_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        backends.register_backend(*args, **kwargs)
    assert backends.backend_name(XP) == "numpy"


def test_unregistering_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"name: no backend 'nope'.*'numpy'"):
        backends.unregister_backend("nope")


def test_the_built_in_backends_are_registered_by_name_through_the_same_function():
    import array_api_compat.torch as xp_torch  # imports no torch until used

    found = backends.backend_for(XP)
    assert (found.name, found.make_ops, found.requires) == \
        ("numpy", "tmcore.backends.numpy:make_ops", "numpy")
    if "torch" in sys.modules:
        assert backends.backend_for(xp_torch).module == "tmcore.backends.torch"


def _distribution(root: Path, name: str, entry: str, module_source: str) -> None:
    """An installed distribution as importlib.metadata finds it on ``sys.path``."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[tmcore.backends]\n{name} = {entry}\n")
    (root / f"{name}.py").write_text(textwrap.dedent(module_source))


def _run(code: str, path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path),
                                                       os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-W", "always", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=240,
                          check=False)


def test_an_installed_package_registers_through_the_entry_point_lazily(tmp_path):
    _distribution(tmp_path, "plugin_demo", "plugin_demo:register", """
        import array_api_compat
        from tmcore.backends import register_backend

        def register():
            register_backend("demo", array_api_compat.is_numpy_namespace,
                             "plugin_demo_ops:make_ops")
    """)
    (tmp_path / "plugin_demo_ops.py").write_text(textwrap.dedent("""
        CALLS = []

        def make_ops(generic, options):
            def sample_fwd(xp, volume, coords):
                CALLS.append(1)
                return generic.sample_fwd(xp, volume, coords)
            return generic._replace(sample_fwd=sample_fwd)
    """))
    _distribution(tmp_path / "broken", "plugin_broken", "plugin_broken:register",
                  "def register():\n    raise RuntimeError('cannot start')\n")
    result = _run("""
        import sys
        import tmcore
        print("after import:", "plugin_demo" in sys.modules)
        import numpy as np
        tmcore.trilinear_sample(np.ones((1, 1, 2)), np.zeros((1, 3, 1)))
        import plugin_demo_ops
        from tmcore.backends import backend_name
        import array_api_compat
        print("calls:", plugin_demo_ops.CALLS, backend_name(array_api_compat.numpy))
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "after import: False" in result.stdout  # read on the first lookup, not on import
    assert "calls: [1] demo" in result.stdout
    result = _run("""
        import numpy as np, tmcore
        print(tmcore.trilinear_sample(np.ones((1, 1, 2)), np.zeros((1, 1, 1))).item())
    """, tmp_path / "broken")
    assert result.returncode == 0 and result.stdout.strip() == "1.0", result.stderr
    assert "plugin_broken = plugin_broken:register failed and is skipped: RuntimeError: " \
        "cannot start" in result.stderr


def test_the_dispatch_imports_neither_the_backends_nor_the_ops():
    """Registration is pushed into tmcore.runtime.dispatch: no import of either package, by
    statement or by name (``importlib.import_module("...")``)."""
    tree = ast.parse((REPO / "tmcore" / "runtime" / "dispatch.py").read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    names += [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
              and "import" in ast.unparse(node.func)]
    assert names and not [n for n in names if "backends" in n or "tmcore.ops" in n
                          or "import_module" in n], names
