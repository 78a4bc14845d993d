"""What a compiler pays for the layer as the sequence grows.

- torch: one ``torch.compile(..., dynamic=True)`` of a training step of the torch
  layer, called at several sequence lengths: the time of each length's first compiled
  step (the compile, at the first length) next to the eager step, the graphs Dynamo
  made for it (none after the first length: a new length does not recompile), and the
  largest difference from eager (checked under ``no_grad``, which compiles its own
  inference graph once).
- JAX: ``jax.jit`` of a training step (value and gradient) of the JAX layer at several
  numbers of chunks: compile time and the size of the optimized HLO text (both flat:
  the chunk loop is a ``lax.scan``, not unrolled).

    python -m benchmarks.compile_dynamic --out benchmarks/results/compile_dynamic.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import machine_line

__all__ = ["torch_dynamic", "jax_compile", "main"]

SIZES = {"embed_dim": 32, "memory_channels": 8, "memory_shape": (4, 4, 4), "chunk_size": 4}


def torch_dynamic(lengths: Sequence[int], *, stream: bool = False) -> dict[str, Any]:
    """One dynamic-shape compile of a torch training step, called at ``lengths``."""
    import torch
    from torch._dynamo.utils import counters

    from tmcore.adapters.torch import TensorMemory

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = TensorMemory(**SIZES)

    def loss(x: Any) -> Any:
        return layer(x, stream=stream)[0].square().mean()

    compiled = torch.compile(loss, dynamic=True)

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    rows = []
    for n in lengths:
        x = torch.randn(2, n, SIZES["embed_dim"], requires_grad=True)
        before = graphs()
        start = time.perf_counter()
        compiled(x).backward()
        seconds = time.perf_counter() - start
        made = graphs() - before  # 0 after the first length: no recompile
        start = time.perf_counter()
        loss(x).backward()
        eager_seconds = time.perf_counter() - start
        with torch.no_grad():  # the check compiles its own (inference) graph once
            before = graphs()
            diff = float((compiled(x) - loss(x)).abs())
            check_graphs = graphs() - before
        rows.append({"tokens": n, "seconds": round(seconds, 3),
                     "eager_seconds": round(eager_seconds, 3), "new_graphs": made,
                     "check_graphs": check_graphs, "graphs_so_far": graphs(),
                     "max_abs_diff": diff})
    return {"stream": stream, "rows": rows,
            "graph_breaks": {str(k): v for k, v in counters["graph_break"].items()},
            "recompiles": {str(k): v for k, v in counters["recompiles"].items()},
            "dynamo_stats": {str(k): v for k, v in counters["stats"].items()}}


def jax_compile(chunk_counts: Sequence[int]) -> list[dict[str, Any]]:
    """Compile time and optimized-HLO size of a jitted JAX training step per chunk count."""
    import jax
    import jax.numpy as jnp

    from tmcore.adapters import jax as tj

    params = tj.init(jax.random.PRNGKey(0), SIZES["embed_dim"], SIZES["memory_channels"],
                     SIZES["memory_shape"], SIZES["chunk_size"])

    def loss(p: Any, x: Any) -> Any:
        out, _ = tj.apply(p, x, stream=False)
        return jnp.mean(out ** 2)

    rows = []
    for steps in chunk_counts:
        x = jnp.ones((2, steps * SIZES["chunk_size"], SIZES["embed_dim"]), jnp.float32)
        start = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
        seconds = time.perf_counter() - start
        rows.append({"chunks": steps, "compile_seconds": round(seconds, 3),
                     "hlo_chars": len(compiled.as_text())})
    return rows


def _commit() -> str:
    """``git rev-parse --short HEAD`` of the checkout, ``+dirty`` with tracked edits."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024],
                        help="JAX chunk counts (chunk size 4: 256 to 4096 tokens)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--warm-cache", action="store_true",
                        help="use Inductor's usual on-disk cache (default: a fresh empty one, "
                             "so the first compile is timed cold)")
    args = parser.parse_args(argv)
    if not args.warm_cache:  # before torch compiles anything
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tmcore-inductor-")
    import torch

    torch.set_num_threads(1)
    result = {"command": "OMP_NUM_THREADS=1 python -m benchmarks.compile_dynamic "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "commit": _commit(), "machine": machine_line(),
              "config": {**SIZES, "batch": 2, "torch_threads": 1,
                         "inductor_cache": "warm" if args.warm_cache else "fresh (cold compile)"},
              "torch": [torch_dynamic(args.lengths, stream=s) for s in (False, True)],
              "jax": jax_compile(args.chunks)}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
