"""The fused CPU kernels: ``kernels.c`` (one ``*.inc`` per kernel family) and
``jax_ffi.cc``, built on first use (:mod:`~tmcore.backends.native.build`) into a
verified cache (:mod:`~tmcore.backends.native.cache`), called from torch through
:mod:`ctypes` (:mod:`~tmcore.backends.native.calls`, the one module here that imports
torch) and from JAX as XLA custom calls."""

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
