"""Step time of the video backbones, measured fairly on a shared machine.

``python -m examples.video timing``: the three models of each seed (same batch,
same optimizer) take training steps in turn, the order rotating every round, so
a change of load on the machine slows them alike; the median per model and seed
goes to ``results/timing.json`` (``rows``: ``{model, metric: "step_ms", setting:
"interleaved", seeds: [median ms per seed]}``).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from examples.image.common import commit_info, environment, interleaved_ms, make_deterministic
from examples.video.data import CLASSES, procedural
from examples.video.train import ClipClassifier, VideoConfig

__all__ = ["measure"]


def measure(config: VideoConfig, rounds: int, command: str, threads: int = 1,
            device: str = "cpu") -> dict:
    """The timing results dictionary (see the module docstring)."""
    provenance = commit_info()
    per_seed: dict[str, list[float]] = {kind: [] for kind in config.models}
    for seed in config.seeds:
        make_deterministic(seed, threads)
        clips, labels = procedural(config.batch, config.frames, config.size, seed)
        x, y = torch.from_numpy(clips).to(device), torch.from_numpy(labels).to(device)
        steps = {}
        for kind in config.models:
            model = ClipClassifier(kind, config, 1, len(CLASSES)).to(device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=config.lr)

            def step(model=model, opt=opt, x=x, y=y) -> None:
                loss = F.cross_entropy(model(x), y)
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
