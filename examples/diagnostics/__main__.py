"""``python -m examples.diagnostics <task> [--full] [--seeds ...] [--out DIR]``.

Tasks: ``binding``, ``noharm``, ``mapping``, ``occlusion``, ``ablations``,
``all`` (the five in turn) and ``demo`` (binding + noharm at CPU scale, the
``make demo`` target). Results go to ``DIR/<task>/results.json`` with PNG plots
beside it; a table per task is printed at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from examples.diagnostics.memory import adapter_name, set_implementation
from examples.diagnostics.report import print_table
from examples.diagnostics.runner import EXPERIMENTS, make_experiment, run_experiment

DEMO = ("binding", "noharm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.diagnostics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=[*EXPERIMENTS, "all", "demo"])
    p.add_argument("--full", action="store_true", help="paper-scale sizes (meant for a GPU)")
    p.add_argument("--tiny", action="store_true", help="a few steps on tiny inputs (smoke test)")
    p.add_argument("--seeds", type=int, nargs="+", help="override the task's seeds")
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--out", type=Path, default=Path("diagnostics_out"), help="output folder")
    p.add_argument("--framework", choices=["torch", "jax"], default="torch",
                   help="jax: train the Tensor Memory model with tmcore.adapters.jax "
                        "(binding and ablation-free tasks only)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 is fastest for these small ops on 2 cores)")
    p.add_argument("--impl", choices=["adapter", "variant"], default="adapter",
                   help="Tensor Memory layer: tmcore.adapters.torch, or the pure-PyTorch "
                        "VariantTensorMemory (same function)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--models", nargs="+", help="only these rows (model labels)")
    p.add_argument("--context", choices=["segment", "full"], default="segment",
                   help="segment (default): attention within segments of --segment tokens, "
                        "memory state carried across segments; full: the whole stream in one "
                        "attention window (memory cannot beat attention there)")
    p.add_argument("--segment", type=int, help="segment length W (default: the task's)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.full and args.tiny:
        raise SystemExit("--full and --tiny are exclusive")
    torch.set_num_threads(args.threads)
    set_implementation(args.impl)
    scale = "full" if args.full else "tiny" if args.tiny else "cpu"
    names = list(EXPERIMENTS) if args.task == "all" else list(DEMO) if args.task == "demo" \
        else [args.task]
    if args.framework == "jax" and names != ["binding"]:
        raise SystemExit("--framework jax is offered for the binding task")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(f"[bold]tmcore diagnostics[/bold]: {', '.join(names)} at {scale} scale, "
                  f"context {args.context}, Tensor Memory from {adapter_name()}, "
                  f"framework {args.framework}, device {device}")
    start = time.perf_counter()
    results = []
    for name in names:
        exp = make_experiment(name, scale, tuple(args.seeds) if args.seeds else None, args.steps,
                              context=args.context, segment=args.segment)
        if args.models:
            exp.entries = [e for e in exp.entries if e.label in args.models]
        results.append(run_experiment(exp, args.out, framework=args.framework,
                                      progress=not args.no_progress, console=console,
                                      device=device))
    if len(results) > 1:
        console.rule("summary")
        for result in results:
            print_table(result, console)
    console.print(f"done in {time.perf_counter() - start:.0f}s; results under {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
