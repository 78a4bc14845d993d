"""Sizes are checked before anything is allocated: int64 element counts and the bytes a call
needs, in both adapters and the public functions, with a clear error naming the argument.

The oversize cases run in a subprocess under an address-space limit
(``RLIMIT_AS``: what it has mapped after the imports plus 1.5 GiB), so nothing
big is ever touched; the subprocess reports each case's exception and its peak
memory, and JAX must never abort (SIGABRT) on an overflowing shape.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tmcore
from tmcore import layer as tl
from tmcore.runtime import validate

pytestmark = pytest.mark.skipif(sys.platform != "linux",
                                reason="RLIMIT_AS and /proc are Linux's; tested there")

_PRELUDE = """
import json, os, resource, sys
def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
def limit():
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + (3 << 29)  # what is mapped now + 1.5 GiB
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
results = {}
def case(name, fn):
    try:
        fn()
        results[name] = ["ok", ""]
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results[name] = [type(exc).__name__, str(exc)]
"""


def _run(body: str) -> dict:
    """Run ``body`` (after the prelude) in a fresh interpreter; its results."""
    code = _PRELUDE + textwrap.dedent(body) + (
        "\nresults['_rss_rise_mib'] = ['ok', str(rss_mib() - start)]\n"
        "print('RESULTS' + json.dumps(results))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMCORE_NATIVE="0")  # kernels: not the subject
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


def _require(*modules: str) -> None:
    """Skip unless ``modules`` are installed (found, not imported: the work is in the
    subprocess)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")


def _expect(results: dict, name: str, kind: str, *needles: str) -> None:
    got, message = results[name]
    assert got == kind, (name, got, message)
    for needle in needles:
        assert needle in message, (name, needle, message)


def test_torch_oversize_shapes_raise_before_allocating():
    _require("torch")
    results = _run("""
        import numpy as np, torch, tmcore
        from tmcore.adapters import torch as tt
        x = torch.randn(2, 8, 8)
        small = tt.TensorMemory(8, 4, (4, 4, 4), 4)
        small(x)  # warm up (builds and loads the kernels) before the limit
        limit()
        start = rss_mib()
        case("overflow", lambda: tt.TensorMemory(8, 2, (2**21,) * 3, 4))
        case("overflow_1d", lambda: tt.TensorMemory(8, 2, (2**62,), 4))
        case("embed", lambda: tt.TensorMemory(2**31, 2, (4,), 4))
        big = tt.TensorMemory(8, 4, (700,) * 3, 4)
        case("stream", lambda: big(x))
        case("plain", lambda: big(x, stream=False))
        case("init_state", lambda: big.init_state(16))
        case("grid_1024", lambda: tt.TensorMemory(8, 1, (1024,) * 3, 4)(x[:1]))
        case("splat", lambda: tt.gaussian_splat(torch.zeros(1, 1, 2), torch.zeros(1, 1, 3),
                                                torch.ones(1, 1), (2**21,) * 3))
        case("splat_bytes", lambda: tmcore.gaussian_splat(
            torch.zeros(1, 1, 64), torch.zeros(1, 1, 3), torch.ones(1, 1), (512,) * 3))
        # a backward keeping every state: 3000 x 2 x 8 MiB checkpoints, refused before the
        # forward runs (h0 itself is small)
        h0 = torch.zeros(1, 4, 64, 64, 64, dtype=torch.float64)
        T = 3000
        p = tmcore.ConvParams(torch.zeros(3, 8, 3, dtype=torch.float64),
                              torch.zeros(3, 8, dtype=torch.float64),
                              torch.zeros(16, 8, dtype=torch.float64),
                              torch.zeros(16, dtype=torch.float64))
        args = (h0, h0, torch.zeros(1, T, 3, dtype=torch.float64),
                torch.zeros(1, T, 3, dtype=torch.float64), torch.ones(1, T, dtype=torch.float64),
                torch.zeros(1, T, 4, dtype=torch.float64), p)
        case("vjp", lambda: tmcore.memory_scan_vjp(*args, torch.zeros(1, T, 4,
                                                                     dtype=torch.float64)))
        case("small_still_runs", lambda: small(x))
    """)
    _expect(results, "overflow", "ValueError", "memory_shape:", "int64")
    _expect(results, "overflow_1d", "ValueError", "memory_shape:", "int64")
    _expect(results, "embed", "ValueError", "embed_dim:", "write_proj.weight")
    for name in ("stream", "plain", "init_state", "grid_1024"):
        _expect(results, name, "MemoryError", "memory_shape:", "nothing was allocated",
                "RLIMIT_AS")
    _expect(results, "splat", "ValueError", "shape:", "int64")
    _expect(results, "splat_bytes", "MemoryError", "shape:", "(B, C, *shape)")
    _expect(results, "vjp", "MemoryError", "h0:", "keeping 3000 states")
    _expect(results, "small_still_runs", "ok")
    assert float(results["_rss_rise_mib"][1]) < 100


