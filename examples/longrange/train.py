"""Training, evaluation, the learning-rate search and the whole grid of rows x seeds.

One model per row and seed, trained on the mixture of both tasks, every key count and every
distance (:func:`examples.longrange.task.mixture_batch`), then evaluated at each distance and
key count on fixed examples. Seeds: the model's initialization and its training batches
(the same batches for every row of a seed). Three fixed data seeds never meet: the
training stream of seed ``s`` (``1000 + s``), the validation split the search scores on
(:data:`VALIDATION_SEED`) and the evaluation split the tables report (:data:`TEST_SEED`).
"""

from __future__ import annotations

import math
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from examples.longrange.models import (
    LABELS,
    MEMORY_ROWS,
    ROWS,
    Built,
    ModelConfig,
    build,
    state_sizes,
)
from examples.longrange.task import (
    IGNORE,
    Batch,
    Vocab,
    make_batch,
    mixture_batch,
    reach,
    sequence_length,
)
from examples.reporting import cpu_features, cpu_model, git

__all__ = ["TaskConfig", "TrainConfig", "Config", "train", "evaluate", "grid_points",
           "run", "tune_point", "seed_run", "VALIDATION_SEED", "TEST_SEED", "TUNE_SEED",
           "make_deterministic"]

VALIDATION_SEED = 54_321
TEST_SEED = 12_345
TUNE_SEED = 1_000_003  # the search's model and training stream (not an evaluation seed)


@dataclass(frozen=True)
class TaskConfig:
    """The data: token ranges, the evaluated distances and key counts, passkey digits."""

    vocab: Vocab = field(default_factory=Vocab)
    distances: tuple[int, ...] = (8, 16, 32, 48, 64)
    keys: tuple[int, ...] = (1, 2, 4, 8)
    passkey_every: int = 4  # every 4th training row is a passkey
    extra_every: int = 8  # training: an extra query at ~1 in 8 filler positions
    eval_examples: int = 64  # per (task, keys, distance) setting

    @property
    def length(self) -> int:
        return sequence_length(max(self.distances), max(self.keys), self.vocab.digits)


@dataclass(frozen=True)
class TrainConfig:
    """The optimizer and budget (the same for every row)."""

    steps: int = 800
    batch: int = 16
    warmup: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    tune_steps: int = 800  # the search trains as long as the evaluation runs
    lrs: tuple[float, ...] = (1e-3, 3e-3)  # the search, the same for every row
    retention: float = 3.0  # every memory's forget-gate / decay bias (fixed, not searched)
    memory_lr_scale: float = 1.0  # the memories' parameters train at lr * this
    memory_weight_decay: float | None = None  # theirs (None: weight_decay)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rows: tuple[str, ...] = ROWS
    seeds: tuple[int, ...] = (0, 1, 2)

    @staticmethod
    def tiny() -> Config:
        """A seconds-long smoke run (tests)."""
        return Config(
            model=ModelConfig(hidden=16, heads=2, intermediate=32, window=4,
                              memory_channels=2, memory_shape=(2, 2, 2), delta_heads=1),
            task=TaskConfig(vocab=Vocab(4, 4, 2, 8), distances=(2, 12), keys=(1, 2),
                            eval_examples=4),
            train=TrainConfig(steps=3, batch=4, tune_steps=3, lrs=(1e-3, 3e-3)),
            seeds=(0,))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"] = self.model.to_dict()
        return out


def make_deterministic(threads: int = 1) -> dict[str, Any]:
    """One torch thread (or ``threads``), deterministic algorithms, tmcore's deterministic
    option: a rerun with the same seed on the same machine gives the same numbers."""
    import tmcore

    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    tmcore.options(deterministic=True)
    try:
        from tmcore.backends import native_kernels_active
        native = bool(native_kernels_active())
    except ImportError:  # pragma: no cover
        native = False
    return {"torch_threads": threads, "torch_deterministic": True, "native_kernels": native}


