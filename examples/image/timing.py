"""Step time of the image backbones, measured fairly on a shared machine.

``python -m examples.image timing``: the four models of each seed (same batch and
masks, same optimizer) take training steps in turn, the order rotating every
round, so a change of load on the machine slows them alike; the median per model
and seed goes to ``results/timing.json`` (``rows``: ``{model, metric: "step_ms",
setting: "interleaved", seeds: [median ms per seed]}``).
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from examples.image.common import commit_info, environment, interleaved_ms, make_deterministic
from examples.image.train import ImageConfig, MaskedAutoencoder, patchify, random_masks

__all__ = ["measure"]


def measure(config: ImageConfig, rounds: int, command: str, threads: int = 1,
            device: str = "cpu") -> dict:
    """The timing results dictionary (see the module docstring)."""
    provenance = commit_info()
    per_seed: dict[str, list[float]] = {kind: [] for kind in config.models}
    for seed in config.seeds:
        gen = make_deterministic(seed, threads)
        images = torch.rand(config.batch, 3, config.size, config.size, generator=gen)
        patches = patchify(images, config.patch).to(device)
        mask = random_masks(config.batch, math.prod(config.grid), 0.5, gen).to(device)
        steps = {}
        for kind in config.models:
            model = MaskedAutoencoder(kind, config).to(device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=config.lr)

            def step(model=model, opt=opt, patches=patches, mask=mask) -> None:
                loss = F.mse_loss(model(patches, mask)[mask], patches[mask])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if device != "cpu":
                    torch.cuda.synchronize()

            steps[kind] = step
        for kind, ms in interleaved_ms(steps, rounds).items():
            per_seed[kind].append(round(statistics.median(ms), 2))
    return {"task": "step time", "command": command, **provenance,
            "config": {**config.as_dict(), "rounds": rounds},
            "environment": environment(threads, device), "seeds": list(config.seeds),
            "rows": [{"model": kind, "metric": "step_ms", "setting": "interleaved",
                      "seeds": per_seed[kind]} for kind in config.models]}
