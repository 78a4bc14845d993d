"""Coordinate binding: bind values to 3-D keys, then recall by a noisy key.

A sequence is ``W`` WRITE tokens ``(key in [-1, 1]^3, value in 0..V-1)``
followed by ``Q`` QUERY tokens ``(key_j + noise)``; the target at a query is
the value of the written key NEAREST to the noisy query. Token features:
``[is_write, is_query, key (3), one_hot(value) (V)]`` (zeros for a query's
value). Chance is about ``1 / V``.
"""

from __future__ import annotations

import numpy as np

from examples.diagnostics.tasks.base import Batch, Task

__all__ = ["CoordinateBinding"]


class CoordinateBinding(Task):
    """Sweeps the number of writes (at zero noise) and the query noise (at a fixed count)."""

    name = "binding"
    sweep_key = "writes"

    def __init__(self, writes: tuple[int, ...] = (4, 8, 16, 32), n_values: int = 16,
                 n_queries: int = 4, noises: tuple[float, ...] = (0.0, 0.05, 0.1),
                 noise_writes: int = 8, train_noise: float = 0.1) -> None:
        self.writes, self.n_values, self.n_queries = writes, n_values, n_queries
        self.train_noise = train_noise
        self.in_features = 5 + n_values
        self.n_classes = n_values
        self.eval_settings = [{"writes": w, "noise": 0.0} for w in writes] + [
            {"writes": noise_writes, "noise": s} for s in noises if s > 0]
        self.fixed: dict | None = None

    @classmethod
    def only(cls, setting: dict, **kwargs: object) -> CoordinateBinding:
        """A task that trains and evaluates on ONE setting (the paper's protocol: one model
        per number of writes and noise level)."""
        task = cls(writes=(setting["writes"],), noises=(), **kwargs)
        task.eval_settings = [dict(setting)]
        task.fixed = dict(setting)
        return task

    def train_setting(self, rng: np.random.Generator) -> dict:
        if self.fixed is not None:
            return dict(self.fixed)
        return {"writes": int(rng.choice(self.writes)),
                "noise": float(rng.uniform(0.0, self.train_noise))}

    def batch(self, rng: np.random.Generator, size: int, setting: dict) -> Batch:
        W, Q, V = setting["writes"], self.n_queries, self.n_values
        keys = rng.uniform(-1.0, 1.0, (size, W, 3))
        values = rng.integers(0, V, (size, W))
        picked = rng.integers(0, W, (size, Q))
        queries = np.take_along_axis(keys, picked[..., None], axis=1)
        queries = np.clip(queries + rng.normal(0.0, 1.0, queries.shape) * setting["noise"], -1, 1)
        dist = ((queries[:, :, None, :] - keys[:, None, :, :]) ** 2).sum(-1)  # (B, Q, W)
        nearest = dist.argmin(-1)  # (B, Q): the write that answers each query
        answers = np.take_along_axis(values, nearest, axis=1)  # (B, Q)
        x = np.zeros((size, W + Q, self.in_features), np.float32)
        x[:, :W, 0] = 1.0
        x[:, W:, 1] = 1.0
        x[:, :W, 2:5] = keys
        x[:, W:, 2:5] = queries
        x[np.arange(size)[:, None], np.arange(W)[None, :], 5 + values] = 1.0
        targets = np.zeros((size, W + Q), np.int64)
        targets[:, W:] = answers
        mask = np.zeros((size, W + Q), bool)
        mask[:, W:] = True
        source = np.full((size, W + Q), -1, np.int64)
        source[:, W:] = nearest
        return Batch(x, targets, mask, source)

    @staticmethod
    def label(setting: dict) -> str:
        """``W=20`` (noise 0) or ``W=20 noise=0.1``."""
        noise = setting["noise"]
        return f"W={setting['writes']}" + (f" noise={noise}" if noise else "")

    def plot_groups(self) -> list[tuple[str, str, list[dict]]]:
        by_writes = [s for s in self.eval_settings if s["noise"] == 0.0]
        groups = [("binding: accuracy vs #writes (noise 0)", "writes", by_writes)]
        with_noise = [s for s in self.eval_settings if s["noise"] > 0]
        if with_noise:
            base = [s for s in by_writes if s["writes"] == with_noise[0]["writes"]]
            groups.append((f"binding: accuracy vs query noise ({with_noise[0]['writes']} writes)",
                           "noise", base + with_noise))
        return groups
