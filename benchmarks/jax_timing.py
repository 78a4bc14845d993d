"""Time the JAX layer in a process of its own (``benchmarks.run`` calls this).

JAX's CPU kernels run OpenMP regions from XLA's threads; timed in the same
process as the torch layer, later torch steps measured up to 2x slower
(6 -> 12 ms/step at lm-256), so the suite keeps the frameworks apart. Prints one
JSON line: per mode (``fwd``, ``train``) the minimum and median seconds of a call.

    python -m benchmarks.jax_timing --config lm-1024 --reps 3
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import CONFIGS, TINY, time_fn
from benchmarks.layers import jax_step, make_inputs, reference_params

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, choices=[c.name for c in [*CONFIGS, TINY]])
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args(argv)
    cfg = next(c for c in [*CONFIGS, TINY] if c.name == args.config)
    params = reference_params(cfg)
    x, g = make_inputs(cfg)
    out = {}
    for mode, train in (("fwd", False), ("train", True)):
        out[mode] = time_fn(jax_step(cfg, params, x, g, train), args.reps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
