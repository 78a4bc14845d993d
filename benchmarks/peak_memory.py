"""Peak resident memory of a torch layer call, each call in a fresh process, side by side.

What a user's process sees: the rise of its resident set's high-water mark (``VmHWM``,
reset through ``/proc/self/clear_refs`` to the resident set just before the call; with
nothing before it, ``ru_maxrss`` reads the same) over one call of
``TensorMemory(d, C, S, L)`` (public constructor only, so any commit runs the same
script) on ``x (B, N, d)``, glibc's allocator at its defaults. Forms (:data:`FORMS`):

- ``step``: ``out, st = m(x); (out.sum() + st.h.sum()).backward()``;
- ``forward``: ``m(x)`` with gradients on (what it keeps for the backward, and its
  temporaries);
- ``step, stream=False``: the step with ``m(x, stream=False)``;
- ``no_grad forward``: ``m(x)`` under ``torch.no_grad()``.

Each form is measured twice, each time in its own fresh process: as the process's
``first`` call (what it costs to start: lazy imports, kernel loading, thread pools and
the call's own buffers) and ``warm``, after a two-chunk call of the same form (the
call's own buffers only). The checkouts' interpreters (``--python``, one or more) are
interleaved, form by form, and the order rotates every round::

    python -m benchmarks.peak_memory --python /tmp/old/.venv/bin/python \\
        --python .venv/bin/python --config lm-4096 --rounds 3 \\
        --json benchmarks/results/peak_memory_side_by_side.json

``make bench`` runs it for its own interpreter (:func:`bench`) and prints the values
next to the ones recorded by the previous run (``benchmarks/results/peak_memory.json``).
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

from benchmarks.common import CONFIGS, TINY, Config, checkout_commit, machine_line

__all__ = ["FORMS", "TOLERANCE", "bench", "main", "measure", "report"]

#: form (what the child runs) -> its label
FORMS = {"step": "step", "forward": "forward", "step-no-stream": "step, stream=False",
         "no-grad": "no_grad forward"}
MODES = ("first", "warm")
#: a rise above the previous recorded value by more than this is marked as a regression
TOLERANCE = 0.05

_CHILD = r"""
import json, sys
import torch
from tmcore.adapters.torch import TensorMemory

batch, d, channels, shape, chunk, tokens, threads, form, warm = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(threads)
layer = TensorMemory(d, channels, tuple(shape), chunk)


def run(x):
    if form == "no-grad":
        with torch.no_grad():
            return layer(x)
    out, state = layer(x, stream=form != "step-no-stream")
    if form != "forward":
        h = state.h if hasattr(state, "h") else state[0]  # a StreamState or (h, c)
        (out.sum() + h.sum()).backward()
    return out, state


def kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])


if warm:
    run(torch.randn(batch, 2 * chunk, d, requires_grad=form != "no-grad"))
x = torch.randn(batch, tokens, d, requires_grad=form != "no-grad")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark := the resident set now
before = kib("VmRSS")
result = run(x)
print(json.dumps((kib("VmHWM") - before) / 1024))
"""


def measure(python: str, cfg: Config, form: str, warm: bool, threads: int = 2) -> float:
    """MiB by which one ``form`` call raises the peak resident set of a fresh ``python``
    process (``warm``: after a two-chunk call of the same form)."""
    spec = json.dumps([cfg.batch, cfg.embed_dim, cfg.channels, list(cfg.shape), cfg.chunk,
                       cfg.tokens, threads, form, warm])
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith("MALLOC_")}
    # cwd "/": no checkout's folder shadows the installed tmcore on sys.path
    done = subprocess.run([python, "-c", _CHILD, spec], capture_output=True, text=True,
                          check=True, env=env, cwd="/")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(pythons: list[str], cfg: Config, rounds: int, threads: int = 2,
            forms: tuple[str, ...] = tuple(FORMS)) -> list[dict]:
    """Per interpreter: ``{"python", "commit", "mib": {"form/mode": [per round]},
    "median_mib": {...}}``, the interpreters interleaved call by call."""
    values = {p: {f"{f}/{m}": [] for f in forms for m in MODES} for p in pythons}
    for index in range(rounds):
        shift = index % len(pythons)
        order = pythons[shift:] + pythons[:shift]
        for form in forms:
            for mode in MODES:
                for python in order:
                    mib = measure(python, cfg, form, mode == "warm", threads)
                    values[python][f"{form}/{mode}"].append(mib)
                    print(f"round {index + 1}: {form}/{mode} {mib:.1f} MiB ({python})",
                          file=sys.stderr, flush=True)
    return [{"python": p, "commit": checkout_commit(p), "mib": values[p],
             "median_mib": {k: statistics.median(v) for k, v in values[p].items()}}
            for p in pythons]


def report(rows: list[dict], previous: dict | None = None) -> str:
    """A markdown table: the medians (MiB) of every row, and the previous recorded values
    with the change where ``previous`` (a results file of the same config) is given."""
    header = ["form", *[f"{mode}: {row['commit'].split()[0]}" for mode in MODES
                        for row in rows]]
    old = previous["rows"][0] if previous else None
    if old:
        header += [f"{mode}: recorded at {old['commit'].split()[0]}" for mode in MODES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for form, label in FORMS.items():
        keys = [f"{form}/{mode}" for mode in MODES]
        if keys[0] not in rows[0]["median_mib"]:
            continue
        cells = [f"{row['median_mib'][k]:.1f}" for k in keys for row in rows]
        if old and keys[0] in old["median_mib"]:
            for k in keys:
                then, now = old["median_mib"][k], rows[0]["median_mib"][k]
                mark = " **grew**" if now > then * (1 + TOLERANCE) else ""
                cells.append(f"{then:.1f} ({now - then:+.1f}){mark}")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def _record(rows: list[dict], cfg: Config, rounds: int, threads: int, command: str) -> dict:
    return {"command": command, "machine": machine_line(), "config": cfg.name,
            "describe": cfg.describe(), "rounds": rounds, "threads": threads, "rows": rows}


def bench(out: Path, cfg: Config, rounds: int = 1) -> dict:
    """``make bench``'s part: this interpreter's values, and the previous run's recorded
    in ``out/benchmarks/results/peak_memory.json`` (``{"now", "previous"}``; the file is
    rewritten with the new values)."""
    path = out / "benchmarks" / "results" / "peak_memory.json"
    previous = json.loads(path.read_text()) if path.exists() else None
    if previous and previous.get("config") != cfg.name:
        previous = None
    rows = compare([sys.executable], cfg, rounds)
    now = _record(rows, cfg, rounds, 2, f"make bench (benchmarks.peak_memory.bench, "
                                        f"{rounds} round{'s' * (rounds > 1)})")
    path.write_text(json.dumps(now, indent=1))
    return {"now": now, "previous": previous}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True,
                        help="an interpreter whose tmcore is a checkout to measure")
    parser.add_argument("--config", default="lm-4096",
                        choices=[c.name for c in [*CONFIGS, TINY]])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forms", nargs="*", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    cfg = next(c for c in [*CONFIGS, TINY] if c.name == args.config)
    pythons = [os.path.abspath(p) for p in args.python]  # the children run in "/"
    rows = compare(pythons, cfg, args.rounds, args.threads, tuple(args.forms))
    print(f"{cfg.describe()}; peak resident-set rise per call, MiB (median of "
          f"{args.rounds} rounds)\n" + report(rows))
    if args.json is not None:
        command = "python -m benchmarks.peak_memory " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        args.json.write_text(json.dumps(_record(rows, cfg, args.rounds, args.threads,
                                                command), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
