"""Peak memory of one training step, measured alone in this process.

``python -m benchmarks.memory --impl torch|plain|jax|numpy --config lm-4096``
prints one JSON line ``{"impl", "config", "peak_bytes"}``: the rise of the
resident set's high-water mark over the resident set before the step, for the
second training step (the first one warms up allocators and thread pools).
:func:`benchmarks.common.run_isolated` runs it in a fresh process.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import CONFIGS, TINY, peak_rss_growth
from benchmarks.layers import (
    jax_step,
    make_inputs,
    numpy_step,
    reference_params,
    torch_layer,
    torch_step,
)

__all__ = ["measure"]


def measure(impl: str, config_name: str) -> int:
    cfg = {c.name: c for c in [*CONFIGS, TINY]}[config_name]
    params = reference_params(cfg)
    x, g = make_inputs(cfg)
    if impl in ("torch", "plain"):
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads()))
        step = torch_step(torch_layer(cfg, params, impl), x, g, train=True)
    elif impl == "jax":
        step = jax_step(cfg, params, x, g, train=True)
    elif impl == "numpy":
        step = numpy_step(cfg, params, train=True)
    else:
        raise ValueError(f"impl: expected torch, plain, jax or numpy, got {impl!r}")
    step()
    return peak_rss_growth(step)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    peak = measure(args.impl, args.config)
    print(json.dumps({"impl": args.impl, "config": args.config, "peak_bytes": peak}))


if __name__ == "__main__":
    main()
