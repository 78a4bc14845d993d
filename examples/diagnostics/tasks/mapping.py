"""Map building: integrate small glimpses of a hidden occupancy grid over T steps.

A hidden ``G x G`` binary grid; at each of ``T`` steps a ``P x P`` patch at a
random position is observed, one token per cell ``[is_obs, is_query, x, y,
bit]`` (``x, y`` the cell centre in ``[-1, 1]``). Then ``Q`` query tokens
``[0, 1, x, y, 0]`` ask for the occupancy of cells that WERE observed, so a
perfect memory scores 100 % at every T; chance is 50 %.
"""

from __future__ import annotations

import numpy as np

from examples.diagnostics.tasks.base import Batch, Task

__all__ = ["MapBuilding"]


class MapBuilding(Task):
    """Sweeps the horizon T (number of glimpses)."""

    name = "mapping"
    sweep_key = "steps"
    in_features = 5
    n_classes = 2

    def __init__(self, horizons: tuple[int, ...] = (2, 4, 8, 12), grid: int = 8,
                 patch: int = 2, n_queries: int = 4) -> None:
        self.horizons, self.grid, self.patch, self.n_queries = horizons, grid, patch, n_queries
        self.eval_settings = [{"steps": t} for t in horizons]

    def train_setting(self, rng: np.random.Generator) -> dict:
        return {"steps": int(rng.choice(self.horizons))}

    def batch(self, rng: np.random.Generator, size: int, setting: dict) -> Batch:
        T, G, P, Q = setting["steps"], self.grid, self.patch, self.n_queries
        occupancy = rng.random((size, G, G)) < 0.5
        corner = rng.integers(0, G - P + 1, (size, T, 2))
        offsets = np.stack(np.meshgrid(np.arange(P), np.arange(P), indexing="ij"), -1)
        cells = (corner[:, :, None, None, :] + offsets).reshape(size, T * P * P, 2)  # (B, TPP, 2)
        rows, cols = cells[..., 0], cells[..., 1]
        bits = occupancy[np.arange(size)[:, None], rows, cols]
        # queries: cells drawn among the observed ones
        which = rng.integers(0, T * P * P, (size, Q, 1))
        picked = np.take_along_axis(cells, which, axis=1)
        q_bits = occupancy[np.arange(size)[:, None], picked[..., 0], picked[..., 1]]
        n_obs = T * P * P
        x = np.zeros((size, n_obs + Q, 5), np.float32)
        x[:, :n_obs, 0] = 1.0
        x[:, n_obs:, 1] = 1.0
        scale = 2.0 / (G - 1)
        x[:, :n_obs, 2] = cols * scale - 1
        x[:, :n_obs, 3] = rows * scale - 1
        x[:, :n_obs, 4] = bits
        x[:, n_obs:, 2] = picked[..., 1] * scale - 1
        x[:, n_obs:, 3] = picked[..., 0] * scale - 1
        targets = np.zeros((size, n_obs + Q), np.int64)
        targets[:, n_obs:] = q_bits
        mask = np.zeros((size, n_obs + Q), bool)
        mask[:, n_obs:] = True
        # the answer's source: the LAST observation of the queried cell
        same = (cells[:, None, :, :] == picked[:, :, None, :]).all(-1)  # (B, Q, TPP)
        last = n_obs - 1 - np.argmax(same[..., ::-1], axis=-1)
        source = np.full((size, n_obs + Q), -1, np.int64)
        source[:, n_obs:] = last
        return Batch(x, targets, mask, source)
