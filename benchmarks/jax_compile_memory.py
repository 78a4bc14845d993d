"""Resident memory of an eager JAX caller that streams pieces of many lengths (issue 63).

``python -m benchmarks.jax_compile_memory [--lengths 192] [--out FILE]`` calls
``tmj.apply`` eagerly on inputs of ``--lengths`` distinct lengths, one after another, and
records the resident set every 32 lengths, twice, each in a fresh process: as a user runs
it, and with ``jax.clear_caches()`` before each reading (JAX's own per-shape caches
emptied). What tmcore keeps is bounded (``STREAM_CACHE_SIZE`` compiled calls, a dropped one
cleared); the difference between the two runs is what JAX's bounded per-shape caches hold.
Writes ``benchmarks/results/jax_compile_memory.json`` (the command, commit and readings).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine_line
from benchmarks.run import git_state

OUT = Path(__file__).resolve().parent / "results" / "jax_compile_memory.json"

_CHILD = """
import gc, sys
import jax, numpy as np
from tmcore.adapters import jax as tmj

lengths, clear = int(sys.argv[1]), sys.argv[2] == "1"
params = tmj.init(jax.random.key(0), 16, 4, (4, 4, 4), 4)
readings = {}
for i, tokens in enumerate(range(5, 5 + lengths), 1):
    tmj.apply(params, jax.device_put(np.ones((1, tokens, 16), np.float32)))
    if i % 32 == 0:
        if clear:
            jax.clear_caches()
        gc.collect()
        pages = int(open("/proc/self/statm").read().split()[1])
        readings[i] = round(pages * 4096 / 2**20, 1)
print(readings)
"""


def measure(lengths: int, clear: bool) -> dict[int, float]:
    """Resident MiB after every 32 lengths, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(lengths), str(int(clear))],
                          capture_output=True, text=True, check=True)
    return {int(k): v for k, v in ast.literal_eval(done.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=192)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    runs = {"as_used": measure(args.lengths, False),
            "jax_caches_cleared": measure(args.lengths, True)}
    result = {"command": "python -m benchmarks.jax_compile_memory"
                         + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
              **git_state(), "machine": machine_line(),
              "config": {"layer": "TensorMemory(16, 4, (4, 4, 4), 4)", "batch": 1,
                         "lengths": f"5 .. {4 + args.lengths}"},
              "resident_mib": runs}
    for name, readings in runs.items():
        grow = readings.get(96, 0) - readings.get(32, 0)
        print(f"{name}: {readings} (32 -> 96 lengths: {grow:+.1f} MiB)")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
