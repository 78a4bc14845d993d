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
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from examples.image.backbone import KINDS, Backbone, BackboneConfig
from examples.image.common import make_deterministic

__all__ = ["ImageConfig", "SCALES", "MaskedAutoencoder", "patchify", "unpatchify",
           "random_masks", "train_one", "reconstruct", "scores", "EVAL_SEED"]

EVAL_SEED = 4321  # the evaluation masks: the same for every model and seed
LABELS = {"base": "Base ViT", "local": "Local ViT", "registers": "Registers ViT",
          "memory": "Spatial ViT + Tensor Memory"}


@dataclass
class ImageConfig:
    """One experiment's sizes (see :data:`SCALES`)."""

    size: int = 32
    patch: int = 4
    width: int = 64
    depth: int = 4
    heads: int = 4
    registers: int = 4
    window: int = 2
    memory_channels: int = 16
    forget_bias: float = 3.0
    steps: int = 300
    batch: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup: int = 20
    train_count: int = 8192
    test_count: int = 256
    ratios: tuple[float, ...] = (0.25, 0.5, 0.75)
    seeds: tuple[int, ...] = (0, 1, 2)
    models: tuple[str, ...] = KINDS
    extra: dict = field(default_factory=dict)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.size // self.patch, self.size // self.patch)

    def backbone(self) -> BackboneConfig:
        return BackboneConfig(grid=self.grid, width=self.width, depth=self.depth,
                              heads=self.heads, registers=self.registers, window=self.window,
                              memory_channels=self.memory_channels,
                              forget_bias=self.forget_bias)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["grid"] = list(self.grid)
        return out


SCALES = {
    "tiny": ImageConfig(size=16, patch=4, width=32, depth=2, heads=2, window=1,
                        memory_channels=4, steps=3, batch=4, warmup=1, train_count=32,
                        test_count=8, seeds=(0,)),
    "cpu": ImageConfig(),
    "full": ImageConfig(size=64, patch=8, width=256, depth=8, heads=8, window=2,
                        memory_channels=32, steps=20_000, batch=256, lr=5e-4, warmup=1000,
                        train_count=200_000, test_count=2048),
}


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


def _lr(step: int, config: ImageConfig) -> float:
    """Linear warmup, then cosine to 10 %."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    t = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


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
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "pos" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=config.lr)
    data = torch.from_numpy(train)
    tokens = math.prod(config.grid)
    batch_rng = np.random.default_rng(seed + 1_000)
    losses, times = [], []
    bar = tqdm(range(config.steps), desc=desc or f"image:{kind}:s{seed}", disable=not progress,
               leave=False, dynamic_ncols=True)
    model.train()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(step, config)
        idx = torch.from_numpy(batch_rng.integers(0, len(data), config.batch))
        ratio = config.ratios[int(batch_rng.integers(len(config.ratios)))]
        images = data[idx].to(device)
        mask = random_masks(config.batch, tokens, ratio, gen).to(device)
        start = time.perf_counter()
        patches = patchify(images, config.patch)
        pred = model(patches, mask)
        loss = F.mse_loss(pred[mask], patches[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    model.eval()
    test_t = torch.from_numpy(test)
    psnr, ssim = {}, {}
    for ratio, masks in eval_masks(config, len(test)).items():
        recon = torch.cat([reconstruct(model, test_t[i:i + 256].to(device),
                                       masks[i:i + 256].to(device), config.patch).cpu()
                           for i in range(0, len(test), 256)])
        psnr[str(ratio)], ssim[str(ratio)] = scores(recon.numpy(), test)
    every = max(1, config.steps // 50)
    record = {
        "model": kind, "seed": seed, "params": sum(p.numel() for p in model.parameters()),
        "psnr": psnr, "ssim": ssim,
        "loss_curve": [[i, round(sum(losses[i:i + every]) / len(losses[i:i + every]), 6)]
                       for i in range(0, len(losses), every)],
        "step_ms": round(1000 * statistics.median(times[len(times) // 5:] or times), 2),
        "train_seconds": round(sum(times), 2), "gates": model.backbone.gates(),
    }
    return record, model
