"""One (backbone, seed) run of the video example, importable by worker processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from examples.video import data as video_data
from examples.video.train import VideoConfig, train_one

__all__ = ["load", "run_one", "TEST_SEED"]

TEST_SEED = 4321  # the held-out procedural clips: the same for every model and seed


def load(config: VideoConfig, data_spec: tuple[str, int | None] | None, seed: int
         ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], list[str]]:
    """``(train, test, class names)``: the UCF-101-style folder of ``data_spec`` (path,
    clips per class), else procedural clips (training clips drawn with ``seed``)."""
    if data_spec is not None:
        return video_data.folder_split(Path(data_spec[0]), config.frames, config.size,
                                       limit=data_spec[1])
    train = video_data.procedural(config.train_count, config.frames, config.size, seed)
    test = video_data.procedural(config.test_count, config.frames, config.size, TEST_SEED)
    return train, test, list(video_data.CLASSES)


def run_one(kind: str, seed: int, config: VideoConfig, data_spec, device: str, threads: int,
            progress: bool) -> dict:
    """One (backbone, seed) run (also in a worker process): its record."""
    train, test, classes = load(config, data_spec, seed)
    return train_one(kind, seed, config, train, test, len(classes), device=device,
                     threads=threads, progress=progress)
