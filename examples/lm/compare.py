"""Train and score one model of the LM comparison; the results file, table and plot.

``run_one(kind, seed, config, data, device, threads, progress)`` trains one
:class:`~examples.lm.baselines.CompareLM` with next-byte prediction on random windows of
the training bytes (the same windows for every model of a seed) and scores it on the
held-out bytes cut into non-overlapping windows of ``context`` tokens (each window
starts from an empty context/state, so every model sees the same text).

Results (``examples/lm/results/<name>.json``)::

    task, command, commit, dirty, config, data, environment, seeds, seconds,
    rows [{model, label, params, seeds [held-out perplexity per seed (per byte)],
           bits_per_byte [..], tokens_per_s [..], memory_mib [..]}]

``memory_mib``: the bytes one training step saves for backward (activations, each
storage once) -- deterministic, the same measure on any device; on CUDA
``cuda_peak_mib`` adds the allocator's peak during training.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from examples import vision_common as common
from examples.lm.baselines import LABELS, MODELS, CompareLM, ModelSizes
from examples.lm.data import load_split

__all__ = ["CompareConfig", "SCALES", "run_one", "heldout_loss", "saved_bytes",
           "build_results", "table", "markdown", "plot", "render"]


@dataclass(frozen=True)
class CompareConfig:
    """Sizes (see :class:`ModelSizes`) and the schedule. ``eval_tokens``: at most this many
    held-out bytes are scored (``0``: all)."""

    sizes: ModelSizes = field(default_factory=ModelSizes)
    context: int = 256
    steps: int = 400
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.01
    eval_tokens: int = 0
    eval_batch: int = 16
    seeds: tuple[int, ...] = (0, 1, 2)
    models: tuple[str, ...] = MODELS

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["sizes"]["memory_shape"] = list(self.sizes.memory_shape)
        out["seeds"], out["models"] = list(self.seeds), list(self.models)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> CompareConfig:
        d = dict(d)
        sizes = dict(d.pop("sizes"))
        sizes["memory_shape"] = tuple(sizes["memory_shape"])
        return cls(sizes=ModelSizes(**sizes), seeds=tuple(d.pop("seeds")),
                   models=tuple(d.pop("models")), **d)


SCALES = {
    "tiny": CompareConfig(sizes=ModelSizes(width=32, layers=2, heads=2, window=16, segment=16,
                                           memory_channels=4, memory_shape=(2, 2, 2),
                                           chunk_size=8, linear_chunk=16),
                          context=64, steps=3, batch=4, warmup=1, eval_tokens=512,
                          eval_batch=4, seeds=(0,)),
    "cpu": CompareConfig(),
    # meant for one GPU (hours, not minutes); the window stays 64
    "full": CompareConfig(sizes=ModelSizes(width=512, layers=6, heads=8, window=64, segment=128,
                                           memory_channels=16, memory_shape=(8, 8, 8),
                                           chunk_size=16, linear_chunk=64),
                          context=512, steps=20_000, batch=32, lr=6e-4, warmup=1000,
                          eval_tokens=0, eval_batch=32),
}


def _lr(step: int, config: CompareConfig) -> float:
    """Linear warmup, then cosine to 10 % of ``lr``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    t = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def _loss(model: CompareLM, window: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of ``window (B, N + 1)``."""
    logits = model(window[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))


def saved_bytes(model: CompareLM, window: torch.Tensor) -> int:
    """Bytes the forward pass of one training step saves for backward (each storage once)."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(t.device.type, storage.data_ptr())] = storage.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, window)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(n for (_, ptr), n in seen.items() if ptr not in params)


@torch.no_grad()
def heldout_loss(model: CompareLM, heldout: torch.Tensor, config: CompareConfig,
                 device: str) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out windows."""
    n = config.context + 1
    usable = heldout if config.eval_tokens <= 0 else heldout[:config.eval_tokens + 1]
    count = (usable.numel() - 1) // config.context
    if count < 1:
        raise ValueError(f"heldout: expected more than {n} bytes, got {usable.numel()}")
    # windows overlap by one byte: every held-out byte after the first is a target once
    windows = usable[:count * config.context + 1].unfold(0, n, config.context)
    model.eval()
    total = 0.0
    for i in range(0, count, config.eval_batch):
        batch = windows[i:i + config.eval_batch].to(device)
        logits = model(batch[:, :-1]).double()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       batch[:, 1:].reshape(-1), reduction="sum"))
    model.train()
    return total / (count * config.context)


def run_one(kind: str, seed: int, config: CompareConfig, data: str | None, device: str,
            threads: int, progress: bool) -> dict:
    """Train ``kind`` with ``seed`` and score it: one record (also in a worker process)."""
    from tqdm.auto import tqdm

    train, heldout, _ = load_split(data)
    common.make_deterministic(seed, threads)
    model = CompareLM(kind, config.sizes).to(device)
    batches = torch.Generator().manual_seed(10_000 + seed)  # same windows for every model
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr,
                            weight_decay=config.weight_decay)

    def window() -> torch.Tensor:
        start = torch.randint(0, train.numel() - config.context - 1, (config.batch,),
                              generator=batches)
        return torch.stack([train[s:s + config.context + 1] for s in start.tolist()]).to(device)

    memory = saved_bytes(model, window())
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    seconds, losses = 0.0, []
    bar = tqdm(range(config.steps), desc=f"{kind} seed {seed}", disable=not progress,
               leave=False, dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        batch = window()
        for group in opt.param_groups:
            group["lr"] = _lr(step, config)
        start = time.perf_counter()
        loss = _loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        losses.append(float(loss.detach()))
        if step % 20 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    nats = heldout_loss(model, heldout, config, device)
    record = {"model": kind, "seed": seed,
              "params": sum(p.numel() for p in model.parameters()),
              "perplexity": round(math.exp(nats), 4),
              "bits_per_byte": round(nats / math.log(2), 5),
              "train_loss": round(statistics.fmean(losses[-20:]), 5) if losses else None,
              "tokens_per_s": round(config.steps * config.batch * config.context
                                    / max(seconds, 1e-9), 1),
              "memory_mib": round(memory / 2**20, 3)}
    if device.startswith("cuda"):
        record["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return record


def build_results(records: list[dict], config: CompareConfig, command: str, data: str,
                  threads: int, device: str, seconds: float, provenance: dict) -> dict:
    """The results dictionary (module doc) from per-run records."""
    rows = []
    for kind in config.models:
        mine = {r["seed"]: r for r in records if r["model"] == kind}
        per = [mine[s] for s in config.seeds]
        row = {"model": kind, "label": LABELS[kind], "params": per[0]["params"],
               "seeds": [r["perplexity"] for r in per],
               "bits_per_byte": [r["bits_per_byte"] for r in per],
               "train_loss": [r["train_loss"] for r in per],
               "tokens_per_s": [r["tokens_per_s"] for r in per],
               "memory_mib": [r["memory_mib"] for r in per]}
        if "cuda_peak_mib" in per[0]:
            row["cuda_peak_mib"] = [r["cuda_peak_mib"] for r in per]
        rows.append(row)
    return {"task": "byte-level causal language modelling (held-out perplexity per byte)",
            "command": command, **provenance, "config": config.as_dict(), "data": data,
            "environment": common.environment(threads, device), "seeds": list(config.seeds),
            "rows": rows, "seconds": round(seconds, 1)}


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: mean ± std over seeds per model."""
    header = ["model", "params", "held-out perplexity / byte", "bits / byte",
              "train tokens/s", "activations MiB"]
    rows = [[row["label"], f"{row['params']:,}", common.mean_std(row["seeds"], 3),
             common.mean_std(row["bits_per_byte"], 3),
             f"{statistics.fmean(row['tokens_per_s']):.0f}",
             f"{statistics.fmean(row['memory_mib']):.1f}"] for row in result["rows"]]
    return header, rows


def markdown(result: dict, name: str) -> str:
    """Caption, table and source line (what ``render`` writes to ``results/<name>.md``)."""
    c = result["config"]
    s = c["sizes"]
    head = (f"*{result['data']}; byte-level, width {s['width']}, {s['layers']} layers, "
            f"{s['heads']} heads, context {c['context']}, window {s['window']}, XL segment "
            f"{s['segment']}, memory {s['memory_channels']} x "
            f"{'x'.join(map(str, s['memory_shape']))} chunk {s['chunk_size']}; {c['steps']} "
            f"steps of batch {c['batch']}; mean ± std over seeds {result['seeds']}.*")
    env = result["environment"]
    source = (f"Source: `examples/lm/results/{name}.json`, made by `{result['command']}` at "
              f"commit {str(result['commit'])[:10]}{' (dirty)' if result.get('dirty') else ''} "
              f"({env['device']}, {env['threads']} thread(s) per run, {result['seconds']:.0f} s).")
    return "\n\n".join([head, common.md_table(*table(result)), source]) + "\n"


def plot(result: dict, path: Path) -> None:
    """Held-out bits/byte per model (mean, std as bars, seeds as dots)."""
    plt = common.pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.2))
    for i, row in enumerate(rows):
        v = row["bits_per_byte"]
        ax.barh(i, statistics.fmean(v), xerr=statistics.stdev(v) if len(v) > 1 else 0.0,
                color="tab:orange" if "memory" in row["model"] else "tab:blue",
                alpha=0.7, capsize=3)
        ax.plot(v, [i] * len(v), "k.", ms=4)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    lo = min(min(r["bits_per_byte"]) for r in rows)
    hi = max(max(r["bits_per_byte"]) for r in rows)
    ax.set_xlim(lo - 0.1 * (hi - lo + 0.1), hi + 0.1 * (hi - lo + 0.1))
    ax.set_xlabel("held-out bits / byte (lower is better)")
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(f"Byte-level causal LM, seeds {result['seeds']}", fontsize=9)
    common.save_figure(fig, path, 110)


def render(results: Path, figures: Path, name: str, check: bool = False) -> bool:
    """Write ``results/<name>.md`` and ``figures/<name>.png`` from ``results/<name>.json``.
    Returns whether the markdown differed (with ``check``: nothing is written)."""
    import json

    result = json.loads((results / f"{name}.json").read_text())
    text = markdown(result, name)
    md = results / f"{name}.md"
    stale = not md.is_file() or md.read_text() != text
    if not check:
        md.write_text(text)
        plot(result, figures / f"{name}.png")
    return stale
