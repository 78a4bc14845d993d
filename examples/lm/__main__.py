"""``python -m examples.lm compare [--full | --tiny] [--data PATH] [...]`` and ``render``.

``compare`` trains the byte-level causal LMs of :mod:`examples.lm.baselines` (full
attention, sliding window, Transformer-XL recurrence, ELU+1 linear attention, and the
window / full model with Tensor Memory in ``causal`` mode) at equal depth and width,
``--seeds`` seeds each, in ``--jobs`` worker processes of ``--threads`` threads (same
numbers as one process), and writes ``<out>/results/<name>.json`` (name ``compare``,
``compare-full``, ``compare-tiny`` or ``compare-<data folder>``), its table
(``results/<name>.md``) and plot (``figures/<name>.png``).
``render [--name NAME] [--check]`` rewrites the table and plot from the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from examples import vision_common as common
from examples.lm.baselines import MODELS
from examples.lm.compare import SCALES, build_results, markdown, render, run_one
from examples.lm.data import load_split

HERE = Path(__file__).resolve().parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.lm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="train and score the models")
    scale = c.add_mutually_exclusive_group()
    scale.add_argument("--full", action="store_true", help="GPU sizes (hours)")
    scale.add_argument("--tiny", action="store_true", help="a smoke test (seconds)")
    c.add_argument("--data", type=Path, default=None,
                   help="folder with WikiText-2 raw files (wiki.train.raw, wiki.valid.raw, "
                        "wiki.test.raw) instead of CPython's help topics")
    c.add_argument("--models", nargs="+", choices=MODELS, default=None)
    c.add_argument("--seeds", nargs="+", type=int, default=None)
    c.add_argument("--steps", type=int, default=None)
    c.add_argument("--jobs", type=int, default=2, help="worker processes")
    c.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    c.add_argument("--device", default="cpu")
    c.add_argument("--out", type=Path, default=HERE)
    c.add_argument("--no-progress", action="store_true")
    r = sub.add_parser("render", help="table and plot from a committed results file")
    r.add_argument("--name", default="compare")
    r.add_argument("--out", type=Path, default=HERE)
    r.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    return p


def _lm_dirty() -> bool:
    """Whether examples/lm has uncommitted code changes (results and figures excluded)."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "examples/lm"],
                             cwd=common.ROOT, capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any("/results/" not in line and "/figures/" not in line
               for line in out.splitlines())


def _compare(args: argparse.Namespace, argv: list[str]) -> int:
    scale = "full" if args.full else "tiny" if args.tiny else "cpu"
    config = SCALES[scale]
    changes = {k: v for k, v in (("models", args.models), ("seeds", args.seeds),
                                 ("steps", args.steps)) if v is not None}
    config = dataclasses.replace(config, **{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in changes.items()})
    name = "compare" + ("" if scale == "cpu" else f"-{scale}")
    if args.data is not None:
        name = f"compare-{args.data.resolve().name}" + ("" if scale == "cpu" else f"-{scale}")
    _, _, description = load_split(args.data)  # fail early on a bad --data
    data = None if args.data is None else str(args.data)
    command = common.command_line("python -m examples.lm", argv)
    provenance = common.commit_info()
    # commit_info watches the library and the vision examples; this example's code counts too
    provenance["dirty"] = provenance["dirty"] or _lm_dirty()
    start = time.perf_counter()
    jobs = [(kind, seed, config, data, args.device, args.threads, not args.no_progress
             and args.jobs == 1) for kind in config.models for seed in config.seeds]
    print(f"{len(jobs)} runs ({scale}: {config.steps} steps) on {description}")
    records = common.run_jobs(
        run_one, jobs, args.jobs, not args.no_progress,
        lambda r: (f"{r['model']:>14} seed {r['seed']}: perplexity {r['perplexity']:.3f} "
                   f"({r['bits_per_byte']:.3f} bits/byte), {r['tokens_per_s']:.0f} tokens/s"))
    result = build_results(records, config, command, description, args.threads, args.device,
                           time.perf_counter() - start, provenance)
    common.write_json(result, args.out / "results" / f"{name}.json")
    render(args.out / "results", args.out / "figures", name)
    print(markdown(result, name))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.command == "compare":
        return _compare(args, argv)
    stale = render(args.out / "results", args.out / "figures", args.name, check=args.check)
    if args.check and stale:
        print(f"{args.name}.md is stale: run python -m examples.lm render --name {args.name}")
        return 1
    print((args.out / "results" / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
