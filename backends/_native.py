"""Build and load the fused CPU cell kernels (``_native_cell.c``) on first use.

The torch backend asks :func:`library` for the kernels the first time a CPU
float32 / float64 cell runs: the C source is compiled once per machine with the
system C compiler (``$CC``, default ``cc``; about 2 s) into a cache folder and
loaded with :mod:`ctypes`. The JAX backend asks :func:`jax_library`: the same C
kernels plus ``_native_jax.cc``, their XLA FFI handlers, compiled with ``$CXX``
(default ``c++``) against the headers jaxlib ships (about 4 s) and registered
as CPU custom-call targets. Later processes load the cached builds. Without a
compiler (and no verified build to reuse), or when a build fails, the call
warns once and returns ``None``, and the backend keeps its framework-only path
(same results, slower).

- ``tmcore.options(native=False)`` or ``TMCORE_NATIVE=0`` turns the kernels off
  (read at call time, by :func:`enabled`).
- ``TMCORE_CACHE_DIR`` sets the cache folder (default
  ``$XDG_CACHE_HOME/tmcore``, else ``~/.cache/tmcore``).
- ``TMCORE_COMPILE_TIMEOUT`` bounds each compiler run, in seconds (default 120;
  ``inf`` or ``none``: no limit; anything else that is not a number > 0 is
  refused with a warning naming the variable, and the default applies).

**The cache cannot be planted into, nor raced.** A shared object in the cache
runs code in this process as soon as it is loaded, so nothing is loaded that
another user could have written or swapped:

- the folder is created private (``0700``); a folder that is not owned by this
  user, or that group or others may write, or that lies below a folder others
  may write without the sticky bit (``/tmp`` has it), is not used: tmcore warns
  once and builds into a fresh private temporary folder for this process;
- a symbolic link on the way to the folder is followed only if this user (or
  root) owns it and it sits in a folder no other user may write (sticky bit or
  not) nor swap from above; any other link makes the folder unsafe, as above.
  The folder is then resolved once, and every later step uses the real path;
- every build is written under a temporary name and renamed into place, and
  the SHA-256 of the shared object is written (also atomically) beside it as
  ``<name>.sha256``; to load, the build is opened ONCE (``O_NOFOLLOW``: a link
  is refused, not followed), that descriptor is ``fstat``-checked (a regular
  file owned by this user, not writable by others) and hashed, and the loader
  maps that same descriptor (``/proc/self/fd/N``; where ``/proc`` is absent, a
  private copy of the bytes that were hashed). No check and load ever look at
  two different files.

**A bad cache heals.** A build that fails its check (truncated, garbage, no
digest) or fails to load (no such symbols) is deleted and rebuilt once in this
process; if the fresh build fails too, tmcore warns and keeps the framework
path. A truncated file is never mapped, so it cannot raise SIGBUS. Compilers
run under the timeout in their own process group (killed whole when it
expires). A compiler's version is cached by (path, size, mtime) in
``compilers.json``, so ``cc --version`` does not run at every start. Each
successful load records its build as the latest for this source and machine,
so a later process without a compiler on ``PATH`` still loads it (verified).

The build is keyed by the source, the flags, the compiler's version and the
CPU's feature flags (it uses ``-march=native``), so a shared cache never hands
a build to a machine it was not made for. The kernels use OpenMP; loaded after
torch, ``libgomp.so.1`` resolves to the copy torch already holds, so both share
one thread pool.

Clear the cache by deleting the folder (``rm -r ~/.cache/tmcore``); it is
rebuilt on the next use.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from tmcore.runtime.options import (
    TIMEOUT_ENV_VAR,
    cache_dir,
    compile_timeout,
    environment,
    get_options,
)

__all__ = ["ENV_VAR", "TIMEOUT_ENV_VAR", "library", "jax_library", "enabled", "cache_dir",
           "compile_timeout", "SOURCE"]

ENV_VAR = "TMCORE_NATIVE"
SOURCE = Path(__file__).with_name("_native_cell.c")
JAX_SOURCE = Path(__file__).with_name("_native_jax.cc")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math")
_KERNELS = ("dw_fwd", "dw_bwd", "gates_fwd", "gates_bwd")
_LOCK = threading.RLock()
_STATE: dict[str, object] = {}  # "torch" / "jax": CDLL, or None once a build failed
_FALLBACK: dict[str, Path] = {}  # "dir": this process's private folder, once one was needed


def enabled() -> bool:
    """Whether the kernels may be used: ``tmcore.get_options().native`` (the option,
    whose default is ``TMCORE_NATIVE``). The one place that answers "are the native
    kernels on?" for both backends."""
    return get_options().native


