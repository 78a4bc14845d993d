"""Results file, table and plots of the action-recognition example.

``rows``: one per (model, metric, setting) with ``seeds`` = the value of each
seed (in the order of the top-level ``seeds``): ``top1`` and ``top5`` (%) at
setting ``"test"``, ``step_ms`` (median wall-clock of one training step) at
setting ``"train"``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from examples.image.common import commit_info, environment, md_table, mean_std  # noqa: E402
from examples.video.train import LABELS  # noqa: E402

__all__ = ["build_results", "table", "markdown", "plot_results", "plot_clips"]


def build_results(records: list[dict], config: dict, command: str, data: str, classes: list,
                  threads: int, device: str, seconds: float,
                  provenance: dict | None = None) -> dict:
    """The results dictionary from per-run records; ``provenance``: :func:`commit_info` taken
    when the run started (default: now)."""
    seeds = sorted({r["seed"] for r in records})
    models = list(dict.fromkeys(r["model"] for r in records))
    rows = []
    for model in models:
        by_seed = {r["seed"]: r for r in records if r["model"] == model}
        for metric in ("top1", "top5"):
            rows.append({"model": model, "metric": metric, "setting": "test",
                         "seeds": [round(100 * by_seed[s][metric], 2) for s in seeds]})
        rows.append({"model": model, "metric": "step_ms", "setting": "train",
                     "seeds": [by_seed[s]["step_ms"] for s in seeds]})
    return {"task": "action recognition", "command": command,
            **(provenance or commit_info()), "data": data, "classes": classes,
            "config": config, "environment": environment(threads, device), "seeds": seeds,
            "rows": rows,
            "params": {m: next(r["params"] for r in records if r["model"] == m)
                       for m in models},
            "gates": {m: [r["gates"] for r in records if r["model"] == m] for m in models},
            "runs": records, "seconds": round(seconds, 1)}


def _values(result: dict, model: str, metric: str) -> list[float]:
    return next(r["seeds"] for r in result["rows"]
                if r["model"] == model and r["metric"] == metric)


def table(result: dict, timing: dict | None = None) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: top-1 / top-5 % and ms per training step, mean ± std over seeds,
    and the step time relative to the first model. Step times come from ``timing`` (the
    interleaved measurement, :mod:`examples.video.timing`) when given, else from training."""
    models = list(result["params"])
    source = timing if timing is not None else result
    base = statistics.fmean(_values(source, models[0], "step_ms"))
    header = ["model", "params", "top-1 %", "top-5 %", "ms / step", "step time"]
    rows = []
    for m in models:
        ms = _values(source, m, "step_ms")
        rows.append([LABELS.get(m, m), f"{result['params'][m]:,}",
                     mean_std(_values(result, m, "top1"), 1),
                     mean_std(_values(result, m, "top5"), 1), mean_std(ms, 0),
                     f"{statistics.fmean(ms) / base:.2f}x"])
    return header, rows


def markdown(result: dict, name: str, timing: dict | None = None) -> str:
    """Title line, table and source line (the README block)."""
    c = result["config"]
    head = (f"*Action recognition, {result['data']}: {len(result['classes'])} classes, "
            f"{c['frames']} frames of {c['size']}x{c['size']}, tubelets of {c.get('tube', 1)} "
            f"frames x {c['patch']}x{c['patch']} pixels "
            f"({c['grid'][0]}x{c['grid'][1]}x{c['grid'][2]} tokens), width "
            f"{c['width']}, depth {c['depth']}, {c['steps']} steps of {c['batch']} clips; "
            f"held-out clips; mean ± std over seeds {result['seeds']}.*")
    env = result["environment"]
    source = (f"Source: `examples/video/results/{name}.json`, made by `{result['command']}` at "
              f"commit {(result.get('commit') or 'unknown')[:10]}"
              f"{' + uncommitted changes' if result.get('dirty') else ''} "
              f"({env['threads']} torch thread(s) on {env['device']}, "
              f"{result['seconds'] / 60:.1f} min in all).")
    if timing is not None:
        source += (f" Step times: `examples/video/results/timing.json`, made by "
                   f"`{timing['command']}` (the models take steps in turn on one batch, "
                   f"median of {timing['config']['rounds']} steps per seed).")
    header, rows = table(result, timing)
    return "\n\n".join([head, md_table(header, rows), source]) + "\n"


def plot_results(result: dict, path: Path, timing: dict | None = None) -> None:
    """Top-1 / top-5 accuracy and ms per step per model (bars: mean; ticks: std); step
    times from ``timing`` (the interleaved measurement) when given."""
    models = list(result["params"])
    names = [LABELS.get(m, m) for m in models]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    x = np.arange(len(models))
    for offset, metric in ((-0.2, "top1"), (0.2, "top5")):
        values = [_values(result, m, metric) for m in models]
        axes[0].bar(x + offset, [statistics.fmean(v) for v in values], 0.4,
                    yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in values],
                    capsize=3, label=metric.replace("top", "top-"))
    axes[0].set_ylabel("held-out accuracy %")
    axes[0].legend(fontsize=8)
    ms = [_values(timing if timing is not None else result, m, "step_ms") for m in models]
    axes[1].bar(x, [statistics.fmean(v) for v in ms],
                yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in ms], capsize=3)
    axes[1].set_ylabel("ms per training step")
    for ax in axes:
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Action recognition ({result['data']}), seeds {result['seeds']}",
                 fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
