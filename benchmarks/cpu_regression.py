"""Is the torch layer's CPU training step as fast as at another commit? Measured side by side.

This machine is shared and noisy, so two checkouts are timed in alternation, in
fresh processes, round after round, and the answer is the ratio of their medians
(and of their minimums, and of their median process CPU times, which a loaded
machine's waits do not inflate: with ``--threads 1``, the step's own work). Each
checkout needs its own environment with tmcore installed from it (for example a copy
of ``.venv`` with ``pip install -e <checkout> --no-deps``)::

    python -m benchmarks.cpu_regression --python /tmp/old/.venv/bin/python \\
        --python .venv/bin/python --config lm-256 --rounds 5

One process times ``--reps`` training steps (forward + backward, float32) of
``tmcore.adapters.torch.TensorMemory`` built from the public constructor only,
so that any commit's adapter runs the same script. ``--json PATH`` writes the
per-round values, the command and the commits.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import CONFIGS, checkout_commit, machine_line

_CHILD = r"""
import json, sys, time
import torch
from tmcore.adapters.torch import TensorMemory

batch, d, channels, shape, chunk, tokens, reps, threads = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(threads)
layer = TensorMemory(d, channels, tuple(shape), chunk)
x = torch.randn(batch, tokens, d, requires_grad=True)
g = torch.randn(batch, tokens, d)


def step():
    out, _ = layer(x)
    out.backward(g)


step()  # warm-up: kernels loaded, allocator primed
times = []
for _ in range(reps):
    start, cpu = time.perf_counter(), time.process_time()
    step()
    times.append([time.perf_counter() - start, time.process_time() - cpu])
print(json.dumps(times))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True,
                        help="an interpreter whose tmcore is the checkout to time (twice or more)")
    parser.add_argument("--config", default="lm-256", choices=[c.name for c in CONFIGS])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if len(args.python) < 2:
        parser.error("--python: give at least two interpreters to compare")
    args.python = [os.path.abspath(p) for p in args.python]  # the children run in "/"
    cfg = next(c for c in CONFIGS if c.name == args.config)
    spec = json.dumps([cfg.batch, cfg.embed_dim, cfg.channels, list(cfg.shape), cfg.chunk,
                       cfg.tokens, args.reps, args.threads])
    per_python: dict[str, list[list[float]]] = {p: [] for p in args.python}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for round_index in range(args.rounds):
        # rotate the order so a load that changes during a round slows every checkout alike
        order = args.python[round_index % len(args.python):] + \
            args.python[:round_index % len(args.python)]
        for python in order:
            # cwd "/": no checkout's folder shadows the installed tmcore on sys.path
            done = subprocess.run([python, "-c", _CHILD, spec], capture_output=True,
                                  text=True, check=True, env=env, cwd="/")
            per_python[python].extend(json.loads(done.stdout.strip().splitlines()[-1]))
    base = args.python[0]
    rows = []
    first_wall, first_cpu = zip(*per_python[base], strict=True)
    for python, pairs in per_python.items():
        times, cpu = zip(*pairs, strict=True)
        row = {"python": python, "commit": checkout_commit(python),
               "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
               "seconds": list(times), "cpu_median_ms": 1e3 * statistics.median(cpu),
               "cpu_seconds": list(cpu)}
        row["median_ratio_to_first"] = statistics.median(times) / statistics.median(first_wall)
        row["min_ratio_to_first"] = min(times) / min(first_wall)
        row["cpu_median_ratio_to_first"] = statistics.median(cpu) / statistics.median(first_cpu)
        rows.append(row)
        print(f"{row['commit']}: median {row['median_ms']:.1f} ms, min {row['min_ms']:.1f} ms "
              f"per training step; x{row['median_ratio_to_first']:.3f} (median), "
              f"x{row['min_ratio_to_first']:.3f} (min), x{row['cpu_median_ratio_to_first']:.3f} "
              f"(median CPU time) of the first")
    if args.json is not None:
        command = "python -m benchmarks.cpu_regression " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        args.json.write_text(json.dumps({"command": command, "machine": machine_line(),
                                         "config": args.config, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
