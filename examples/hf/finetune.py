"""Pretrain a tiny Llama, add Tensor Memory with ``zero_init=True``, fine-tune on long documents.

Everything runs on the CPU from text already on the machine: the byte-level corpus is
Python's own standard-library source (``sysconfig``'s ``stdlib`` folder: every ``.py``
file directly in it, sorted; every 5th file is held out). No tokenizer or model is
downloaded.

1. Pretrain a tiny ``LlamaForCausalLM`` (bytes as tokens) on short windows
   (``pretrain_tokens``) of the training files.
2. For each seed, fine-tune two copies of it with ``transformers.Trainer`` on long
   windows (``long_tokens``, several times the pretraining length) of the same files:
   the plain model, and the model with a Tensor Memory attached to every block
   (``tmcore.adapters.hf.attach_memory(..., zero_init=True)``: bit-identical to the
   plain model at step 0, checked and recorded).
3. Held-out loss (nats per byte) on long windows of the held-out files, before and
   after fine-tuning, per seed; a greedy ``generate`` demo from the memory model.

``python -m examples.hf run`` writes ``examples/hf/results/finetune.json`` (command,
commit, config, per-seed values); ``python -m examples.hf render`` renders it into the
table of ``examples/hf/README.md``. ``--tiny`` is a seconds-long smoke run.
"""

from __future__ import annotations

import copy
import dataclasses
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from examples.reporting import cpu_model, git, md_table, mean_std

VOCAB = 256 + 2  # bytes, then BOS and EOS
BOS, EOS = 256, 257


@dataclasses.dataclass(frozen=True)
class Config:
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 172
    pretrain_tokens: int = 128
    pretrain_steps: int = 500
    pretrain_batch: int = 16
    pretrain_lr: float = 3e-3
    long_tokens: int = 512
    finetune_steps: int = 60
    finetune_batch: int = 8
    finetune_lr: float = 1e-3
    eval_windows: int = 24
    memory_channels: int = 8
    memory_shape: tuple[int, ...] = (4, 4, 4)
    chunk_size: int = 16
    gate_init: float = 0.0
    forget_bias: float = 3.0
    max_files: int = 400
    demo_prompt: str = "def __init__(self"
    demo_tokens: int = 48

    @staticmethod
    def tiny() -> Config:
        return Config(hidden_size=16, layers=1, heads=2, intermediate=32, pretrain_tokens=32,
                      pretrain_steps=4, pretrain_batch=4, long_tokens=64, finetune_steps=2,
                      finetune_batch=2, eval_windows=2, memory_channels=2,
                      memory_shape=(2, 2, 2), chunk_size=8, max_files=12, demo_tokens=4)


# --------------------------------------------------------------------------- data


def corpus(max_files: int) -> tuple[list[bytes], list[bytes], str]:
    """(training files, held-out files, the folder) from Python's standard library."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in folder.glob("*.py") if p.is_file())[:max_files]
    texts = [p.read_bytes() for p in files]
    train = [t for i, t in enumerate(texts) if i % 5 != 4]
    held = [t for i, t in enumerate(texts) if i % 5 == 4]
    if not train or not held:
        raise RuntimeError(f"no Python sources found in {folder}")
    return train, held, str(folder)


def windows(texts: list[bytes], length: int, count: int, generator: torch.Generator
            ) -> torch.Tensor:
    """``count`` random windows of ``length`` byte tokens (BOS first), from files at least
    that long (the whole concatenation when none is)."""
    long = [t for t in texts if len(t) >= length] or [b"".join(texts)]
    out = torch.empty(count, length, dtype=torch.long)
    for i in range(count):
        text = long[int(torch.randint(len(long), (1,), generator=generator))]
        start = int(torch.randint(len(text) - length + 2, (1,), generator=generator))
        piece = list(text[start:start + length - 1])
        out[i] = torch.tensor([BOS, *piece, *[EOS] * (length - 1 - len(piece))])
    return out


class Windows(Dataset):
    """Fixed windows for the Trainer (labels are the inputs: the model shifts them)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = self.tokens[index]
        return {"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}


# --------------------------------------------------------------------------- models


def make_llama(config: Config, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate,
                        num_hidden_layers=config.layers, num_attention_heads=config.heads,
                        num_key_value_heads=config.heads,
                        max_position_embeddings=config.long_tokens * 2,
                        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS,
                        tie_word_embeddings=True)
    return LlamaForCausalLM(llama)


def pretrain(model: Any, data: torch.Tensor, config: Config, seed: int) -> list[float]:
    """A plain AdamW loop (cosine decay) over ``data`` windows; returns the losses."""
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.pretrain_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(config.pretrain_steps, 1))
    losses = []
    for step in range(config.pretrain_steps):
        batch = data[step * config.pretrain_batch:(step + 1) * config.pretrain_batch]
        loss = model(batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def heldout_loss(model: Any, data: torch.Tensor, batch: int = 4) -> float:
    """Mean next-byte loss (nats) over ``data`` windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, data.shape[0], batch):
        x = data[i:i + batch]
        logits = model(x, use_cache=False).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1), reduction="sum")
        total, count = total + float(loss), count + x[:, 1:].numel()
    return total / count


def finetune(model: Any, data: torch.Tensor, config: Config, seed: int, out: Path) -> float:
    """``transformers.Trainer`` over the long windows; returns the last logged loss."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=config.finetune_batch,
        max_steps=config.finetune_steps, learning_rate=config.finetune_lr,
        lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=max(config.finetune_steps // 4, 1), save_strategy="no", report_to=[],
        seed=seed, data_seed=seed, use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Windows(data))
    result = trainer.train()
    return float(result.training_loss)


def demo(model: Any, config: Config) -> str:
    prompt = torch.tensor([[BOS, *config.demo_prompt.encode()]])
    model.eval()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=config.demo_tokens, do_sample=False,
                             pad_token_id=EOS)
    return bytes(t for t in out[0, 1:].tolist() if t < 256).decode("utf-8", "replace")


