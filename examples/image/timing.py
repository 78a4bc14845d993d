"""Step time of the image backbones, measured fairly on a shared machine.

``python -m examples.image timing``: the four models of each seed (same batch and
masks, same optimizer) take training steps in turn, the order rotating every
round, so a change of load on the machine slows them alike; the median per model
and seed goes to ``results/timing.json`` (``rows``: ``{model, metric: "step_ms",
setting: "interleaved", seeds: [median ms per seed]}``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from examples.image.train import ImageConfig, MaskedAutoencoder, patchify, random_masks
from examples.vision_common import make_deterministic, measure_steps

__all__ = ["measure"]


def measure(config: ImageConfig, rounds: int, command: str, threads: int = 1,
            device: str = "cpu") -> dict:
    """The timing results dictionary (see the module docstring)."""

    def prepare(seed: int):
        gen = make_deterministic(seed, threads)
        images = torch.rand(config.batch, 3, config.size, config.size, generator=gen)
        patches = patchify(images, config.patch).to(device)
        mask = random_masks(config.batch, math.prod(config.grid), 0.5, gen).to(device)
        return (lambda kind: MaskedAutoencoder(kind, config),
                lambda model: F.mse_loss(model(patches, mask)[mask], patches[mask]))

    return measure_steps(config, rounds, command, threads, device, prepare)
