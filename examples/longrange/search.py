"""What makes Tensor Memory address here: a budgeted search over its configurations.

Every variant is the default run's row changed in the named ways (:data:`VARIANTS`), with
the same state (512 numbers per layer), task, window and evaluation, and the SAME search
budget as every row of ``run``: the learning rates of ``TrainConfig.lrs``, each trained
for the variant's full length from :data:`~examples.longrange.train.TUNE_SEED` and scored
on the validation split, the best one then trained at each seed and evaluated on the
evaluation split (with and without the state reset), and, for Tensor Memory, the
addressing measures (:mod:`examples.longrange.addressing`). Baseline variants (LSTM, delta
rule) get the same extra budget as the Tensor Memory variants they are compared with.

Results go to ``results/search.json`` after every trained model (a crash loses one), and
a rerun skips what the file already holds for the same configuration.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from examples.longrange.addressing import measures
from examples.longrange.task import make_batch, reach
from examples.longrange.train import (
    TEST_SEED,
    VALIDATION_SEED,
    Config,
    eval_batches,
    grid_points,
    make_deterministic,
    seed_run,
    tune_point,
)
from examples.reporting import cpu_features, cpu_model, git

__all__ = ["Variant", "VARIANTS", "variant_config", "search"]


@dataclass(frozen=True)
class Variant:
    """A row of the default run with some fields of its ``ModelConfig`` (``model``) and
    ``TrainConfig`` (``train``) changed and its training (the search's too) ``length``
    times as long; ``label`` says what changed."""

    label: str
    row: str = "tensor_memory"
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    length: int = 1


MEMORY_LR = {"memory_lr_scale": 10.0, "memory_weight_decay": 0.0}

#: The variants, one factor at a time from the default row, then combinations.
VARIANTS: dict[str, Variant] = {
    "default": Variant("the default row: C = 4 at 4x4x4, after each block, forget bias 3"),
    "c8": Variant("C = 8 at 4x4x2", model={"memory_channels": 8, "memory_shape": (4, 4, 2)}),
    "c16": Variant("C = 16 at 4x2x2",
                   model={"memory_channels": 16, "memory_shape": (4, 2, 2)}),
    "c32": Variant("C = 32 at 2x2x2",
                   model={"memory_channels": 32, "memory_shape": (2, 2, 2)}),
    "c64": Variant("C = 64 at 2x2x1",
                   model={"memory_channels": 64, "memory_shape": (2, 2, 1)}),
    "c256": Variant("C = 256 at 1x1x1 (one cell: no address)",
                    model={"memory_channels": 256, "memory_shape": (1, 1, 1)}),
    "before": Variant("before each block's attention", model={"placement": "before"}),
    "forget5": Variant("forget bias 5", train={"retention": 5.0}),
    "write_identity": Variant("write projection initialized to the identity",
                              model={"write_init": "identity"}),
    "memory_lr": Variant("memory at 10x the learning rate, no weight decay", train=MEMORY_LR),
    "input_bias": Variant("ConvLSTM input-gate bias -3 (a cell no write reaches keeps "
                          "its content)", model={"input_bias": -3.0}),
    "long": Variant("4x the training steps", length=4),
    "oracle": Variant("a diagnosis: facts write and questions read at a fixed cell per key",
                      model={"addressing": "oracle"}),
    "oracle_keep": Variant("the oracle, forget bias 5 and input-gate bias -3",
                           model={"addressing": "oracle", "input_bias": -3.0},
                           train={"retention": 5.0}),
    "c32_before": Variant("C = 32 at 2x2x2, before each block's attention",
                          model={"memory_channels": 32, "memory_shape": (2, 2, 2),
                                 "placement": "before"}),
    "c32_long": Variant("C = 32 at 2x2x2, 4x the training steps",
                        model={"memory_channels": 32, "memory_shape": (2, 2, 2)}, length=4),
    "lstm_long": Variant("LSTM memory, 4x the training steps", row="lstm", length=4),
    "delta_long": Variant("gated delta-rule memory, 4x the training steps", row="delta",
                          length=4),
}


#: The measures every Tensor Memory seed has (one missing: the seed is trained again).
MEASURES = {"eta2_write", "eta2_read", "nearest", "sigma_facts", "sigma_filler", "read_ratio",
            "gate", "c_rms"}


def variant_config(base: Config, variant: Variant) -> Config:
    """``base`` with ``variant``'s changes, running only its row."""
    model = dataclasses.replace(base.model, **variant.model)
    train = dataclasses.replace(base.train, **variant.train,
                                steps=base.train.steps * variant.length,
                                tune_steps=base.train.tune_steps * variant.length)
    return dataclasses.replace(base, model=model, train=train, rows=(variant.row,))


def _environment() -> dict[str, Any]:
    return {"cpu": cpu_model(), **cpu_features(), **make_deterministic(1),
            "python": platform.python_version(), "torch": torch.__version__}


def _same(stored: dict[str, Any], config: dict[str, Any], base: dict[str, Any]) -> bool:
    """Whether a stored config is ``config``; a field it lacks (added to the example
    since) counts as the base's value of it."""
    def plain(value: Any) -> Any:
        return json.loads(json.dumps(value))

    for key, value in config.items():
        if isinstance(value, dict):
            if not _same(stored.get(key, {}), value, base[key]):
                return False
        elif plain(stored.get(key, base[key])) != plain(value):
            return False
    return True


def _made_by() -> dict[str, Any]:
    """The command, the commit and its uncommitted changes (outside ``results/``, which
    this writes), as this process started."""
    dirty = git("status", "--porcelain", "--untracked-files=no") or ""
    paths = (line.split(maxsplit=1)[1] for line in dirty.splitlines())
    return {"command": " ".join(["python -m examples.longrange", *sys.argv[1:]]),
            "commit": git("rev-parse", "HEAD"),
            "dirty": sorted(p for p in paths if not p.startswith("examples/longrange/results/"))}


def _save(results: dict[str, Any], out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")


def search(names: list[str], base: Config, out: Path | None, *, plots: Path | None = None,
           plot_names: tuple[str, ...] = (), log: Callable[[str], None] = print,
           variants: dict[str, Variant] | None = None) -> dict[str, Any]:
    """Run the variants ``names`` (every point and seed the results file ``out`` lacks),
    saving after each trained model; returns the results.

    ``plot_names``: variants whose seed-``base.seeds[0]`` model is drawn by
    :func:`tmcore.adapters.torch.probe.plot` on one key-value example (4 keys, the asked
    one at the longest distance) into ``plots / probe_<name>.png`` (retrained if its entry
    exists).
    """
    variants = VARIANTS if variants is None else variants
    unknown = sorted(set(names) - set(variants))
    if unknown:
        raise SystemExit(f"variants: unknown {unknown}; expected some of {sorted(variants)}")
    results: dict[str, Any] = json.loads(out.read_text()) if out and out.exists() else {}
    results.setdefault("variants", {})
    made_by = _made_by()
    results.update({
        "reach": reach(base.model.window, base.model.layers),
        "splits": {"validation_seed": VALIDATION_SEED, "test_seed": TEST_SEED},
        "environment": _environment()})
    validation = eval_batches(base.task, VALIDATION_SEED)
    test = eval_batches(base.task, TEST_SEED)
    vocab = base.task.vocab
    for name in names:
        variant = variants[name]
        config = variant_config(base, variant)
        entry = results["variants"].get(name)
        if entry is None or not _same(entry["config"], config.to_dict(), base.to_dict()):
            entry = {"label": variant.label, "row": variant.row,
                     "config": config.to_dict(), "points": [], "seeds": []}
            results["variants"][name] = entry
        started = time.process_time()
        for point in grid_points(variant.row, config.train):
            if any(p["hparams"] == point for p in entry["points"]):
                continue
            entry["points"].append(tune_point(variant.row, config, point, validation))
            entry.update(made_by)
            _save(results, out)
        best = max(entry["points"], key=lambda p: p["validation_mean"])
        entry["chosen"] = best["hparams"]
        log(f"{name}: chose {best['hparams']} (validation {100 * best['validation_mean']:.1f} %)")
        for seed in config.seeds:
            drawn = plots is not None and name in plot_names and seed == config.seeds[0]
            old = next((s for s in entry["seeds"] if s["seed"] == seed), None)
            measured = variant.row != "tensor_memory" or (
                old is not None and all(MEASURES <= set(m) for m in old.get("measures", [{}])))
            if old is not None and measured and not drawn:
                continue
            seed_entry, built = seed_run(variant.row, config, best["hparams"]["lr"], seed, test)
            seed_entry["commit"] = made_by["commit"]
            if variant.row == "tensor_memory":
                seed_entry["measures"] = measures(built, test, vocab)
            if old is not None:  # trained again (a plot, a new measure): the same numbers?
                seed_entry["reproduced"] = all(old.get(k) == seed_entry.get(k)
                                               for k in ("accuracy", "reset", "loss_curve"))
            if drawn:
                _plot(built, base, plots / f"probe_{name}.png", f"{variant.label}, seed {seed}")
            entry["seeds"] = [s for s in entry["seeds"] if s["seed"] != seed] + [seed_entry]
            entry["seeds"].sort(key=lambda s: s["seed"])
            entry["params"] = built.parameters()
            entry["carried_per_layer"] = built.numbers
            entry.update(made_by)
            _save(results, out)
            log(f"{name} seed {seed}: done")
        entry["cpu_seconds"] = round(entry.get("cpu_seconds", 0)
                                     + time.process_time() - started, 1)
        _save(results, out)
    return results


def _plot(built: Any, base: Config, path: Path, title: str) -> None:
    """Draw the traces of one key-value example (4 keys, the asked one farthest back)."""
    from tmcore.adapters.torch.probe import plot, trace

    g = torch.Generator().manual_seed(TEST_SEED)
    setting = ("kv", min(4, max(base.task.keys)), max(base.task.distances))
    batch = make_batch(base.task.vocab, [setting], base.task.length, g)
    _, traces = trace(built.model, lambda: built.forward(batch.tokens, batch.tags))
    vocab = base.task.vocab
    tags = batch.tags[0].tolist()
    facts = [i for i, t in enumerate(tags) if vocab.value0 <= t < vocab.place0]
    asked = [i for i in facts if batch.tokens[0, i] == batch.tokens[0, -1]]
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(traces, path, title=title, marks={"facts": facts, "asked fact": asked,
                                           "question": [len(tags) - 1]})

