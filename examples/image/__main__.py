"""``python -m examples.image [--full | --tiny] [--data PATH] [...]`` and ``... render [--check]``.

Trains Base ViT, Local ViT, Registers ViT and the Spatial ViT with Tensor
Memory (equal depth and width) on masked-patch reconstruction, ``--seeds`` seeds
each, and evaluates PSNR / SSIM on held-out images at every mask ratio.
Writes ``<out>/results/<name>.json`` (name ``masked``, ``masked-full``,
``masked-tiny`` or ``masked-<data folder>``), the metric plot and one picture
per model (masked input / reconstruction / target) under ``<out>/figures/``.
The default ``--out`` is this folder, so the command reproduces the committed files.
``render`` rewrites the README's image table and the metric plot from the
committed results (``--check``: compare only, exit 1 if stale).
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

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
COMMITTED = "masked"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from examples.image.backbone import KINDS

    p = argparse.ArgumentParser(prog="python -m examples.image", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="run", choices=["run", "render", "timing"])
    p.add_argument("--rounds", type=int, default=20, help="timing: timed steps per model")
    p.add_argument("--full", action="store_true", help="larger sizes, meant for a GPU")
    p.add_argument("--tiny", action="store_true", help="a few steps on tiny inputs (smoke)")
    p.add_argument("--data", type=Path, help="an ImageFolder-style directory root/<class>/<image> "
                   "(e.g. CUB-200-2011's images/) instead of the bundled photographs")
    p.add_argument("--limit", type=int, help="--data: at most this many images per class")
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--steps", type=int)
    p.add_argument("--models", nargs="+", choices=KINDS)
    p.add_argument("--out", type=Path, default=HERE, help="results/ and figures/ go here")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes (same numbers as 1; each uses --threads threads)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check", action="store_true", help="render: compare only")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def render(check: bool = False) -> bool:
    """The README block and the metric plot from the committed results; returns whether
    the README was stale."""
    from examples.image.common import render_readme
    from examples.image.report import markdown, plot_metrics

    path = HERE / "results" / f"{COMMITTED}.json"
    result = json.loads(path.read_text())
    if not check:
        plot_metrics(result, HERE / "figures" / "metrics.png")
    timing_path = HERE / "results" / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else None
    return render_readme({"image": lambda: markdown(result, COMMITTED, timing)}, check=check)


def _config(args: argparse.Namespace):
    from examples.image.train import SCALES

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
    """Interleaved step times (:mod:`examples.image.timing`) -> ``<out>/results/timing.json``."""
    from examples.image.common import md_table, write_json
    from examples.image.timing import measure

    scale, config = _config(args)
    command = "python -m examples.image " + " ".join(shlex.quote(a) for a in argv)
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

    from examples.image.common import commit_info, write_json
    from examples.image.report import build_results, picture, plot_metrics
    from examples.image.runner import load, run_one
    from examples.image.train import LABELS

    scale, config = _config(args)
    name = COMMITTED if scale == "cpu" else f"{COMMITTED}-{scale}"
    if args.data:
        name = f"{COMMITTED}-{args.data.resolve().name}" + ("" if scale == "cpu" else f"-{scale}")
        data_name = f"folder {args.data.resolve().name}"
    else:
        data_name = "scikit-image's bundled photographs (crops)"
    command = "python -m examples.image " + " ".join(shlex.quote(a) for a in argv)
    print(f"tmcore image example: {scale} scale, {len(config.models)} models x "
          f"{len(config.seeds)} seeds, {config.steps} steps, device {args.device}")
    start = time.perf_counter()
    provenance = commit_info()
    data_spec = (str(args.data), args.limit) if args.data else None
    runs = [(s, m) for s in config.seeds for m in config.models]
    jobs = [(kind, seed, config, data_spec, args.device, args.threads,
             not args.no_progress and args.jobs == 1, seed == config.seeds[0])
            for seed, kind in runs]
    records, pictures = [], {}
    outer = tqdm(total=len(jobs), desc="runs", disable=args.no_progress, dynamic_ncols=True)
    if args.jobs > 1:  # worker processes, one thread each: the same numbers as one job
        pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
        done = pool.map(run_one, *zip(*jobs, strict=True))
    else:
        pool, done = None, (run_one(*job) for job in jobs)
    for record, shown in done:
        records.append(record)
        if shown is not None:
            pictures[record["model"]] = shown
        outer.update()
        outer.write(f"{record['model']:>10} seed {record['seed']}: PSNR "
                    + " ".join(f"{v:.2f}" for v in record["psnr"].values()) + "  SSIM "
                    + " ".join(f"{v:.3f}" for v in record["ssim"].values())
                    + f"  ({record['step_ms']:.0f} ms/step)")
    outer.close()
    if pool is not None:
        pool.shutdown()
    _, test = load(config, data_spec, config.seeds[0])
    result = build_results(records, config.as_dict(), command, data_name, args.threads,
                           args.device, time.perf_counter() - start, provenance)
    write_json(result, args.out / "results" / f"{name}.json")
    figures = args.out / "figures"
    suffix = "" if name == COMMITTED else f"-{name}"
    plot_metrics(result, figures / f"metrics{suffix}.png")
    for kind, (masks, recons) in pictures.items():
        picture(np.asarray(test[:4]), masks, recons,
                config.patch, f"{LABELS[kind]}: masked input / reconstruction / target",
                figures / f"{kind}{suffix}.png")
    from examples.image.report import table

    header, rows = table(result)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    print(f"done in {result['seconds']:.0f}s: {args.out / 'results' / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
