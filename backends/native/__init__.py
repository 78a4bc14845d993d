"""The fused CPU kernels (``kernels.c``, ``jax_ffi.cc``): built on first use (:mod:`.build`)
into a verified cache (:mod:`.cache`), called from torch through ctypes (:mod:`.calls`, the
one module here that imports torch) and from JAX as XLA custom calls.
"""

from __future__ import annotations

from .build import (
    ENV_VAR,
    SOURCE,
    SOURCES,
    TIMEOUT_ENV_VAR,
    cache_dir,
    compile_timeout,
    enabled,
    jax_library,
    library,
)

__all__ = ["ENV_VAR", "TIMEOUT_ENV_VAR", "SOURCE", "SOURCES", "library", "jax_library",
           "enabled", "cache_dir", "compile_timeout"]
