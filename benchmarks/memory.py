"""Peak memory of one training step, measured alone in this process.

``python -m benchmarks.memory --impl torch|plain|jax|numpy --config lm-4096``
prints one JSON line ``{"impl", "config", "peak_bytes"}``: the rise of the
resident set's high-water mark over the resident set before the step, for the
second training step (the first one warms up allocators and thread pools; the torch
layer's pooled scan buffers are released in between, so the step's own buffers count).
:func:`benchmarks.common.run_isolated` runs it in a fresh process.

``python -m benchmarks.memory --long-scan 20000`` instead measures a long
inference scan: one ``no_grad`` call of the torch layer over ``T`` chunks
(chunk 1, B=2, d=64, C=16, grid 8^3), with glibc's allocator left at its
defaults (as a user runs it); it prints the resident set's growth over the call
and its peak. Inference memory should not grow with ``T`` beyond the outputs
themselves (``T * B * d`` floats).
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
    if impl == "torch":  # the fused CPU scan keeps its buffers for the next call: let the
        import tmcore.backends  # measured step allocate them, as a first step would

        tmcore.backends.release_scan_buffers()
    return peak_rss_growth(step)


def measure_long_scan(steps: int) -> dict:
    """RSS growth (bytes) of one ``no_grad`` torch-layer call over ``steps`` chunks:
    ``{"steps", "rss_growth_bytes", "peak_growth_bytes", "output_bytes"}``."""
    import gc

    import torch

    from benchmarks.common import _rss_kib
    from tmcore.adapters.torch import TensorMemory

    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = TensorMemory(64, 16, (8, 8, 8), 1)
    with torch.no_grad():
        layer(torch.randn(2, 64, 64), stream=False)  # warm-up: kernel build, allocator
        x = torch.randn(2, steps, 64)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss_kib("VmRSS")
        out, _ = layer(x, stream=False)
        after, peak = _rss_kib("VmRSS"), _rss_kib("VmHWM")
    return {"steps": steps, "rss_growth_bytes": (after - before) * 1024,
            "peak_growth_bytes": (peak - before) * 1024,
            "output_bytes": out.numel() * out.element_size()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl")
    parser.add_argument("--config")
    parser.add_argument("--long-scan", type=int, default=None, metavar="T")
    args = parser.parse_args(argv)
    if args.long_scan is not None:
        print(json.dumps(measure_long_scan(args.long_scan)))
        return
    if not args.impl or not args.config:
        parser.error("--impl and --config are required (or --long-scan T)")
    peak = measure(args.impl, args.config)
    print(json.dumps({"impl": args.impl, "config": args.config, "peak_bytes": peak}))


if __name__ == "__main__":
    main()
