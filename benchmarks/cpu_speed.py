"""The torch layer against the floor and the plain baseline on the CPU, side by side.

One process, one thread. For each configuration (``lm-256``, ``lm-1024`` by
default) it times, forward (no grad) and forward + backward:

- ``torch``: :class:`tmcore.adapters.torch.TensorMemory` (fused C kernels where
  they run),
- ``floor``: the pointwise-mixing matrix products of one chunk step
  (:func:`benchmarks.layers.floor_step`), and
- ``plain``: the plain autograd layer (:mod:`benchmarks.plain_torch`).

The machine is shared and noisy, so the implementations are timed in
alternation, round after round (each round: one call of each), and each one's
time is its minimum over the rounds (the least disturbed call); medians are
kept too. Times are per chunk step (a layer call over ``T`` chunks counts as
``T`` steps; the floor is one step). The ratios ``torch / floor`` and
``plain / torch`` come from the same rounds, by wall time (min and median) and
by this thread's CPU time (``time.thread_time``: what the step costs the core,
less sensitive to other processes on a loaded machine).

    python -m benchmarks.cpu_speed                       # lm-256, lm-1024
    python -m benchmarks.cpu_speed --configs lm-1024 --rounds 9 \\
        --out benchmarks/results/cpu_speed.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import CONFIGS, TINY, Config, machine_line
from benchmarks.layers import floor_step, make_inputs, reference_params, torch_layer, torch_step

__all__ = ["measure_config", "main"]

REPO = Path(__file__).resolve().parent.parent
_IMPLS = ("torch", "floor", "plain")


def _steps(cfg: Config, train: bool) -> dict[str, tuple[Callable[[], Any], int, int]]:
    """``impl -> (callable, chunk steps it covers, calls per timed sample)``."""
    params = reference_params(cfg)
    x, g = make_inputs(cfg)
    floor = floor_step(cfg, train)
    calls = max(1, min(200, cfg.steps))  # the floor is tiny: time a batch of calls
    return {
        "torch": (torch_step(torch_layer(cfg, params, "torch"), x, g, train), cfg.steps, 1),
        "floor": (floor, 1, calls),
        "plain": (torch_step(torch_layer(cfg, params, "plain"), x, g, train), cfg.steps, 1),
    }


def _time_once(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """``(wall seconds, this thread's CPU seconds)`` per call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall) / calls, (time.thread_time() - cpu) / calls


def measure_config(cfg: Config, rounds: int, impls: Sequence[str] = _IMPLS) -> dict:
    """Per-step times (ms, min and median over ``rounds``) and ratios, forward and
    forward + backward, the implementations alternating within each round."""
    result: dict[str, Any] = {"config": cfg.describe(), "steps": cfg.steps}
    for mode, train in (("fwd", False), ("train", True)):
        fns = {k: v for k, v in _steps(cfg, train).items() if k in impls}
        for fn, _, calls in fns.values():  # warm-up: kernels built, allocator primed
            _time_once(fn, calls)
        walls: dict[str, list[float]] = {k: [] for k in fns}
        cpus: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for name, (fn, steps, calls) in fns.items():
                wall, cpu = _time_once(fn, calls)
                walls[name].append(wall / steps * 1e3)
                cpus[name].append(cpu / steps * 1e3)
        row: dict[str, Any] = {
            name: {"ms_per_step": min(walls[name]),
                   "median_ms_per_step": statistics.median(walls[name]),
                   "cpu_ms_per_step": min(cpus[name]),
                   "samples": walls[name], "cpu_samples": cpus[name]} for name in fns}
        for key, num, den in (("torch_over_floor", "torch", "floor"),
                              ("plain_over_torch", "plain", "torch")):
            if num in row and den in row:
                row[key] = row[num]["ms_per_step"] / row[den]["ms_per_step"]
                row[key + "_median"] = (row[num]["median_ms_per_step"]
                                        / row[den]["median_ms_per_step"])
                row[key + "_cpu"] = row[num]["cpu_ms_per_step"] / row[den]["cpu_ms_per_step"]
        result[mode] = row
    return result


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=REPO, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=REPO).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _line(name: str, mode: str, row: dict) -> str:
    parts = [f"{name:8s} {mode:5s}"]
    for impl in _IMPLS:
        if impl in row:
            parts.append(f"{impl} {row[impl]['ms_per_step']:7.3f} "
                         f"(cpu {row[impl]['cpu_ms_per_step']:.3f})")
    for key in ("torch_over_floor", "plain_over_torch"):
        if key in row:
            parts.append(f"{key.replace('_over_', '/')} {row[key]:.2f}x (median "
                         f"{row[key + '_median']:.2f}x, cpu {row[key + '_cpu']:.2f}x)")
    return "  ".join(parts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    names = {c.name: c for c in [*CONFIGS, TINY]}
    parser.add_argument("--configs", nargs="+", default=["lm-256", "lm-1024"],
                        choices=sorted(names))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=list(_IMPLS), choices=_IMPLS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks.cpu_speed",
                               *(argv if argv is not None else sys.argv[1:])]),
        "commit": _commit(),
        "machine": machine_line(),
        "threads": args.threads,
        "rounds": args.rounds,
        "configs": {},
    }
    for name in args.configs:
        res = measure_config(names[name], args.rounds, args.impls)
        results["configs"][name] = res
        for mode in ("fwd", "train"):
            print(_line(name, mode, res[mode]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
