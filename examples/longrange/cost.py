"""The cost of long streams: process memory and tokens/s while streaming one long document.

For each row a fresh Python process (``python -m examples.longrange cost --row-worker ROW``)
builds the row's model at the sizes of the recall run (untrained: the cost does not depend
on the weights), warms it up, then streams ``tokens`` random tokens in calls of ``piece``
tokens through one ``transformers.DynamicCache`` (``use_cache=True``), as a chat or a
document reader would. Every ``every`` tokens it records the tokens so far, the interval's
ms per token, the process's resident memory above what it held before streaming
(``/proc/self/statm``) and the bytes of the state the cache carries (keys and values, plus
the memory's state). The peak is the largest resident memory read after any call, minus
the resident memory before streaming (torch's CPU allocator has no peak statistics,
Python's ``tracemalloc`` does not see tensors, and ``getrusage``'s ``ru_maxrss``, also
recorded, includes building the model).

Full attention's cache keeps every token; the window's cache keeps ``W - 1`` tokens per
layer (Mistral's ``DynamicSlidingWindowLayer``); a memory adds its fixed-size state.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from examples.reporting import cpu_features, cpu_model, git

__all__ = ["CostConfig", "run", "worker", "table", "ROWS"]

#: The rows that can stream through a cache (the XL row's attention is an uncached one;
#: streamed, it is a window of W + M).
ROWS = ("full", "window", "tensor_memory", "lstm", "delta")


@dataclass(frozen=True)
class CostConfig:
    tokens: int = 16384
    piece: int = 1
    every: int = 1024
    rows: tuple[str, ...] = ROWS
    tiny: bool = False
    chunk: int | None = None  # the memory's chunk size (None: the model config's)

    @staticmethod
    def make(tiny: bool = False, tokens: int | None = None, piece: int | None = None,
             rows: list[str] | None = None, chunk: int | None = None) -> CostConfig:
        base = CostConfig(tokens=64, piece=4, every=16, rows=("full", "window",
                                                              "tensor_memory"), tiny=True) \
            if tiny else CostConfig()
        unknown = sorted(set(rows or ()) - set(ROWS))
        if unknown:
            raise SystemExit(f"--rows: unknown {unknown}; expected some of {ROWS}")
        return CostConfig(tokens=tokens or base.tokens, piece=piece or base.piece,
                          every=base.every, rows=tuple(rows) if rows else base.rows,
                          tiny=base.tiny, chunk=chunk)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def state_bytes(built: Any, cache: Any) -> int:
    """The bytes a cache carries: every layer's keys and values, plus the memory's state."""
    total = sum(_tensor_bytes([getattr(layer, "keys", None), getattr(layer, "values", None)])
                for layer in cache.layers)
    if built.row == "tensor_memory":
        state = built.handle.state_of(cache) or []
        total += sum(_tensor_bytes([s.h, s.c, s.pending, s.read]) for s in state)
    elif built.row in ("lstm", "delta"):
        total += _tensor_bytes(getattr(cache, "_longrange_state", (0, []))[1])
    return total


def worker(row: str, spec: dict[str, Any]) -> None:
    """Stream in this process and print one JSON line (the row's measurements)."""
    import torch
    from transformers import DynamicCache

    from examples.longrange.models import LABELS, build
    from examples.longrange.train import Config

    torch.set_num_threads(1)
    config = Config.tiny() if spec["tiny"] else Config()
    if spec.get("chunk"):
        config = replace(config, model=replace(config.model, chunk_size=spec["chunk"]))
    vocab = config.task.vocab
    built = build(row, config.model, vocab.size, 0, config.train.retention)
    model = built.model.eval()
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(vocab.filler0, vocab.size, (1, spec["tokens"]), generator=g)
    piece, every = spec["piece"], spec["every"]
    with torch.no_grad():
        warm = DynamicCache(config=model.config)
        for start in range(0, 4 * piece, piece):
            model(input_ids=stream[:, start:start + piece], cache=warm, use_cache=True)
        del warm
        before = _rss_mib()
        cache = DynamicCache(config=model.config)
        trace, started, mark = [], time.perf_counter(), time.perf_counter()
        peak = before
        for start in range(0, spec["tokens"], piece):
            model(input_ids=stream[:, start:start + piece], cache=cache, use_cache=True)
            peak = max(peak, _rss_mib())
            done = start + piece
            if done % every == 0 or done >= spec["tokens"]:
                now = time.perf_counter()
                span = done - (trace[-1]["tokens"] if trace else 0)
                trace.append({"tokens": done, "ms_per_token": 1000 * (now - mark) / span,
                              "rss_growth_mib": round(_rss_mib() - before, 2),
                              "state_mib": state_bytes(built, cache) / 2**20})
                mark = now
        elapsed = time.perf_counter() - started
    print(json.dumps({
        "row": row, "label": LABELS[row], "tokens": spec["tokens"],
        "seconds": round(elapsed, 2), "tokens_per_s": spec["tokens"] / elapsed,
        "rss_before_mib": round(before, 1),
        "peak_rss_growth_mib": round(peak - before, 2),
        "ru_maxrss_mib": round(_peak_mib(), 1),
        "ms_per_token_last": trace[-1]["ms_per_token"],
        "cache_tokens_per_layer": cache.layers[0].keys.shape[-2], "trace": trace,
    }))


def run(config: CostConfig, log: Any = print) -> dict[str, Any]:
    """Every row in its own process, one after the other; the results dict."""
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    spec = asdict(config)
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for row in config.rows:
        done = subprocess.run(
            [sys.executable, "-m", "examples.longrange", "cost", "--row-worker", row,
             "--config-json", json.dumps(spec)], capture_output=True, text=True, check=False,
            env=env, cwd=os.fspath(_root()))
        if done.returncode != 0:
            raise RuntimeError(f"cost worker {row} failed:\n{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        log(f"{row}: {rows[-1]['tokens_per_s']:.0f} tokens/s, peak RSS growth "
            f"{rows[-1]['peak_rss_growth_mib']:.1f} MiB")
    import torch

    return {
        "command": " ".join(["python -m examples.longrange", *sys.argv[1:]]),
        "commit": commit,
        "dirty": sorted(line[3:].strip() for line in (dirty or "").splitlines()),
        "environment": {"cpu": cpu_model(), **cpu_features(), "torch_threads": 1,
                        "python": platform.python_version(), "torch": torch.__version__},
        "config": spec,
        "rows": rows,
    }


def _root() -> Any:
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


def table(results: dict[str, Any]) -> str:
    from examples.longrange.render import cost_table

    return cost_table(results)