def test_jax_oversize_shapes_raise_and_never_abort():
    _require("jax", "flax")
    results = _run("""
        import jax, jax.numpy as jnp
        from tmcore.adapters import jax as tj
        key = jax.random.PRNGKey(0)
        params = tj.init(key, 8, 2, (4, 4, 4), 4)
        x = jnp.zeros((1, 4, 8))
        tj.apply(params, x)  # warm up before the limit
        def grid(shape):  # the parameters for another grid (no parameter depends on it)
            return {**params, "config": params["config"].replace(memory_shape=shape)}
        limit()
        start = rss_mib()
        case("init", lambda: tj.init(key, 8, 2, (2**21,) * 3, 4))
        case("init_state", lambda: tj.init_state(1, 1, (2**21,) * 3))
        case("apply", lambda: tj.apply(grid((2**21,) * 3), x))
        case("apply_bytes", lambda: tj.apply(grid((1024,) * 3), x, stream=False))
        case("apply_stream", lambda: tj.apply(grid((1024,) * 3), x))
        case("jit", lambda: jax.jit(lambda p, x: tj.apply(p, x))(grid((1024,) * 3), x))
        case("init_params", lambda: tj.init(key, 2**16, 2, (4,), 64))
        case("state_bytes", lambda: tj.init_state(64, 8, (512,) * 3))
        case("splat", lambda: tj.gaussian_splat(jnp.zeros((1, 1, 2)), jnp.zeros((1, 1, 3)),
                                                jnp.ones((1, 1)), (2**21,) * 3))
        case("small_still_runs", lambda: tj.apply(params, x))
    """)
    for name in ("init", "init_state", "apply"):
        _expect(results, name, "ValueError", "memory_shape:", "int64")
    for name in ("apply_bytes", "apply_stream", "jit", "state_bytes"):
        _expect(results, name, "MemoryError", "memory_shape:", "nothing was allocated")
    _expect(results, "init_params", "MemoryError", "embed_dim:", "parameters")
    _expect(results, "splat", "ValueError", "shape:", "int64")
    _expect(results, "small_still_runs", "ok")
    assert float(results["_rss_rise_mib"][1]) < 100


# --------------------------------------------------------------------------- in process


def test_numpy_public_functions_check_counts_before_allocating():
    with pytest.raises(ValueError, match=r"^shape: the volume .* int64"):
        tmcore.gaussian_splat(np.zeros((1, 1, 2)), np.zeros((1, 1, 3)), np.ones((1, 1)),
                              (2**21,) * 3)
    with pytest.raises(ValueError, match=r"^memory_shape: .* int64"):
        tl.layer_config(8, 2, (2**21,) * 3, 4)
    with pytest.raises(ValueError, match=r"^embed_dim: write_proj.weight"):
        tl.layer_config(2**31, 2, (4,), 4)


def test_a_budget_below_the_estimate_refuses_and_names_it(monkeypatch):
    """With a fake 64 MiB device, a 2 x 32 MiB state plus one step is refused; the
    message gives the estimate and the budget."""
    monkeypatch.setattr(validate, "memory_budget", lambda xp, device=None: (64 << 20, "a test"))
    config = tl.layer_config(8, 1, (256, 256, 128), 4)
    with pytest.raises(MemoryError, match=r"^memory_shape: the state .* would take at least "
                                          r"[0-9.]+ .iB, more than 64.0 MiB \(a test\)"):
        tl.zero_state(np, config, 1, dtype=np.float32)
    small = tl.layer_config(8, 1, (16, 16, 16), 4)
    h, c = tl.zero_state(np, small, 1, dtype=np.float32)  # small: not even looked up
    assert h.shape == (1, 1, 16, 16, 16)


def test_the_estimates_are_lower_bounds_of_what_is_held():
    """The scan estimate counts at least the state in and out and the reads, so it never
    exceeds what a real scan holds; with checkpoints it grows by 2 states each."""
    state, batch, channels = 1000, 2, 4
    none = validate.scan_bytes(state, batch, channels, 10, 0, 4)
    assert none >= 4 * (4 * state + batch * 10 * channels)
    assert validate.scan_bytes(state, batch, channels, 10, 5, 4) - none == 4 * 2 * 5 * state


def test_the_host_budget_is_known_here():
    budget = validate.memory_budget(np)
    assert budget is not None and budget[0] > 1 << 28
