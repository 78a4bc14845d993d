"""Command line of the backend kit: ``python -m tmcore.testing NAMESPACE [...]``.

Prints the :class:`~tmcore.testing.kit.NamespaceReport` of each namespace (what served
it, passed properties with their example counts, every failure with its minimal
example) and a one-line tally; exits 1 if any property failed, 2 if a namespace or the
backend could not be loaded or the namespace lacks float64. For example::

    python -m tmcore.testing numpy marray.numpy --max-examples 3 --time-budget 60
    python -m tmcore.testing numpy --backend mypkg.ops:make_ops   # your fast path
    python -m tmcore.testing jax.numpy --x64        # JAX with float64 enabled
    python -m tmcore.testing mlx.core --without-float64
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tmcore.testing",
                                     description="Run tmcore's property suite on namespaces.")
    parser.add_argument("namespaces", nargs="+",
                        help="dotted names (numpy, array_api_strict, torch, jax.numpy, "
                             "marray.numpy, ndonnx, array_api_compat.dask.array, ...)")
    parser.add_argument("--backend", default=None, metavar="MODULE:FUNCTION",
                        help="a make_ops(generic, options) to serve the namespaces' arrays "
                             "(default: the registered backends)")
    parser.add_argument("--max-examples", type=int, default=None,
                        help="examples per property (default: each property's own)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds per namespace, shared by its properties")
    parser.add_argument("--properties", default=None,
                        help="comma-separated property names (default: all)")
    parser.add_argument("--without-float64", action="store_true",
                        help="run only the properties that need no float64 in the namespace")
    parser.add_argument("--x64", action="store_true",
                        help="enable JAX float64 (sets JAX_ENABLE_X64=1 before JAX is imported)")
    args = parser.parse_args(argv)
    if args.x64:
        # JAX reads this when it is first imported, which is below (tmcore.testing
        # itself never imports a framework)
        os.environ["JAX_ENABLE_X64"] = "1"
    from tmcore.testing.kit import check_namespace
    from tmcore.testing.properties import PROPERTIES

    properties = args.properties.split(",") if args.properties else None
    if args.without_float64:
        properties = [name for name in properties or PROPERTIES
                      if not PROPERTIES[name].needs_float64]
    status = 0
    for name in args.namespaces:
        start = time.perf_counter()
        try:
            report = check_namespace(name, properties=properties, max_examples=args.max_examples,
                                     time_budget=args.time_budget, backend=args.backend)
        except (ImportError, ValueError, TypeError) as exc:
            print(f"{name}: not run: {type(exc).__name__}: {exc}")
            status = max(status, 2)
            continue
        print(report)
        total = len(report.passed) + len({f.name for f in report.failures})
        print(f"{name}: {len(report.passed)}/{total} passed in "
              f"{time.perf_counter() - start:.1f} s\n", flush=True)
        if report.failures:
            status = max(status, 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
