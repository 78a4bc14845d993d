"""How much of a CPU training step is page faults from the C allocator.

glibc's malloc hands multi-MB blocks back to the system when they are freed,
so a training step that allocates fresh tensors of a few MB every chunk step
touches new pages all the time (minor faults, paid in system time). tmcore
reuses its own per-step temporaries inside the scan (the backend workspace),
but torch's outputs and the checkpoints stay fresh. This runs the same torch
layer training step in two fresh processes, with glibc's defaults and with
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` raised (what
jemalloc / tcmalloc do by default), and prints time, minor faults and system
time per chunk step, interleaved over ``--rounds`` rounds.

    python -m benchmarks.allocator [--config lm-1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from benchmarks.common import CONFIGS

__all__ = ["main", "TUNED_ENV"]

#: glibc tunables that keep freed memory in the process (64 MiB / 256 MiB).
TUNED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def _child(name: str, reps: int) -> dict:
    from benchmarks import layers

    cfg = next(c for c in CONFIGS if c.name == name)
    params = layers.reference_params(cfg)
    x, g = layers.make_inputs(cfg)
    step = layers.torch_step(layers.torch_layer(cfg, params), x, g, train=True)
    step()
    step()
    best = None
    for _ in range(reps):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        run = {"ms_per_step": seconds / cfg.steps * 1e3,
               "faults_per_step": (after.ru_minflt - before.ru_minflt) / cfg.steps,
               "sys_ms_per_step": (after.ru_stime - before.ru_stime) / cfg.steps * 1e3}
        if best is None or run["ms_per_step"] < best["ms_per_step"]:
            best = run
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="lm-1024", choices=[c.name for c in CONFIGS])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.config, args.reps)))
        return
    base = {k: v for k, v in os.environ.items() if k not in TUNED_ENV}
    command = [sys.executable, "-m", "benchmarks.allocator", "--child", "--config", args.config,
               "--reps", str(args.reps)]
    print(f"{args.config}, torch layer fwd+bwd, best of {args.reps} per process")
    for round_ in range(args.rounds):
        for label, env in (("glibc defaults", base), ("tuned malloc", {**base, **TUNED_ENV})):
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {round_}  {label:15s} {r['ms_per_step']:6.2f} ms/step  "
                  f"{r['faults_per_step']:5.0f} minor faults/step  "
                  f"{r['sys_ms_per_step']:5.2f} ms/step system time", flush=True)


if __name__ == "__main__":
    main()
