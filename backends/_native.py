"""Build and load the fused CPU cell kernels (``_native_cell.c``) on first use.

The torch backend asks :func:`library` for the kernels the first time a CPU
float32 / float64 cell runs: the C source is compiled once per machine with the
system C compiler (``$CC``, default ``cc``; about 2 s) into a cache folder and
loaded with :mod:`ctypes`. The JAX backend asks :func:`jax_library`: the same C
kernels plus ``_native_jax.cc``, their XLA FFI handlers, compiled with ``$CXX``
(default ``c++``) against the headers jaxlib ships (about 4 s) and registered
as CPU custom-call targets. Later processes load the cached builds. Without a
compiler, or when a build fails, the call warns once and returns ``None``, and
the backend keeps its framework-only path (same results, slower).

- ``TMCORE_NATIVE=0`` turns the kernels off (read at call time).
- ``TMCORE_CACHE_DIR`` sets the cache folder (default
  ``$XDG_CACHE_HOME/tmcore``, else ``~/.cache/tmcore``).

The build is keyed by the source, the flags, the compiler's version and the
CPU's feature flags (it uses ``-march=native``), so a shared cache never hands
a build to a machine it was not made for. The kernels use OpenMP; loaded after
torch, ``libgomp.so.1`` resolves to the copy torch already holds, so both share
one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from tmcore._options import get_options

__all__ = ["ENV_VAR", "library", "jax_library", "enabled", "cache_dir", "SOURCE"]

ENV_VAR = "TMCORE_NATIVE"
SOURCE = Path(__file__).with_name("_native_cell.c")
JAX_SOURCE = Path(__file__).with_name("_native_jax.cc")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math")
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "torch" / "jax": CDLL, or None once a build failed


def enabled() -> bool:
    """Whether the kernels may be used: ``tmcore.get_options().native`` (the option,
    whose default is ``TMCORE_NATIVE``)."""
    return get_options().native


def cache_dir() -> Path:
    """Where builds are kept (``TMCORE_CACHE_DIR``, else the user's cache folder)."""
    if os.environ.get("TMCORE_CACHE_DIR"):
        return Path(os.environ["TMCORE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tmcore"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _tool(env: str, default: str) -> str | None:
    return shutil.which(os.environ.get(env, default))


def _version(compiler: str) -> str:
    return str(subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()[:1])


def _build_key(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in (*parts, platform.machine(), _cpu_flags()):
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip()[-2000:] or f"{command[0]} failed")


def _build(target: Path, commands) -> None:
    """Run ``commands(workdir, out)`` (a list of compiler calls writing ``out``) in a
    scratch folder next to ``target``, then move ``out`` into place: concurrent
    builders never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        out = Path(work) / target.name
        for command in commands(Path(work), out):
            _run(command)
        os.replace(out, target)


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    shape = ctypes.POINTER(ctypes.c_int64)
    for suffix in ("f32", "f64"):
        getattr(lib, f"dw_fwd_{suffix}").argtypes = [ptr, ptr, ptr, ptr, i64, i64, cint, shape]
        getattr(lib, f"dw_bwd_{suffix}").argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64,
                                                     i64, cint, shape]
        getattr(lib, f"gates_fwd_{suffix}").argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
        getattr(lib, f"gates_bwd_{suffix}").argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64,
                                                        i64, i64]
        for kernel in ("dw_fwd", "dw_bwd", "gates_fwd", "gates_bwd"):
            getattr(lib, f"{kernel}_{suffix}").restype = None


def _load_c() -> ctypes.CDLL:
    cc = _tool("CC", "cc")
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, or cc on PATH)")
    key = _build_key(SOURCE.read_bytes(), " ".join(_FLAGS), _version(cc))
    target = cache_dir() / f"tmcore_cell-{key}.so"
    if not target.exists():
        _build(target, lambda work, out: [[cc, *_FLAGS, "-o", str(out), str(SOURCE), "-lm"]])
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    return lib


def _load_jax() -> ctypes.CDLL:
    import jax

    cc, cxx = _tool("CC", "cc"), _tool("CXX", "c++")
    if cc is None or cxx is None:
        raise RuntimeError("no C / C++ compiler found ($CC / $CXX, or cc / c++ on PATH)")
    include = jax.ffi.include_dir()
    cxx_flags = ("-std=c++17", "-O2", "-fPIC", "-w", f"-I{include}")
    key = _build_key(SOURCE.read_bytes(), JAX_SOURCE.read_bytes(), " ".join(_FLAGS),
                     " ".join(cxx_flags), _version(cc), _version(cxx), jax.__version__)
    target = cache_dir() / f"tmcore_cell_jax-{key}.so"
    if not target.exists():
        c_flags = [f for f in _FLAGS if f != "-shared"]

        def commands(work: Path, out: Path) -> list[list[str]]:
            return [[cc, *c_flags, "-c", str(SOURCE), "-o", str(work / "cell.o")],
                    [cxx, *cxx_flags, "-c", str(JAX_SOURCE), "-o", str(work / "ffi.o")],
                    [cxx, "-shared", "-fopenmp", str(work / "cell.o"), str(work / "ffi.o"),
                     "-o", str(out), "-lm"]]
        _build(target, commands)
    lib = ctypes.CDLL(str(target))
    for kernel in ("dw_fwd", "dw_bwd", "gates_fwd", "gates_bwd"):
        for suffix in ("f32", "f64"):
            name = f"tmcore_{kernel}_{suffix}"
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)),
                                        platform="cpu")
    return lib


def _cached(key: str, loader):
    """``loader()``'s library, loaded once (``None``, warned once, if it fails)."""
    if not enabled():
        return None
    if key not in _STATE:
        with _LOCK:
            if key not in _STATE:
                try:
                    _STATE[key] = loader()
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
    return _cached("jax", _load_jax)


def library() -> ctypes.CDLL | None:
    """The loaded kernels (for ctypes), building them on the first call; ``None`` if
    disabled or they cannot be built here (warned once, with the reason)."""
    return _cached("torch", _load_c)
