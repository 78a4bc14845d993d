"""The full-size sweep as one command, and its cost estimate.

``python -m examples.diagnostics sweep --cache diagnostics_out/.jobs-full --out
examples/diagnostics/results [--jobs N] [--parts ...] [--cached-only]`` runs, at the
authors' sizes (``--full``) and 3 seeds, every part of :data:`PARTS` in order:

- ``binding``: the paper protocol's binding, the four rows, n = 5 / 10 / 20 / 50 writes x
  query noise 0 / 0.05 / 0.1 (``binding-paper-full.json``);
- ``binding-exact``: the same with the authors' own models (``--authors-exact``, plus
  their Tensor Memory with a causal state; ``binding-paper-exact-full.json``);
- ``collapse``: writes 20 / 50 / 100 / 200 x training budgets 500 / 2000 / 4000 steps,
  transformer and Tensor Memory, noise 0 (``collapse-paper-full.json``);
- ``mapping``, ``occlusion``: the authors' map building and occlusion at their sizes
  (``mapping-paper-full.json``, ``occlusion-paper-full.json``).

Every finished job goes to the job cache, and every run of a results file records its
job key, so the sweep accumulates over sittings: a part's jobs already in the cache or
in the part's results file at ``--out`` are not run again (a job still running when the
machine stops is lost; finished ones are kept). The cache lives in the checkout; the
committed results files survive a fresh one, so assemble and commit what has finished
before a sitting ends. ``--cached-only`` assembles each results file from what has
finished (the cache and the file it replaces; each row lists its seeds). Every results
file records the scale, and each run its wall time, ms per training step, job key and
commit.

``sweep --estimate`` times ``--estimate-steps`` training steps (after one warm-up step)
of every distinct (row, number of tokens) of the sweep, in this process at one thread,
and writes ``<out>/sweep-estimate.json``: the CPU ms per step of each row (this
process's CPU time, which a loaded machine barely inflates; the wall ms is recorded too)
and the CPU hours of each part (ms per step x steps x seeds x settings; evaluation not
counted).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from examples.diagnostics import authors, results
from examples.diagnostics.models import build_model
from examples.diagnostics.runner import (
    Experiment,
    _apply_hparams,
    _groups,
    make_experiment,
    run_experiment,
)
from examples.diagnostics.train import make_deterministic, masked_loss, to_tensors

__all__ = ["Part", "PARTS", "SEEDS", "sweep_experiments", "run_sweep", "estimate_sweep"]

#: seeds of every part of the sweep
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Part:
    """One results file of the sweep: an experiment under the paper protocol at full size."""

    name: str
    task: str
    authors_exact: bool = False


PARTS = (Part("binding", "binding"), Part("binding-exact", "binding", authors_exact=True),
         Part("collapse", "collapse"), Part("mapping", "mapping"),
         Part("occlusion", "occlusion"))


def _only_noises(exp: Experiment, noises: tuple[float, ...]) -> None:
    """Keep the binding settings whose query noise is in ``noises`` (the jobs of the
    others are not run; the ones kept have the cache keys of the full part)."""
    settings = [s for s in exp.task.eval_settings if s.get("noise", 0.0) in noises]
    if not settings:
        have = sorted({s.get("noise", 0.0) for s in exp.task.eval_settings})
        raise ValueError(f"noises: expected some of {have}, got {list(noises)}")
    exp.task.eval_settings = settings


def _only_settings(exp: Experiment, labels: tuple[str, ...]) -> None:
    """Keep the settings whose column label is in ``labels`` (e.g. ``L=6``); a part with
    none of them keeps all (the jobs kept have the cache keys of the full part)."""
    settings = [s for s in exp.task.eval_settings if exp.task.label(s) in labels]
    if settings:
        exp.task.eval_settings = settings


def sweep_experiments(parts: tuple[str, ...] | None = None, scale: str = "full",
                      seeds: tuple[int, ...] = SEEDS, models: tuple[str, ...] | None = None,
                      noises: tuple[float, ...] | None = None,
                      settings: tuple[str, ...] | None = None
                      ) -> list[tuple[Part, Experiment]]:
    """The experiments of the named parts (all of :data:`PARTS` by default), in order;
    ``models``: only the rows whose label or kind is named (the collapse rows are
    ``"<kind>, <budget> steps"``), parts left with no row are dropped; ``noises``: the
    binding parts' settings with these query noises only (the other parts have none);
    ``settings``: only the settings with these column labels (e.g. ``L=6``), in the parts
    that have any of them; a label no part has raises."""
    if settings is not None:
        known = {e.task.label(s) for _, e in sweep_experiments(parts, scale, seeds)
                 for s in e.task.eval_settings}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"settings: expected column labels such as "
                             f"{sorted(known)[:6]}, got {unknown}")
    names = [p.name for p in PARTS]
    unknown = sorted(set(parts or ()) - set(names))
    if unknown:
        raise ValueError(f"parts: expected some of {names}, got {unknown}")
    out = []
    for part in PARTS:
        if parts is not None and part.name not in parts:
            continue
        exp = make_experiment(part.task, scale, seeds, protocol="paper",
                              authors_exact=part.authors_exact)
        # the models are sized for the part's longest stream (their positional table):
        # pinned before the settings are narrowed, so a selection trains the part's models
        # and its jobs keep the part's keys
        exp.model = replace(exp.model, max_len=max(exp.model.max_len, exp.task.max_len()))
        if models is not None:
            exp.entries = [e for e in exp.entries
                           if e.label in models or (e.kind in models and e.train_overrides)]
        if noises is not None and part.task == "binding":
            _only_noises(exp, noises)
        if settings is not None:
            _only_settings(exp, settings)
        if exp.entries:
            out.append((part, exp))
    return out


def run_sweep(out_dir: Path, *, parts: tuple[str, ...] | None = None, scale: str = "full",
              seeds: tuple[int, ...] = SEEDS, models: tuple[str, ...] | None = None,
              noises: tuple[float, ...] | None = None,
              settings: tuple[str, ...] | None = None, jobs: int = 1, threads: int = 1,
              cache: Path | None = None, cached_only: bool = False, progress: bool = False,
              console: Console | None = None, command: str = "") -> list[dict]:
    """Run (or, ``cached_only``, assemble) every part; returns the results dictionaries."""
    console = console or Console()
    done = []
    for part, exp in sweep_experiments(parts, scale, seeds, models, noises, settings):
        console.rule(f"sweep: {part.name} ({scale} scale, seeds {list(seeds)})")
        done.append(run_experiment(exp, out_dir, progress=progress, console=console,
                                   jobs=jobs, threads=threads, command=command,
                                   cache=cache, cached_only=cached_only, resume=True))
    return done


def _shapes(exp: Experiment) -> list[tuple[object, object, int]]:
    """``(entry, task group, jobs)`` per distinct (row, number of writes / horizon / L):
    the noise level does not change a step's cost, so those groups share one timing;
    ``jobs`` counts the groups (settings) it stands for."""
    seen: dict[tuple[str, int], list] = {}
    for entry in exp.entries:
        for group in _groups(exp):
            tokens = group.batch(np.random.default_rng(0), 1,
                                 group.eval_settings[0]).inputs.shape[1]
            key = (entry.label, tokens)
            if key in seen:
                seen[key][2] += 1
            else:
                seen[key] = [entry, group, 1]
    return [tuple(v) for v in seen.values()]


def _time_steps(exp: Experiment, entry, group, steps: int) -> tuple[float, float]:
    """``(CPU ms, wall ms)`` per training step of one row on one task group (after one
    warm-up step). The CPU time of this process (one torch thread) is what a step costs a
    core; the wall time also counts the waits on a machine shared with other work."""
    model_cfg = replace(exp.model, max_len=max(exp.model.max_len, group.max_len()))
    train, cfg = _apply_hparams(exp.train, replace(model_cfg, **entry.overrides), {})
    torch.manual_seed(0)
    variant = dict(entry.variant)
    if variant.pop("authors_exact", False):
        model = authors.build_authors_model(entry.kind, group, cfg, **variant)
    else:
        model = build_model(entry.kind, group.in_features, group.n_classes, cfg, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
    rng = np.random.default_rng(0)
    cpu = wall = 0.0
    for step in range(steps + 1):
        x, y, m = to_tensors(group.batch(rng, train.batch_size, group.train_setting(rng)))
        start, start_cpu = time.perf_counter(), time.process_time()
        loss, _ = masked_loss(model(x), y, m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()
        if step:  # the first step warms up (allocations, kernel loading)
            cpu += time.process_time() - start_cpu
            wall += time.perf_counter() - start
    return 1000 * cpu / steps, 1000 * wall / steps


def estimate_sweep(out_dir: Path, *, parts: tuple[str, ...] | None = None,
                   scale: str = "full", seeds: tuple[int, ...] = SEEDS, steps: int = 2,
                   threads: int = 1, console: Console | None = None,
                   command: str = "") -> dict:
    """Time a few steps of every distinct (row, length) of the sweep and estimate each
    part's CPU hours; writes ``<out>/sweep-estimate.json`` and returns it."""
    console = console or Console()
    make_deterministic(threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows, totals, timed = [], {}, {}
    for part, exp in sweep_experiments(parts, scale, seeds):
        hours = 0.0
        for entry, group, settings in _shapes(exp):
            # rows that differ only in their budget (the collapse sweep) or that recur in
            # another part cost the same per step: timed once
            key = (entry.kind, repr(entry.variant), repr(entry.overrides), repr(exp.model),
                   exp.train.batch_size, group.label(group.eval_settings[0]).split(" ")[0],
                   type(group).__name__)
            if key not in timed:
                timed[key] = _time_steps(exp, entry, group, steps)
            ms, wall_ms = timed[key]
            n_steps = entry.train_overrides.get("steps", exp.train.steps)
            job_hours = ms * n_steps / 3.6e6
            hours += job_hours * settings * len(seeds)
            setting = group.label(group.eval_settings[0]).split(" noise")[0]
            rows.append({"part": part.name, "model": entry.label, "setting": setting,
                         "ms_per_step": round(ms, 1), "wall_ms_per_step": round(wall_ms, 1),
                         "steps": n_steps,
                         "jobs": settings * len(seeds),
                         "cpu_hours": round(job_hours * settings * len(seeds), 2)})
            console.print(f"  {part.name}: {entry.label} {setting}: {ms:,.0f} CPU ms/step "
                          f"({wall_ms:,.0f} wall) x "
                          f"{n_steps} steps x {settings * len(seeds)} job(s) = "
                          f"{job_hours * settings * len(seeds):.2f} h")
        totals[part.name] = round(hours, 2)
    result = {"kind": "estimate", "scale": scale, "command": command,
              **results.commit_info(), "seeds": list(seeds), "timed_steps": steps,
              "load_average_at_start": load, "environment": results.environment(threads),
              "rows": rows, "cpu_hours": totals,
              "cpu_hours_total": round(sum(totals.values()), 2)}
    path = Path(out_dir) / "sweep-estimate.json"
    results.write_results(result, path)
    console.print(f"estimated CPU hours: {totals} (total {result['cpu_hours_total']}); "
                  f"written to {path}")
    return result
