"""Streamed-token cost side by side: ``python -m examples.longrange cost`` repeated, its rows
(window, window + Tensor Memory, + LSTM, + gated delta rule at equal state) per chunk size
and checkout, rounds interleaved.

This machine is shared and loaded, so one run of the example is not an answer: each round
runs the example once per (chunk, interpreter), in rotating order, and the answer is the
median over the rounds of each row's tokens/s and of the per-round ratios Tensor Memory /
LSTM and Tensor Memory / delta rule (the rows of one example run ran minutes apart at
most, one process each, one torch thread). ``--python`` names an interpreter whose tmcore
is the checkout to time; its examples (with ``cost --chunk``) run from that checkout::

    python -m benchmarks.decode_cost --python /tmp/old/.venv/bin/python \\
        --python .venv/bin/python --chunks 1 16 --tokens 4096 --rounds 3

Writes ``--json`` (default ``benchmarks/results/decode_cost.json``: the command, the
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
import tempfile
from pathlib import Path

from benchmarks.common import (
    checkout_arguments,
    checkout_commit,
    interleaved_rounds,
    machine_line,
    save_results,
)

ROWS = ("window", "tensor_memory", "lstm", "delta")
LABELS = {"window": "window only", "tensor_memory": "window + Tensor Memory",
          "lstm": "window + LSTM memory", "delta": "window + gated delta-rule memory"}


def _checkout(python: str) -> Path:
    """The checkout ``python``'s tmcore was installed from (its examples run from there)."""
    where = subprocess.run([python, "-c", "import tmcore, os; print(os.path.dirname("
                            "os.path.dirname(tmcore.__file__)))"], capture_output=True,
                           text=True, check=True, cwd="/").stdout.strip()
    return Path(where)


def _one(python: str, chunk: int, tokens: int) -> dict[str, float]:
    """One run of the example: tokens/s per row."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "cost.json"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([python, "-m", "examples.longrange", "cost", "--tokens", str(tokens),
                        "--chunk", str(chunk), "--rows", *ROWS, "--out", str(out)],
                       check=True, capture_output=True, text=True, env=env,
                       cwd=_checkout(python))
        result = json.loads(out.read_text())
    return {r["row"]: r["tokens_per_s"] for r in result["rows"]}


def summarize(result: dict) -> list[dict]:
    """Per (chunk, checkout): the median tokens/s of each row, and the median and range of
    the per-round ratios."""
    table = []
    for run in result["runs"]:
        rounds = run["rounds"]
        row = {"chunk": run["chunk"], "commit": run["commit"]}
        for name in ROWS:
            row[name] = statistics.median(r[name] for r in rounds)
        for key, other in (("memory_over_lstm", "lstm"), ("memory_over_delta", "delta")):
            ratios = sorted(r["tensor_memory"] / r[other] for r in rounds)
            row[key], row[key + "_range"] = statistics.median(ratios), (ratios[0], ratios[-1])
        table.append(row)
    return table


def render(result: dict) -> str:
    """The Markdown page of a results dict."""
    lines = ["# Streamed-token cost side by side (examples/longrange cost)", "",
             f"`{result['command']}`; {result['machine']}; {result['config']['tokens']} "
             f"tokens per run, one token per call, {result['config']['rounds']} rounds "
             "(interleaved); medians over the rounds (the ratios: of the per-round ratios, "
             "their range in brackets). Every round's values: "
             "`decode_cost.json`.", "",
             "| chunk | checkout | " + " | ".join(f"{LABELS[r]} tokens/s" for r in ROWS)
             + " | memory / LSTM | memory / delta rule |",
             "|---:|---|" + "---:|" * (len(ROWS) + 2)]
    for row in summarize(result):
        lines.append(f"| {row['chunk']} | `{row['commit'].split(' ')[0]}` | "
                     + " | ".join(f"{row[r]:.0f}" for r in ROWS)
                     + "".join(f" | {row[k]:.2f}x ({row[k + '_range'][0]:.2f}-"
                               f"{row[k + '_range'][1]:.2f}x)"
                               for k in ("memory_over_lstm", "memory_over_delta")) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    checkout_arguments(parser, "decode_cost")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.render:
        args.md.write_text(render(json.loads(args.json.read_text())))
        return 0
    pythons = [os.path.abspath(p) for p in (args.python or [sys.executable])]
    jobs = [(python, chunk, args.tokens) for chunk in args.chunks for python in pythons]
    rounds = interleaved_rounds(jobs, args.rounds, _one)
    command = "python -m benchmarks.decode_cost " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    result = {"command": command, "machine": machine_line(),
              "config": {"tokens": args.tokens, "rounds": args.rounds, "chunks": args.chunks,
                         "rows": list(ROWS), "piece": 1, "torch_threads": 1},
              "runs": [{"chunk": chunk, "python": python, "commit": checkout_commit(python),
                        "rounds": rounds[python, chunk, tokens]}
                       for python, chunk, tokens in jobs]}
    save_results(args, result, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
