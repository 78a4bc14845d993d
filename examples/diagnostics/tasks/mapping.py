"""Map building in the authors' glimpse format: integrate 2x2 glimpses of a hidden grid.

A hidden ``G x G`` binary occupancy grid (each cell occupied with probability
1/2). Each of ``T`` steps is ONE token: a ``P x P`` glimpse at a random
position, ``[glimpse bits (P*P), row / G, col / G, 0]`` with ``(row, col)``
the glimpse's top-left cell. Then ``Q`` query tokens ``[0 (P*P), qrow / G,
qcol / G, 1]`` ask whether a cell drawn uniformly from the WHOLE grid is
occupied (2 classes, chance 50 %). As in the authors' task (``G = 8``,
``P = 2``, one query, ``T`` up to 64), a queried cell may never have been
glimpsed; those can only be guessed, so even a perfect memory stays below
100 % at short horizons: :meth:`observed_fraction`, and the window ceiling in
one window, give that limit.
"""

from __future__ import annotations

import numpy as np

from examples.diagnostics.tasks.base import Batch, Task

__all__ = ["MapBuilding"]


class MapBuilding(Task):
    """Sweeps the horizon T (number of glimpses)."""

    name = "mapping"
    sweep_key = "steps"
    n_classes = 2

    def __init__(self, horizons: tuple[int, ...] = (16, 32, 64), grid: int = 8,
                 patch: int = 2, n_queries: int = 1) -> None:
        if not 0 < patch <= grid:
            raise ValueError(f"patch: expected 1..grid ({grid}), got {patch}")
        self.horizons, self.grid, self.patch, self.n_queries = horizons, grid, patch, n_queries
        self.in_features = patch * patch + 3
        self.eval_settings = [{"steps": t} for t in horizons]
        self.fixed: dict | None = None

    def train_setting(self, rng: np.random.Generator) -> dict:
        if self.fixed is not None:
            return dict(self.fixed)
        return {"steps": int(rng.choice(self.horizons))}

    def batch(self, rng: np.random.Generator, size: int, setting: dict) -> Batch:
        T, G, P, Q = setting["steps"], self.grid, self.patch, self.n_queries
        occupancy = rng.random((size, G, G)) < 0.5
        corner = rng.integers(0, G - P + 1, (size, T, 2))  # (B, T, [row, col]) top-left
        offsets = np.arange(P)
        rows = corner[:, :, 0, None, None] + offsets[:, None]  # (B, T, P, 1)
        cols = corner[:, :, 1, None, None] + offsets[None, :]  # (B, T, 1, P)
        bits = occupancy[np.arange(size)[:, None, None, None], rows, cols]  # (B, T, P, P)
        query = rng.integers(0, G, (size, Q, 2))
        answer = occupancy[np.arange(size)[:, None], query[..., 0], query[..., 1]]
        x = np.zeros((size, T + Q, self.in_features), np.float32)
        x[:, :T, : P * P] = bits.reshape(size, T, P * P)
        x[:, :T, P * P: P * P + 2] = corner / G
        x[:, T:, P * P: P * P + 2] = query / G
        x[:, T:, P * P + 2] = 1.0
        targets = np.zeros((size, T + Q), np.int64)
        targets[:, T:] = answer
        mask = np.zeros((size, T + Q), bool)
        mask[:, T:] = True
        # the answer's source: the LAST glimpse that covered the queried cell (-1: none)
        d = query[:, :, None, :] - corner[:, None, :, :]  # (B, Q, T, 2)
        covers = ((d >= 0) & (d < P)).all(-1)
        last = T - 1 - np.argmax(covers[..., ::-1], axis=-1)
        source = np.full((size, T + Q), -1, np.int64)
        source[:, T:] = np.where(covers.any(-1), last, -1)
        return Batch(x, targets, mask, source)

    def observed_fraction(self, steps: int) -> float:
        """Probability that a uniformly drawn cell was covered by at least one of ``steps``
        uniformly placed glimpses (exact)."""
        G, P = self.grid, self.patch
        positions = (G - P + 1) ** 2
        total = 0.0
        for r in range(G):
            for c in range(G):
                rows = min(r, G - P) - max(0, r - P + 1) + 1
                cols = min(c, G - P) - max(0, c - P + 1) + 1
                total += 1 - (1 - rows * cols / positions) ** steps
        return total / (G * G)

    @staticmethod
    def label(setting: dict) -> str:
        return f"T={setting['steps']}"
