"""``python -m examples.video [--full | --tiny] [--data PATH] [...]`` and ``... render [--check]``.

Trains a joint space-time transformer, the same with register tokens and the
same with Tensor Memory (equal depth and width) to recognise actions in
procedurally generated clips (``--data``: extracted frames in the UCF-101
layout), ``--seeds`` seeds each; reports top-1 / top-5 on held-out clips and the
wall-clock of a training step. Writes ``<out>/results/<name>.json`` (name
``actions``, ``actions-full``, ``actions-tiny`` or ``actions-<data folder>``), a
plot and, for the procedural clips, one example clip per class under
``<out>/figures/``. The default ``--out`` is this folder, so the command
reproduces the committed files. ``render`` rewrites the README's video table
and plot from the committed results (``--check``: compare only, exit 1 if stale).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
COMMITTED = "actions"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from examples.video.train import MODELS

    p = argparse.ArgumentParser(prog="python -m examples.video", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="run", choices=["run", "render", "timing"])
    p.add_argument("--rounds", type=int, default=20, help="timing: timed steps per model")
    p.add_argument("--full", action="store_true", help="larger sizes, meant for a GPU")
    p.add_argument("--tiny", action="store_true", help="a few steps on tiny inputs (smoke)")
    p.add_argument("--data", type=Path, help="extracted frames root/<class>/<clip>/<frame> "
                   "(UCF-101 layout) instead of the procedural clips")
    p.add_argument("--limit", type=int, help="--data: at most this many clips per class")
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--steps", type=int)
    p.add_argument("--models", nargs="+", choices=MODELS)
    p.add_argument("--out", type=Path, default=HERE, help="results/ and figures/ go here")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes (same accuracies as 1; step times then share the CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check", action="store_true", help="render: compare only")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def render(check: bool = False) -> bool:
    """The README block and the plot from the committed results; returns whether the
    README was stale."""
    from examples.image.common import render_readme
    from examples.video.report import markdown, plot_results

    result = json.loads((HERE / "results" / f"{COMMITTED}.json").read_text())
    timing_path = HERE / "results" / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else None
    if not check:
        plot_results(result, HERE / "figures" / "accuracy.png", timing)
    return render_readme({"video": lambda: markdown(result, COMMITTED, timing)}, check=check)


def _config(args: argparse.Namespace):
    from examples.video.train import SCALES

    if args.full and args.tiny:
        raise SystemExit("--full and --tiny are exclusive")
    scale = "full" if args.full else "tiny" if args.tiny else "cpu"
    config = dataclasses.replace(SCALES[scale])
    if args.seeds:
        config.seeds = tuple(args.seeds)
    if args.steps:
        config.steps = args.steps
    if args.models:
        config.models = tuple(args.models)
    return scale, config


def timing(args: argparse.Namespace, argv: list[str]) -> int:
    """Interleaved step times (:mod:`examples.video.timing`) -> ``<out>/results/timing.json``."""
    from examples.image.common import md_table, write_json
    from examples.video.timing import measure

    scale, config = _config(args)
    command = "python -m examples.video " + " ".join(shlex.quote(a) for a in argv)
    result = measure(config, args.rounds, command, args.threads, args.device)
    name = "timing" if scale == "cpu" else f"timing-{scale}"
    write_json(result, args.out / "results" / f"{name}.json")
    print(md_table(["model", "median ms per step, per seed"],
                   [[r["model"], ", ".join(f"{v:.0f}" for v in r["seeds"])]
                    for r in result["rows"]]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.command == "render":
        stale = render(args.check)
        print(("stale" if args.check else "rendered") if stale else "up to date")
        return 1 if (args.check and stale) else 0
    if args.command == "timing":
        return timing(args, argv)
    from tqdm.auto import tqdm

    from examples.image.common import commit_info, md_table, write_json
    from examples.video.report import build_results, plot_clips, plot_results, table
    from examples.video.runner import load, run_one

    scale, config = _config(args)
    name = COMMITTED if scale == "cpu" else f"{COMMITTED}-{scale}"
    if args.data:
        name = f"{COMMITTED}-{args.data.resolve().name}" + ("" if scale == "cpu" else f"-{scale}")
        data_name = f"frames in {args.data.resolve().name}"
    else:
        data_name = "procedural motion clips"
    command = "python -m examples.video " + " ".join(shlex.quote(a) for a in argv)
    print(f"tmcore video example: {scale} scale, {len(config.models)} models x "
          f"{len(config.seeds)} seeds, {config.steps} steps, device {args.device}")
    start = time.perf_counter()
    provenance = commit_info()
    data_spec = (str(args.data), args.limit) if args.data else None
    jobs = [(kind, seed, config, data_spec, args.device, args.threads,
             not args.no_progress and args.jobs == 1)
            for seed in config.seeds for kind in config.models]
    records = []
    outer = tqdm(total=len(jobs), desc="runs", disable=args.no_progress, dynamic_ncols=True)
    if args.jobs > 1:  # worker processes: the same accuracies; step times share the CPU
        pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
        done = pool.map(run_one, *zip(*jobs, strict=True))
    else:
        pool, done = None, (run_one(*job) for job in jobs)
    for record in done:
        records.append(record)
        outer.update()
        outer.write(f"{record['model']:>10} seed {record['seed']}: top-1 "
                    f"{100 * record['top1']:.1f}  top-5 {100 * record['top5']:.1f}  "
                    f"({record['step_ms']:.0f} ms/step)")
    outer.close()
    if pool is not None:
        pool.shutdown()
    _, (test_x, test_y), classes = load(dataclasses.replace(config, train_count=10,
                                                            test_count=config.test_count),
                                        data_spec, config.seeds[0])
    result = build_results(records, config.as_dict(), command, data_name, classes,
                           args.threads, args.device, time.perf_counter() - start, provenance)
    write_json(result, args.out / "results" / f"{name}.json")
    suffix = "" if name == COMMITTED else f"-{name}"
    plot_results(result, args.out / "figures" / f"accuracy{suffix}.png")
    plot_clips(test_x, test_y, classes, args.out / "figures" / f"clips{suffix}.png")
    header, rows = table(result)
    print(md_table(header, rows))
    print(f"done in {result['seconds']:.0f}s: {args.out / 'results' / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
