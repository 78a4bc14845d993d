"""Action recognition: the clip classifier, its training loop and its evaluation.

A clip ``(T, C, H, W)`` is cut into tubelets of ``tube`` frames x ``patch x
patch`` pixels (a ``(T/tube, H/p, W/p)`` token grid, time-major; a tubelet sees
the motion between its frames, as in ViViT's tubelet embedding); every backbone
is a joint space-time transformer over all tokens (full attention, learned
position embeddings, same depth and width), mean-pooled and classified by a
linear head:

- ``base``: the joint space-time transformer;
- ``registers``: the same with learned register tokens;
- ``memory``: the same with a gated Tensor Memory after every block, voxel grid
  = the token grid ``(T/tube, H/p, W/p)``, one chunk per time step, ``threaded`` mode
  (the whole clip is given at once and classified as a whole, so nothing needs
  to be causal; the state a layer reaches after the last frame seeds the next
  layer's pass, the paper's reference behaviour).

Top-1 / top-5 accuracy on the held-out clips, and the median wall-clock of one
training step (forward, backward, optimizer).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from examples.image.backbone import Backbone, BackboneConfig
from examples.image.common import make_deterministic

__all__ = ["VideoConfig", "SCALES", "ClipClassifier", "tubelets", "train_one", "topk",
           "MODELS", "LABELS"]

MODELS = ("base", "registers", "memory")
LABELS = {"base": "Joint space-time", "registers": "+ registers",
          "memory": "+ Tensor Memory"}


@dataclass
class VideoConfig:
    """One experiment's sizes (see :data:`SCALES`)."""

    frames: int = 8
    size: int = 16
    patch: int = 4
    tube: int = 2
    width: int = 64
    depth: int = 3
    heads: int = 4
    registers: int = 4
    memory_channels: int = 16
    forget_bias: float = 3.0
    steps: int = 300
    batch: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup: int = 20
    train_count: int = 6000
    test_count: int = 1000
    seeds: tuple[int, ...] = (0, 1, 2)
    models: tuple[str, ...] = MODELS

    def __post_init__(self) -> None:
        if self.frames % self.tube or self.size % self.patch:
            raise ValueError(f"frames, size: expected multiples of tube={self.tube} and "
                             f"patch={self.patch}, got {self.frames} and {self.size}")

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.frames // self.tube, self.size // self.patch, self.size // self.patch)

    def backbone(self) -> BackboneConfig:
        return BackboneConfig(grid=self.grid, width=self.width, depth=self.depth,
                              heads=self.heads, registers=self.registers,
                              memory_channels=self.memory_channels,
                              forget_bias=self.forget_bias)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["grid"] = list(self.grid)
        return out


SCALES = {
    "tiny": VideoConfig(frames=4, size=16, patch=4, width=32, depth=1, heads=2,
                        memory_channels=4, steps=3, batch=4, warmup=1, train_count=20,
                        test_count=20, seeds=(0,)),
    "cpu": VideoConfig(),
    "full": VideoConfig(frames=16, size=64, patch=8, width=256, depth=8, heads=8,
                        memory_channels=32, steps=20_000, batch=64, lr=5e-4, warmup=1000,
                        train_count=100_000, test_count=5000),
}


def tubelets(clips: Tensor, patch: int, tube: int = 1) -> Tensor:
    """``(B, T, C, H, W)`` -> ``(B, (T/tube) (H/p) (W/p), tube C p p)``: time-major, then
    rows, then columns; each token holds ``tube`` frames of one ``p x p`` patch."""
    b, t, c, h, w = clips.shape
    x = clips.reshape(b, t // tube, tube, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 1, 4, 6, 2, 3, 5, 7).reshape(
        b, (t // tube) * (h // patch) * (w // patch), tube * c * patch * patch)


class ClipClassifier(nn.Module):
    """``forward(clips (B, T, C, H, W)) -> logits (B, classes)``."""

    def __init__(self, kind: str, config: VideoConfig, channels: int, classes: int):
        super().__init__()
        self.patch, self.tube = config.patch, config.tube
        self.embed = nn.Linear(config.tube * channels * config.patch ** 2, config.width)
        self.backbone = Backbone(kind, config.backbone())
        self.head = nn.Linear(config.width, classes)

    def forward(self, clips: Tensor) -> Tensor:
        tokens = self.embed((tubelets(clips, self.patch, self.tube) - 0.5) / 0.25)
        return self.head(self.backbone(tokens).mean(dim=1))


def topk(logits: Tensor, labels: Tensor, k: int) -> float:
    """Fraction of rows whose label is among the ``k`` largest logits (``k`` capped at the
    number of classes)."""
    k = min(k, logits.shape[1])
    return float((logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).float().mean())


def _lr(step: int, config: VideoConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    t = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_one(kind: str, seed: int, config: VideoConfig,
              train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
              classes: int, *, device: str = "cpu", threads: int = 1,
              progress: bool = True) -> dict:
    """Train backbone ``kind`` with ``seed``; the record: ``top1`` / ``top5`` on ``test``,
    loss curve, median ms per training step, parameters, memory gates."""
    make_deterministic(seed, threads)
    model = ClipClassifier(kind, config, train[0].shape[2], classes).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "pos" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=config.lr)
    xs, ys = torch.from_numpy(train[0]), torch.from_numpy(train[1])
    batch_rng = np.random.default_rng(seed + 1_000)
    losses, times = [], []
    bar = tqdm(range(config.steps), desc=f"video:{kind}:s{seed}", disable=not progress,
               leave=False, dynamic_ncols=True)
    model.train()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(step, config)
        idx = torch.from_numpy(batch_rng.integers(0, len(xs), config.batch))
        clips, labels = xs[idx].to(device), ys[idx].to(device)
        start = time.perf_counter()
        loss = F.cross_entropy(model(clips), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(torch.from_numpy(test[0][i:i + 250]).to(device)).cpu()
                            for i in range(0, len(test[0]), 250)])
    labels = torch.from_numpy(test[1])
    every = max(1, config.steps // 50)
    return {
        "model": kind, "seed": seed, "params": sum(p.numel() for p in model.parameters()),
        "top1": topk(logits, labels, 1), "top5": topk(logits, labels, 5),
        "loss_curve": [[i, round(sum(losses[i:i + every]) / len(losses[i:i + every]), 5)]
                       for i in range(0, len(losses), every)],
        "step_ms": round(1000 * statistics.median(times[len(times) // 5:] or times), 2),
        "train_seconds": round(sum(times), 2), "gates": model.backbone.gates(),
    }