# --------------------------------------------------------------------------- one model


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at the answer positions: the mean over each sequence's answers, then
    over the sequences (a 5-digit passkey weighs as much as one key-value answer)."""
    mask = targets != IGNORE
    per = F.cross_entropy(logits.transpose(1, 2), targets.clamp_min(0), reduction="none")
    per = (per * mask).sum(1) / mask.sum(1).clamp_min(1)
    return per.mean()


def train(built: Built, config: Config, lr: float, data_seed: int, steps: int,
          tick: Callable[[float], None] | None = None) -> list[float]:
    """AdamW (linear warmup, cosine decay, clipping) on the mixture stream of ``data_seed``;
    returns the loss every step."""
    task, opt_cfg = config.task, config.train
    model = built.model
    model.train()
    groups: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    if opt_cfg.memory_lr_scale != 1.0 or opt_cfg.memory_weight_decay is not None:
        memory = built.memory_parameters()
        ids = {id(p) for p in memory}
        decay = opt_cfg.weight_decay if opt_cfg.memory_weight_decay is None \
            else opt_cfg.memory_weight_decay
        groups = [{"params": [p for p in model.parameters() if id(p) not in ids]},
                  {"params": memory, "lr": lr * opt_cfg.memory_lr_scale, "weight_decay": decay}]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=opt_cfg.weight_decay,
                            betas=(0.9, 0.95))
    warm = max(1, int(opt_cfg.warmup * steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    g = torch.Generator().manual_seed(data_seed)
    losses = []
    for _ in range(steps):
        batch = mixture_batch(task.vocab, opt_cfg.batch, max(task.keys), max(task.distances),
                              task.passkey_every, task.length, g, task.extra_every)
        loss = loss_of(built.forward(batch.tokens, batch.tags), batch.targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.clip)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if tick is not None:
            tick(losses[-1])
    model.eval()
    return losses


def eval_settings(task: TaskConfig) -> list[tuple[str, int, int]]:
    """Every evaluated ``(task, keys, distance)``: key-value recall at every key count and
    distance (``d >= n``), the passkey at every distance (``d >= P``)."""
    kv = [("kv", n, d) for n in task.keys for d in task.distances if d >= n]
    return kv + [("passkey", 0, d) for d in task.distances if d >= task.vocab.digits]


def setting_name(setting: tuple[str, int, int]) -> str:
    kind, keys, distance = setting
    return f"kv n={keys} d={distance}" if kind == "kv" else f"passkey d={distance}"


def eval_batches(task: TaskConfig, seed: int, batch: int = 64) -> list[Batch]:
    """The fixed examples of a split: ``eval_examples`` per setting, in batches."""
    g = torch.Generator().manual_seed(seed)
    settings = [s for s in eval_settings(task) for _ in range(task.eval_examples)]
    return [make_batch(task.vocab, settings[i:i + batch], task.length, g)
            for i in range(0, len(settings), batch)]


@torch.no_grad()
def evaluate(built: Built, batches: Iterable[Batch], reset_every: int | None = None
             ) -> dict[str, float]:
    """Accuracy per setting name (a passkey is right only if all its digits are)."""
    built.model.eval()
    right: dict[str, int] = {}
    total: dict[str, int] = {}
    for batch in batches:
        logits = built.forward(batch.tokens, batch.tags, reset_every=reset_every)
        mask = batch.targets != IGNORE
        ok = ((logits.argmax(-1) == batch.targets) | ~mask).all(1).tolist()
        for kind, keys, distance, good in zip(batch.kinds, batch.keys, batch.distances, ok,
                                              strict=True):
            name = setting_name((kind, keys, distance))
            right[name] = right.get(name, 0) + int(good)
            total[name] = total.get(name, 0) + 1
    return {name: right[name] / total[name] for name in total}


def grid_points(row: str, config: TrainConfig) -> list[dict[str, float]]:
    """The search's points, the same learning rates for every row (``row`` is unused: the
    budget does not depend on it)."""
    return [{"lr": lr} for lr in config.lrs]


# --------------------------------------------------------------------------- the grid


def _progress(total: int, desc: str, enabled: bool) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def run(config: Config, progress: bool = True, log: Callable[[str], None] = print,
        command: str | None = None) -> dict[str, Any]:
    """The search (per row, on the validation split) and the evaluation (every row and seed,
    with and without its state reset); returns the results dict (command, commit, config,
    per-seed values)."""
    started, cpu_started = time.time(), time.process_time()
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    env = make_deterministic(1)
    task, model_cfg = config.task, config.model
    validation = eval_batches(task, VALIDATION_SEED)
    test = eval_batches(task, TEST_SEED)
    points = {row: grid_points(row, config.train) for row in config.rows}
    total = sum(len(p) for p in points.values()) * config.train.tune_steps \
        + len(config.rows) * len(config.seeds) * config.train.steps
    bar = _progress(total, "longrange", progress)

    def tick(loss: float) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    tuning: dict[str, Any] = {}
    rows: dict[str, Any] = {}
    for row in config.rows:
        scored = [tune_point(row, config, point, validation, tick) for point in points[row]]
        best = max(scored, key=lambda s: s["validation_mean"])
        tuning[row] = {"points": scored, "chosen": best["hparams"]}
        log(f"{row}: chose {best['hparams']} (validation mean "
            f"{100 * best['validation_mean']:.1f} %)")
        hp = best["hparams"]
        per_seed = []
        for seed in config.seeds:
            entry, built = seed_run(row, config, hp["lr"], seed, test, tick)
            per_seed.append(entry)
            log(f"{row} seed {seed}: mean {100 * _mean(entry['accuracy'].values()):.1f} %"
                + (f", reset {100 * _mean(entry['reset'].values()):.1f} %"
                   if "reset" in entry else ""))
        rows[row] = {"label": LABELS[row], "params": built.parameters(),
                     "carried_per_layer": built.numbers, "hparams": hp, "seeds": per_seed}
    if bar is not None:
        bar.close()
    return {
        "command": command or " ".join(["python -m examples.longrange", *sys.argv[1:]]),
        "commit": commit,
        "dirty": sorted(line.split(maxsplit=1)[1] for line in (dirty or "").splitlines()),
        "environment": {"cpu": cpu_model(), **cpu_features(), **env,
                        "python": platform.python_version(), "torch": torch.__version__,
                        "transformers": _version("transformers")},
        "config": config.to_dict(),
        "settings": [setting_name(s) for s in eval_settings(task)],
        "sequence_length": task.length,
        "reach": reach(model_cfg.window, model_cfg.layers),
        "state_sizes": state_sizes(model_cfg),
        "chance": {"kv": 1 / task.vocab.values, "passkey": 10.0 ** -task.vocab.digits},
        "splits": {"validation_seed": VALIDATION_SEED, "test_seed": TEST_SEED,
                   "tune_seed": TUNE_SEED, "train_seed": "1000 + seed"},
        "tuning": tuning,
        "rows": rows,
        "seconds": round(time.time() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
    }


def tune_point(row: str, config: Config, point: dict[str, float], validation: list[Batch],
               tick: Callable[[float], None] | None = None) -> dict[str, Any]:
    """One point of the search: row ``row`` trained from :data:`TUNE_SEED` for
    ``tune_steps`` at ``point["lr"]``, scored on the ``validation`` batches."""
    built = build(row, config.model, config.task.vocab.size, TUNE_SEED, config.train.retention)
    start = time.process_time()
    losses = train(built, config, point["lr"], TUNE_SEED, config.train.tune_steps, tick)
    acc = evaluate(built, validation)
    return {"hparams": point, "validation_mean": _mean(acc.values()), "validation": acc,
            "final_loss": losses[-1], "cpu_seconds": round(time.process_time() - start, 1)}


def seed_run(row: str, config: Config, lr: float, seed: int, test: list[Batch],
             tick: Callable[[float], None] | None = None) -> tuple[dict[str, Any], Built]:
    """Row ``row`` at seed ``seed`` (weights ``seed``, training stream ``1000 + seed``),
    trained ``steps`` at ``lr`` and evaluated on ``test`` (also with its state reset);
    returns the seed's entry and the trained model."""
    built = build(row, config.model, config.task.vocab.size, seed, config.train.retention)
    start, wall = time.process_time(), time.time()
    losses = train(built, config, lr, 1000 + seed, config.train.steps, tick)
    train_cpu = time.process_time() - start
    entry: dict[str, Any] = {
        "seed": seed, "accuracy": evaluate(built, test),
        "final_loss": losses[-1], "loss_curve": losses[:: max(1, len(losses) // 50)],
        "train_cpu_seconds": round(train_cpu, 1),
        "train_wall_seconds": round(time.time() - wall, 1),
        "ms_per_step": round(1000 * train_cpu / max(1, config.train.steps), 1),
    }
    if built.resettable:
        entry["reset"] = evaluate(built, test, reset_every=config.model.window)
    if row in MEMORY_ROWS:
        entry["gates"] = _gates(built)
    return entry, built


def _gates(built: Built) -> list[float]:
    """Each memory's gate ``sigmoid(logit)`` after training."""
    out = []
    for module in built.model.modules():
        gate = getattr(module, "gate", None)
        if isinstance(gate, torch.nn.Parameter) and gate.numel() == 1:
            out.append(round(float(torch.sigmoid(gate.detach())), 4))
    return out


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:  # pragma: no cover
        return None


