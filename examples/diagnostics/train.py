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

__all__ = ["RunResult", "train_and_evaluate", "evaluate", "evaluate_memory_off",
           "eval_batches", "to_tensors", "masked_loss"]

EVAL_SEED = 12_345  # every model of a task is evaluated on the same examples


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
    #: accuracy with every memory read switched off (gates closed): how much the memory is used
    memory_off: dict[str, float] = field(default_factory=dict)


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


def eval_batches(task: Task, n_examples: int, chunk: int = 128) -> dict[str, list[Batch]]:
    """The fixed evaluation set of every setting, seeded by ``EVAL_SEED``."""
    out = {}
    for i, setting in enumerate(task.eval_settings):
        rng = np.random.default_rng(EVAL_SEED + i)
        sizes = [min(chunk, n_examples - s) for s in range(0, n_examples, chunk)]
        out[task.label(setting)] = [task.batch(rng, n, setting) for n in sizes]
    return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: dict[str, list[Batch]]) -> dict[str, float]:
    """Accuracy per setting label."""
    model.eval()
    device = next(model.parameters()).device
    result = {}
    for label, parts in batches.items():
        correct = total = 0
        for batch in parts:
            x, y, m = to_tensors(batch, device)
            pred = model(x).argmax(-1)
            correct += int((pred[m] == y[m]).sum())
            total += int(m.sum())
        result[label] = correct / max(total, 1)
    model.train()
    return result


@torch.no_grad()
def evaluate_memory_off(model: torch.nn.Module, batches: dict[str, list[Batch]]
                        ) -> dict[str, float]:
    """Accuracy per setting with every memory gate closed (``sigmoid(-inf) = 0``): the
    memory still runs, but nothing it reads reaches the tokens. Empty without memories."""
    memories = model.memories() if hasattr(model, "memories") else []
    if not memories:
        return {}
    saved = [m.gate.detach().clone() for m in memories]
    for m in memories:
        m.gate.fill_(-float("inf"))
    try:
        return evaluate(model, batches)
    finally:
        for m, gate in zip(memories, saved, strict=True):
            m.gate.copy_(gate)


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
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def train_and_evaluate(model: torch.nn.Module, task: Task, cfg: TrainConfig, seed: int,
                       name: str, eval_sets: dict[str, list[Batch]],
                       progress: bool = True) -> RunResult:
    """Train ``model`` on fresh batches of ``task`` for ``cfg.steps`` steps, then evaluate.

    The data stream depends only on ``seed``, so every backbone sees the same
    batches. Gate values (``model.gate_values()``) are logged with the loss.
    """
    rng = np.random.default_rng(seed)
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
    result.accuracy = evaluate(model, eval_sets)
    result.memory_off = evaluate_memory_off(model, eval_sets)
    result.seconds = time.perf_counter() - start
    return result
