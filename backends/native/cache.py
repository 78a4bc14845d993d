"""The kernel cache: a private folder, each build checked before use, and the very file checked
is the one loaded, so no other user can plant or swap a build (the rules:
docs/guides/errors-and-cache.md, "The kernel cache"; what is built: :mod:`.build`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from tmcore.runtime.options import cache_dir

__all__ = ["safe_dir", "file_problem", "write_atomic", "install", "remove", "open_build",
           "unload", "latest"]

_FALLBACK: dict[str, Path] = {}  # "dir": this process's private folder, once one was needed


def _writable_by_others(info: os.stat_result, uid: int) -> bool:
    """Whether a user other than ``uid`` (and root) may change entries of this folder."""
    return info.st_uid not in (uid, 0) or bool(info.st_mode & 0o022)


def _ancestry_problem(folder: Path) -> str | None:
    """Why a link-free folder path could be swapped by another user (a parent owned by another
    user, or others may write it without the sticky bit), or None."""
    uid = os.geteuid()
    for parent in folder.parents:
        info = os.stat(parent)
        if info.st_uid not in (uid, 0):
            return f"{parent} is owned by another user (uid {info.st_uid})"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return f"others may write to {parent} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _link_problem(path: Path) -> str | None:
    """Why a symbolic link on the way to ``path`` could be re-pointed by another user, or None.

    Walks the path as the kernel does; a link is refused when another user owns it, or the
    folder holding it may be written by another user (sticky bit or not) or lies below one
    they may write without it: they could swap it between a check and a load.
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
    """Why the folder ``path`` may hold files another user wrote (its links, itself, its parents),
    or None; callers use the resolved folder from then on."""
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


def file_problem(path: Path) -> str | None:
    """Why ``path`` is not a regular file only this user may write, or None (``"is missing"``);
    links are refused, not followed."""
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
    """A descriptor of ``path`` opened once without following a link and ``fstat``-checked; every
    later check and the load use it, never the path. Raises :class:`_Refused`."""
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
    """A small file of ours (a digest, a pointer) read through one checked descriptor."""
    fd = _open_checked(path)
    try:
        return _read_fd(fd, limit).decode(errors="replace")
    finally:
        os.close(fd)


def safe_dir() -> Path:
    """The cache folder (resolved, created private), or when it is unsafe a fresh private
    temporary folder for this process (warned once)."""
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
        # the same checks as the cache folder: under a TMPDIR others may write without
        # the sticky bit, another user could rename it away and put theirs in its place
        fallback_problem = _folder_problem(fresh)
        if fallback_problem is not None:
            shutil.rmtree(fresh, ignore_errors=True)
            raise RuntimeError(
                f"the kernel cache folder {wanted} is not safe ({problem}), and neither is "
                f"the private fallback folder {fresh} ({fallback_problem}); set "
                f"TMCORE_CACHE_DIR (or TMPDIR) to a folder only you can write")
        _FALLBACK["dir"] = fresh
        warnings.warn(
            f"tmcore: not using the kernel cache folder {wanted}: {problem}. The fused "
            f"CPU kernels are built into the private folder {fresh} for this process "
            f"instead (set TMCORE_CACHE_DIR to a folder only you can write to keep "
            f"builds between runs).", RuntimeWarning, stacklevel=5)
    return _FALLBACK["dir"]


def write_atomic(path: Path, data: bytes) -> None:
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
    """``target`` opened once, ``fstat``-checked and hashed THROUGH THAT DESCRIPTOR against its
    recorded SHA-256; else why not."""
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


def remove(target: Path) -> None:
    """Delete a build and its digest; a folder in their place is renamed away in one step, then
    deleted (it heals); other non-files are unlinked."""
    for path in (target, _sidecar(target)):
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=".stale-"))
            with contextlib.suppress(OSError):
                os.replace(path, aside / "d")  # atomic: the name is free at once
            shutil.rmtree(aside, ignore_errors=True)
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)


