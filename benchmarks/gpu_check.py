"""One prepared GPU check: agreement and timings of every fast path vs the generic path.

    python benchmarks/gpu_check.py                  # CUDA: torch-cuda, jax-gpu, cupy
    python benchmarks/gpu_check.py --device cpu     # the same on the CPU (tested in CI)

For each library that imports and sees the device (otherwise it prints
``skipped: why``), each config (``lm`` B=8 C=32 8^3, ``wide`` B=2 C=64 8^3,
``toy`` B=32 C=16 6^3) and each case (read, write, factorized conv 2C -> 4C,
forward and VJP, and the scan step forward and VJP), it runs the fast path
and the forced-generic path in float32, checks both against the float64 NumPy
generic path (relative error <= ``--tol``), checks that the VJPs are bitwise
reproducible, and prints one table of best-of-n milliseconds. Runs in
well under 4 minutes on one GPU. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import _backend_bench as bb


def _framework(name: str, device: str):
    """``(Framework, None)`` or ``(None, why it is skipped)``."""
    module_name = {"torch": "torch", "jax": "jax", "cupy": "cupy", "numpy": "numpy"}[name]
    if importlib.util.find_spec(module_name) is None:
        return None, "not installed"
    try:
        fw = bb.Framework(name, device)
        if device == "cuda":
            if name == "torch" and not fw.module.cuda.is_available():
                return None, "torch sees no CUDA device"
            if name == "jax":
                import jax

                try:
                    jax.devices("gpu")
                except RuntimeError as err:
                    return None, f"jax has no GPU backend ({str(err).splitlines()[0]})"
            if name == "cupy" and fw.module.cuda.runtime.getDeviceCount() < 1:
                return None, "cupy sees no CUDA device"
        elif name == "cupy":
            return None, "cupy runs only on a GPU"
        elif name == "jax":
            import jax

            jax.config.update("jax_platforms", "cpu")
        return fw, None
    except Exception as err:  # noqa: BLE001 - report any import/driver failure and go on
        return None, f"{type(err).__name__}: {err}"


def _deterministic(fw, config: str) -> bool:
    """The fast VJPs give bitwise-identical results on two runs."""
    import numpy as np

    batch, channels, grid = bb.CONFIGS[config]
    inputs = {k: fw.convert(v, "float32")
              for k, v in bb.make_inputs(batch, channels, grid).items()}
    for case, fn in bb.case_fns(fw).items():
        if not case.endswith("vjp"):
            continue
        run = fw.prepare(fn, inputs, generic=False)
        first = [bb.to_numpy(x) for x in bb.flatten(run())]
        second = [bb.to_numpy(x) for x in bb.flatten(run())]
        if not all(np.array_equal(a, b) for a, b in zip(first, second, strict=True)):
            print(f"  {fw.name}: {case} is not bitwise reproducible")
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--frameworks", nargs="+", default=None,
                        help="default: torch jax cupy (cuda) or numpy torch jax (cpu)")
    parser.add_argument("--configs", nargs="+", default=["lm", "wide", "toy"],
                        choices=list(bb.CONFIGS))
    parser.add_argument("--budget", type=float, default=0.2, help="seconds per timing")
    parser.add_argument("--tol", type=float, default=5e-4, help="float32 relative tolerance")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    bb.ensure_tmcore()
    names = args.frameworks or (["torch", "jax", "cupy"] if args.device == "cuda"
                                else ["numpy", "torch", "jax"])
    expected = {config: bb.expected_outputs(config) for config in args.configs}
    rows, failures = [], []
    for name in names:
        fw, why = _framework(name, args.device)
        if fw is None:
            print(f"{name}: skipped: {why}")
            continue
        if name == "torch" and args.threads:
            fw.module.set_num_threads(args.threads)
        for config in args.configs:
            try:
                new = bb.bench_table(fw, config, budget_s=args.budget, expected=expected[config])
            except Exception as err:  # noqa: BLE001 - report and continue with the others
                failures.append(f"{name} {config}: {type(err).__name__}: {err}")
                continue
            rows.extend(new)
            failures += [f"{row[0]} {config} {row[2]}: error {max(row[6:]):.1e} > {args.tol}"
                         for row in new if max(row[6:]) > args.tol]
        if not _deterministic(fw, args.configs[0]):
            failures.append(f"{name}: VJPs not bitwise reproducible")
    bb.print_rows(rows)
    print(f"checks: {len(rows)} cases, {len(failures)} failures; "
          f"{time.perf_counter() - start:.0f} s")
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
