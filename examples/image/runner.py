"""One (backbone, seed) run of the image example, importable by worker processes."""

from __future__ import annotations

from pathlib import Path

import torch

from examples.image import data as image_data
from examples.image.train import ImageConfig, eval_masks, reconstruct, train_one

__all__ = ["load", "run_one"]


def load(config: ImageConfig, data_spec: tuple[str, int | None] | None,
         seed: int) -> tuple:
    """(train, test) arrays: the folder given by ``data_spec`` (path, per-class limit), else
    the bundled crops of ``seed``."""
    if data_spec is not None:
        return image_data.folder_split(Path(data_spec[0]), config.size, limit=data_spec[1])
    return image_data.bundled_split(config.size, config.train_count, config.test_count, seed)


def run_one(kind: str, seed: int, config: ImageConfig, data_spec, device: str, threads: int,
            progress: bool, show: bool) -> tuple[dict, tuple | None]:
    """One (backbone, seed) run (also in a worker process): the record, and for ``show``
    the picture's masks and reconstructions of the first 4 held-out images."""
    train, test = load(config, data_spec, seed)
    record, model = train_one(kind, seed, config, train, test, device=device,
                              threads=threads, progress=progress)
    if not show:
        return record, None
    images = torch.from_numpy(test[:4]).to(device)
    masks = {f"{round(100 * r)}%": m[:4] for r, m in eval_masks(config, len(test)).items()}
    recons = {s: reconstruct(model, images, m.to(device), config.patch).cpu().numpy()
              for s, m in masks.items()}
    return record, ({s: m.numpy() for s, m in masks.items()}, recons)