# --------------------------------------------------------------------------- the experiment


def run(config: Config, seeds: list[int], work: Path, log: Any = print) -> dict[str, Any]:
    from tmcore.adapters import hf

    torch.set_num_threads(1)
    started, cpu_started = time.time(), time.process_time()
    commit = git("rev-parse", "HEAD")   # the code that runs (read before it runs)
    dirty = git("status", "--porcelain", "--untracked-files=no")
    train_files, held_files, folder = corpus(config.max_files)
    g = torch.Generator().manual_seed(1234)
    pre_data = windows(train_files, config.pretrain_tokens,
                       config.pretrain_steps * config.pretrain_batch, g)
    held = windows(held_files, config.long_tokens, config.eval_windows, g)
    base = make_llama(config, seed=0)
    pre_losses = pretrain(base, pre_data, config, seed=0)
    pre_held = heldout_loss(base, held)
    log(f"pretrained {config.pretrain_steps} steps: train loss {pre_losses[-1]:.3f}, "
        f"held-out loss on {config.long_tokens}-byte windows {pre_held:.4f} "
        f"({time.time() - started:.0f} s)")
    per_seed = []
    for seed in seeds:
        data = windows(train_files, config.long_tokens,
                       config.finetune_steps * config.finetune_batch,
                       torch.Generator().manual_seed(100 + seed))
        row: dict[str, Any] = {"seed": seed}
        for arm in ("plain", "memory"):
            model = copy.deepcopy(base)
            if arm == "memory":
                torch.manual_seed(seed)
                hf.attach_memory(model, memory_channels=config.memory_channels,
                                 memory_shape=config.memory_shape,
                                 chunk_size=config.chunk_size, zero_init=True,
                                 gate_init=config.gate_init, forget_bias=config.forget_bias)
                row["memory_step0_loss"] = heldout_loss(model, held)
                row["identity_at_step0"] = row["memory_step0_loss"] == pre_held
            tick = time.time()
            row[f"{arm}_train_loss"] = finetune(model, data, config, seed, work / arm)
            row[f"{arm}_heldout"] = heldout_loss(model, held)
            row[f"{arm}_seconds"] = round(time.time() - tick, 1)
            if arm == "memory":
                row["demo"] = demo(model, config)
            log(f"seed {seed} {arm}: held-out {row[f'{arm}_heldout']:.4f} "
                f"({row[f'{arm}_seconds']} s)")
        row["delta"] = row["memory_heldout"] - row["plain_heldout"]
        per_seed.append(row)
    return {
        "command": " ".join(["python -m examples.hf", *sys.argv[1:]]),
        "commit": commit,
        "dirty": sorted(line[2:].strip() for line in (dirty or "").splitlines()),
        "cpu": cpu_model(), "threads": 1, "python": platform.python_version(),
        "torch": torch.__version__, "transformers": _version("transformers"),
        "corpus": {"folder": folder, "train_files": len(train_files),
                   "heldout_files": len(held_files)},
        "config": {k: list(v) if isinstance(v, tuple) else v
                   for k, v in dataclasses.asdict(config).items()},
        "pretrain": {"final_train_loss": pre_losses[-1], "heldout": pre_held},
        "seeds": per_seed,
        "seconds": round(time.time() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
    }


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:  # pragma: no cover
        return None


def table(results: dict[str, Any]) -> str:
    """The markdown table of a results file (per seed, then mean ± std)."""
    rows = []
    seeds = results["seeds"]
    for r in seeds:
        rows.append([str(r["seed"]), f"{results['pretrain']['heldout']:.4f}",
                     f"{r['plain_heldout']:.4f}", f"{r['memory_heldout']:.4f}",
                     f"{r['delta']:+.4f}", "yes" if r["identity_at_step0"] else "NO"])
    rows.append(["mean ± std", "",
                 mean_std([r["plain_heldout"] for r in seeds], 4),
                 mean_std([r["memory_heldout"] for r in seeds], 4),
                 mean_std([r["delta"] for r in seeds], 4), ""])
    header = ["seed", "pretrained (no fine-tune)", "fine-tuned, plain",
              "fine-tuned, with memory", "memory - plain", "memory = plain at step 0"]
    return md_table(header, rows)
