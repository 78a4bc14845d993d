"""Experiments: which task, which backbones, how long; runs them and writes the results."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console

from examples.diagnostics import report
from examples.diagnostics.config import MODEL_KINDS, ModelConfig, TrainConfig, scaled
from examples.diagnostics.memory import adapter_name
from examples.diagnostics.models import build_model
from examples.diagnostics.picture import memory_states, plot_memory_states
from examples.diagnostics.tasks import CoordinateBinding, MapBuilding, NoHarm, Occlusion, Task
from examples.diagnostics.train import eval_batches, train_and_evaluate

__all__ = ["Entry", "Experiment", "EXPERIMENTS", "make_experiment", "run_experiment"]


@dataclass(frozen=True)
class Entry:
    """One row of a results table: a backbone, optional ablation switches and config changes."""

    label: str
    kind: str
    variant: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)


@dataclass
class Experiment:
    """A task, its sizes and the rows to train."""

    task: Task
    train: TrainConfig
    model: ModelConfig
    entries: list[Entry]
    picture: str | None = None  # label of the entry whose memory state is drawn


def _backbones() -> list[Entry]:
    return [Entry(kind, kind) for kind in MODEL_KINDS]


def _binding() -> Experiment:
    # a 4^3 grid: half the time per chunk step of 6^3 (the demo's budget), 64 cells for <= 32 keys;
    # 600 steps: discovering the key -> address map takes ~300-500 (README findings)
    return Experiment(CoordinateBinding(), TrainConfig(steps=600, warmup=60),
                      ModelConfig(memory_shape=(4, 4, 4)), _backbones(), picture="tensor_memory")


def _noharm() -> Experiment:
    return Experiment(NoHarm(), TrainConfig(steps=100, warmup=10, seeds=(0, 1, 2)),
                      ModelConfig(), _backbones())


def _mapping() -> Experiment:
    return Experiment(MapBuilding(), TrainConfig(steps=300), ModelConfig(memory_shape=(2, 8, 8)),
                      _backbones(), picture="tensor_memory")


def _occlusion() -> Experiment:
    return Experiment(Occlusion(), TrainConfig(steps=300), ModelConfig(), _backbones())


def _ablations() -> Experiment:
    base = {"write": "gaussian", "tied": True, "conv": "factorized"}  # forces the variant layer

    def row(label: str, overrides: dict | None = None, **switch: object) -> Entry:
        return Entry(label, "tensor_memory", {**base, **switch}, overrides or {})

    entries = [
        row("base (gauss, tied, factorized, 4^3, L=1)"),
        row("hard nearest-cell write", write="hard"),
        row("separate coord heads", tied=False),
        row("pointwise conv only", conv="pointwise"),
        row("grid 6^3", {"memory_shape": (6, 6, 6)}),
        row("grid 8^3", {"memory_shape": (8, 8, 8)}),
        row("chunk 2", {"chunk_size": 2}),
        row("chunk 4", {"chunk_size": 4}),
    ]
    task = CoordinateBinding(writes=(5, 10, 20), noises=())
    # the binding setting (4^3 base grid, 600 steps: finding the memory takes ~300-500)
    return Experiment(task, TrainConfig(steps=600, warmup=60),
                      ModelConfig(memory_shape=(4, 4, 4)), entries)


EXPERIMENTS = {"binding": _binding, "noharm": _noharm, "mapping": _mapping,
               "occlusion": _occlusion, "ablations": _ablations}


#: Minute versions of the tasks for ``--tiny`` (smoke tests).
TINY_TASKS = {
    "binding": lambda: CoordinateBinding(writes=(2, 4), n_queries=2, noises=(0.1,),
                                         noise_writes=4),
    "noharm": lambda: NoHarm(length=6),
    "mapping": lambda: MapBuilding(horizons=(1, 2), grid=4, n_queries=2),
    "occlusion": lambda: Occlusion(lengths=(1, 2), frame=4, visible=2),
    "ablations": lambda: CoordinateBinding(writes=(2, 3), n_queries=2, noises=()),
}


def make_experiment(name: str, scale: str = "cpu", seeds: tuple[int, ...] | None = None,
                    steps: int | None = None, context: str = "segment",
                    segment: int | None = None) -> Experiment:
    """The named experiment at a scale (``cpu`` default, ``full``, ``tiny``).

    ``context="segment"`` (default): attention within segments of ``segment``
    tokens (default: the config's), memory state carried across segments;
    ``context="full"``: the whole stream in one attention window.
    """
    if context not in ("segment", "full"):
        raise ValueError(f"context: expected 'segment' or 'full', got {context!r}")
    exp = EXPERIMENTS[name]()
    if scale == "tiny":
        exp.task = TINY_TASKS[name]()
    exp.train, exp.model = scaled(exp.train, exp.model, scale)
    if seeds:
        exp.train = replace(exp.train, seeds=tuple(seeds))
    if steps:
        exp.train = replace(exp.train, steps=steps, warmup=min(exp.train.warmup, steps // 4 + 1))
    if context == "full":
        exp.model = replace(exp.model, segment=None)
    elif segment:
        exp.model = replace(exp.model, segment=segment)
    if scale == "tiny":  # tiny grids keep the smoke test fast; ablated grids shrink too
        exp.entries = [replace(e, overrides={**e.overrides, "memory_shape": (3, 3, 3)})
                       if "memory_shape" in e.overrides else e for e in exp.entries]
    return exp


def run_experiment(exp: Experiment, out_dir: Path, *, framework: str = "torch",
                   progress: bool = True, console: Console | None = None,
                   device: str = "cpu") -> dict:
    """Train every entry for every seed, evaluate, print the table, write JSON and plots.

    Returns the result dictionary (also written to ``out_dir/<task>/results.json``).
    """
    console = console or Console()
    task, out = exp.task, Path(out_dir) / exp.task.name
    out.mkdir(parents=True, exist_ok=True)
    model_cfg = replace(exp.model, max_len=max(exp.model.max_len, task.max_len()))
    evals = eval_batches(task, exp.train.eval_examples)
    runs, trained = [], {}
    start = time.perf_counter()
    for seed in exp.train.seeds:
        for entry in exp.entries:
            if framework == "jax":
                from examples.diagnostics.jax_binding import train_and_evaluate_jax

                if entry.kind != "tensor_memory":
                    continue
                run = train_and_evaluate_jax(task, exp.train, replace(model_cfg, **entry.overrides),
                                             seed, entry.label + " (jax)", evals, progress)
                runs.append(asdict(run))
                continue
            torch.manual_seed(seed)
            cfg = replace(model_cfg, **entry.overrides)
            model = build_model(entry.kind, task.in_features, task.n_classes, cfg,
                                entry.variant).to(device)
            run = train_and_evaluate(model, task, exp.train, seed, entry.label, evals, progress)
            runs.append(asdict(run))
            trained.setdefault(entry.label, model)
            acc = " ".join(f"{100 * v:.0f}" for v in run.accuracy.values())
            console.print(f"  [dim]{task.name} {entry.label} seed {seed}: {acc} "
                          f"({run.seconds:.0f}s)[/dim]")
    settings = [task.label(s) for s in task.eval_settings]
    result = {
        "task": task.name, "framework": framework, "adapter": adapter_name(),
        "context": f"segments of {model_cfg.segment}" if model_cfg.segment else "full",
        "sweep_key": task.sweep_key, "settings": settings,
        "label_of": {json.dumps(s, sort_keys=True): task.label(s) for s in task.eval_settings},
        "train_config": asdict(exp.train), "model_config": asdict(model_cfg),
        "runs": runs, "summary": report.summarize(runs),
        "seconds": time.perf_counter() - start, "files": {},
    }
    report.plot_sweeps(result, task.plot_groups(), out / "accuracy.png")
    result["files"]["accuracy_plot"] = str(out / "accuracy.png")
    if report.plot_gates(result, out / "gates.png"):
        result["files"]["gates_plot"] = str(out / "gates.png")
    if exp.picture in trained:
        setting = task.eval_settings[min(1, len(task.eval_settings) - 1)]
        norms = memory_states(trained[exp.picture], task, setting)
        path = out / "memory_state.png"
        plot_memory_states(norms, path, f"{task.name}, {task.label(setting)}: ||h|| per cell "
                           f"(rows: step, columns: depth slice)")
        result["files"]["memory_state_plot"] = str(path)
    report.write_json(result, out / "results.json")
    report.print_table(result, console)
    return result
