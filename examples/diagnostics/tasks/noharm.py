"""No-harm control: a fully observed task where memory cannot help.

Tokens count up modulo ``V`` from a random start; the target at every
position is the next token (``token + 1 mod V``), readable from the current
token alone. Every model should reach ~100 %, and the memory gates should
stay near their initial value. Features: ``one_hot(token) (V)``.
"""

from __future__ import annotations

import numpy as np

from examples.diagnostics.tasks.base import Batch, Task

__all__ = ["NoHarm"]


class NoHarm(Task):
    """One setting: sequences of ``length`` tokens over a vocabulary of ``n_values``."""

    name = "noharm"
    sweep_key = "length"

    def __init__(self, n_values: int = 16, length: int = 8) -> None:
        self.n_values, self.length = n_values, length
        self.in_features = self.n_classes = n_values
        self.eval_settings = [{"length": length}]

    def train_setting(self, rng: np.random.Generator) -> dict:
        return {"length": self.length}

    def batch(self, rng: np.random.Generator, size: int, setting: dict) -> Batch:
        N, V = setting["length"], self.n_values
        tokens = (rng.integers(0, V, (size, 1)) + np.arange(N)) % V  # (B, N)
        x = np.eye(V, dtype=np.float32)[tokens]
        source = np.broadcast_to(np.arange(N), (size, N)).copy()  # the token itself
        return Batch(x, (tokens + 1) % V, np.ones((size, N), bool), source)