# --------------------------------------------------------------------------- safe paths


def _writable_by_others(info: os.stat_result, uid: int) -> bool:
    """Whether a user other than ``uid`` (and root) may change entries of this folder."""
    return info.st_uid not in (uid, 0) or bool(info.st_mode & 0o022)


def _ancestry_problem(folder: Path) -> str | None:
    """Why a real (link-free) folder path could be swapped by another user: one of its
    parents is owned by another user, or others may write it without the sticky bit."""
    uid = os.geteuid()
    for parent in folder.parents:
        info = os.stat(parent)
        if info.st_uid not in (uid, 0):
            return f"{parent} is owned by another user (uid {info.st_uid})"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return f"others may write to {parent} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _link_problem(path: Path) -> str | None:
    """Why a symbolic link on the way to ``path`` could be re-pointed by another user,
    or ``None``.

    Walks the absolute path as given, one component at a time, following links as the
    kernel does. A link is refused when another user owns it, or when the folder
    holding it may be written by another user (even with the sticky bit), or lies
    below one they may write without it: that user could swap the link between a
    check and a load. Links only this user (or root) controls are followed.
    """
    uid = os.geteuid()
    given = Path(path)  # not normalized: ".." after a link is resolved physically, below
    parts = list((given if given.is_absolute() else Path.cwd() / given).parts)
    current = Path(parts.pop(0))
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            return None  # nothing to swap yet; mkdir creates real folders
        if not stat.S_ISLNK(info.st_mode):
            current = candidate
            continue
        hops += 1
        if hops > 40:
            return f"{path} has too many levels of symbolic links"
        holder = os.stat(current)
        if info.st_uid not in (uid, 0):
            return (f"{candidate} is a symbolic link owned by another user "
                    f"(uid {info.st_uid})")
        if _writable_by_others(holder, uid):
            return (f"{candidate} is a symbolic link in {current}, a folder another user "
                    f"may write (owner uid {holder.st_uid}, mode "
                    f"{stat.S_IMODE(holder.st_mode):o})")
        problem = _ancestry_problem(current)
        if problem is not None:
            return f"{candidate} is a symbolic link below a folder others control ({problem})"
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            current = Path(target.parts[0])
            parts = list(target.parts[1:]) + parts
        else:
            parts = list(target.parts) + parts
    return None


def _folder_problem(path: Path) -> str | None:
    """Why the existing folder ``path`` may hold files another user wrote, or ``None``.

    Checks the links on the way (:func:`_link_problem`), then the folder they lead to
    and its parents. Callers use the resolved folder from then on, so no later step
    goes through a link again."""
    problem = _link_problem(path)
    if problem is not None:
        return problem
    uid = os.geteuid()
    resolved = path.resolve()
    info = os.stat(resolved)
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != uid:
        return f"it is owned by uid {info.st_uid}, not by this user ({uid})"
    if info.st_mode & 0o022:
        return f"group or others may write to it (mode {stat.S_IMODE(info.st_mode):o})"
    return _ancestry_problem(resolved)


def _info_problem(info: os.stat_result) -> str | None:
    """Why an opened file is not a regular file only this user may write, or ``None``."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}"
    if info.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _file_problem(path: Path) -> str | None:
    """Why ``path`` is not a regular file only this user may write, or ``None``
    (``"is missing"`` when absent). Symbolic links are refused, not followed."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    return _info_problem(info)


#: open(2) flags for every file the loader trusts: never through a final symbolic link
#: (ELOOP instead), not inherited by children, never blocking on a planted FIFO.
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_NONBLOCK", 0))


class _Refused(Exception):
    """A cached file that must not be used; the message says why (after its name)."""


