"""Task-graph size and time of tmcore's generic path on dask arrays.

Builds ``memory_scan`` (forward) and ``memory_scan_vjp`` on dask arrays of one
block each (state ``(B, C, *S)``), counts the distinct tasks of the result
graphs and the most blocks of any output, then computes them with the
synchronous scheduler. ``--per-cell-blocks`` swaps in the conv's neighbours as
they were before the fix (concat of zeros, then shifted slices, no rechunk),
which split the state into one block per cell::

    python -m benchmarks.dask_graph --steps 2 4 8
    python -m benchmarks.dask_graph --steps 2 4 8 --per-cell-blocks
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import tmcore
import tmcore.ops.conv

__all__ = ["main", "measure"]


def _neighbours_per_cell_blocks(xp: Any, x: Any, axis: int) -> tuple[Any, Any]:
    """The conv's neighbours before the fix: blocks 1, S, 1 cut at 1 and S-1."""
    size = x.shape[axis]
    pad_shape = list(x.shape)
    pad_shape[axis] = 1
    pad = xp.zeros(tuple(pad_shape), dtype=x.dtype)
    padded = xp.concat([pad, x, pad], axis=axis)
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, size)
    prev = padded[tuple(index)]
    index[axis] = slice(2, size + 2)
    return prev, padded[tuple(index)]


def measure(steps: int, vjp: bool, shape: tuple[int, ...] = (6, 6, 6), batch: int = 2,
            channels: int = 4) -> dict:
    """Tasks, max blocks per output, graph-build and compute seconds for one call."""
    import dask
    import dask.array as da

    rng = np.random.default_rng(0)
    n = len(shape)

    def mk(*s: int, low: float | None = None) -> Any:
        a = rng.standard_normal(s) if low is None else rng.uniform(low, 1.0, s)
        return da.from_array(a)

    h0, c0 = mk(batch, channels, *shape) * 0.5, mk(batch, channels, *shape) * 0.5
    ins = (h0, c0, mk(batch, steps, n, low=-1.0), mk(batch, steps, n, low=-1.0),
           mk(batch, steps, low=0.2), mk(batch, steps, channels))
    params = tmcore.ConvParams(mk(n, 2 * channels, 3), mk(n, 2 * channels),
                               mk(4 * channels, 2 * channels), mk(4 * channels))
    start = time.perf_counter()
    if vjp:
        out = tmcore.memory_scan_vjp(*ins, params, mk(batch, steps, channels),
                                     mk(batch, channels, *shape), mk(batch, channels, *shape),
                                     checkpoint_every=2)
        leaves = [*out[:6], *out[6]]
    else:
        leaves = list(tmcore.memory_scan(*ins, params))
    build = time.perf_counter() - start
    graph: dict = {}
    for leaf in leaves:
        graph.update(dict(leaf.__dask_graph__()))
    start = time.perf_counter()
    dask.compute(*leaves, scheduler="sync")
    return dict(steps=steps, vjp=vjp, tasks=len(graph),
                max_blocks=max(leaf.npartitions for leaf in leaves), build_s=build,
                compute_s=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--per-cell-blocks", action="store_true",
                        help="the conv's neighbours as before the fix")
    parser.add_argument("--no-vjp", action="store_true", help="forward only")
    args = parser.parse_args(argv)
    if args.per_cell_blocks:
        tmcore.ops.conv.neighbours = _neighbours_per_cell_blocks
    label = "per-cell blocks (before)" if args.per_cell_blocks else "one block per axis"
    print(f"dask, state (2, 4, 6, 6, 6) float64, {label}")
    for vjp in (False,) if args.no_vjp else (False, True):
        for steps in args.steps:
            r = measure(steps, vjp)
            print(f"{'memory_scan_vjp' if vjp else 'memory_scan':16s} T={steps}: "
                  f"{r['tasks']:7d} tasks, {r['max_blocks']:4d} blocks max, "
                  f"build {r['build_s']:.2f} s, compute {r['compute_s']:.2f} s", flush=True)


if __name__ == "__main__":
    main()
