"""The fused kernels' build cache (``backends/native/build.py``, ``cache.py``): nothing
planted runs, a bad cache heals, compilers are bounded and not re-run at every start.

Each test points ``TMCORE_CACHE_DIR`` at a folder of its own and forgets the
loaded libraries first (a new process, as far as the loader can tell). Builds
are seeded from one module-wide build where a test is not about building, so
the suite compiles only where the behaviour under test is a (re)build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore  # noqa: E402
import tmcore.backends.native.build as native  # noqa: E402
from tmcore.backends.native import cache  # noqa: E402
from tmcore.backends.torch import conv  # noqa: E402
from tmcore.types import ConvParams  # noqa: E402

CC = shutil.which(os.environ.get("CC", "cc"))
pytestmark = [
    pytest.mark.skipif(CC is None, reason="no C compiler to build the kernels"),
    pytest.mark.skipif(sys.platform != "linux",
                       reason="the cache's checks are POSIX; tested on Linux"),
]


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """One real build (the .so, its digest, the compiler table), made by the loader."""
    folder = tmp_path_factory.mktemp("seed")
    saved = dict(native._STATE), dict(cache._FALLBACK)
    old = {k: os.environ.get(k) for k in ("TMCORE_CACHE_DIR", "CC")}
    os.environ["TMCORE_CACHE_DIR"], os.environ["CC"] = str(folder), CC
    native._STATE.clear()
    try:
        assert native.library() is not None
    finally:
        native._STATE.clear()
        native._STATE.update(saved[0])
        cache._FALLBACK.update(saved[1])
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return folder


def _so(folder: Path) -> Path:
    (path,) = folder.glob("tmcore_cell-*.so")
    return path


def _copy_seed(seed: Path, folder: Path) -> Path:
    """The seed's build and compiler table in a private ``folder``; the build's path."""
    folder.mkdir(mode=0o700, exist_ok=True)
    for path in seed.iterdir():
        if path.suffix in (".so", ".sha256") or path.name == "compilers.json":
            shutil.copy2(path, folder / path.name)
    return _so(folder)


def _works(lib) -> None:
    """The loaded kernels give the torch ops' results."""
    assert lib is not None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 5, generator=gen)
    params = ConvParams(torch.randn(2, 3, 3, generator=gen), torch.randn(2, 3, generator=gen),
                        torch.randn(6, 3, generator=gen), torch.randn(6, generator=gen))
    z, residuals = conv.conv_fwd(None, x, params)
    assert isinstance(residuals, conv._NativeConvResiduals)
    torch.testing.assert_close(z, conv._pointwise(conv._depthwise_stages(x, params)[-1], params))


def _planted(tmp_path: Path, marker: Path) -> Path:
    """A shared object whose constructor writes ``marker`` when it is loaded."""
    source = tmp_path / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void)'
                      f' {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    out = tmp_path / "planted.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out


