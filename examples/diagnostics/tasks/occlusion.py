"""Occlusion / object permanence, in two versions.

:class:`OcclusionFinalFrame` is the authors' task: ``T = 8`` frames of
``16 x 16``, a 2x2 ball starting anywhere with an integer velocity in
``{-1, 0, 1}^2`` (not both 0), wrapping at the borders; during the ``L``
middle frames (``L`` in 0..6) the ball is not drawn. Each frame is cut into
``4 x 4`` patches, one token each (16 pixel values), 16 tokens per frame;
the target is the quadrant of the ball in the FINAL frame (4 classes). The
final frame is never hidden, so the answer is on screen: this version needs
no memory at all (its window ceiling is 100 % at every ``L``). The authors
read the answer from the mean of the final frame's tokens; our backbone
predicts per token, so the answer is read at the final frame's last token,
which attends to the whole frame.

:class:`Occlusion` is the harder version: ``K`` visible frames of a ball (a
Gaussian blob) moving in a straight line at constant speed, then ``L``
frames in which an occluder covers the whole view (every pixel 0.5). One
token per frame: ``[pixels (F*F), is_visible, is_occluded, clock]``. The
target is the ball's quadrant at EVERY hidden frame, so a model must know
both where the ball was going and how many hidden frames have passed.
``clock=True`` fills the clock feature with the frame's index in the stream
(``t / 32``), so that a model no longer has to count hidden frames itself:
comparing rows with and without it tests whether counting is what fails.
Chance is 25 %.
"""

from __future__ import annotations

import numpy as np

from examples.diagnostics.tasks.base import Batch, Task

__all__ = ["Occlusion", "OcclusionFinalFrame"]

#: the clock feature is the frame index over this (streams are shorter)
CLOCK_SCALE = 32.0


class _OcclusionSweep(Task):
    """What both versions share: 4 quadrants, a sweep over the number of hidden frames."""

    name = "occlusion"
    sweep_key = "occluded"
    n_classes = 4
    lengths: tuple[int, ...]

    def train_setting(self, rng: np.random.Generator) -> dict:
        if self.fixed is not None:
            return dict(self.fixed)
        return {"occluded": int(rng.choice(self.lengths))}

    @staticmethod
    def label(setting: dict) -> str:
        return f"L={setting['occluded']}"


class OcclusionFinalFrame(_OcclusionSweep):
    """The authors' occlusion: sweeps the number ``L`` of hidden middle frames."""

    def __init__(self, lengths: tuple[int, ...] = (0, 2, 4, 6), frames: int = 8,
                 frame_size: int = 16, patch: int = 4, ball: int = 2) -> None:
        if frame_size % patch:
            raise ValueError(f"patch: expected a divisor of frame_size {frame_size}, "
                             f"got {patch}")
        if max(lengths) >= frames:
            raise ValueError(f"lengths: expected < frames ({frames}), got {lengths}")
        self.lengths, self.frames, self.frame_size = lengths, frames, frame_size
        self.patch, self.ball = patch, ball
        self.tokens_per_frame = (frame_size // patch) ** 2
        self.in_features = patch * patch
        self.eval_settings = [{"occluded": n} for n in lengths]

    def batch(self, rng: np.random.Generator, size: int, setting: dict) -> Batch:
        T, L, S, P = self.frames, setting["occluded"], self.frame_size, self.patch
        start = rng.integers(0, S, (size, 2))  # (row, col) of the ball's top-left pixel
        velocity = rng.integers(-1, 2, (size, 2))
        still = (velocity == 0).all(-1)
        velocity[still, 1] = 1  # a ball that does not move is no test of permanence
        hidden_from = max(0, (T - L) // 2)
        frames = np.zeros((size, T, S, S), np.float32)
        b = np.arange(size)
        for t in range(T):
            if hidden_from <= t < hidden_from + L:
                continue
            pos = (start + velocity * t) % S
            for dr in range(self.ball):
                for dc in range(self.ball):
                    frames[b, t, (pos[:, 0] + dr) % S, (pos[:, 1] + dc) % S] = 1.0
        final = (start + velocity * (T - 1)) % S
        quadrant = 2 * (final[:, 0] >= S // 2) + (final[:, 1] >= S // 2)
        n = S // P
        patches = frames.reshape(size, T, n, P, n, P).transpose(0, 1, 2, 4, 3, 5)
        x = patches.reshape(size, T * n * n, P * P)
        N = x.shape[1]
        targets = np.zeros((size, N), np.int64)
        targets[:, -1] = quadrant
        mask = np.zeros((size, N), bool)
        mask[:, -1] = True
        source = np.full((size, N), -1, np.int64)
        source[:, -1] = N - self.tokens_per_frame  # the final frame's first token
        return Batch(np.ascontiguousarray(x), targets, mask, source)


class Occlusion(_OcclusionSweep):
    """The harder occlusion: per-frame targets while hidden; sweeps ``L``."""

    def __init__(self, lengths: tuple[int, ...] = (2, 4, 8, 16), frame: int = 8,
                 visible: int = 4, blob: float = 0.7, clock: bool = False) -> None:
        if visible < 2:
            raise ValueError(f"visible: expected >= 2 frames (position and velocity), "
                             f"got {visible}")
        if visible + max(lengths) > CLOCK_SCALE:
            raise ValueError(f"visible + max(lengths): expected <= {CLOCK_SCALE:g}")
        self.lengths, self.frame, self.visible, self.blob = lengths, frame, visible, blob
        self.clock = clock
        self.in_features = frame * frame + 3
        self.eval_settings = [{"occluded": n} for n in lengths]

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
        x = np.zeros((size, n_frames, self.in_features), np.float32)
        x[..., : F * F] = frames.reshape(size, n_frames, F * F)
        x[:, :K, F * F] = 1.0
        x[:, K:, F * F + 1] = 1.0
        if self.clock:
            x[..., F * F + 2] = np.arange(n_frames) / CLOCK_SCALE
        centre = (F - 1) / 2
        targets = (pos[..., 0] > centre) * 2 + (pos[..., 1] > centre)  # (B, frames)
        mask = np.zeros((size, n_frames), bool)
        mask[:, K:] = True
        # constant velocity: the last TWO visible frames give position and velocity
        source = np.full((size, n_frames), -1, np.int64)
        source[:, K:] = K - 2
        return Batch(x, targets.astype(np.int64), mask, source)

    def references(self, setting: dict, examples: int = 2048) -> dict[str, float]:
        """``last seen quadrant``: answer every hidden frame with the quadrant of the last
        visible frame. A model that carries where the ball was, but not where it was
        going, scores about this."""
        batch = self.batch(np.random.default_rng(2024), examples, setting)
        K = self.visible
        held = batch.targets[:, K:] == batch.targets[:, K - 1:K]
        return {"last seen quadrant": float(held.mean())}
