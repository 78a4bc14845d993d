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
  layer's pass, the paper's reference behaviour);
- ``memory_warp`` / ``memory_warp_local`` (on request, ``--models``): ``memory``
  with warped dynamics (a per-chunk shift of the state), and with local updates of
  a 2-cell window too (:data:`OPTION_MODELS`).

Top-1 / top-5 accuracy on the held-out clips, and the median wall-clock of one
training step (forward, backward, optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.image.backbone import Backbone
from examples.vision_common import (
    ExperimentConfig,
    fit,
    make_deterministic,
    scales,
    training_summary,
)

__all__ = ["VideoConfig", "SCALES", "ClipClassifier", "tubelets", "train_one", "topk",
           "MODELS", "OPTION_MODELS", "CHOICES", "LABELS"]

MODELS = ("base", "registers", "memory")
#: Tensor Memory with the layer options beyond the paper (``tmcore.layer.layer_config``):
#: not run by default (``--models ... memory_warp``); the other memory settings unchanged
OPTION_MODELS = {"memory_warp": {"dynamics": "warp"},
                 "memory_warp_local": {"dynamics": "warp", "update": "local", "window": 2}}
#: The ``--models`` choices.
CHOICES = MODELS + tuple(OPTION_MODELS)
LABELS = {"base": "Joint space-time", "registers": "+ registers",
          "memory": "+ Tensor Memory", "memory_warp": "+ Tensor Memory, warp",
          "memory_warp_local": "+ Tensor Memory, warp + local w=2"}


@dataclass
class VideoConfig(ExperimentConfig):
    """One experiment's sizes (see :data:`SCALES`): :class:`ExperimentConfig`'s with other
    defaults, the clip length ``frames``, the tubelet length ``tube`` and the ``models``."""

    size: int = 16
    depth: int = 3
    lr: float = 2e-3
    train_count: int = 6000
    test_count: int = 1000
    frames: int = 8
    tube: int = 2
    models: tuple[str, ...] = MODELS

    def __post_init__(self) -> None:
        if self.frames % self.tube or self.size % self.patch:
            raise ValueError(f"frames, size: expected multiples of tube={self.tube} and "
                             f"patch={self.patch}, got {self.frames} and {self.size}")

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.frames // self.tube, self.size // self.patch, self.size // self.patch)


SCALES = scales(VideoConfig,
                tiny={"frames": 4, "size": 16, "patch": 4, "depth": 1, "train_count": 20,
                      "test_count": 20},
                full={"frames": 16, "size": 64, "patch": 8, "batch": 64, "train_count": 100_000,
                      "test_count": 5000})


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
        backbone = config.backbone()
        if kind in OPTION_MODELS:
            backbone = replace(backbone, memory_options=tuple(OPTION_MODELS[kind].items()))
            kind = "memory"
        self.backbone = Backbone(kind, backbone)
        self.head = nn.Linear(config.width, classes)

    def forward(self, clips: Tensor) -> Tensor:
        tokens = self.embed((tubelets(clips, self.patch, self.tube) - 0.5) / 0.25)
        return self.head(self.backbone(tokens).mean(dim=1))


def topk(logits: Tensor, labels: Tensor, k: int) -> float:
    """Fraction of rows whose label is among the ``k`` largest logits (``k`` capped at the
    number of classes)."""
    k = min(k, logits.shape[1])
    return float((logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).float().mean())


def train_one(kind: str, seed: int, config: VideoConfig,
              train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
              classes: int, *, device: str = "cpu", threads: int = 1,
              progress: bool = True) -> dict:
    """Train backbone ``kind`` with ``seed``; the record: ``top1`` / ``top5`` on ``test``,
    loss curve, median ms per training step, parameters, memory gates."""
    make_deterministic(seed, threads)
    model = ClipClassifier(kind, config, train[0].shape[2], classes).to(device)
    xs, ys = torch.from_numpy(train[0]), torch.from_numpy(train[1])

    def draw(batch_rng: np.random.Generator):
        idx = torch.from_numpy(batch_rng.integers(0, len(xs), config.batch))
        clips, labels = xs[idx].to(device), ys[idx].to(device)
        return lambda: F.cross_entropy(model(clips), labels)

    losses, times = fit(model, config, seed, draw, device=device, progress=progress,
                        desc=f"video:{kind}:s{seed}", loss_digits=3)
    with torch.no_grad():
        logits = torch.cat([model(torch.from_numpy(test[0][i:i + 250]).to(device)).cpu()
                            for i in range(0, len(test[0]), 250)])
    labels = torch.from_numpy(test[1])
    return {"model": kind, "seed": seed,
            "params": sum(p.numel() for p in model.parameters()),
            "top1": topk(logits, labels, 1), "top5": topk(logits, labels, 5),
            **training_summary(losses, times, config.steps, 5),
            "gates": model.backbone.gates()}
