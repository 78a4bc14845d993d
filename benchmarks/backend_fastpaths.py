"""Fast path vs generic path, per primitive (forward and VJP) and the scan step, per backend.

    .venv/bin/python benchmarks/backend_fastpaths.py [--configs lm toy] [--budget 0.3]
        [--frameworks numpy torch jax] [--threads 2]

Configs: ``lm`` = B=8, C=32 (conv 2C=64 -> 4C=128), grid 8^3; ``toy`` = B=32,
C=16, grid 6^3; one read and one write per batch entry (as in a chunk step).
float32 on CPU. Prints median milliseconds, the speedup generic/fast, and the
largest relative difference between the two paths' outputs.
"""

from __future__ import annotations

import argparse
import importlib.util

import _backend_bench as bb


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["lm", "toy"], choices=list(bb.CONFIGS))
    parser.add_argument("--frameworks", nargs="+", default=["numpy", "torch", "jax"])
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per timing")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    bb.ensure_tmcore()
    rows = []
    for name in args.frameworks:
        if importlib.util.find_spec(name) is None:
            print(f"{name}: skipped: not installed")
            continue
        fw = bb.Framework(name, "cpu")
        if name == "torch" and args.threads:
            fw.module.set_num_threads(args.threads)
        for config in args.configs:
            rows.extend(bb.bench_table(fw, config, budget_s=args.budget))
    bb.print_rows(rows)


if __name__ == "__main__":
    main()
