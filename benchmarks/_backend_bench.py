"""Shared by ``backend_fastpaths.py`` and ``gpu_check.py``: cases, timing, agreement.

A *case* is one primitive (or the scan step), forward or VJP, at one size, as a
zero-argument callable built for one framework and device. Each is timed twice:
with the backend's fast path (the default) and under
``tmcore.options(generic=True)``. For JAX both variants are jitted; the path is
chosen while tracing, so each variant is traced inside its own context.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def ensure_tmcore() -> None:
    """Import tmcore from this checkout, mapping ``tmcore.backends`` to ``backends/``
    when the package is not installed (e.g. a bare GPU machine)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import tmcore  # noqa: F401

    try:
        importlib.import_module("tmcore.backends")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "tmcore.backends", ROOT / "backends" / "__init__.py",
            submodule_search_locations=[str(ROOT / "backends")],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["tmcore.backends"] = module
        spec.loader.exec_module(module)


# (name, B, C, grid)
CONFIGS = {
    "lm": (8, 32, (8, 8, 8)),
    "wide": (2, 64, (8, 8, 8)),
    "toy": (32, 16, (6, 6, 6)),
    "tiny": (2, 4, (3, 3, 3)),
}


def make_inputs(batch: int, channels: int, grid: tuple[int, ...], seed: int = 0) -> dict:
    """float64 NumPy inputs for every primitive and the step (read/write count 1)."""
    rng = np.random.default_rng(seed)
    n = len(grid)
    c2, c4 = 2 * channels, 4 * channels
    return {
        "volume": rng.standard_normal((batch, channels, *grid)),
        "coords": rng.uniform(-0.95, 0.95, (batch, 1, n)),
        "g_read": rng.standard_normal((batch, 1, channels)),
        "content": rng.standard_normal((batch, 1, channels)),
        "mu": rng.uniform(-0.9, 0.9, (batch, 1, n)),
        "sigma": rng.uniform(0.1, 0.5, (batch, 1)),
        "g_vol": rng.standard_normal((batch, channels, *grid)),
        "x": rng.standard_normal((batch, c2, *grid)),
        "params": [rng.standard_normal((n, c2, 3)) * 0.5, rng.standard_normal((n, c2)) * 0.1,
                   rng.standard_normal((c4, c2)) / math.sqrt(c2), rng.standard_normal(c4) * 0.1],
        "g_z": rng.standard_normal((batch, c4, *grid)),
        "h": rng.standard_normal((batch, channels, *grid)) * 0.5,
        "c": rng.standard_normal((batch, channels, *grid)) * 0.5,
    }


def case_fns(fw: Framework) -> dict[str, Callable[[dict], Any]]:
    """One-argument callables over converted inputs ``a`` (arrays of one namespace)."""
    import tmcore as tm
    from tmcore.scan import step_bwd, step_fwd
    from tmcore.types import ConvParams, StepInputs

    def grid(a):
        return tuple(a["volume"].shape[2:])

    def step_args(a):
        step = StepInputs(a["coords"][:, 0], a["mu"][:, 0], a["sigma"][:, 0],
                          a["content"][:, 0])
        return fw.namespace(a["h"]), a["h"], a["c"], step, ConvParams(*a["params"])

    return {
        "sample fwd": lambda a: tm.trilinear_sample(a["volume"], a["coords"]),
        "sample vjp": lambda a: tm.trilinear_sample_vjp(a["volume"], a["coords"], a["g_read"]),
        "splat fwd": lambda a: tm.gaussian_splat(a["content"], a["mu"], a["sigma"], grid(a)),
        "splat vjp": lambda a: tm.gaussian_splat_vjp(a["content"], a["mu"], a["sigma"],
                                                     grid(a), a["g_vol"]),
        "conv fwd": lambda a: tm.factorized_conv(a["x"], ConvParams(*a["params"])),
        "conv vjp": lambda a: tm.factorized_conv_vjp(a["x"], ConvParams(*a["params"]),
                                                     a["g_z"]),
        "step fwd": lambda a: step_fwd(*step_args(a), 1e-6, None),
        "step vjp": lambda a: step_bwd(*step_args(a), a["g_read"][:, 0], a["h"], a["c"],
                                       1e-6, None),
    }


