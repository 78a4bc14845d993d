"""Build and load the fused CPU kernels on first use (the cache, its variables and how it
heals: docs/guides/errors-and-cache.md, "The kernel cache").

:func:`library` (torch, ctypes) compiles ``kernels.c`` with ``$CC``; :func:`jax_library` adds
``jax_ffi.cc`` with ``$CXX`` against jaxlib's headers and registers XLA CPU targets. Without
a compiler or verified build, or after a failed build, they warn once and return None (the
framework path runs). A build is keyed by the sources, flags, compiler version and CPU
flags (``-march=native``), so a shared cache never hands it to another machine. The kernels
use OpenMP: loaded after torch, ``libgomp.so.1`` resolves to torch's copy (one thread pool).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
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

from . import cache

__all__ = ["ENV_VAR", "TIMEOUT_ENV_VAR", "library", "jax_library", "enabled", "cache_dir",
           "compile_timeout", "SOURCE", "SOURCES"]

ENV_VAR = "TMCORE_NATIVE"
_HERE = Path(__file__).parent
#: The one C translation unit; it includes the kernel families (``*.inc``), once per dtype.
SOURCE = _HERE / "kernels.c"
#: Every C source of the build (its key depends on all of them).
SOURCES = (SOURCE, *sorted(_HERE.glob("*.inc")))
JAX_SOURCE = _HERE / "jax_ffi.cc"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math")
_KERNELS = ("dw_fwd", "dw_bwd", "gates_fwd", "gates_bwd")
_LOCK = threading.RLock()
_STATE: dict[str, object] = {}  # "torch" / "jax": CDLL, or None once a build failed


def enabled() -> bool:
    """Whether the kernels may be used (the ``native`` option): the one answer for both backends."""
    return get_options().native


# --------------------------------------------------------------------------- compilers


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _tool(env: str, default: str) -> list[str] | None:
    """The compiler command ``$env`` names (default ``default``) split as a shell would, its program
    on ``PATH``; None if not found or unparsable."""
    try:
        argv = shlex.split(environment(env, default) or default)
    except ValueError:
        return None
    program = shutil.which(argv[0]) if argv else None
    return None if program is None else [program, *argv[1:]]


#: Seconds a build may run before its wait is announced in a warning (at most half
#: the timeout): the first kernel call of a process blocks on the compiler.
ANNOUNCE_AFTER_S = 10.0


def _announce(command: Sequence[str], waited: float, timeout: float | None) -> None:
    limit = "without a limit" if timeout is None else f"up to {timeout:g} s in all"
    warnings.warn(
        f"tmcore: building the fused CPU kernels with {Path(command[0]).name} (their first "
        f"use on this machine) has taken {waited:g} s; this call waits for the compiler "
        f"{limit} ({TIMEOUT_ENV_VAR} sets the limit; {ENV_VAR}=0 skips the kernels)",
        RuntimeWarning, stacklevel=6)


def _run(command: Sequence[str], timeout: float | None, announce: list[bool] | None = None
         ) -> str:
    """``command``'s stdout; run in its own process group, killed whole at ``timeout``. With
    ``announce`` (one flag per build): a warning once it has run ``min(ANNOUNCE_AFTER_S,
    timeout / 2)`` s."""
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        if announce and announce[0]:
            patience = (ANNOUNCE_AFTER_S if timeout is None
                        else min(ANNOUNCE_AFTER_S, timeout / 2))
            try:
                out, err = proc.communicate(timeout=patience)
            except subprocess.TimeoutExpired:
                announce[0] = False
                _announce(command, patience, timeout)
                out, err = proc.communicate(
                    timeout=None if timeout is None else max(timeout - patience, 1e-3))
        else:
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


def _identity(folder: Path, command: list[str], timeout: float | None) -> str:
    """The compiler's version line (cached in ``compilers.json`` by path, size and mtime) and its
    extra flags."""
    compiler, extra = command[0], " ".join(command[1:])
    real = os.path.realpath(compiler)
    info = os.stat(real)
    stamp = [info.st_size, info.st_mtime_ns]
    table_path = folder / "compilers.json"
    table: dict = {}
    if cache.file_problem(table_path) is None:
        try:
            table = json.loads(table_path.read_text())
        except (OSError, ValueError):
            table = {}
    entry = table.get(real) if isinstance(table, dict) else None
    if isinstance(entry, dict) and entry.get("stamp") == stamp and "version" in entry:
        return f"{entry['version']} {extra}"
    version = str(_run([compiler, "--version"], timeout).splitlines()[:1])
    table = table if isinstance(table, dict) else {}
    table[real] = {"stamp": stamp, "version": version}
    with contextlib.suppress(OSError):
        cache.write_atomic(table_path, json.dumps(table, indent=1, sort_keys=True).encode())
    return f"{version} {extra}"


def _build_key(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _build(target: Path, commands: Callable[[Path, Path], list[list[str]]],
           timeout: float | None) -> None:
    """Run ``commands(workdir, out)`` in a private scratch folder next to ``target``, then install
    ``out`` (renamed with its digest: no process ever sees half a file)."""
    announce = [True]
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        out = Path(work) / target.name
        for command in commands(Path(work), out):
            _run(command, timeout, announce)
        cache.install(out, target)


# --------------------------------------------------------------------------- loading


class _Spec(NamedTuple):
    """How to build and finish loading one library."""

    prefix: str  # file names: {prefix}-{key}.so
    tools: tuple[tuple[str, str], ...]  # (environment variable, default) per compiler
    parts: Callable[[], list[bytes | str]]  # what the build depends on, compilers aside
    commands: Callable[[list[list[str]], Path, Path], list[list[str]]]  # compilers, work, out
    finish: Callable[[ctypes.CDLL], None]  # declare / register; AttributeError: no symbol


def _load(spec: _Spec) -> ctypes.CDLL:
    folder = cache.safe_dir()
    timeout = compile_timeout()
    base = _build_key(*spec.parts(), " ".join(_FLAGS), platform.machine(), _cpu_flags())
    pointer = folder / f"{spec.prefix}-{base}.latest"
    compilers = [_tool(env, default) for env, default in spec.tools]
    have_compilers = all(c is not None for c in compilers)
    if have_compilers:
        key = _build_key(base, *(_identity(folder, c, timeout) for c in compilers))
        target = folder / f"{spec.prefix}-{key}.so"
    else:
        target = cache.latest(pointer)
        if target is None:
            names = " / ".join(f"${env} or {default}" for env, default in spec.tools)
            raise RuntimeError(f"no compiler found ({names} on PATH) and no earlier "
                               f"build in {folder}")
    lib, problem = cache.open_build(target, spec.finish)
    if lib is None:
        if not have_compilers:
            raise RuntimeError(f"{problem}, and no compiler is found to rebuild it")
        if not problem.endswith("is missing"):
            warnings.warn(f"tmcore: the cached kernel build {problem}; rebuilding it",
                          RuntimeWarning, stacklevel=5)
        cache.remove(target)
        _build(target, lambda work, out: spec.commands(compilers, work, out), timeout)
        lib, problem = cache.open_build(target, spec.finish)
        if lib is None:
            problem = problem[len(target.name) + 1:] if problem.startswith(target.name) \
                else problem
            raise RuntimeError(f"the fresh build {target} {problem}")
    if cache.latest(pointer) != target:  # recorded for a later process without a compiler
        with contextlib.suppress(OSError):
            cache.write_atomic(pointer, target.name.encode())
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
    # the fused CPU local scan (tmcore.backends.torch.local): boxes of the grid
    argtypes["box_op"] = [ptr, shape, ptr, ptr, shape, ptr, shape, ptr, shape, cint, i64, i64,
                          cint]
    argtypes["corner_read_bwd"] = [ptr, shape, ptr, shape, ptr, ptr, ptr, ptr, i64, ptr, i64,
                                   i64, i64, cint]
    argtypes["local_geometry"] = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, cint, shape, i64,
                                  shape, shape, shape, ctypes.c_double, ctypes.c_double, ptr,
                                  ptr, ptr, ptr, ptr, ptr, ptr]
    argtypes["box_write_bwd"] = [ptr, ptr, ptr, ptr, i64, i64, i64, cint, shape, i64, shape,
                                 shape, ctypes.c_double, ctypes.c_double, ptr, ptr, ptr, ptr]
    argtypes["step_fwd"] = [ptr, ptr, ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr,
                            i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_double, ctypes.c_double, ptr,
                            i64, ptr, ptr, ptr, ptr, i64, i64, cint, shape]
    argtypes["token_fwd"] = [ptr, ptr, shape, ptr]
    functions = [(getattr(lib, f"{k}_{s}"), k) for k in argtypes for s in ("f32", "f64")]
    for function, kernel in functions:  # all looked up first: a missing one changes nothing
        function.argtypes = argtypes[kernel]
        function.restype = cint  # 0, or nonzero when a scratch allocation failed


_TORCH = _Spec(
    prefix="tmcore_cell",
    tools=(("CC", "cc"),),
    parts=lambda: [p.read_bytes() for p in SOURCES],
    commands=lambda cc, work, out: [[*cc[0], *_FLAGS, "-o", str(out), str(SOURCE), "-lm"]],
    finish=_declare,
)


def _jax_spec() -> _Spec:
    import jax

    include = jax.ffi.include_dir()
    cxx_flags = ("-std=c++17", "-O2", "-fPIC", "-w", f"-I{include}")
    c_flags = [f for f in _FLAGS if f != "-shared"]

    def commands(tools: list[list[str]], work: Path, out: Path) -> list[list[str]]:
        cc, cxx = tools
        return [[*cc, *c_flags, "-c", str(SOURCE), "-o", str(work / "cell.o")],
                [*cxx, *cxx_flags, "-c", str(JAX_SOURCE), "-o", str(work / "ffi.o")],
                [*cxx, "-shared", "-fopenmp", str(work / "cell.o"), str(work / "ffi.o"),
                 "-o", str(out), "-lm"]]

    def finish(lib: ctypes.CDLL) -> None:
        names = [f"tmcore_{k}_{s}" for k in _KERNELS for s in ("f32", "f64")]
        handlers = [getattr(lib, name) for name in names]  # all found before any registers
        for name, handler in zip(names, handlers, strict=True):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")

    return _Spec(
        prefix="tmcore_cell_jax",
        tools=(("CC", "cc"), ("CXX", "c++")),
        parts=lambda: [*(p.read_bytes() for p in (*SOURCES, JAX_SOURCE)), " ".join(cxx_flags),
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
    """The kernels as XLA FFI targets for JAX on the CPU, built and registered on the first call;
    None if disabled or not buildable (warned once)."""
    return _cached("jax", _jax_spec)


def library() -> ctypes.CDLL | None:
    """The kernels for ctypes, built on the first call; None if disabled or not buildable (warned
    once). Each returns 0, or nonzero when it could not allocate its scratch."""
    return _cached("torch", lambda: _TORCH)
