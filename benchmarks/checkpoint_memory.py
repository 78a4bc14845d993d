"""Peak training memory of the torch layer at lm-4096 for a given ``checkpoint_every``.

``python -m benchmarks.checkpoint_memory K`` prints ``K, peak MiB, seconds`` for one
training step (after a warm-up step). Run one K per process: the peak is the growth of
the process's resident-set high-water mark.
"""

from __future__ import annotations

import sys
import time

from benchmarks.common import CONFIGS, peak_rss_growth
from benchmarks.layers import make_inputs, reference_params, torch_layer, torch_step


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    every = int(args[0]) if args else 1
    cfg = {c.name: c for c in CONFIGS}["lm-4096"]
    params = reference_params(cfg)
    x, g = make_inputs(cfg)
    layer = torch_layer(cfg, params, "torch")
    layer.checkpoint_every = every
    step = torch_step(layer, x, g, train=True)
    step()
    start = time.perf_counter()
    peak = peak_rss_growth(step)
    print(f"checkpoint_every={every}: peak {peak / 2**20:.1f} MiB, "
          f"{time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