def _replace(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` as a new file (truncating a loaded library in place would
    fault this process when its code runs)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


# --------------------------------------------------------------------------- planted code


def test_the_default_folder_is_created_private_and_builds_carry_their_digest(
        fresh, monkeypatch, tmp_path):
    monkeypatch.delenv("TMCORE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(native, "_STATE", {})
    _works(native.library())
    folder = tmp_path / "xdg" / "tmcore"
    assert native.cache_dir() == folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    build = _so(folder)
    info = build.lstat()
    assert info.st_uid == os.geteuid() and not info.st_mode & 0o022
    assert (folder / (build.name + ".sha256")).read_text().strip() == _sha256(build)
    assert not list(folder.glob(".build-*")) and not list(folder.glob(".tmp-*"))


def test_a_planted_object_in_a_world_writable_cache_folder_never_runs(fresh, seed, tmp_path):
    """Another user could write this folder: its files are not loaded, even with a
    digest and pointer that match (the attacker writes those too)."""
    marker = tmp_path / "marker"
    planted = _planted(tmp_path, marker)
    shared = fresh(tmp_path / "shared")
    shared.mkdir()
    shared.chmod(0o777)
    name = _so(seed).name
    shutil.copy(planted, shared / name)
    (shared / (name + ".sha256")).write_text(_sha256(planted))
    for pointer in seed.glob("*.latest"):
        shutil.copy(pointer, shared / pointer.name)
    with pytest.warns(RuntimeWarning, match="not using the kernel cache folder"):
        lib = native.library()
    assert not marker.exists(), "the planted constructor ran"
    _works(lib)
    assert Path(lib._name).parent == cache._FALLBACK["dir"] != shared
    assert stat.S_IMODE(cache._FALLBACK["dir"].stat().st_mode) == 0o700
    # warned once per process: a second library (JAX) or call does not warn again
    native._STATE.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _works(native.library())


def test_a_cache_folder_below_a_folder_others_may_write_is_not_used(fresh, seed, tmp_path):
    """Without the sticky bit others may rename the cache folder away and put their own."""
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # no sticky bit (unlike /tmp)
    folder = fresh(open_parent / "cache")
    _copy_seed(seed, folder)
    with pytest.warns(RuntimeWarning, match="others may write to"):
        lib = native.library()
    assert Path(lib._name).parent != folder


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_cache_folder_owned_by_another_user_is_not_used(fresh, seed, tmp_path):
    folder = fresh(tmp_path / "theirs")
    _copy_seed(seed, folder)
    os.chown(folder, 4242, 4242)
    with pytest.warns(RuntimeWarning, match="owned by uid 4242"):
        lib = native.library()
    assert Path(lib._name).parent != folder


def test_a_cached_object_others_may_write_is_replaced_not_loaded(fresh, seed, tmp_path):
    """In a private folder, a group- or world-writable build with a matching digest is
    still refused (someone else could have written it): rebuilt, never run."""
    marker = tmp_path / "marker"
    planted = _planted(tmp_path, marker)
    folder = fresh(tmp_path / "cache")
    build = _copy_seed(seed, folder)
    shutil.copy(planted, build)
    build.chmod(0o620)  # group-writable
    (folder / (build.name + ".sha256")).write_text(_sha256(planted))
    with pytest.warns(RuntimeWarning, match="writable by group or others .*; rebuilding"):
        lib = native.library()
    assert not marker.exists()
    _works(lib)
    assert not build.lstat().st_mode & 0o022 and _sha256(build) == _sha256(_so(seed))


def test_a_symbolic_link_in_the_cache_is_not_followed(fresh, seed, tmp_path):
    marker = tmp_path / "marker"
    planted = _planted(tmp_path, marker)
    folder = fresh(tmp_path / "cache")
    build = _copy_seed(seed, folder)
    build.unlink()
    build.symlink_to(planted)
    (folder / (build.name + ".sha256")).write_text(_sha256(planted))
    with pytest.warns(RuntimeWarning, match="not a regular file; rebuilding"):
        _works(native.library())
    assert not marker.exists() and not build.is_symlink()


# --------------------------------------------------------------------------- healing


def _symbolless(tmp_path: Path) -> bytes:
    source = tmp_path / "empty.c"
    source.write_text("int tmcore_unrelated(void) { return 1; }\n")
    out = tmp_path / "empty.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out.read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "symbol-less", "no digest"])
def test_a_damaged_cached_build_is_rebuilt_and_works(fresh, seed, tmp_path, damage):
    """A build cut to 4 KiB (mapped, it raised SIGBUS in every later process), garbage,
    a valid object without the kernels (its digest recorded, so it loads and fails
    the symbol lookup), or a build without its digest: rebuilt once, results right."""
    folder = fresh(tmp_path / "cache")
    build = _copy_seed(seed, folder)
    good = build.read_bytes()
    sidecar = folder / (build.name + ".sha256")
    if damage == "truncated":
        build.write_bytes(good[:4096])
    elif damage == "garbage":
        build.write_bytes(os.urandom(len(good)))
    elif damage == "symbol-less":
        build.write_bytes(_symbolless(tmp_path))
        sidecar.write_text(_sha256(build))
    else:
        sidecar.unlink()
    if damage == "no digest":  # e.g. a build of an older tmcore: rebuilt without a fuss
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lib = native.library()
    else:
        with pytest.warns(RuntimeWarning, match="rebuilding"):
            lib = native.library()
    _works(lib)
    assert sidecar.read_text().strip() == _sha256(build) and build.stat().st_size == len(good)


def test_a_build_that_never_loads_is_tried_once(fresh, tmp_path, monkeypatch):
    """A compiler whose output never loads: one build, one warning, then the torch ops
    (no rebuild loop, no warning in every call)."""
    log = tmp_path / "log"
    fake = _script(tmp_path / "fakecc", f'echo "$@" >> {log}\n'
                   'case "$1" in --version) echo "fake cc 1.0";; *)\n'
                   'for a; do [ "$prev" = "-o" ] && echo garbage > "$a"; prev="$a"; done;;\n'
                   'esac\n')
    fresh(tmp_path / "cache")
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="fresh build .* fails to load"):
        assert native.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None
    calls = log.read_text().splitlines()
    assert sum("--version" not in c for c in calls) == 1, calls
    x = torch.randn(1, 2, 3)
    params = ConvParams(torch.randn(1, 2, 3), torch.zeros(1, 2), torch.randn(4, 2),
                        torch.zeros(4))
    assert isinstance(conv.conv_fwd(None, x, params)[1], list)  # the torch ops


# --------------------------------------------------------------------------- compilers


def test_a_hanging_compiler_times_out(fresh, tmp_path, monkeypatch):
    log = tmp_path / "log"
    fake = _script(tmp_path / "slowcc", f'echo "$1" >> {log}\n'
                   'case "$1" in --version) echo "slow cc 1.0";; *) sleep 60;; esac\n')
    fresh(tmp_path / "cache")
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv(native.TIMEOUT_ENV_VAR, "1")
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"did not finish within 1 s \(set "
                      "TMCORE_COMPILE_TIMEOUT"):
        assert native.library() is None
    assert time.monotonic() - start < 20
    assert len(log.read_text().splitlines()) == 2  # --version, then the one build


def test_the_compiler_version_is_asked_once_per_install(fresh, seed, tmp_path, monkeypatch):
    log = tmp_path / "log"
    wrapper = _script(tmp_path / "cc", f'[ "$1" = --version ] && echo v >> {log}\n'
                      f'exec {CC} "$@"\n')
    monkeypatch.setenv("CC", str(wrapper))
    folder = fresh(tmp_path / "cache")
    _works(native.library())  # builds (the wrapper's version line is its compiler's)
    assert log.read_text().count("v") == 1
    for _ in range(2):  # later processes: no --version, the same build
        native._STATE.clear()
        assert Path(native.library()._name) == _so(folder)
    assert log.read_text().count("v") == 1
    os.utime(wrapper, ns=(time.time_ns(), time.time_ns() + 10**9))  # "reinstalled"
    native._STATE.clear()
    assert native.library() is not None
    assert log.read_text().count("v") == 2


def test_a_verified_build_is_used_without_a_compiler(fresh, seed, tmp_path, monkeypatch):
    folder = fresh(tmp_path / "cache")
    _copy_seed(seed, folder)
    _works(native.library())  # loads the seeded build (no compile) and records it
    native._STATE.clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _works(native.library())
    # ... but only a verified one: damaged, it is not loaded (and cannot be rebuilt)
    native._STATE.clear()
    build = _so(folder)
    _replace(build, build.read_bytes()[:4096])  # a new file: the loaded one stays mapped
    with pytest.warns(RuntimeWarning, match="no compiler is found to rebuild it"):
        assert native.library() is None


def test_the_docs_say_where_the_cache_is_and_how_to_clear_it():
    guide = (Path(__file__).parents[2] / "docs" / "guides" / "errors-and-cache.md").read_text()
    paragraph = guide[guide.index("## The kernel cache"):]
    for needle in ("~/.cache/tmcore", "TMCORE_CACHE_DIR", "0700", "SHA-256", "rm -r",
                   "TMCORE_COMPILE_TIMEOUT"):
        assert needle in paragraph, needle
    assert tmcore is not None
