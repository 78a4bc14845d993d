"""The one training loop every task and backbone shares (AdamW, warmup + cosine, fixed seeds)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from examples.diagnostics.config import TrainConfig
from examples.diagnostics.tasks import Batch, Task

__all__ = ["RunResult", "train_and_evaluate", "evaluate", "eval_batches", "to_tensors",
           "masked_loss", "make_deterministic", "EVAL_SEED", "TUNE_EVAL_SEED", "TUNE_DATA_SEED"]

EVAL_SEED = 12_345  # every model of a task is evaluated on the same examples
#: The held-out tuning split: its own evaluation examples and its own training streams, so a
#: hyper-parameter search never sees the evaluation examples nor the final runs' batches.
TUNE_EVAL_SEED = 54_321
TUNE_DATA_SEED = 1_000_003


def make_deterministic(threads: int = 1) -> dict:
    """Pin everything a rerun's numbers depend on in this process; returns what was set.

    Why a rerun drifted before: torch's CPU reductions split work by thread
    count (1 vs 2 intra-op threads give different float32 sums, so different
    weights after a few steps), and tmcore's fused CPU kernels round float32
    differently from the torch ops they replace (a build that fails, or
    ``TMCORE_NATIVE=0``, silently changes the numbers; they are also compiled
    for the CPU at hand, ``-march=native``). So: a fixed thread count,
    deterministic algorithms, tmcore's deterministic option, and the results
    file records the thread count and whether the kernels ran.
    """
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    info = {"torch_threads": threads, "torch_deterministic": True}
    try:
        import tmcore

        if hasattr(tmcore, "options"):
            tmcore.options(deterministic=True)
            info["tmcore_deterministic"] = True
    except ImportError:  # the examples also run on the pure-PyTorch variant
        pass
    return info


@dataclass
class RunResult:
    """One trained model: curves and final accuracies (``accuracy[label] in [0, 1]``)."""

    model: str
    seed: int
    params: int
    seconds: float
    accuracy: dict[str, float]
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    gate_curve: list[tuple[int, list[float]]] = field(default_factory=list)
    #: accuracy with what the model carries reset (``Backbone.forward(reset=...)``: state
    #: and caches at every segment boundary; every token in one-window runs): the part of
    #: the accuracy that needs the carried state. Empty for models that carry nothing.
    reset: dict[str, float] = field(default_factory=dict)
    #: the hyper-parameters this run used (lr, retention bias, ...)
    hparams: dict = field(default_factory=dict)
    #: training steps, and the seconds the training loop took (``seconds`` also counts the
    #: evaluation): ``1000 * train_seconds / steps`` is the cost of one step in ms
    steps: int = 0
    train_seconds: float = 0.0


def to_tensors(batch: Batch, device: torch.device | str = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs (B, N, F) float32, targets (B, N) int64, mask (B, N) bool)`` on ``device``."""
    return tuple(torch.from_numpy(a).to(device)
                 for a in (batch.inputs, batch.targets, batch.mask))  # type: ignore[return-value]


def masked_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and accuracy over the masked positions of ``logits (B, N, K)``."""
    picked = logits[mask]
    loss = F.cross_entropy(picked, targets[mask])
    acc = (picked.argmax(-1) == targets[mask]).float().mean()
    return loss, acc


def eval_batches(task: Task, n_examples: int, chunk: int = 128, seed: int = EVAL_SEED
                 ) -> dict[str, list[Batch]]:
    """The fixed evaluation set of every setting, seeded by ``seed`` (``EVAL_SEED``; the
    tuning split uses ``TUNE_EVAL_SEED``)."""
    out = {}
    for i, setting in enumerate(task.eval_settings):
        rng = np.random.default_rng(seed + i)
        sizes = [min(chunk, n_examples - s) for s in range(0, n_examples, chunk)]
        out[task.label(setting)] = [task.batch(rng, n, setting) for n in sizes]
    return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: dict[str, list[Batch]],
             reset: str | None = None) -> dict[str, float]:
    """Accuracy per setting label (``reset``: see ``models.Backbone.forward``)."""
    model.eval()
    device = next(model.parameters()).device
    result = {}
    for label, parts in batches.items():
        correct = total = 0
        for batch in parts:
            x, y, m = to_tensors(batch, device)
            pred = (model(x, reset=reset) if reset else model(x)).argmax(-1)
            correct += int((pred[m] == y[m]).sum())
            total += int(m.sum())
        result[label] = correct / max(total, 1)
    model.train()
    return result


def carries_state(model: torch.nn.Module) -> bool:
    """Whether the model carries anything across segments / tokens (memory or cache)."""
    return any(getattr(b, "memory", None) is not None or getattr(b, "attention", "local")
               != "local" for b in getattr(model, "blocks", []))


def _param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict]:
    """Two AdamW groups: the memory layers (Tensor Memory or slots, not their gates) at
    ``lr * memory_lr_scale``, everything else at ``lr``."""
    memory_ids = {id(p) for m in getattr(model, "memories", list)() for p in
                  m.memory.parameters()}
    params = list(model.parameters())
    memory = [p for p in params if id(p) in memory_ids]
    rest = [p for p in params if id(p) not in memory_ids]
    groups = [{"params": rest}]
    if memory:
        groups.append({"params": memory, "lr": cfg.lr * cfg.memory_lr_scale})
    return groups


def _lr_lambda(cfg: TrainConfig):
    def factor(step: int) -> float:
        if cfg.schedule == "constant":
            return 1.0
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def train_and_evaluate(model: torch.nn.Module, task: Task, cfg: TrainConfig, seed: int,
                       name: str, eval_sets: dict[str, list[Batch]],
                       progress: bool = True, reset: str | None = "segment",
                       data_seed: int | None = None) -> RunResult:
    """Train ``model`` on fresh batches of ``task`` for ``cfg.steps`` steps, then evaluate
    (and, for models that carry state, evaluate again with ``reset``).

    The data stream depends only on ``data_seed`` (default ``seed``), so every
    backbone sees the same batches. Gate values (``model.gate_values()``) are
    logged with the loss.
    """
    rng = np.random.default_rng(seed if data_seed is None else data_seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(_param_groups(model, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    result = RunResult(name, seed, sum(p.numel() for p in model.parameters()), 0.0, {})
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"{task.name}:{name}:s{seed}", disable=not progress,
               leave=False, dynamic_ncols=True)
    running = None
    for step in bar:
        x, y, m = to_tensors(task.batch(rng, cfg.batch_size, task.train_setting(rng)), device)
        loss, acc = masked_loss(model(x), y, m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        value = loss.item()
        running = value if running is None else 0.9 * running + 0.1 * value
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            result.loss_curve.append((step, value))
            result.gate_curve.append((step, list(model.gate_values())))
            bar.set_postfix(loss=f"{running:.3f}", acc=f"{acc.item():.2f}")
    result.steps, result.train_seconds = cfg.steps, time.perf_counter() - start
    result.accuracy = evaluate(model, eval_sets)
    if reset and carries_state(model):
        result.reset = evaluate(model, eval_sets, reset=reset)
    result.seconds = time.perf_counter() - start
    return result
