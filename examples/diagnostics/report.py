"""Results: the terminal table (rich), the JSON file and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

__all__ = ["summarize", "print_table", "write_json", "plot_sweeps", "plot_gates"]


def summarize(runs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """``{model: {setting label: {"mean", "std", "n"}}}`` over seeds (accuracies in [0, 1])."""
    out: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for label, acc in run["accuracy"].items():
            out.setdefault(run["model"], {}).setdefault(label, []).append(acc)
    return {m: {k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "n": len(v)}
                for k, v in per.items()} for m, per in out.items()}


def print_table(result: dict, console: Console | None = None) -> Table:
    """Print one task's accuracy table (mean +- std over seeds, in %) and return it.

    ``gate``: final ``sigmoid(gate)`` of each memory (first seed); ``mem off``:
    accuracy averaged over the settings with the memory gates closed after
    training (close to the row's accuracies = the memory is not used)."""
    console = console or Console()
    summary, labels = result["summary"], result["settings"]
    seeds = len({r["seed"] for r in result["runs"]})
    context = result.get("context", "full")
    table = Table(title=f"{result['task']} — accuracy % (mean ± std over {seeds} seed(s)), "
                        f"context: {context}")
    table.add_column("model", style="bold")
    table.add_column("params", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    table.add_column("gate", justify="right")
    table.add_column("mem off", justify="right")
    table.add_column("train s", justify="right")
    for model, per in summary.items():
        runs = [r for r in result["runs"] if r["model"] == model]
        gates = runs[0]["gate_curve"][-1][1] if runs and runs[0]["gate_curve"] else []
        cells = []
        for label in labels:
            s = per[label]
            cells.append(f"{100 * s['mean']:.1f}" + (f" ± {100 * s['std']:.1f}" if s["n"] > 1
                                                     else ""))
        off = [np.mean(list(r["memory_off"].values())) for r in runs if r.get("memory_off")]
        table.add_row(model, f"{runs[0]['params']:,}", *cells,
                      " ".join(f"{g:.2f}" for g in gates) or "-",
                      f"{100 * np.mean(off):.1f}" if off else "-",
                      f"{np.mean([r['seconds'] for r in runs]):.0f}")
    console.print(table)
    return table


def write_json(result: dict, path: Path) -> None:
    """Write ``result`` (task, settings, runs, summary, config) as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def plot_sweeps(result: dict, groups: list[tuple[str, str, list[dict]]], path: Path) -> None:
    """Accuracy vs the swept setting, one panel per ``(title, x_key, settings)`` group."""
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
    for ax, (title, key, settings) in zip(axes[0], groups, strict=True):
        xs = [s[key] for s in settings]
        for model, per in result["summary"].items():
            labels = [result["label_of"][json.dumps(s, sort_keys=True)] for s in settings]
            mean = np.array([per[k]["mean"] for k in labels]) * 100
            std = np.array([per[k]["std"] for k in labels]) * 100
            ax.errorbar(xs, mean, yerr=std, marker="o", capsize=3, label=model)
        ax.set(title=title, xlabel=key, ylabel="accuracy %", ylim=(0, 102))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gates(result: dict, path: Path) -> bool:
    """``sigmoid(gate)`` of every memory layer over training (first seed); False if none."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    drew = False
    for run in result["runs"]:
        if run["seed"] != result["runs"][0]["seed"] or not run["gate_curve"]:
            continue
        steps = [s for s, _ in run["gate_curve"]]
        values = np.array([g for _, g in run["gate_curve"]])
        if values.size == 0 or values.ndim != 2 or values.shape[1] == 0:
            continue
        for layer in range(values.shape[1]):
            ax.plot(steps, values[:, layer], label=f"{run['model']} (memory {layer})")
            drew = True
    if drew:
        ax.set(title=f"{result['task']}: memory gate sigmoid(gate) over training",
               xlabel="step", ylabel="gate", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drew
