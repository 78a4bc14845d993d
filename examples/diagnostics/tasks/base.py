"""What a diagnostic task provides: on-the-fly batches and the settings it sweeps."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

__all__ = ["Batch", "Task"]


@dataclass
class Batch:
    """One batch of a token-stream task (NumPy, converted to tensors by the trainer).

    inputs ``(B, N, F)`` float32 token features; targets ``(B, N)`` int64 class
    per position; mask ``(B, N)`` bool, where the loss and accuracy count;
    source ``(B, N)`` int64 (optional): for each masked position, the EARLIEST
    position a model must still see to answer it (-1 elsewhere); used for the
    window ceiling.
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    source: np.ndarray | None = None


class Task:
    """Base class: a synthetic task with a swept setting.

    Subclasses set ``name``, ``in_features``, ``n_classes``, ``sweep_key`` (the
    setting plotted on the x axis), ``eval_settings`` (list of dicts) and
    implement :meth:`batch` and :meth:`train_setting`.
    """

    name: str = "task"
    in_features: int
    n_classes: int
    sweep_key: str
    eval_settings: list[dict]
    #: set by :meth:`fixed_to`: the one setting every training batch uses
    fixed: dict | None = None

    def batch(self, rng: np.random.Generator, size: int, setting: dict) -> Batch:
        """``size`` fresh examples of ``setting``."""
        raise NotImplementedError

    def train_setting(self, rng: np.random.Generator) -> dict:
        """The setting of the next training batch (tasks train on a mixture)."""
        raise NotImplementedError

    def max_len(self) -> int:
        """Longest sequence any setting produces."""
        return max(self.batch(np.random.default_rng(0), 1, s).inputs.shape[1]
                   for s in self.eval_settings)

    def window_ceiling(self, setting: dict, window: int | None, examples: int = 2048) -> float:
        """Best accuracy of a model that sees only its own segment of ``window`` tokens
        (segments cut as ``models.Backbone`` cuts them: left-padded so the last segment
        ends the stream): the answers whose source lies in the query's segment, plus
        chance (``1 / n_classes``) on the others. ``window=None``: one window; 1.0 unless
        some answers have no source in the stream at all (map building's unglimpsed
        cells), which only chance can answer."""
        batch = self.batch(np.random.default_rng(2024), examples, setting)
        if batch.source is None:
            if window is None:
                return 1.0
            raise NotImplementedError(f"{self.name}: no answer sources for a window ceiling")
        N = batch.inputs.shape[1]
        window = window or N
        pad = (-N) % window
        rows, cols = np.nonzero(batch.mask)
        src = batch.source[rows, cols]
        visible = (src >= 0) & ((src + pad) // window == (cols + pad) // window)
        chance = 1.0 / self.n_classes
        return float(visible.mean() + (1 - visible.mean()) * chance)

    def references(self, setting: dict, examples: int = 2048) -> dict[str, float]:
        """Accuracies of simple rules that need no model (``{name: fraction}``), printed
        under the table for scale; none by default."""
        return {}

    def fixed_to(self, setting: dict) -> Task:
        """A copy that trains and evaluates on ONE setting (the paper protocol: one model
        per setting). Subclasses honour ``fixed`` in :meth:`train_setting`."""
        task = copy.copy(self)
        task.eval_settings = [dict(setting)]
        task.fixed = dict(setting)
        return task

    def with_options(self, **options: object) -> Task:
        """A copy with some attributes changed (a row's task-side ablation, e.g. the
        occlusion clock); unknown names raise."""
        task = copy.copy(self)
        for name, value in options.items():
            if not hasattr(task, name):
                raise ValueError(f"{type(self).__name__} has no option {name!r}")
            setattr(task, name, value)
        return task

    @staticmethod
    def label(setting: dict) -> str:
        """A short column label, e.g. ``writes=20,noise=0.05``."""
        return ",".join(f"{k}={v}" for k, v in setting.items())

    def plot_groups(self) -> list[tuple[str, str, list[dict]]]:
        """Panels of the sweep plot: ``(title, x key, settings)``."""
        return [(f"{self.name}: accuracy vs {self.sweep_key}", self.sweep_key,
                 list(self.eval_settings))]
