"""The kernel cache cannot be raced: every check and the load act on ONE object.

An attacker who controls a symbolic link on the way to the cache (or, as a
proof that the check and the load are one, anyone swapping the build file
itself) keeps swapping it in a separate process while the victim loads in a
loop; the planted object's constructor (which writes a marker) must never run.
"Another user" is simulated as in ``tests/backends/test_native_cache.py``: a folder
others may write (``0777``), or, as root, one given to uid 4242.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore.backends.native.build as native  # noqa: E402
import tmcore.runtime.options  # noqa: E402
from tmcore.backends.native import cache  # noqa: E402

CC = shutil.which(os.environ.get("CC", "cc"))
pytestmark = [
    pytest.mark.skipif(CC is None, reason="no C compiler to build the kernels"),
    pytest.mark.skipif(sys.platform != "linux",
                       reason="the cache's checks are POSIX; tested on Linux"),
]

RACE_SECONDS = 3.0


# the loader fixtures (``fresh``, ``seed``) and build helpers of the cache tests, defined
# once there
import test_native_cache as _cache_tests  # noqa: E402

seed = _cache_tests.seed  # (``fresh`` comes from tests/conftest.py)
_so, _copy_seed = _cache_tests._so, _cache_tests._copy_seed


def _planted(tmp_path: Path, marker: Path) -> Path:
    """A shared object whose constructor writes ``marker`` when it is loaded."""
    source = tmp_path / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void)'
                      f' {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    out = tmp_path / "planted.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _swapper(body: str) -> subprocess.Popen:
    """A separate process (the attacker) running ``body`` in a loop until killed."""
    code = "import os, sys\nwhile True:\n" + textwrap.indent(textwrap.dedent(body), "    ")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def _another_users_folder(folder: Path, how: str) -> Path:
    folder.mkdir()
    if how == "uid 4242":
        os.chown(folder, 4242, 4242)
        folder.chmod(0o755)
    else:
        folder.chmod(0o777)
    return folder


# --------------------------------------------------------------------------- the races


@pytest.mark.parametrize("how", [
    "world-writable",
    pytest.param("uid 4242", marks=pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root to give a folder to another user")),
])
def test_a_symlink_swapped_in_another_users_folder_never_runs_its_object(
        fresh, seed, tmp_path, how):
    """TMCORE_CACHE_DIR runs through a folder another user controls and ends in a link
    to the victim's own private cache; the attacker swaps the link between that cache
    and a folder with a planted object (matching digest and pointer) in a loop, while
    the victim loads through the public loader in a loop."""
    marker = tmp_path / "marker"
    planted = _planted(tmp_path, marker)
    victim = tmp_path / "victim"
    good = _copy_seed(seed, victim)
    theirs = _another_users_folder(tmp_path / "theirs", how)
    evil = theirs / "evil"
    evil.mkdir(mode=0o700)
    shutil.copy(planted, evil / good.name)
    (evil / (good.name + ".sha256")).write_text(_sha256(planted))
    for path in victim.iterdir():
        if path.suffix == ".latest" or path.name == "compilers.json":
            shutil.copy(path, evil / path.name)
    link = theirs / "cache"
    link.symlink_to(victim)
    fresh(link)
    attacker = _swapper(f"""
        for target in ({str(victim)!r}, {str(evil)!r}):
            os.symlink(target, {str(theirs / '.next')!r})
            os.replace({str(theirs / '.next')!r}, {str(link)!r})
    """)
    loads = 0
    try:
        deadline = time.monotonic() + RACE_SECONDS
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while time.monotonic() < deadline or loads < 20:
                native._STATE.clear()
                lib = native.library()
                assert not marker.exists(), f"the planted constructor ran (load {loads})"
                assert lib is not None
                loads += 1
                # unmapped again, so that every load maps afresh (the dynamic loader would
                # otherwise hand back the first object it mapped under that name)
                cache.unload(lib)
    finally:
        _stop(attacker)
    assert not marker.exists(), "the planted constructor ran"
    assert any("is a symbolic link" in str(w.message) for w in caught)
    assert Path(lib._name).parent == cache._FALLBACK["dir"]  # built privately instead


def test_check_and_load_act_on_one_file_while_it_is_swapped(fresh, seed, tmp_path):
    """Even inside a private folder, the digest is taken from the very descriptor that
    is loaded: a process replacing the build with a planted one in a loop (between
    any check and any load) only ever gets its object refused, never run."""
    marker = tmp_path / "marker"
    planted = _planted(tmp_path, marker)
    folder = tmp_path / "cache"
    target = _copy_seed(seed, folder)
    good = tmp_path / "good.so"
    shutil.copy2(target, good)
    good.chmod(0o700)
    planted.chmod(0o700)
    attacker = _swapper(f"""
        for source in ({str(good)!r}, {str(planted)!r}):
            os.link(source, {str(folder / '.swap')!r})
            os.replace({str(folder / '.swap')!r}, {str(target)!r})
    """)
    outcomes = {"loaded": 0, "refused": 0}
    try:
        deadline = time.monotonic() + RACE_SECONDS
        while time.monotonic() < deadline or min(outcomes.values()) == 0:
            assert time.monotonic() < deadline + 30, outcomes
            lib, problem = cache.open_build(target, native._declare)
            assert not marker.exists(), "the planted constructor ran"
            if lib is None:
                assert "does not match its recorded SHA-256" in problem, problem
                outcomes["refused"] += 1
            else:
                assert lib._name == str(target)
                outcomes["loaded"] += 1
    finally:
        _stop(attacker)
    assert not marker.exists(), "the planted constructor ran"
    assert min(outcomes.values()) > 0, outcomes  # both files were seen: the race was real


# --------------------------------------------------------------------------- links we keep


def test_a_link_this_user_controls_is_followed_and_resolved_once(fresh, seed, tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    build = _copy_seed(seed, victim)
    link = private / "cache"
    link.symlink_to(victim)
    fresh(link)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib = native.library()
    assert lib._name == str(build.resolve())  # loaded from the real folder, not via the link


@pytest.mark.parametrize("where", ["in an open folder", "below an open folder"])
def test_a_link_others_could_swap_makes_the_folder_unsafe(fresh, seed, tmp_path, where):
    victim = tmp_path / "victim"
    _copy_seed(seed, victim)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)  # no sticky bit
    holder = open_folder
    if where == "below an open folder":
        holder = open_folder / "mine"
        holder.mkdir(mode=0o700)  # private, but others may rename it away
    (holder / "cache").symlink_to(victim)
    fresh(holder / "cache")
    with pytest.warns(RuntimeWarning, match="is a symbolic link (in|below)"):
        lib = native.library()
    assert Path(lib._name).parent == cache._FALLBACK["dir"]


def test_a_link_owned_by_another_user_is_refused(fresh, seed, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a link to another user")
    victim = tmp_path / "victim"
    _copy_seed(seed, victim)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "cache").symlink_to(victim)
    os.lchown(private / "cache", 4242, 4242)
    fresh(private / "cache")
    with pytest.warns(RuntimeWarning, match="symbolic link owned by another user"):
        native.library()


def test_the_same_build_loaded_again_reuses_its_descriptor(fresh, seed, tmp_path):
    """Loading through ``/proc/self/fd/N`` holds one descriptor per loaded build, not one
    per load (a loop of loads does not leak descriptors)."""
    fresh(tmp_path / "cache")
    _copy_seed(seed, tmp_path / "cache")
    native._STATE.clear()
    native.library()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        native._STATE.clear()
        assert native.library() is not None
    assert len(os.listdir("/proc/self/fd")) <= before


# --------------------------------------------------------------------------- the timeout


@pytest.mark.parametrize("raw", ["inf", "none", "Infinity"])
def test_an_infinite_compile_timeout_means_no_limit(fresh, tmp_path, monkeypatch, raw):
    monkeypatch.setenv(native.TIMEOUT_ENV_VAR, raw)
    assert native.compile_timeout() is None
    # a compiler run under no limit: the fake compiler's garbage fails to load (and says
    # so), instead of "cannot convert float infinity to integer"
    fake = tmp_path / "fakecc"
    fake.write_text('#!/bin/sh\ncase "$1" in --version) echo "fake cc 1.0";; *)\n'
                    'for a; do [ "$prev" = "-o" ] && echo garbage > "$a"; prev="$a"; done;;\n'
                    'esac\n')
    fake.chmod(0o755)
    fresh(tmp_path / "cache")
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="fresh build .* fails to load"):
        assert native.library() is None


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "-inf"])
def test_a_bad_compile_timeout_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(native.TIMEOUT_ENV_VAR, raw)
    monkeypatch.setattr(tmcore.runtime.options, "_WARNED_TIMEOUTS", set())
    with pytest.warns(RuntimeWarning, match=f"{native.TIMEOUT_ENV_VAR}=.*using 120 s"):
        assert native.compile_timeout() == tmcore.runtime.options.DEFAULT_TIMEOUT
    monkeypatch.setenv(native.TIMEOUT_ENV_VAR, "2.5")
    assert native.compile_timeout() == 2.5
