"""The build cache's corners (issue 51, items 5 and 6): a compiler given with flags, an
unsafe fallback folder, a non-file where a build should be, a foreign object behind a
reused descriptor, and a slow compiler's wait announced.

Each test points ``TMCORE_CACHE_DIR`` at a folder of its own and forgets the loaded
libraries first (a new process, as far as the loader can tell).
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore.backends.native.build as native  # noqa: E402
from tmcore.backends.native import cache  # noqa: E402
from tmcore.backends.native.calls import ptr  # noqa: E402

CC = shutil.which(os.environ.get("CC", "cc"))
pytestmark = [
    pytest.mark.skipif(CC is None, reason="no C compiler to build the kernels"),
    pytest.mark.skipif(sys.platform != "linux",
                       reason="the cache's checks are POSIX; tested on Linux"),
]


@pytest.fixture
def fresh(monkeypatch):
    """A loader with nothing loaded, no fallback folder yet and the real compiler."""
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(cache, "_FALLBACK", {})
    monkeypatch.setenv("CC", CC)
    monkeypatch.delenv(native.TIMEOUT_ENV_VAR, raising=False)
    monkeypatch.delenv(native.ENV_VAR, raising=False)

    def use(folder: Path) -> Path:
        monkeypatch.setenv("TMCORE_CACHE_DIR", str(folder))
        return folder

    return use


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _works(lib) -> None:
    assert lib is not None
    out, c_new = torch.empty(1, 1, 2), torch.empty(1, 1, 2)
    z, c = torch.zeros(1, 4, 2), torch.ones(1, 1, 2)
    status = lib.gates_fwd_f32(ptr(z), ptr(c), ptr(out), ptr(c_new), 1, 1, 2)
    assert status == 0 and torch.allclose(out, torch.full_like(out, 0.5 * float(
        torch.tanh(torch.tensor(0.5)))))


# --------------------------------------------------------------------------- CC with flags


def test_a_compiler_given_with_flags_is_used_with_them(fresh, tmp_path, monkeypatch):
    log = tmp_path / "log"
    wrapper = _script(tmp_path / "cc", f'echo "$@" >> {log}\nexec {CC} "$@"\n')
    folder = fresh(tmp_path / "cache")
    monkeypatch.setenv("CC", f"{wrapper} -O0 -DTMCORE_TEST_FLAG='1'")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "no compiler found"
        _works(native.library())
    builds = [line for line in log.read_text().splitlines() if "--version" not in line]
    assert len(builds) == 1 and builds[0].startswith("-O0 -DTMCORE_TEST_FLAG=1 -O3"), builds
    # the flags are part of the build's key: the plain compiler builds another file
    native._STATE.clear()
    monkeypatch.setenv("CC", str(wrapper))
    _works(native.library())
    assert len(list(folder.glob("tmcore_cell-*.so"))) == 2


def test_a_compiler_command_that_does_not_parse_is_named(fresh, tmp_path, monkeypatch):
    fresh(tmp_path / "cache")
    monkeypatch.setenv("CC", f"{CC} '-O0")  # an unclosed quote
    with pytest.warns(RuntimeWarning, match=r"no compiler found \(\$CC"):
        assert native.library() is None
