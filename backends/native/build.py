"""Build and load the fused CPU kernels (``kernels.c``) on first use.

The torch backend asks :func:`library` for the kernels the first time a CPU
float32 / float64 cell runs: the C sources are compiled once per machine with the
system C compiler (``$CC``, default ``cc``, split as a shell would, so
``CC="gcc -O0"`` is ``gcc`` with ``-O0`` before tmcore's flags; about 2 s) into a cache folder and
loaded with :mod:`ctypes`. The JAX backend asks :func:`jax_library`: the same C
kernels plus ``jax_ffi.cc``, their XLA FFI handlers, compiled with ``$CXX``
(default ``c++``) against the headers jaxlib ships (about 4 s) and registered
as CPU custom-call targets. Later processes load the cached builds. Without a
compiler (and no verified build to reuse), or when a build fails, the call
warns once and returns ``None``, and the backend keeps its framework-only path
(same results, slower).

- ``tmcore.options(native=False)`` or ``TMCORE_NATIVE=0`` turns the kernels off
  (read at call time, by :func:`enabled`).
- ``TMCORE_CACHE_DIR`` sets the cache folder (default
  ``$XDG_CACHE_HOME/tmcore``, else ``~/.cache/tmcore``); how it is guarded:
  :mod:`tmcore.backends.native.cache`.
- ``TMCORE_COMPILE_TIMEOUT`` bounds each compiler run, in seconds (default 120;
  ``inf`` or ``none``: no limit; anything else that is not a number > 0 is
  refused with a warning naming the variable, and the default applies). The first
  kernel call of a process waits for the build; a build still running after
  ``min(10 s, timeout / 2)`` says so in a warning with the most it will wait.

**A bad cache heals.** A build that fails its check (truncated, garbage, no
digest) or fails to load (no such symbols) is deleted and rebuilt once in this
process; if the fresh build fails too, tmcore warns and keeps the framework
path. Compilers run under the timeout in their own process group (killed whole
when it expires). A compiler's version is cached by (path, size, mtime) in
``compilers.json``, so ``cc --version`` does not run at every start. Each
successful load records its build as the latest for these sources and this
machine, so a later process without a compiler on ``PATH`` still loads it
(verified).

The build is keyed by the sources, the flags, the compiler's version and the
CPU's feature flags (it uses ``-march=native``), so a shared cache never hands
a build to a machine it was not made for. The kernels use OpenMP; loaded after
torch, ``libgomp.so.1`` resolves to the copy torch already holds, so both share
one thread pool.

Clear the cache by deleting the folder (``rm -r ~/.cache/tmcore``); it is
rebuilt on the next use.
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
    """Whether the kernels may be used: ``tmcore.get_options().native`` (the option,
    whose default is ``TMCORE_NATIVE``). The one place that answers "are the native
    kernels on?" for both backends."""
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
    """The compiler command ``$env`` names (default ``default``) as an argument list, split
    as a shell would (``CC="gcc -O0"``: the compiler ``gcc`` with the flag ``-O0``, added
    before tmcore's own), its program resolved on ``PATH``; ``None`` if not found. A
    value that does not parse (an unclosed quote) counts as not found."""
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
    """Run ``command`` in its own process group; its stdout. The whole group is killed
    when ``timeout`` expires (a compiler's children too). With ``announce`` (a one-item
    flag shared by the commands of one build, ``[True]`` until it is said): once the
    command has run ``min(ANNOUNCE_AFTER_S, timeout / 2)`` s, a warning says that this
    call waits for the compiler and for how long at most."""
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
    """The compiler's version line and its extra flags (``command[1:]``), the version
    cached in ``folder/compilers.json`` by the resolved path, size and mtime of its
    executable (so it runs once per compiler install)."""
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
    """Run ``commands(workdir, out)`` (compiler calls writing ``out``) in a private
    scratch folder next to ``target``, record ``out``'s SHA-256, then rename both
    into place: no process ever sees half a file."""
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
    """The kernels as XLA FFI targets for JAX on the CPU (``tmcore_{kernel}_{f32,f64}``),
    built and registered on the first call; ``None`` if disabled or not buildable
    (warned once)."""
    return _cached("jax", _jax_spec)


def library() -> ctypes.CDLL | None:
    """The loaded kernels (for ctypes), building them on the first call; ``None`` if
    disabled or they cannot be built here (warned once, with the reason). Each kernel
    returns 0, or nonzero when it could not allocate its scratch memory."""
    return _cached("torch", lambda: _TORCH)
