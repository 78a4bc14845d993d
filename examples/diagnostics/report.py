"""Tables and plots from a results dictionary (``results.py``).

One function, :func:`table`, turns a results dictionary into rows of strings;
the terminal table (rich) and the README's markdown tables (``render.py``) are
both printed from it, so they cannot disagree.

Conventions: accuracy in %, ``mean ± std`` over seeds (sample std, ddof 1);
``window ceiling``: the best a model that sees only its own segment can do
(answers in the segment + chance on the rest; 100 in one window); rows marked
``(a rule, no model)``: accuracies of simple rules (``Task.references``);
``uses state``: seeds whose accuracy drops by >= :data:`USE_MARGIN` points
(mean over settings) when the carried state is reset -- the memory was
discovered and is used; ``gate``: final ``sigmoid(gate)`` of the first memory,
mean over runs (initial value 0.5; :func:`gate_reach` bounds how far it could
have moved).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from examples import reporting  # noqa: E402

__all__ = ["table", "title", "cost_table", "collapse_verdict", "print_table", "print_tuning",
           "plot_results", "USE_MARGIN", "mean_std", "gate_reach"]

USE_MARGIN = 5.0


def mean_std(values: list[float]) -> str:
    """``"88.3 ± 2.1"`` (sample std), or ``"88.3"`` for one value, ``"-"`` for none."""
    return reporting.mean_std(values, digits=1)


def gate_reach(train: dict) -> float:
    """How far a scalar can move in one run: Adam moves a parameter by at most about the
    learning rate per step, so the sum of the schedule's learning rates bounds the gate
    logit's travel from its initial value."""
    steps, lr, warmup = train["steps"], train["lr"], train.get("warmup", 0)
    total = 0.0
    for step in range(steps):
        if train.get("schedule", "cosine") == "constant":
            factor = 1.0
        elif step < warmup:
            factor = (step + 1) / warmup
        else:
            progress = min((step - warmup) / max(1, steps - warmup), 1.0)
            factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        total += lr * factor
    return total


def _gate(result: dict, model: str) -> str:
    finals = [g[0] for g in result.get("gates", {}).get(model, []) if g]
    return f"{statistics.fmean(finals):.2f}" if finals else "-"


def _uses_state(result: dict, model: str) -> str:
    """``"used/seeds"``: per seed, the drop on reset averaged over the settings that seed
    has run (an assembly of finished jobs may lack some: cells pair by seed id, not by
    position)."""
    drops: dict[int, list[float]] = {}
    for r in result["rows"]:
        if r["model"] != model or not r["reset"] or len(r["reset"]) != len(r["seeds"]):
            continue
        ids = r.get("seed_ids", result.get("seeds", range(len(r["seeds"]))))
        for seed, acc, reset in zip(ids, r["seeds"], r["reset"], strict=True):
            drops.setdefault(seed, []).append(acc - reset)
    if not drops:
        return "-"
    used = sum(statistics.fmean(d) >= USE_MARGIN for d in drops.values())
    return f"{used}/{len(drops)}"


def _seed_marks(have: list[list[int] | None]) -> tuple[str, list[str]]:
    """``(name mark, cell marks)`` for a row whose cells hold the seeds ``have`` (one id
    list per setting, ``None`` where the file does not say): an assembly of finished jobs
    (``--cached-only``) may lack seeds, so one set shared by the whole row goes with its
    name (``" (seeds 0, 2 only)"``), else each partial cell says which seeds it has."""
    uniform = bool(have[0]) and all(h == have[0] for h in have)
    if uniform:
        return f" (seeds {', '.join(map(str, have[0]))} only)", [""] * len(have)
    return "", [f" (seed{'s' * (len(h) > 1)} {', '.join(map(str, h))})" if h else ""
                for h in have]