def _open_checked(path: Path) -> int:
    """A descriptor of ``path``, opened once without following a link, whose ``fstat``
    says it is a regular file of this user that nobody else may write. Every later
    check (the digest) and the load act on this descriptor, never on the path again.
    Raises :class:`_Refused` (``"is missing"`` when absent)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise _Refused("is missing") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # the last component is a link
            raise _Refused("is not a regular file") from None
        raise _Refused(f"cannot be read ({exc})") from None
    try:
        problem = _info_problem(os.fstat(fd))
    except OSError as exc:
        problem = f"cannot be read ({exc})"
    if problem is not None:
        os.close(fd)
        raise _Refused(problem)
    return fd


def _read_fd(fd: int, limit: int | None = None) -> bytes:
    """Everything ``fd`` holds from its start (at most ``limit`` bytes)."""
    chunks, offset = [], 0
    while limit is None or offset < limit:
        block = os.pread(fd, 1 << 20 if limit is None else min(1 << 20, limit - offset),
                         offset)
        if not block:
            break
        chunks.append(block)
        offset += len(block)
    return b"".join(chunks)


def _read_trusted(path: Path, limit: int = 1 << 16) -> str:
    """The text of a small file of ours (a digest, a pointer), read through one checked
    descriptor. Raises :class:`_Refused`."""
    fd = _open_checked(path)
    try:
        return _read_fd(fd, limit).decode(errors="replace")
    finally:
        os.close(fd)


def _safe_dir() -> Path:
    """The cache folder (resolved: no link on the way), created private; or, when it is
    not safe (or cannot be made), a fresh private temporary folder for this process
    (warned once)."""
    wanted = cache_dir()
    try:
        wanted.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _folder_problem(wanted)
    except OSError as exc:
        problem = f"it cannot be created or read ({exc})"
    if problem is None:
        # Resolved once, after the checks: the links on the way are under this user's
        # control (checked above), and every later step uses the real folder.
        resolved = wanted.resolve()
        if _folder_problem(resolved) is None:
            return resolved
        problem = f"it changed while being checked (now {resolved})"
    if "dir" not in _FALLBACK:
        fresh = Path(tempfile.mkdtemp(prefix="tmcore-native-")).resolve()  # 0700, ours
        atexit.register(shutil.rmtree, fresh, ignore_errors=True)
        _FALLBACK["dir"] = fresh
        warnings.warn(
            f"tmcore: not using the kernel cache folder {wanted}: {problem}. The fused "
            f"CPU kernels are built into the private folder {fresh} for this process "
            f"instead (set TMCORE_CACHE_DIR to a folder only you can write to keep "
            f"builds between runs).", RuntimeWarning, stacklevel=5)
    return _FALLBACK["dir"]


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a private temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


class _Verified(NamedTuple):
    """A build opened once and checked through that descriptor."""

    fd: int  # open, read-only; the load goes through it
    data: bytes  # what was hashed (for a private copy where /proc is absent)


def _verify(target: Path) -> _Verified | str:
    """``target`` opened once (no link followed), ``fstat``-checked (a regular file of
    this user's, not writable by others) and hashed THROUGH THAT DESCRIPTOR against its
    recorded SHA-256; else why not (``"<name> is missing"`` when absent)."""
    try:
        recorded = _read_trusted(_sidecar(target)).strip()
    except _Refused as why:
        return f"{_sidecar(target).name} {why}"
    try:
        fd = _open_checked(target)
    except _Refused as why:
        return f"{target.name} {why}"
    try:
        data = _read_fd(fd)
    except OSError as exc:
        os.close(fd)
        return f"{target.name} cannot be read ({exc})"
    if hashlib.sha256(data).hexdigest() != recorded:
        os.close(fd)
        return f"{target.name} does not match its recorded SHA-256 (truncated or replaced)"
    return _Verified(fd, data)


def _check(target: Path) -> str | None:
    """``None`` when ``target`` may be loaded (see :func:`_verify`), else why not."""
    verified = _verify(target)
    if isinstance(verified, str):
        return verified
    os.close(verified.fd)
    return None


def _remove(target: Path) -> None:
    for path in (target, _sidecar(target)):
        with contextlib.suppress(OSError):
            os.unlink(path)


# --------------------------------------------------------------------------- compilers


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _tool(env: str, default: str) -> str | None:
    return shutil.which(environment(env, default))


def _run(command: Sequence[str], timeout: float | None) -> str:
    """Run ``command`` in its own process group; its stdout. The whole group is killed
    when ``timeout`` expires (a compiler's children too)."""
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{Path(command[0]).name} did not finish within {timeout:g} s "
                           f"(set {TIMEOUT_ENV_VAR} to allow longer)") from None
    if proc.returncode != 0:
        raise RuntimeError(err.strip()[-2000:] or f"{command[0]} failed ({proc.returncode})")
    return out


def _identity(folder: Path, compiler: str, timeout: float | None) -> str:
    """The compiler's version line, cached in ``folder/compilers.json`` by the resolved
    path, size and mtime of its executable (so it runs once per compiler install)."""
    real = os.path.realpath(compiler)
    info = os.stat(real)
    stamp = [info.st_size, info.st_mtime_ns]
    table_path = folder / "compilers.json"
    table: dict = {}
    if _file_problem(table_path) is None:
        try:
            table = json.loads(table_path.read_text())
        except (OSError, ValueError):
            table = {}
    entry = table.get(real) if isinstance(table, dict) else None
    if isinstance(entry, dict) and entry.get("stamp") == stamp and "version" in entry:
        return str(entry["version"])
    version = str(_run([compiler, "--version"], timeout).splitlines()[:1])
    table = table if isinstance(table, dict) else {}
    table[real] = {"stamp": stamp, "version": version}
    with contextlib.suppress(OSError):
        _write_atomic(table_path, json.dumps(table, indent=1, sort_keys=True).encode())
    return version


def _build_key(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _build(target: Path, commands: Callable[[Path, Path], list[list[str]]],
           timeout: float | None) -> None:
    """Run ``commands(workdir, out)`` (compiler calls writing ``out``) in a private
    scratch folder next to ``target``, record ``out``'s SHA-256, then rename both
    into place: no process ever sees half a file."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        out = Path(work) / target.name
        for command in commands(Path(work), out):
            _run(command, timeout)
        os.chmod(out, 0o700)
        digest = _digest(out)
        os.replace(out, target)
        _write_atomic(_sidecar(target), digest.encode())


# --------------------------------------------------------------------------- loading


class _Spec(NamedTuple):
    """How to build and finish loading one library."""

    prefix: str  # file names: {prefix}-{key}.so
    tools: tuple[tuple[str, str], ...]  # (environment variable, default) per compiler
    parts: Callable[[], list[bytes | str]]  # what the build depends on, compilers aside
    commands: Callable[[list[str], Path, Path], list[list[str]]]  # compilers, work, out
    finish: Callable[[ctypes.CDLL], None]  # declare / register; AttributeError: no symbol


#: Descriptors of the loaded builds, by (device, inode), held open while the library
#: is mapped: the loader knows each build by the name ``/proc/self/fd/N`` it was
#: loaded through, and a number reused for another file would make it hand back the
#: earlier library. The same build verified again reuses its descriptor.
_HELD: dict[tuple[int, int], int] = {}
_PROC_FD = Path("/proc/self/fd")


def _dlopen(verified: _Verified, target: Path) -> ctypes.CDLL:
    """Map exactly the file that was checked: through its descriptor
    (``/proc/self/fd/N``), or where ``/proc`` is absent, through a private copy of the
    bytes that were hashed. ``lib._name`` is the verified build's path."""
    if not _PROC_FD.is_dir():
        private = Path(tempfile.mkdtemp(prefix="tmcore-load-"))  # 0700, ours
        try:
            copy = private / target.name
            with open(copy, "xb") as handle:
                handle.write(verified.data)
            lib = ctypes.CDLL(str(copy))
        finally:
            os.close(verified.fd)
            shutil.rmtree(private, ignore_errors=True)  # the mapping outlives the file
        lib._name = str(target)
        return lib
    info = os.fstat(verified.fd)
    key = (info.st_dev, info.st_ino)
    fd = _HELD.get(key)
    if fd is not None:  # this very file is loaded already: the loader shares it
        os.close(verified.fd)
    else:
        fd = verified.fd
    try:
        lib = ctypes.CDLL(str(_PROC_FD / str(fd)))
    except OSError:
        if fd not in _HELD.values():
            os.close(fd)
        raise
    _HELD.setdefault(key, fd)
    lib._name = str(target)
    lib._tmcore_key = key
    return lib


def _unload(lib: ctypes.CDLL) -> None:
    """Drop a library that loaded but is unusable, so that a rebuild at the same path
    is mapped afresh (the dynamic loader reuses a loaded object by name)."""
    try:
        import _ctypes

        _ctypes.dlclose(lib._handle)
    except (ImportError, AttributeError, OSError):
        return
    fd = _HELD.pop(getattr(lib, "_tmcore_key", None), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _open(target: Path, finish: Callable[[ctypes.CDLL], None]) -> tuple[ctypes.CDLL | None,
                                                                          str | None]:
    """Verify ``target`` and load the very file verified (:func:`_verify`, :func:`_dlopen`),
    then finish it: ``(library, None)``, or ``(None, why not)``."""
    verified = _verify(target)
    if isinstance(verified, str):
        return None, verified
    try:
        lib = _dlopen(verified, target)
    except OSError:
        return None, f"{target.name} fails to load"
    try:
        finish(lib)
    except (AttributeError, OSError, TypeError, ValueError):
        _unload(lib)
        return None, f"{target.name} fails to load"
    return lib, None


_NAME = re.compile(r"[A-Za-z0-9_]+-[0-9a-f]{20}\.so")


def _latest(pointer: Path) -> Path | None:
    """The build a ``*.latest`` pointer names, if the pointer is safe and well-formed."""
    try:
        name = _read_trusted(pointer, 256).strip()
    except _Refused:
        return None
    return pointer.with_name(name) if _NAME.fullmatch(name) else None


def _load(spec: _Spec) -> ctypes.CDLL:
    folder = _safe_dir()
    timeout = compile_timeout()
    base = _build_key(*spec.parts(), " ".join(_FLAGS), platform.machine(), _cpu_flags())
    pointer = folder / f"{spec.prefix}-{base}.latest"
    compilers = [_tool(env, default) for env, default in spec.tools]
    have_compilers = all(c is not None for c in compilers)
    if have_compilers:
        key = _build_key(base, *(_identity(folder, c, timeout) for c in compilers))
        target = folder / f"{spec.prefix}-{key}.so"
    else:
        target = _latest(pointer)
        if target is None:
            names = " / ".join(f"${env} or {default}" for env, default in spec.tools)
            raise RuntimeError(f"no compiler found ({names} on PATH) and no earlier "
                               f"build in {folder}")
    lib, problem = _open(target, spec.finish)
    if lib is None:
        if not have_compilers:
            raise RuntimeError(f"{problem}, and no compiler is found to rebuild it")
        if not problem.endswith("is missing"):
            warnings.warn(f"tmcore: the cached kernel build {problem}; rebuilding it",
                          RuntimeWarning, stacklevel=5)
        _remove(target)
        _build(target, lambda work, out: spec.commands(compilers, work, out), timeout)
        lib, problem = _open(target, spec.finish)
        if lib is None:
            problem = problem[len(target.name) + 1:] if problem.startswith(target.name) \
                else problem
            raise RuntimeError(f"the fresh build {target} {problem}")
    if _latest(pointer) != target:  # recorded for a later process without a compiler
        with contextlib.suppress(OSError):
            _write_atomic(pointer, target.name.encode())
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    shape = ctypes.POINTER(ctypes.c_int64)
    argtypes = {
        "dw_fwd": [ptr, ptr, ptr, ptr, i64, i64, cint, shape],
        "dw_bwd": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, cint, shape],
        "gates_fwd": [ptr, ptr, ptr, ptr, i64, i64, i64],
        "gates_bwd": [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64],
    }
    # the torch backend's fused CPU scan (float64 accumulators passed as pointers too)
    argtypes["dw2_fwd"] = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, cint, shape]
    argtypes["dw2_bwd"] = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr,
                           ptr, i64, i64, cint, shape]
    argtypes["read_fwd"] = [ptr, ptr, i64, ptr, i64, i64, i64, cint, shape]
    argtypes["read_bwd"] = [ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, cint, shape]
    argtypes["gates2_fwd"] = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
    argtypes["gates2_bwd"] = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
    # the fused CPU local scan (backends/_cpu_local.py): boxes of the grid
    argtypes["box_op"] = [ptr, shape, ptr, ptr, shape, ptr, shape, ptr, shape, cint, i64, i64,
                          cint]
    argtypes["corner_read_bwd"] = [ptr, shape, ptr, shape, ptr, ptr, ptr, ptr, i64, ptr, i64,
                                   i64, i64, cint]
    argtypes["local_geometry"] = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, cint, shape, i64,
                                  shape, shape, shape, ctypes.c_double, ctypes.c_double, ptr,
                                  ptr, ptr, ptr, ptr, ptr, ptr]
    argtypes["box_write_bwd"] = [ptr, ptr, ptr, ptr, i64, i64, i64, cint, shape, i64, shape,
                                 shape, ctypes.c_double, ctypes.c_double, ptr, ptr, ptr, ptr]
    functions = [(getattr(lib, f"{k}_{s}"), k) for k in argtypes for s in ("f32", "f64")]
    for function, kernel in functions:  # all looked up first: a missing one changes nothing
        function.argtypes = argtypes[kernel]
        function.restype = cint  # 0, or nonzero when a scratch allocation failed


