"""Build and load the fused CPU cell kernels (``_native_cell.c``) on first use.

The torch backend asks :func:`library` for the kernels the first time a CPU
float32 / float64 cell runs. The C source is compiled once per machine with the
system C compiler (``$CC``, default ``cc``; about 2 s) into a cache folder and
loaded with :mod:`ctypes`; later processes load the cached build. Without a
compiler, or when the build fails, :func:`library` warns once and returns
``None``, and the torch backend keeps its pure-torch path (same results, slower).

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

__all__ = ["ENV_VAR", "library", "enabled", "cache_dir", "SOURCE"]

ENV_VAR = "TMCORE_NATIVE"
SOURCE = Path(__file__).with_name("_native_cell.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math")
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "lib": CDLL | None once tried


def enabled() -> bool:
    """Whether the kernels may be used (``TMCORE_NATIVE`` is not ``0``)."""
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "false", "no", "off")


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


def _compiler() -> str | None:
    name = os.environ.get("CC", "cc")
    return shutil.which(name)


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(_FLAGS).encode(), str(version).encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile next to the target, then rename: concurrent builders never see half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *_FLAGS, "-o", tmp, str(SOURCE), "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip()[-2000:] or "the compiler failed")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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


def _load() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, or cc on PATH)")
    target = cache_dir() / f"tmcore_cell-{_build_key(compiler)}.so"
    if not target.exists():
        _build(compiler, target)
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on the first call; ``None`` if disabled or
    they cannot be built here (warned once, with the reason)."""
    if not enabled():
        return None
    if "lib" not in _STATE:
        with _LOCK:
            if "lib" not in _STATE:
                try:
                    _STATE["lib"] = _load()
                except Exception as exc:  # no compiler, read-only cache, failed build
                    _STATE["lib"] = None
                    warnings.warn(
                        f"tmcore: the fused CPU cell kernels are unavailable ({exc}); the "
                        f"torch backend uses its pure-torch path (same results, slower). "
                        f"Set {ENV_VAR}=0 to skip the attempt.", RuntimeWarning, stacklevel=3)
    return _STATE["lib"]  # type: ignore[return-value]