def title(result: dict) -> str:
    """One line naming the task, protocol, scale, seeds and context."""
    model = result["config"]["model"]
    context = (f"segments of {model['segment']}, state carried" if model.get("segment")
               else "whole stream in one window")
    per = "one model per setting" if result["config"].get("per_setting") else \
        "one model per row"
    return (f"{result['task']}, protocol {result['protocol']} ({result['scale']} scale; "
            f"{context}; {per}) — accuracy % over seeds {result['seeds']}")


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of strings: one row per model, then the window ceiling; then,
    for the models that carry state, a row with the accuracy after resetting it."""
    settings = result["settings"]
    header = ["model", "params", "carried", *settings, "uses state", "gate"]
    by = {(r["model"], r["setting"]): r for r in result["rows"]}
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    rows = []
    marks = {model: _seed_marks([by[model, s].get("seed_ids") for s in settings])
             for model in models}
    for model in models:
        name_mark, cell_marks = marks[model]
        cells = [mean_std(by[model, s]["seeds"]) + mark
                 for s, mark in zip(settings, cell_marks, strict=True)]
        rows.append([model + name_mark,
                     f"{result['params'][model]:,}",
                     f"{result['carried'].get(model, 0):,}" if result["carried"].get(model)
                     else "0",
                     *cells, _uses_state(result, model), _gate(result, model)])
    rows.append(["window ceiling", "", "",
                 *[f"{result['window_ceiling'][s]:.1f}" for s in settings], "", ""])
    for name, values in result.get("references", {}).items():
        rows.append([f"{name} (a rule, no model)", "", "",
                     *[f"{values[s]:.1f}" for s in settings], "", ""])
    reset = result["config"].get("reset", "segment")
    for model in models:
        if any(by[model, s]["reset"] for s in settings):
            name_mark, cell_marks = marks[model]
            rows.append([f"{model}{name_mark}, state reset every {reset}", "", "",
                         *[mean_std(by[model, s]["reset"]) + mark
                           for s, mark in zip(settings, cell_marks, strict=True)], "", ""])
    return header, rows


def cost_table(result: dict, marks: dict[tuple[str, str], str] | None = None
               ) -> tuple[list[str], list[list[str]]] | None:
    """``(header, rows)`` of the training cost: ms per training step (mean over seeds) of
    every row and setting, the row's total wall time (training and evaluation, all
    seeds), and for every ``tensor_memory`` row whose ``transformer`` counterpart exists
    (the same label with the model's name changed) the ratio of their ms per step.
    ``marks``: a suffix per ``(model, setting)`` number (``render.cost_marks``: where
    its seeds ran). ``None`` for a results file without cost records."""
    cost = result.get("cost")
    if not cost:
        return None
    settings, marks = result["settings"], marks or {}
    header = ["model (ms per training step)", *settings, "wall time, all seeds"]
    rows = []

    def ms(model: str, setting: str) -> float | None:
        values = cost.get(model, {}).get(setting, {}).get("ms_per_step", [])
        return statistics.fmean(values) if values else None

    # one model per row covers every setting: its seconds are listed under each setting
    per_setting = result.get("config", {}).get("per_setting", True)
    for model, per in cost.items():
        wall = (sum(sum(c["seconds"]) for c in per.values()) if per_setting
                else sum(next(iter(per.values()))["seconds"]))
        rows.append([model, *[f"{v:,.0f}{marks.get((model, s), '')}"
                              if (v := ms(model, s)) is not None else "-"
                              for s in settings], f"{wall / 3600:.2f} h" if wall >= 3600
                     else f"{wall:,.0f} s"])
    for model in cost:
        base = model.replace("tensor_memory", "transformer", 1)
        if "tensor_memory" not in model or base not in cost:
            continue
        ratios = []
        for s in settings:
            a, b = ms(model, s), ms(base, s)
            where_a, where_b = (marks.get((m, s), "").strip(" ()") for m in (model, base))
            # a ratio of numbers from different CPUs says so (they do not compare)
            mixed = f" ({where_a} / {where_b})" if where_a != where_b else ""
            ratios.append(f"{a / b:.1f}x{mixed}" if a and b else "-")
        rows.append([f"ratio {model} / {base}", *ratios, ""])
    return header, rows


def collapse_verdict(result: dict) -> list[str]:
    """The collapse sweep's answer (a results file whose task config has ``budgets``):
    per number of writes, the smallest training budget at which the mean of the
    ``tensor_memory, <b> steps`` row exceeds the ``transformer, <b> steps`` row's by more
    than the larger of the two seed spreads (sample std; needs >= 2 seeds in both), then
    the smallest such setting overall. Where Tensor Memory's row was also scored with its
    state reset at every token, the lead says what is left of it then: a lead that
    survives the reset is not the memory's. Empty for other results files."""
    budgets = result.get("config", {}).get("task", {}).get("budgets")
    if not budgets:
        return []
    by = {(r["model"], r["setting"]): r["seeds"] for r in result["rows"]}
    reset = {(r["model"], r["setting"]): r.get("reset") or [] for r in result["rows"]}
    lines, first = [], None
    for setting in result["settings"]:
        found, compared = None, []
        for budget in sorted(budgets):
            tm = by.get((f"tensor_memory, {budget} steps", setting), [])
            tf = by.get((f"transformer, {budget} steps", setting), [])
            if len(tm) < 2 or len(tf) < 2:
                continue
            compared.append(budget)
            gap = statistics.fmean(tm) - statistics.fmean(tf)
            if gap > max(statistics.stdev(tm), statistics.stdev(tf)):
                tm_reset = reset.get((f"tensor_memory, {budget} steps", setting), [])
                found = (budget, gap, statistics.fmean(tm_reset) - statistics.fmean(tf)
                         if tm_reset else None)
                break
        if found is None and not compared:
            lines.append(f"{setting}: not compared yet (no budget has >= 2 seeds of both rows)")
        elif found is None:
            lines.append(f"{setting}: Tensor Memory is never ahead by more than the seed "
                         f"spread at the budgets compared "
                         f"({', '.join(map(str, compared))} steps)")
        else:
            after_reset = ("" if found[2] is None else
                           f"; {found[2]:+.1f} with its state reset every token")
            lines.append(f"{setting}: Tensor Memory ahead by more than the seed spread first "
                         f"at {found[0]} steps (+{found[1]:.1f} points{after_reset})")
            first = first or (setting, found[0])
    lines.append("smallest such setting: " + (f"{first[0]} at {first[1]} steps" if first
                                                else "none"))
    return lines


def print_table(result: dict, console: Console | None = None) -> Table:
    """Print :func:`table` with :func:`title` and return the rich table."""
    console = console or Console()
    header, rows = table(result)
    out = Table(title=title(result))
    for i, name in enumerate(header):
        out.add_column(name, justify="left" if i == 0 else "right", style="bold" if i == 0
                       else None)
    for row in rows:
        out.add_row(*row)
    console.print(out)
    return out


def print_tuning(result: dict, console: Console | None = None) -> Table:
    """Every tuning point's mean accuracy on the tuning split, the chosen one marked."""
    console = console or Console()
    out = Table(title=f"tuning {result['task']} / {result['protocol']}: mean accuracy % on "
                      f"the held-out tuning split")
    out.add_column("model", style="bold")
    out.add_column("point")
    out.add_column("mean", justify="right")
    for row in result["rows"]:
        for point in row["points"]:
            mark = " *" if point["hparams"] == row["chosen"] else ""
            out.add_row(row["model"], _point(point["hparams"]) + mark,
                        f"{100 * point['mean']:.1f}")
    console.print(out)
    return out


def _point(hparams: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in hparams.items())


def plot_results(result: dict, path: Path) -> None:
    """Accuracy vs setting per model (mean ± std), with the window ceiling dashed."""
    settings = result["settings"]
    by = {(r["model"], r["setting"]): r for r in result["rows"]}
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = range(len(settings))
    for model in models:
        # a partial sweep (``--cached-only``) may lack a model's runs at some settings
        seeds = [by[model, s]["seeds"] if (model, s) in by else [] for s in settings]
        points = [(x, v) for x, v in zip(xs, seeds, strict=True) if v]
        means = [statistics.fmean(v) for _, v in points]
        stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in points]
        ax.errorbar([x for x, _ in points], means, yerr=stds, marker="o", capsize=3,
                    label=model)
    ax.plot(xs, [result["window_ceiling"][s] for s in settings], "k--", label="window ceiling")
    ax.set_xticks(list(xs), settings)
    if len(settings) > 6:  # long labels ("W=20 noise=0.05") overlap when flat
        ax.tick_params(axis="x", labelrotation=35, labelsize=7)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    ax.set(title=f"{result['task']} ({result['protocol']} protocol, {result['scale']} scale)",
           ylabel="accuracy %", ylim=(0, 102))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
