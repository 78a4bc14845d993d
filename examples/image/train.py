"""Masked-patch reconstruction: the model, its training loop and its evaluation.

The model embeds every ``patch x patch`` patch, replaces the masked ones by one
learned mask token, runs a :class:`~examples.image.backbone.Backbone` over the
grid and predicts every patch's pixels with a linear head. The loss is the
mean squared error on the masked patches. One model per (backbone, seed) is
trained with the mask ratio drawn per batch from the evaluated ratios, and is
evaluated at each ratio on the held-out crops with masks that are the same for
every model and seed. PSNR and SSIM (scikit-image's
``peak_signal_noise_ratio`` / ``structural_similarity``) are computed per image on
the composite -- the visible patches as given, the masked ones predicted --
and averaged over the images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.image.backbone import KINDS, Backbone
from examples.vision_common import (
    ExperimentConfig,
    fit,
    make_deterministic,
    scales,
    training_summary,
)

__all__ = ["ImageConfig", "SCALES", "MaskedAutoencoder", "patchify", "unpatchify",
           "random_masks", "train_one", "reconstruct", "scores", "EVAL_SEED"]

EVAL_SEED = 4321  # the evaluation masks: the same for every model and seed
LABELS = {"base": "Base ViT", "local": "Local ViT", "registers": "Registers ViT",
          "memory": "Spatial ViT + Tensor Memory"}


@dataclass
class ImageConfig(ExperimentConfig):
    """One experiment's sizes (see :data:`SCALES`): :class:`ExperimentConfig`'s, the local
    attention ``window``, the mask ``ratios`` and the ``models``."""

    window: int = 2
    ratios: tuple[float, ...] = (0.25, 0.5, 0.75)
    models: tuple[str, ...] = KINDS
    extra: dict = field(default_factory=dict)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.size // self.patch, self.size // self.patch)


SCALES = scales(ImageConfig,
                tiny={"size": 16, "patch": 4, "depth": 2, "window": 1, "train_count": 32,
                      "test_count": 8},
                full={"size": 64, "patch": 8, "window": 2, "batch": 256,
                      "train_count": 200_000, "test_count": 2048})


def patchify(images: Tensor, patch: int) -> Tensor:
    """``(B, C, H, W)`` -> ``(B, (H/p)(W/p), C p p)``, patches row-major."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpatchify(patches: Tensor, patch: int, channels: int, size: int) -> Tensor:
    """Inverse of :func:`patchify`."""
    b, g = patches.shape[0], size // patch
    x = patches.reshape(b, g, g, channels, patch, patch)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, channels, size, size)


def random_masks(batch: int, tokens: int, ratio: float, generator: torch.Generator) -> Tensor:
    """``(batch, tokens)`` bool, exactly ``round(ratio * tokens)`` True per row."""
    k = round(ratio * tokens)
    order = torch.rand(batch, tokens, generator=generator).argsort(dim=1)
    return order < k


class MaskedAutoencoder(nn.Module):
    """``forward(patches (B, N, P), mask (B, N) bool) -> predicted patches (B, N, P)``."""

    def __init__(self, kind: str, config: ImageConfig, channels: int = 3):
        super().__init__()
        dim = channels * config.patch ** 2
        self.embed = nn.Linear(dim, config.width)
        self.mask_token = nn.Parameter(torch.randn(1, 1, config.width) * 0.02)
        self.backbone = Backbone(kind, config.backbone())
        self.head = nn.Linear(config.width, dim)

    def forward(self, patches: Tensor, mask: Tensor) -> Tensor:
        tokens = self.embed((patches - 0.5) / 0.25)  # pixels in [0, 1] -> about unit scale
        tokens = torch.where(mask[..., None], self.mask_token.to(tokens.dtype), tokens)
        return self.head(self.backbone(tokens))


def reconstruct(model: MaskedAutoencoder, images: Tensor, mask: Tensor, patch: int) -> Tensor:
    """The composite ``(B, C, H, W)`` in [0, 1]: visible patches given, masked ones predicted."""
    patches = patchify(images, patch)
    with torch.no_grad():
        pred = model(patches, mask).clamp(0, 1)
    out = torch.where(mask[..., None], pred, patches)
    return unpatchify(out, patch, images.shape[1], images.shape[-1])


def scores(recon: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """Mean PSNR (dB) and SSIM over images ``(B, C, H, W)`` in [0, 1] (scikit-image)."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    psnr, ssim = [], []
    for r, t in zip(recon.astype(np.float64), target.astype(np.float64), strict=True):
        psnr.append(peak_signal_noise_ratio(t, r, data_range=1.0))
        ssim.append(structural_similarity(t, r, data_range=1.0, channel_axis=0))
    return float(np.mean(psnr)), float(np.mean(ssim))


def eval_masks(config: ImageConfig, count: int) -> dict[float, Tensor]:
    """The evaluation masks per ratio (independent of model and seed)."""
    tokens = math.prod(config.grid)
    return {r: random_masks(count, tokens, r, torch.Generator().manual_seed(EVAL_SEED + i))
            for i, r in enumerate(config.ratios)}


def train_one(kind: str, seed: int, config: ImageConfig, train: np.ndarray, test: np.ndarray,
              *, device: str = "cpu", threads: int = 1, progress: bool = True,
              desc: str | None = None) -> tuple[dict, MaskedAutoencoder]:
    """Train backbone ``kind`` with ``seed``; returns ``(record, model)``. The record has
    ``psnr`` / ``ssim`` per ratio, the loss curve, time per step (ms), parameters."""
    gen = make_deterministic(seed, threads)
    model = MaskedAutoencoder(kind, config, channels=train.shape[1]).to(device)
    data = torch.from_numpy(train)
    tokens = math.prod(config.grid)

    def draw(batch_rng: np.random.Generator):
        idx = torch.from_numpy(batch_rng.integers(0, len(data), config.batch))
        ratio = config.ratios[int(batch_rng.integers(len(config.ratios)))]
        images = data[idx].to(device)
        mask = random_masks(config.batch, tokens, ratio, gen).to(device)

        def loss() -> Tensor:
            patches = patchify(images, config.patch)
            return F.mse_loss(model(patches, mask)[mask], patches[mask])

        return loss

    losses, times = fit(model, config, seed, draw, device=device, progress=progress,
                        desc=desc or f"image:{kind}:s{seed}", loss_digits=4)
    test_t = torch.from_numpy(test)
    psnr, ssim = {}, {}
    for ratio, masks in eval_masks(config, len(test)).items():
        recon = torch.cat([reconstruct(model, test_t[i:i + 256].to(device),
                                       masks[i:i + 256].to(device), config.patch).cpu()
                           for i in range(0, len(test), 256)])
        psnr[str(ratio)], ssim[str(ratio)] = scores(recon.numpy(), test)
    record = {"model": kind, "seed": seed,
              "params": sum(p.numel() for p in model.parameters()), "psnr": psnr, "ssim": ssim,
              **training_summary(losses, times, config.steps, 6),
              "gates": model.backbone.gates()}
    return record, model