class Framework:
    """How to convert, synchronize and (for JAX) compile for one library and device."""

    def __init__(self, name: str, device: str = "cpu"):
        self.name, self.device = name, device
        self.module = importlib.import_module({"numpy": "numpy", "torch": "torch",
                                               "jax": "jax", "cupy": "cupy"}[name])

    def namespace(self, x: Any) -> Any:
        import array_api_compat

        return array_api_compat.array_namespace(x)

    def convert(self, value: Any, dtype: str) -> Any:
        if isinstance(value, list):
            return [self.convert(v, dtype) for v in value]
        if self.name == "numpy":
            return np.asarray(value, dtype=dtype)
        if self.name == "torch":
            torch = self.module
            return torch.tensor(value, dtype=getattr(torch, dtype), device=self.device)
        if self.name == "jax":
            import jax
            import jax.numpy as jnp

            dev = jax.devices("gpu" if self.device == "cuda" else "cpu")[0]
            return jax.device_put(jnp.asarray(value, dtype=dtype), dev)
        return self.module.asarray(value, dtype=dtype)

    def sync(self, out: Any) -> None:
        if self.name == "torch" and self.device == "cuda":
            self.module.cuda.synchronize()
        elif self.name == "jax":
            import jax

            jax.block_until_ready(out)
        elif self.name == "cupy":
            self.module.cuda.get_current_stream().synchronize()

    def prepare(self, fn: Callable[[dict], Any], a: dict, generic: bool) -> Callable[[], Any]:
        """``fn(a)`` as a zero-argument callable on the chosen path (jitted for JAX)."""
        import tmcore

        if self.name == "jax":
            import jax

            jitted = jax.jit(lambda arrays: fn(arrays))
            with tmcore.options(generic=generic):
                self.sync(jitted(a))  # trace and compile on this path
            return lambda: jitted(a)

        def run():
            with tmcore.options(generic=generic):
                return fn(a)

        return run


def time_pair(fw: Framework, fast: Callable[[], Any], generic: Callable[[], Any],
              budget_s: float = 0.3, max_reps: int = 300) -> tuple[float, float]:
    """Best-of-n wall time in ms of each (synchronized), alternating the two so that
    load from other processes hits both alike."""
    for fn in (fast, generic, fast, generic):
        fw.sync(fn())
    best = [math.inf, math.inf]
    reps = 0
    start = time.perf_counter()
    while reps < max_reps and (reps < 5 or time.perf_counter() - start < budget_s):
        for k, fn in enumerate((fast, generic)):
            t0 = time.perf_counter()
            fw.sync(fn())
            best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
        reps += 1
    return best[0], best[1]


def to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().float() if str(x.dtype) == "torch.bfloat16" else x.detach().cpu()
    if hasattr(x, "get"):  # cupy
        x = x.get()
    return np.asarray(x, dtype=np.float64)


def flatten(out: Any) -> list[Any]:
    if isinstance(out, tuple | list):
        return [leaf for item in out for leaf in flatten(item)]
    return [out]


def max_rel_diff(a: Any, b: Any) -> float:
    """Worst ``max|a-b| / max|b|`` over the leaves of two outputs."""
    worst = 0.0
    for x, y in zip(flatten(a), flatten(b), strict=True):
        x, y = to_numpy(x), to_numpy(y)
        worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return worst


def expected_outputs(config: str) -> dict[str, Any]:
    """float64 NumPy outputs of every case on the generic path (the verified baseline)."""
    import tmcore

    fw = Framework("numpy")
    batch, channels, grid = CONFIGS[config]
    inputs = {k: fw.convert(v, "float64") for k, v in make_inputs(batch, channels, grid).items()}
    with tmcore.options(generic=True):
        return {case: fn(inputs) for case, fn in case_fns(fw).items()}


def bench_table(fw: Framework, config: str, dtype: str = "float32", budget_s: float = 0.3,
                expected: dict | None = None) -> list[tuple]:
    """Rows ``(backend, config, case, fast ms, generic ms, rel diff fast vs generic,
    rel err fast, rel err generic)``; the errors are against ``expected`` (NaN without)."""
    batch, channels, grid = CONFIGS[config]
    inputs = {k: fw.convert(v, dtype) for k, v in make_inputs(batch, channels, grid).items()}
    rows = []
    for case, fn in case_fns(fw).items():
        fast = fw.prepare(fn, inputs, generic=False)
        generic = fw.prepare(fn, inputs, generic=True)
        out_fast, out_generic = fast(), generic()
        diff = max_rel_diff(out_fast, out_generic)
        errs = ((max_rel_diff(out_fast, expected[case]), max_rel_diff(out_generic,
                                                                     expected[case]))
                if expected else (math.nan, math.nan))
        rows.append((f"{fw.name}-{fw.device}", config, case,
                     *time_pair(fw, fast, generic, budget_s), diff, *errs))
    return rows


def print_rows(rows: list[tuple]) -> None:
    print(f"{'backend':<12}{'config':<7}{'case':<12}{'fast ms':>10}{'generic ms':>12}"
          f"{'speedup':>9}{'fast~gen':>10}{'err fast':>10}{'err gen':>10}")
    def err(value: float) -> str:
        return f"{'-':>10}" if math.isnan(value) else f"{value:>10.1e}"

    for name, config, case, fast, generic, diff, err_fast, err_generic in rows:
        print(f"{name:<12}{config:<7}{case:<12}{fast:>10.3f}{generic:>12.3f}"
              f"{generic / fast:>8.2f}x{diff:>10.1e}{err(err_fast)}{err(err_generic)}")
