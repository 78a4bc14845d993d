"""Occlusion / object permanence: where is the ball after L hidden frames?

A ball (a Gaussian blob) moves at constant velocity across ``F x F`` frames:
``K`` visible frames, then ``L`` frames where an occluder covers the whole
view (every pixel 0.5). The last token asks for the quadrant of the ball in
the final (hidden) frame. Start and end points are drawn inside the frame so
the motion is a straight line at constant speed. Token features:
``[pixels (F*F), is_visible, is_occluded, is_query]``. Chance is 25 %.
"""

from __future__ import annotations

import numpy as np

from examples.diagnostics.tasks.base import Batch, Task

__all__ = ["Occlusion"]


class Occlusion(Task):
    """Sweeps the occlusion length L."""

    name = "occlusion"
    sweep_key = "occluded"
    n_classes = 4

    def __init__(self, lengths: tuple[int, ...] = (2, 4, 8, 16), frame: int = 8,
                 visible: int = 4, blob: float = 0.7) -> None:
        self.lengths, self.frame, self.visible, self.blob = lengths, frame, visible, blob
        self.in_features = frame * frame + 3
        self.eval_settings = [{"occluded": n} for n in lengths]

    def train_setting(self, rng: np.random.Generator) -> dict:
        return {"occluded": int(rng.choice(self.lengths))}

    def batch(self, rng: np.random.Generator, size: int, setting: dict) -> Batch:
        K, L, F = self.visible, setting["occluded"], self.frame
        n_frames = K + L
        start = rng.uniform(0.5, F - 1.5, (size, 2))
        end = rng.uniform(0.5, F - 1.5, (size, 2))
        t = np.arange(n_frames) / (n_frames - 1)
        pos = start[:, None] + (end - start)[:, None] * t[None, :, None]  # (B, frames, 2)
        grid = np.arange(F)
        dy = (grid[None, None, :] - pos[..., 0:1]) ** 2  # (B, frames, F)
        dx = (grid[None, None, :] - pos[..., 1:2]) ** 2
        frames = np.exp(-(dy[..., :, None] + dx[..., None, :]) / (2 * self.blob**2))
        frames[:, K:] = 0.5  # the occluder
        x = np.zeros((size, n_frames + 1, self.in_features), np.float32)
        x[:, :n_frames, : F * F] = frames.reshape(size, n_frames, F * F)
        x[:, :K, F * F] = 1.0
        x[:, K:n_frames, F * F + 1] = 1.0
        x[:, n_frames, F * F + 2] = 1.0
        centre = (F - 1) / 2
        quadrant = (end[:, 0] > centre) * 2 + (end[:, 1] > centre)
        targets = np.zeros((size, n_frames + 1), np.int64)
        targets[:, n_frames] = quadrant
        mask = np.zeros((size, n_frames + 1), bool)
        mask[:, n_frames] = True
        # constant velocity: the last TWO visible frames give position and velocity
        source = np.full((size, n_frames + 1), -1, np.int64)
        source[:, n_frames] = K - 2
        return Batch(x, targets, mask, source)
