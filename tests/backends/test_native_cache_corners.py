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


# --------------------------------------------------------------------------- the folders


def test_an_unsafe_fallback_folder_is_refused_with_its_name(fresh, tmp_path, monkeypatch):
    unsafe = fresh(tmp_path / "cache")
    unsafe.mkdir()
    unsafe.chmod(0o777)  # others may write: the cache folder is not used
    open_tmp = tmp_path / "opentmp"
    open_tmp.mkdir()
    open_tmp.chmod(0o777)  # world-writable, no sticky bit: where the fallback would go
    monkeypatch.setattr("tempfile.tempdir", str(open_tmp))
    with pytest.warns(RuntimeWarning, match=f"fallback folder {open_tmp}/tmcore-native-"):
        assert native.library() is None
    assert not cache._FALLBACK
    assert not list(open_tmp.glob("tmcore-native-*/*.so"))  # nothing was built there


def test_a_folder_where_the_build_should_be_heals(fresh, tmp_path):
    folder = fresh(tmp_path / "cache")
    _works(native.library())
    (build,) = folder.glob("tmcore_cell-*.so")
    for path in (build, build.with_name(build.name + ".sha256")):
        path.unlink()
        (path / "inner").mkdir(parents=True)  # a folder, not empty
        native._STATE.clear()
        with pytest.warns(RuntimeWarning, match="is not a regular file; rebuilding it"):
            _works(native.library())
        assert build.is_file() and not list(folder.glob(".stale-*"))
    native._STATE.clear()
    with warnings.catch_warnings():  # healed for every later process
        warnings.simplefilter("error")
        _works(native.library())


def _shared_object(tmp_path: Path, folder: Path, symbol: str) -> Path:
    source = tmp_path / f"{symbol}.c"
    source.write_text(f"int {symbol}(void) {{ return 7; }}\n")
    out = tmp_path / f"{symbol}.so"
    import subprocess

    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    target = folder / f"tmcore_{symbol}-{'0' * 20}.so"
    cache.install(out, target)
    return target


def test_a_reused_descriptor_number_never_loads_another_object(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    first = _shared_object(tmp_path, folder, "tm_first")
    second = _shared_object(tmp_path, folder, "tm_second")
    monkeypatch.setattr(cache, "_HELD", {})
    lib, problem = cache.open_build(first, lambda lib: lib.tm_first)
    assert problem is None
    held = cache._HELD[lib._tmcore_key]
    os.close(held)  # other code closes the descriptor tmcore holds ...
    real_open = os.open

    def reuse(path, flags, *args):  # ... and the next build opened gets its number
        fd = real_open(path, flags, *args)
        if Path(path) != second or fd == held:  # (the lowest free number may be it)
            return fd
        os.dup2(fd, held)
        os.close(fd)
        return held

    monkeypatch.setattr(cache.os, "open", reuse)
    other, problem = cache.open_build(second, lambda lib: lib.tm_second)
    monkeypatch.undo()
    assert problem is None, problem
    assert other.tm_second() == 7
    assert not hasattr(other, "tm_first") or other._handle != lib._handle
    # the first build loaded again: the same object (shared), still working
    again, problem = cache.open_build(first, lambda lib: lib.tm_first)
    assert problem is None and again.tm_first() == 7


# --------------------------------------------------------------------------- slow compilers


def test_a_slow_build_announces_the_wait(fresh, tmp_path, monkeypatch):
    fake = _script(tmp_path / "slowcc", 'case "$1" in --version) echo "slow cc 1.0";;\n'
                   f'*) sleep 2; exec {CC} "$@";; esac\n')
    fresh(tmp_path / "cache")
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv(native.TIMEOUT_ENV_VAR, "60")
    monkeypatch.setattr(native, "ANNOUNCE_AFTER_S", 0.5)
    with pytest.warns(RuntimeWarning, match=r"has taken 0\.5 s; this call waits for the "
                      r"compiler up to 60 s in all \(TMCORE_COMPILE_TIMEOUT") as record:
        _works(native.library())
    assert sum("has taken" in str(w.message) for w in record) == 1  # once per build


def test_a_hanging_compiler_is_announced_then_stopped(fresh, tmp_path, monkeypatch):
    fake = _script(tmp_path / "hangcc", 'case "$1" in --version) echo "hang cc 1.0";;\n'
                   '*) sleep 60;; esac\n')
    fresh(tmp_path / "cache")
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv(native.TIMEOUT_ENV_VAR, "2")
    with pytest.warns(RuntimeWarning) as record:
        assert native.library() is None
    messages = [str(w.message) for w in record]
    assert any("has taken 1 s; this call waits for the compiler up to 2 s" in m
               for m in messages), messages
    assert any("did not finish within 2 s" in m for m in messages), messages