_TORCH = _Spec(
    prefix="tmcore_cell",
    tools=(("CC", "cc"),),
    parts=lambda: [SOURCE.read_bytes()],
    commands=lambda cc, work, out: [[cc[0], *_FLAGS, "-o", str(out), str(SOURCE), "-lm"]],
    finish=_declare,
)


def _jax_spec() -> _Spec:
    import jax

    include = jax.ffi.include_dir()
    cxx_flags = ("-std=c++17", "-O2", "-fPIC", "-w", f"-I{include}")
    c_flags = [f for f in _FLAGS if f != "-shared"]

    def commands(tools: list[str], work: Path, out: Path) -> list[list[str]]:
        cc, cxx = tools
        return [[cc, *c_flags, "-c", str(SOURCE), "-o", str(work / "cell.o")],
                [cxx, *cxx_flags, "-c", str(JAX_SOURCE), "-o", str(work / "ffi.o")],
                [cxx, "-shared", "-fopenmp", str(work / "cell.o"), str(work / "ffi.o"),
                 "-o", str(out), "-lm"]]

    def finish(lib: ctypes.CDLL) -> None:
        names = [f"tmcore_{k}_{s}" for k in _KERNELS for s in ("f32", "f64")]
        handlers = [getattr(lib, name) for name in names]  # all found before any registers
        for name, handler in zip(names, handlers, strict=True):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")

    return _Spec(
        prefix="tmcore_cell_jax",
        tools=(("CC", "cc"), ("CXX", "c++")),
        parts=lambda: [SOURCE.read_bytes(), JAX_SOURCE.read_bytes(), " ".join(cxx_flags),
                       jax.__version__],
        commands=commands,
        finish=finish,
    )


