"""JAX native kernels under ``vmap`` over streams: one folded call vs one batch vs a loop.

A ConvLSTM step's value and gradient (the fused CPU kernels: depthwise passes and
gates, forward and VJP) for ``V`` streams of batch ``B``, three ways, interleaved in one
process (median of ``--reps`` rounds):

- ``batch``: one call on the ``(V B, ...)`` batch (the reference);
- ``vmap``: ``jax.vmap`` over the streams (now one custom call per kernel);
- ``loop``: ``lax.map`` over the streams, which is what the kernels' former
  ``vmap_method="sequential"`` ran.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.jax_native_vmap --out
benchmarks/results/jax_native_vmap.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

import tmcore
from tmcore.types import ConvParams

from .common import machine_line


def _loss(cell, x, h, c):
    h_new, c_new = tmcore.convlstm_step(x, h, c, cell)
    return jnp.sum(h_new ** 2) + jnp.sum(jnp.sin(c_new))


def _measure(V: int, B: int, C: int, g: int, reps: int) -> dict:
    S = (g,) * 3
    rng = np.random.default_rng(0)

    def arr(*s, scale=1.0):
        return jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)

    x, h, c = arr(V, B, C, *S), arr(V, B, C, *S), arr(V, B, C, *S)
    cell = ConvParams(arr(3, 2 * C, 3), arr(3, 2 * C), arr(4 * C, 2 * C, scale=0.2),
                      arr(4 * C))
    grad = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3))
    flat = lambda a: a.reshape(V * B, *a.shape[2:])  # noqa: E731
    ways = {
        "batch": jax.jit(lambda p, x, h, c: grad(p, flat(x), flat(h), flat(c))),
        "vmap": jax.jit(jax.vmap(grad, in_axes=(None, 0, 0, 0))),
        "loop": jax.jit(lambda p, x, h, c: jax.lax.map(lambda t: grad(p, *t), (x, h, c))),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for fn in ways.values():
        jax.block_until_ready(fn(cell, x, h, c))
    for _ in range(reps):  # interleaved
        for name, fn in ways.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(cell, x, h, c))
            times[name].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    hlo = ways["vmap"].lower(cell, x, h, c).as_text()
    return {
        "streams": V, "batch": B, "channels": C, "grid": list(S),
        "median_ms": {k: round(1e3 * v, 3) for k, v in median.items()},
        "vmap_over_batch": round(median["vmap"] / median["batch"], 3),
        "loop_over_batch": round(median["loop"] / median["batch"], 3),
        "vmap_custom_calls_gates_fwd": hlo.count("custom_call @tmcore_gates_fwd_f32("),
        "vmap_hlo_has_while": "while" in hlo,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    # (streams, batch per stream, channels, grid side): small (per-call overhead shows)
    # and larger (the kernels' work dominates)
    configs = [(16, 1, 4, 4), (8, 1, 16, 12)]
    result = {
        "command": "OMP_NUM_THREADS=1 python -m benchmarks.jax_native_vmap --out "
                   "benchmarks/results/jax_native_vmap.json",
        "commit": subprocess.run(["git", "rev-parse", "--short=10", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "machine": machine_line(),
        "what": "value_and_grad of one convlstm_step, float32, fused CPU kernels on",
        "reps": args.reps,
        "rows": [_measure(*config, args.reps) for config in configs],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
