"""Results file, table and plots of the action-recognition example.

``rows``: one per (model, metric, setting) with ``seeds`` = the value of each
seed (in the order of the top-level ``seeds``): ``top1`` and ``top5`` (%) at
setting ``"test"``, ``step_ms`` (median wall-clock of one training step) at
setting ``"train"``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from examples import vision_common as common
from examples.video.train import LABELS

plt = common.pyplot()

__all__ = ["build_results", "table", "markdown", "plot_results", "plot_clips"]


def build_results(records: list[dict], config: dict, command: str, data: str, classes: list,
                  threads: int, device: str, seconds: float,
                  provenance: dict | None = None) -> dict:
    """The results dictionary from per-run records; ``provenance``: ``commit_info()`` taken
    when the run started (default: now)."""

    def metric_rows(model: str, by_seed: dict, seeds: list) -> list[dict]:
        return [{"model": model, "metric": metric, "setting": "test",
                 "seeds": [round(100 * by_seed[s][metric], 2) for s in seeds]}
                for metric in ("top1", "top5")]

    return common.results_dict("action recognition", records, metric_rows, config, command,
                               data, threads, device, seconds, provenance,
                               extra={"classes": classes})


def table(result: dict, timing: dict | None = None) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: top-1 / top-5 % and ms per training step, mean ± std over seeds,
    and the step time relative to the first model. Step times come from ``timing`` (the
    interleaved measurement, :mod:`examples.video.timing`) when given, else from training."""
    base = statistics.fmean(common.step_times(result, timing, next(iter(result["params"]))))
    header = ["model", "params", "top-1 %", "top-5 %", "ms / step", "step time"]
    return header, common.model_rows(result, timing, LABELS, lambda m, ms: [
        *[common.mean_std(common.row_values(result, m, metric), 1) for metric in ("top1", "top5")],
        common.mean_std(ms, 0), f"{statistics.fmean(ms) / base:.2f}x"])


def markdown(result: dict, name: str, timing: dict | None = None) -> str:
    """Title line, table and source line (the README block)."""
    c = result["config"]
    head = (f"*Action recognition, {result['data']}: {len(result['classes'])} classes, "
            f"{c['frames']} frames of {c['size']}x{c['size']}, tubelets of {c.get('tube', 1)} "
            f"frames x {c['patch']}x{c['patch']} pixels "
            f"({c['grid'][0]}x{c['grid'][1]}x{c['grid'][2]} tokens), width "
            f"{c['width']}, depth {c['depth']}, {c['steps']} steps of {c['batch']} clips; "
            f"held-out clips; mean ± std over seeds {result['seeds']}.*")
    return common.readme_block("video", name, head, result, timing, table)


def plot_results(result: dict, path: Path, timing: dict | None = None) -> None:
    """Top-1 / top-5 accuracy and ms per step per model (bars: mean; ticks: std); step
    times from ``timing`` (the interleaved measurement) when given."""
    models = list(result["params"])
    names = [LABELS.get(m, m) for m in models]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    x = np.arange(len(models))
    for offset, metric in ((-0.2, "top1"), (0.2, "top5")):
        values = [common.row_values(result, m, metric) for m in models]
        axes[0].bar(x + offset, [statistics.fmean(v) for v in values], 0.4,
                    yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in values],
                    capsize=3, label=metric.replace("top", "top-"))
    axes[0].set_ylabel("held-out accuracy %")
    axes[0].legend(fontsize=8)
    ms = [common.step_times(result, timing, m) for m in models]
    axes[1].bar(x, [statistics.fmean(v) for v in ms],
                yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in ms], capsize=3)
    axes[1].set_ylabel("ms per training step")
    for ax in axes:
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Action recognition ({result['data']}), seeds {result['seeds']}",
                 fontsize=10)
    common.save_figure(fig, path, 110)


def plot_clips(clips: np.ndarray, labels: np.ndarray, classes: list[str], path: Path) -> None:
    """One clip per class, frames left to right (``clips (N, T, C, H, W)``)."""
    shown = [int(np.nonzero(labels == c)[0][0]) for c in range(len(classes))
             if (labels == c).any()][:10]
    frames = clips.shape[1]
    fig, axes = plt.subplots(len(shown), frames, figsize=(0.9 * frames, 0.95 * len(shown)),
                             squeeze=False)
    for row, i in enumerate(shown):
        for f in range(frames):
            image = clips[i, f].transpose(1, 2, 0)
            axes[row, f].imshow(image[..., 0] if image.shape[-1] == 1 else image,
                                cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            axes[row, f].set_xticks([])
            axes[row, f].set_yticks([])
        axes[row, 0].set_ylabel(classes[labels[i]], fontsize=6, rotation=0, ha="right")
    common.save_figure(fig, path, 80)
