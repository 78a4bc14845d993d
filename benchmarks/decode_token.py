"""A decode token through ``MemoryResidual`` alone, by its position in the chunk, side by side.

Each round runs this file's worker once per (shape, interpreter) in rotating order, a fresh
process each (one torch thread, ``no_grad``, C = 16 on a 4x4x4 grid, chunk 4, 2,048 tokens
after 400 warm-up tokens): the median microseconds of a call at each position of its chunk
(start, middle, middle, completion) and their mean. The answer is the median over the
rounds. ``--python`` names an interpreter whose tmcore is the checkout to time (the worker
imports only torch and tmcore, so an older checkout runs it too)::

    python -m benchmarks.decode_token --python /tmp/old/.venv/bin/python \\
        --python .venv/bin/python --rounds 3

Writes ``--json`` (default ``benchmarks/results/decode_token.json``: the command, the
commits, the config and every round's values) and ``--md`` (the table, rendered from it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

SHAPES = ((1, 64), (4, 64), (4, 512))  # (batch, d)
POSITIONS = ("start", "middle", "middle", "completion")
CHUNK, TOKENS, WARMUP = 4, 2048, 400


def worker(batch: int, d: int) -> dict[str, list[float]]:
    """Median microseconds per position of the chunk (this process's tmcore)."""
    import time

    import torch

    from tmcore.adapters.torch import MemoryResidual, TensorMemory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = MemoryResidual(TensorMemory(d, 16, (4, 4, 4), CHUNK)).eval()
    tokens = torch.randn(WARMUP + TOKENS, batch, 1, d)
    times: list[list[float]] = [[] for _ in range(CHUNK)]
    state = None
    with torch.no_grad():
        for t in range(WARMUP + TOKENS):
            start = time.perf_counter()
            _, state = module(tokens[t], state)
            if t >= WARMUP:
                times[t % CHUNK].append((time.perf_counter() - start) * 1e6)
    return {"us": [statistics.median(v) for v in times]}


def _one(python: str, batch: int, d: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, str(Path(__file__).resolve()), "--worker", str(batch), str(d)],
                         capture_output=True, text=True, check=True, env=env, cwd="/").stdout
    return json.loads(out.strip().splitlines()[-1])["us"]


def render(result: dict) -> str:
    """The Markdown page of a results dict."""
    lines = ["# A decode token through MemoryResidual alone, side by side", "",
             f"`{result['command']}`; {result['machine']}; C = 16, 4x4x4 grid, chunk "
             f"{CHUNK}, one torch thread, `no_grad`, {TOKENS} tokens after {WARMUP} of "
             f"warm-up per run, {result['config']['rounds']} rounds (interleaved); the median "
             "over the rounds of each run's median microseconds per call by the token's "
             "position in its chunk. Every round's values: `decode_token.json`.", "",
             "| B | d | checkout | " + " | ".join(POSITIONS) + " | mean |",
             "|---:|---:|---|" + "---:|" * (len(POSITIONS) + 1)]
    for run in result["runs"]:
        medians = [statistics.median(r[i] for r in run["rounds"]) for i in range(CHUNK)]
        lines.append(f"| {run['batch']} | {run['d']} | `{run['commit'].split(' ')[0]}` | "
                     + " | ".join(f"{v:.1f}" for v in medians)
                     + f" | {statistics.mean(medians):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # (run as a file by another checkout's interpreter)
        print(json.dumps(worker(int(argv[1]), int(argv[2]))))
        return 0
    from benchmarks.common import (
        checkout_arguments,
        checkout_commit,
        interleaved_rounds,
        machine_line,
        save_results,
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    checkout_arguments(parser, "decode_token")
    args = parser.parse_args(argv)
    if args.render:
        args.md.write_text(render(json.loads(args.json.read_text())))
        return 0
    pythons = [os.path.abspath(p) for p in (args.python or [sys.executable])]
    jobs = [(python, *shape) for shape in SHAPES for python in pythons]
    rounds = interleaved_rounds(jobs, args.rounds, _one)
    command = "python -m benchmarks.decode_token " + " ".join(shlex.quote(a) for a in argv)
    result = {"command": command, "machine": machine_line(),
              "config": {"rounds": args.rounds, "chunk": CHUNK, "tokens": TOKENS,
                         "warmup": WARMUP, "channels": 16, "grid": [4, 4, 4],
                         "torch_threads": 1},
              "runs": [{"batch": batch, "d": d, "python": python,
                        "commit": checkout_commit(python), "rounds": rounds[python, batch, d]}
                       for python, batch, d in jobs]}
    save_results(args, result, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
