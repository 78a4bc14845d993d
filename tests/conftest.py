"""pytest configuration: the deterministic hypothesis profile and the ``xp`` fixture.

The "ci" profile (derandomized, no deadline) is loaded by default; set
``HYPOTHESIS_PROFILE=dev`` for fresh random examples on every run.

XLA compiles the suite's JAX programs with its cheap settings (:data:`TEST_XLA_FLAGS`):
with tiny shapes, compiling is most of a JAX test's time, and these settings halve it
(the same programs, compiled with fewer optimization passes). They are appended to
``XLA_FLAGS`` before JAX is imported (subprocess tests inherit them);
``TMCORE_TEST_XLA_DEFAULTS=1`` runs the suite with XLA's default pipeline instead.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

#: XLA CPU settings for the tests: no LLVM optimization passes and the classic loop
#: emitters (compile time of the small programs here drops by about 2x).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_use_fusion_emitters=false")
if os.environ.get("TMCORE_TEST_XLA_DEFAULTS", "") in ("", "0"):
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS]).strip()

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The array-API standard revision array_api_strict is pinned to in tests: the most
# widely implemented one, so that tmcore only relies on functions every
# conforming namespace offers.
STRICT_API_VERSION = "2023.12"

NAMESPACES = ["numpy", "array_api_strict"]


def load_namespace(name: str) -> ModuleType:
    """Import an array namespace by name, skipping the test when it is missing."""
    if name == "numpy":
        import numpy

        return numpy
    module = pytest.importorskip(name, reason=f"{name} is not installed")
    if name == "array_api_strict":
        module.set_array_api_strict_flags(api_version=STRICT_API_VERSION)
    return importlib.import_module(name)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``slow`` are skipped unless ``TMCORE_SLOW_TESTS`` is set (not 0)."""
    if os.environ.get("TMCORE_SLOW_TESTS", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow: set TMCORE_SLOW_TESTS=1")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", params=NAMESPACES)
def xp(request) -> ModuleType:
    """The array namespace under test (session-scoped so hypothesis can reuse it)."""
    return load_namespace(request.param)


@pytest.fixture(autouse=True)
def _isolated_process_settings():
    """Each test starts from the same tmcore options and torch settings.

    Examples under test call ``tmcore.options(deterministic=True)`` as a setter and
    pin torch's thread count, and property tests turn on JAX's float64; without this,
    those settings would leak into every later test of the session (and hide what the
    environment variables set, or make a test's dtypes depend on the order).
    """
    from tmcore.runtime import options as _options

    token = _options._LOCAL.set(_options._LOCAL.get())
    torch = importlib.import_module("torch") if "torch" in sys.modules else None
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) \
        if torch is not None else None
    # a test that turns on JAX's float64 (jax_enable_x64) turns it off again for the next
    x64 = sys.modules["jax"].config.jax_enable_x64 if "jax" in sys.modules else False
    try:
        yield
    finally:
        _options._LOCAL.reset(token)
        if "jax" in sys.modules and sys.modules["jax"].config.jax_enable_x64 != x64:
            sys.modules["jax"].config.update("jax_enable_x64", x64)
        torch = importlib.import_module("torch") if "torch" in sys.modules else None
        if torch is not None:
            if saved is not None:
                torch.set_num_threads(saved[0])
                torch.use_deterministic_algorithms(saved[1])
            else:
                torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def _reload_environment_after_test():
    """tmcore reads its switches' environment variables once (and on
    ``reload_environment()``): after a test that changed them (``monkeypatch.setenv``,
    undone before this teardown), read them again."""
    yield
    if "tmcore.runtime.options" in sys.modules:
        sys.modules["tmcore.runtime.options"].reload_environment()


# The native kernel cache's tests (tests/backends/test_native_cache*.py).
@pytest.fixture
def fresh(monkeypatch):
    """A loader with nothing loaded, no fallback folder yet and the real compiler;
    ``fresh(folder)`` makes ``folder`` the cache folder."""
    import tmcore.backends.native.build as native
    from tmcore.backends.native import cache

    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(cache, "_FALLBACK", {})
    monkeypatch.setenv("CC", shutil.which(os.environ.get("CC", "cc")) or "cc")
    monkeypatch.delenv(native.TIMEOUT_ENV_VAR, raising=False)
    monkeypatch.delenv(native.ENV_VAR, raising=False)

    def use(folder: Path) -> Path:
        monkeypatch.setenv("TMCORE_CACHE_DIR", str(folder))
        return folder

    return use
