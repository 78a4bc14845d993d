"""The results file: every number in the README tables comes from one of these.

``examples/diagnostics/results/<task>-<protocol>.json``::

    task, protocol ("paper" | "streaming"), scale, command, commit, dirty,
    dirty_paths, config {task, train, model, ...}, environment {torch, threads,
    native kernels, cpu, ...}, settings [labels], window_ceiling {label: %},
    references {rule: {label: %}} (rules that need no model; may be empty),
    rows [{model, setting, seeds: [% per seed], reset: [% per seed]}],
    seeds [the seed of each position], params {model: n}, carried {model: n},
    gates {model: [[per layer] per seed]}, runs [full per-run records], seconds,
    cost {model: {setting: {seconds: [per seed], ms_per_step: [per seed]}}} (runs that
    recorded their training time only)

Accuracies in ``rows`` are percentages rounded to 0.01; ``reset`` is the
accuracy with the carried state reset (``models.Backbone.forward(reset=...)``),
empty for models that carry nothing.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from examples.reporting import cpu_features, cpu_model, git

__all__ = ["build_results", "write_results", "load_results", "commit_info", "environment",
           "RESULTS_DIR", "TRACKED_PATHS"]

RESULTS_DIR = Path(__file__).with_name("results")
#: The paths whose uncommitted changes can change a run's numbers.
TRACKED_PATHS = ("examples/diagnostics", "tmcore", "backends", "adapters")


def commit_info() -> dict:
    """``{"commit": HEAD, "dirty": bool, "dirty_paths": [...]}`` at run time; ``dirty``
    counts uncommitted source changes under :data:`TRACKED_PATHS` only (other files and
    docs cannot change a run)."""
    head = git("rev-parse", "HEAD")
    # names only (``git status --porcelain`` lines lose their first column to the
    # stripping of the output): changed tracked files, then untracked ones
    changed = git("diff", "--name-only", "HEAD", "--", *TRACKED_PATHS) or ""
    untracked = git("ls-files", "--others", "--exclude-standard", "--", *TRACKED_PATHS) or ""
    paths = sorted({name for name in (changed + "\n" + untracked).splitlines()
                    if name.endswith((".py", ".c", ".cc", ".h"))})  # code, not docs
    return {"commit": head, "dirty": bool(paths), "dirty_paths": paths[:50]}


def ran_at_of(output: dict) -> list[dict]:
    """Where a job's output or a results file's run records it ran (``jobstore.ran_at``;
    one place, a list of them, or none: older records have the commit only)."""
    at = output.get("ran_at")
    return at if isinstance(at, list) else [at] if at else []


def environment(threads: int) -> dict:
    """What a bitwise rerun must match: versions, CPU, threads, whether the fused kernels
    ran (they round float32 differently from the torch ops and are built per CPU)."""
    import numpy
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "numpy": numpy.__version__, "machine": platform.machine(), "threads": threads,
           "cpu": cpu_model(), **cpu_features(), "native_kernels": None}
    try:
        from tmcore.backends import native_kernels_active

        env["native_kernels"] = native_kernels_active()
    except Exception:  # no tmcore backends (pure-PyTorch variant): nothing fused ran
        env["native_kernels"] = False
    env["TMCORE_NATIVE"] = os.environ.get("TMCORE_NATIVE")
    return env


def build_results(*, task: str, protocol: str, scale: str, command: str, settings: list[str],
                  ceilings: dict[str, float], runs: list[dict], carried: dict[str, int],
                  config: dict, environment: dict, seconds: float,
                  references: dict[str, dict[str, float]] | None = None) -> dict:
    """The results dictionary from per-run records (``train.RunResult`` as dicts)."""
    seeds = sorted({r["seed"] for r in runs})
    models = list(dict.fromkeys(r["model"] for r in runs))
    rows = []
    for model in models:
        mine = [r for r in runs if r["model"] == model]
        for setting in settings:
            by_seed = {r["seed"]: r for r in mine if setting in r["accuracy"]}
            have = [s for s in seeds if s in by_seed]
            row = {
                "model": model, "setting": setting,
                "seeds": [round(100 * by_seed[s]["accuracy"][setting], 2) for s in have],
                "reset": [round(100 * by_seed[s]["reset"][setting], 2) for s in have
                          if by_seed[s].get("reset")],
            }
            if have != seeds:  # an assembly of finished jobs (--cached-only) lacks some
                row["seed_ids"] = have
            rows.append(row)
    return {
        "task": task, "protocol": protocol, "scale": scale, "command": command,
        **commit_info(), "config": config, "environment": environment,
        "settings": settings,
        "window_ceiling": {k: round(100 * v, 2) for k, v in ceilings.items()},
        "references": {name: {k: round(100 * v, 2) for k, v in values.items()}
                       for name, values in (references or {}).items()},
        "seeds": seeds, "rows": rows,
        "params": {m: next(r["params"] for r in runs if r["model"] == m) for m in models},
        "carried": carried,
        "gates": {m: [r["gate_curve"][-1][1] if r["gate_curve"] else [] for r in runs
                      if r["model"] == m] for m in models},
        "runs": runs, "seconds": round(seconds, 1),
        **({"cost": _cost(runs, models, settings)} if runs and all(
            r.get("steps") for r in runs) else {}),
    }


def _cost(runs: list[dict], models: list[str], settings: list[str]) -> dict:
    """``{model: {setting: {"seconds": [per seed], "ms_per_step": [per seed]}}}``: each
    run's wall time (training and evaluation) and its training loop's ms per step."""
    out: dict = {}
    for model in models:
        for setting in settings:
            mine = [r for r in runs if r["model"] == model and setting in r["accuracy"]]
            out.setdefault(model, {})[setting] = {
                "seconds": [round(r["seconds"], 1) for r in mine],
                "ms_per_step": [round(1000 * r["train_seconds"] / r["steps"], 1)
                                for r in mine]}
    return out


def write_results(result: dict, path: Path) -> None:
    """Write ``result`` as indented JSON (``path``'s folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def load_results(folder: Path = RESULTS_DIR) -> dict[str, dict]:
    """``{file stem: results}`` of every results file in ``folder`` (sorted by name)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))}