def install(out: Path, target: Path) -> None:
    """Rename the finished build ``out`` to ``target`` and record its SHA-256 (atomically)."""
    os.chmod(out, 0o700)
    digest = _digest(out)
    os.replace(out, target)
    write_atomic(_sidecar(target), digest.encode())


#: Descriptors of the loaded builds, by (device, inode), held open while the library
#: is mapped: the loader knows each build by the name ``/proc/self/fd/N`` it was
#: loaded through, and a number reused for another file would make it hand back the
#: earlier library. The same build verified again reuses its descriptor.
_HELD: dict[tuple[int, int], int] = {}
_PROC_FD = Path("/proc/self/fd")


def _dlopen(verified: _Verified, target: Path) -> ctypes.CDLL:
    """Map exactly the file checked: through its descriptor (``/proc/self/fd/N``), or without
    ``/proc`` a private copy of the bytes hashed; ``lib._name`` is the build's path."""
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
    if fd is not None and not _is(fd, key):  # closed by other code (its number reused)
        del _HELD[key]
        fd = None
    if fd is not None:  # this very file is loaded already: the loader shares it
        os.close(verified.fd)
    else:
        fd = _fresh_name(verified.fd, key)
    try:
        lib = ctypes.CDLL(str(_PROC_FD / str(fd)))
    except OSError:
        if fd not in _HELD.values():
            os.close(fd)
        raise
    known = _HANDLES.get(lib._handle)
    if known is not None and known != key:
        # the loader handed back another object it knows by this name: never use it
        if fd not in _HELD.values():
            os.close(fd)
        raise OSError(f"/proc/self/fd/{fd} names another loaded object")
    _HANDLES[lib._handle] = key
    _NAMES[fd] = key
    _HELD.setdefault(key, fd)
    lib._name = str(target)
    lib._tmcore_key = key
    return lib


#: What each loaded object is: handle -> (device, inode), and the ``/proc/self/fd/N``
#: numbers the loader knows a build by -> (device, inode). The loader reuses a loaded
#: object for a name it has seen, so a number (closed by other code, then reused for
#: another build) must not be loaded through again.
_HANDLES: dict[int, tuple[int, int]] = {}
_NAMES: dict[int, tuple[int, int]] = {}


def _is(fd: int, key: tuple[int, int]) -> bool:
    """Whether descriptor ``fd`` is still open on the file ``key`` (device, inode)."""
    try:
        info = os.fstat(fd)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == key


def _fresh_name(fd: int, key: tuple[int, int]) -> int:
    """``fd``, or a duplicate under a number the loader has not seen for another file (it knows a
    build by ``/proc/self/fd/N``)."""
    if _NAMES.get(fd, key) == key:
        return fd
    lowest = max(_NAMES) + 1
    duplicate = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return duplicate


def unload(lib: ctypes.CDLL) -> None:
    """Drop an unusable library, so a rebuild at its path is mapped afresh."""
    try:
        import _ctypes

        _ctypes.dlclose(lib._handle)
    except (ImportError, AttributeError, OSError):
        return
    _HANDLES.pop(lib._handle, None)
    fd = _HELD.pop(getattr(lib, "_tmcore_key", None), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def open_build(target: Path, finish: Callable[[ctypes.CDLL], None]
               ) -> tuple[ctypes.CDLL | None, str | None]:
    """Verify ``target``, load the very file verified and ``finish`` it: ``(library, None)`` or
    ``(None, why not)``."""
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
        unload(lib)
        return None, f"{target.name} fails to load"
    return lib, None


_NAME = re.compile(r"[A-Za-z0-9_]+-[0-9a-f]{20}\.so")


def latest(pointer: Path) -> Path | None:
    """The build a ``*.latest`` pointer names, if the pointer is safe and well-formed."""
    try:
        name = _read_trusted(pointer, 256).strip()
    except _Refused:
        return None
    return pointer.with_name(name) if _NAME.fullmatch(name) else None
