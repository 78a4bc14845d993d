"""The flow warp's VJP: the generic tile contraction vs the scatter-add fast path.

``tmcore.ops.warp.warp_bwd`` with a per-cell flow, torch CPU, one thread, float32, B = 2,
C = 8, n = 3, at grids 8^3 and 16^3, every method timed at every grid in turn in one
process (so the load of a shared machine falls on all alike):

- ``vjp generic``: the whole VJP under ``tmcore.options(generic=True)``: the state's
  gradient by dense products over tiles of cells, ``O(B C P^2)``;
- ``vjp fast``: the whole VJP by the default dispatch: the state's gradient scatter-added
  into the ``2^n`` corners (``Ops.scatter_add``, torch ``index_add_``), ``O(2^n B C P)``;
- ``d_volume generic`` / ``d_volume fast``: the state's gradient alone (the part that
  differs; the displacement's gradient is the same code in both).

Each measurement repeats until it has at least ``--reps`` calls and ``--min-seconds``;
minimum and median in ms. Writes ``benchmarks/results/warp_flow.json`` (``command``,
``commit``, ``dirty_paths``, ``machine``, ``load``, ``config``, ``rows``, ``ratios``)::

    python -m benchmarks.warp_flow              # well under 2 minutes
    python -m benchmarks.warp_flow --tiny       # seconds, no file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = ("vjp generic", "vjp fast", "d_volume generic", "d_volume fast")

__all__ = ["measure", "main"]


def _case(torch, batch: int, channels: int, grid: int, seed: int = 0):
    """``(xp, residuals, g)`` of one flow warp of a ``(B, C, grid^3)`` volume."""
    import array_api_compat.torch as xp

    from tmcore.ops.warp import warp_fwd

    gen = torch.Generator().manual_seed(seed)
    shape = (grid, grid, grid)
    volume = torch.randn(batch, channels, *shape, generator=gen)
    shift = (torch.rand(batch, 3, generator=gen) * 2 - 1) * 0.3
    flow = (torch.rand(batch, 3, *shape, generator=gen) * 2 - 1) * 0.2
    g = torch.randn(batch, channels, *shape, generator=gen)
    _, residuals = warp_fwd(xp, volume, shift, flow)
    return xp, residuals, g


def _calls(torch, batch: int, channels: int, grid: int):
    import tmcore
    from tmcore.ops import warp as warp
    from tmcore.runtime.dispatch import ops_for

    xp, residuals, g = _case(torch, batch, channels, grid)
    scatter_add = ops_for(xp).scatter_add
    assert scatter_add is not None, "torch has no scatter_add in its table"

    def vjp_generic():
        with tmcore.options(generic=True):
            return warp.warp_bwd(xp, residuals, g)

    def d_volume_fast():
        corners = list(warp._corner_indices(xp, residuals.volume, residuals.axes))
        return warp._flow_volume_scatter(xp, residuals, g, corners, scatter_add)

    calls = {"vjp generic": vjp_generic,
             "vjp fast": lambda: warp.warp_bwd(xp, residuals, g),
             "d_volume generic": lambda: warp._flow_volume_grad(xp, residuals, g),
             "d_volume fast": d_volume_fast}
    # the two paths agree (float32 rounding): the timing compares equal results
    gen, fast = calls["vjp generic"]()[0], calls["vjp fast"]()[0]
    err = float((gen - fast).abs().max() / gen.abs().max())
    assert err < 1e-5, f"generic and fast d_volume differ by {err:.2e} (relative)"
    return calls


def measure(grids: list[int], batch: int, channels: int, reps: int,
            min_seconds: float) -> list[dict]:
    """One row per (grid, method): ``ms_min``, ``ms_median``, ``reps``."""
    import torch

    torch.set_num_threads(1)
    calls = {grid: _calls(torch, batch, channels, grid) for grid in grids}
    times: dict[tuple[int, str], list[float]] = {(g, m): [] for g in grids for m in METHODS}
    spent = {key: 0.0 for key in times}
    for fn in (f for per in calls.values() for f in per.values()):
        fn()  # warm-up
    while any(len(times[k]) < reps or spent[k] < min_seconds for k in times):
        for grid in grids:
            for method in METHODS:
                key = (grid, method)
                if len(times[key]) >= reps and spent[key] >= min_seconds:
                    continue
                start = time.perf_counter()
                calls[grid][method]()
                elapsed = time.perf_counter() - start
                times[key].append(elapsed * 1e3)
                spent[key] += elapsed
    return [{"grid": f"{g}^3", "method": m, "ms_min": round(min(times[g, m]), 3),
             "ms_median": round(statistics.median(times[g, m]), 3), "reps": len(times[g, m])}
            for g in grids for m in METHODS]


def _ratios(rows: list[dict]) -> dict:
    by = {(r["grid"], r["method"]): r for r in rows}
    out = {}
    for grid in dict.fromkeys(r["grid"] for r in rows):
        for part in ("vjp", "d_volume"):
            gen, fast = by[grid, f"{part} generic"], by[grid, f"{part} fast"]
            out[f"{grid} {part} generic / fast"] = {
                stat: round(gen[stat] / fast[stat], 1) for stat in ("ms_min", "ms_median")}
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", type=int, nargs="+", default=[8, 16])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-seconds", type=float, default=3.0)
    p.add_argument("--tiny", action="store_true", help="grid 4^3, one rep, no file")
    p.add_argument("--out", default=RESULTS)
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.tiny:
        args.grids, args.reps, args.min_seconds = [4], 1, 0.0
    from benchmarks.common import machine_line
    from benchmarks.run import git_state

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    rows = measure(args.grids, args.batch, args.channels, args.reps, args.min_seconds)
    result = {"command": " ".join(["python -m benchmarks.warp_flow", *argv]),
              **git_state(), "machine": machine_line(),
              "load": {"1-min before": round(load_before, 2),
                       "1-min after": round(os.getloadavg()[0], 2)},
              "wall_s": round(time.perf_counter() - start, 1),
              "config": {"backend": "torch CPU", "threads": 1, "dtype": "float32",
                         "batch": args.batch, "channels": args.channels, "n": 3,
                         "shift": "uniform +-0.3", "flow": "uniform +-0.2 per cell",
                         "reps_at_least": args.reps, "min_seconds": args.min_seconds},
              "rows": rows, "ratios": _ratios(rows)}
    for row in rows:
        print(f"{row['grid']:>5} {row['method']:<17} min {row['ms_min']:9.3f} ms  "
              f"median {row['ms_median']:9.3f} ms  ({row['reps']} reps)")
    for key, value in result["ratios"].items():
        print(f"{key}: {value['ms_min']}x (min), {value['ms_median']}x (median)")
    if not args.tiny:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "warp_flow.json"), "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
