"""Step time of the video backbones, measured fairly on a shared machine.

``python -m examples.video timing``: the three models of each seed (same batch,
same optimizer) take training steps in turn, the order rotating every round, so
a change of load on the machine slows them alike; the median per model and seed
goes to ``results/timing.json`` (``rows``: ``{model, metric: "step_ms", setting:
"interleaved", seeds: [median ms per seed]}``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.video.data import CLASSES, procedural
from examples.video.train import ClipClassifier, VideoConfig
from examples.vision_common import make_deterministic, measure_steps

__all__ = ["measure"]


def measure(config: VideoConfig, rounds: int, command: str, threads: int = 1,
            device: str = "cpu") -> dict:
    """The timing results dictionary (see the module docstring)."""

    def prepare(seed: int):
        make_deterministic(seed, threads)
        clips, labels = procedural(config.batch, config.frames, config.size, seed)
        x, y = torch.from_numpy(clips).to(device), torch.from_numpy(labels).to(device)
        return (lambda kind: ClipClassifier(kind, config, 1, len(CLASSES)),
                lambda model: F.cross_entropy(model(x), y))

    return measure_steps(config, rounds, command, threads, device, prepare)