def _cached(key: str, spec: Callable[[], _Spec]):
    """The library of ``spec()``, loaded once (``None``, warned once, if it fails)."""
    if not enabled():
        return None
    if key not in _STATE:
        with _LOCK:
            if key not in _STATE:
                try:
                    _STATE[key] = _load(spec())
                except Exception as exc:  # no compiler, read-only cache, failed build
                    _STATE[key] = None
                    warnings.warn(
                        f"tmcore: the fused CPU cell kernels ({key}) are unavailable ({exc}); "
                        f"the pure-{key} path runs instead (same results, slower). "
                        f"Set {ENV_VAR}=0 to skip the attempt.", RuntimeWarning, stacklevel=4)
    return _STATE[key]


def jax_library() -> ctypes.CDLL | None:
    """The kernels as XLA FFI targets for JAX on the CPU (``tmcore_{kernel}_{f32,f64}``),
    built and registered on the first call; ``None`` if disabled or not buildable
    (warned once)."""
    return _cached("jax", _jax_spec)


def library() -> ctypes.CDLL | None:
    """The loaded kernels (for ctypes), building them on the first call; ``None`` if
    disabled or they cannot be built here (warned once, with the reason). Each kernel
    returns 0, or nonzero when it could not allocate its scratch memory."""
    return _cached("torch", lambda: _TORCH)
