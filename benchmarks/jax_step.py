"""JAX decode step cost: one-token ``tmj.apply`` called eagerly, as a jitted step and inside
``lax.scan`` (issues 50 and 60), per token, interleaved in one run.

Usage::

    python -m benchmarks.jax_step            # writes benchmarks/results/jax_step.json

One thread (``XLA_FLAGS`` single-threaded Eigen), float32, the bare memory layer.
``ratio`` is the jitted step's ms/token over the scan's; ``eager_over_jit`` the eager call's
over the jitted step's (issue 60: <= 3; and the scan <= 0.05 ms/token). Best and median of
the passes; every pass is recorded.
``jit dispatch floor`` is a jitted function taking and returning the same pytree and
doing nothing: what any per-token ``jax.jit`` call costs on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "jax_step.json")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Best and median of ``passes`` ms per token of each mode, the passes interleaved."""
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    import jax
    from jax import lax

    from tmcore.adapters import jax as tmj

    shape = tuple(args.grid)
    params = tmj.init(jax.random.key(0), args.width, args.channels, shape, args.chunk)
    # (T, B, 1, d): every Python-driven mode takes token t with one eager index, none reshapes
    tokens = jax.random.normal(jax.random.key(1), (args.tokens, args.batch, 1, args.width))
    start = tmj.empty_stream_state(params, args.batch)

    @jax.jit
    def step(state: Any, token: Any) -> Any:
        out, state = tmj.apply(params, token, state)
        return out, state

    def body(state: Any, token: Any) -> Any:
        out, state = tmj.apply(params, token, state)
        return state, out[:, 0]

    scan = jax.jit(lambda s, xs: lax.scan(body, s, xs))

    def run_step() -> None:
        state = start
        for t in range(args.tokens):
            out, state = step(state, tokens[t])
        jax.block_until_ready((out, state))

    def run_scan() -> None:
        jax.block_until_ready(scan(start, tokens))

    @jax.jit
    def floor(state: Any, token: Any) -> Any:  # the same pytree in and out, no work
        return token, state

    def run_floor() -> None:
        state = start
        for t in range(args.tokens):
            out, state = floor(state, tokens[t])
        jax.block_until_ready((out, state))

    def run_eager() -> None:
        state = start
        for t in range(args.tokens):
            out, state = tmj.apply(params, tokens[t], state)
        jax.block_until_ready((out, state))

    modes = (("eager", run_eager), ("jit step", run_step), ("lax.scan", run_scan),
             ("jit dispatch floor", run_floor))
    passes: dict[str, list[float]] = {name: [] for name, _ in modes}
    for _, run in modes:  # compile
        run()
    for _ in range(args.passes):
        for name, run in modes:
            begin = time.perf_counter()
            run()
            passes[name].append(1e3 * (time.perf_counter() - begin) / args.tokens)
    ms = {k: min(v) for k, v in passes.items()}
    median = {k: statistics.median(v) for k, v in passes.items()}
    return {"ms_per_token": ms, "median_ms_per_token": median, "passes_ms_per_token": passes,
            "ratio": ms["jit step"] / ms["lax.scan"],
            "eager_over_jit": ms["eager"] / ms["jit step"],
            "median_eager_over_jit": statistics.median(
                e / j for e, j in zip(passes["eager"], passes["jit step"], strict=True)),
            "step_over_floor": ms["jit step"] / ms["jit dispatch floor"]}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print and write the results file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--grid", type=int, nargs="+", default=[4, 4, 4])
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    import jax

    command = " ".join(["python -m benchmarks.jax_step",
                        *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command, "commit": _commit(),
              "machine": f"{platform.processor() or platform.machine()}; "
                         f"{os.cpu_count()} cores; jax {jax.__version__}",
              "config": vars(args), **measure(args)}
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
