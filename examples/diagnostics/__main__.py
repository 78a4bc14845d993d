"""``python -m examples.diagnostics <task> [--protocol paper|streaming] [--full] [...]``.

Tasks: ``binding`` (both protocols), ``noharm``, ``mapping``, ``occlusion``,
``ablations`` (streaming only), ``collapse`` (paper only: many writes x training
budgets); ``sweep`` (the full-size sweep, or ``--estimate`` its cost; see
:mod:`examples.diagnostics.sweep`); ``demo`` (binding under both protocols at CPU
scale, seed 0: the ``make demo`` target); ``render`` (rewrite the README tables
from the committed results files; ``--check`` to compare only).
``--tune`` runs the hyper-parameter search on the held-out tuning split
instead. Results go to ``<out>/<task>-<protocol>.json`` with a PNG plot; the
committed ones are in ``examples/diagnostics/results/``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from examples.diagnostics.memory import adapter_name, set_implementation
from examples.diagnostics.protocols import PROTOCOLS
from examples.diagnostics.report import print_table
from examples.diagnostics.results import RESULTS_DIR
from examples.diagnostics.runner import TASKS, make_experiment, run_experiment, run_tuning

#: ``make demo``: binding under both protocols at CPU scale, seed 0 (the committed results'
#: first seed, so the demo's table can be checked against them).
DEMO = (("binding", "paper"), ("binding", "streaming"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.diagnostics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=[*TASKS, "demo", "render", "sweep"])
    p.add_argument("--protocol", choices=PROTOCOLS, default="streaming",
                   help="paper: the whole stream in one window, the authors' settings; "
                        "streaming: segments with carried state (default)")
    p.add_argument("--full", action="store_true", help="the paper's sizes (meant for a GPU)")
    p.add_argument("--tiny", action="store_true", help="a few steps on tiny inputs (smoke test)")
    p.add_argument("--tune", action="store_true",
                   help="run the hyper-parameter search (same grid size for every row) on "
                        "the held-out tuning split instead of the evaluation runs")
    p.add_argument("--tune-steps", type=int, help="training steps of each tuning point")
    p.add_argument("--hparams", type=Path,
                   help="a tuning results file whose chosen points the rows use (default for "
                        "streaming: the committed <task>-streaming-tuning.json, if any)")
    p.add_argument("--seeds", type=int, nargs="+", help="override the protocol's seeds")
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--out", type=Path, default=Path("diagnostics_out"), help="output folder")
    p.add_argument("--framework", choices=["torch", "jax"], default="torch",
                   help="jax: train the Tensor Memory row with tmcore.adapters.jax (binding)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per job (results are bitwise repeatable for a "
                        "given count; 1 is fastest for these small ops)")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes (same numbers as 1; each pins its own threads)")
    p.add_argument("--impl", choices=["adapter", "variant"], default="adapter",
                   help="Tensor Memory layer: tmcore.adapters.torch, or the pure-PyTorch "
                        "VariantTensorMemory (same function)")
    p.add_argument("--device", default="cpu", help="torch device (the runner trains on cpu)")
    p.add_argument("--models", nargs="+", help="only these rows (model labels)")
    p.add_argument("--segment", type=int, help="streaming: segment length W")
    p.add_argument("--check", action="store_true", help="render: compare only (exit 1 if stale)")
    p.add_argument("--cache", type=Path,
                   help="reuse finished jobs from this folder and add new ones (resumes an "
                        "interrupted run; jobs are deterministic)")
    p.add_argument("--cached-only", action="store_true",
                   help="with --cache: assemble the results from the finished jobs only "
                        "(a row lists the seeds it has); sweep: the finished jobs of the "
                        "cache and of the results files at --out")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--authors-exact", action="store_true",
                   help="paper protocol (binding, mapping, occlusion): the authors' own "
                        "models (their embeddings, positions, blocks, slots, shared and "
                        "threaded Tensor Memory, read-out); results <task>-paper-exact.json")
    p.add_argument("--parts", nargs="+",
                   help="sweep: only these parts (binding, binding-exact, collapse, "
                        "mapping, occlusion)")
    p.add_argument("--noises", type=float, nargs="+",
                   help="sweep: the binding parts' settings with these query noises only "
                        "(e.g. 0)")
    p.add_argument("--settings", nargs="+",
                   help="sweep: only the settings with these column labels (e.g. L=6 or "
                        "T=32), in the parts that have them")
    p.add_argument("--estimate", action="store_true",
                   help="sweep: time a few steps of every row and estimate the CPU hours "
                        "(writes <out>/sweep-estimate.json) instead of running it")
    p.add_argument("--estimate-steps", type=int, default=2,
                   help="sweep --estimate: timed steps per row and length (after 1 warm-up)")
    return p.parse_args(argv)


def _hparams(args: argparse.Namespace, task: str, protocol: str,
             tuning_from: str | None = None) -> tuple[dict, str | None]:
    """The rows' chosen points: ``--hparams``, else (streaming) the committed tuning file of
    this task, else of ``tuning_from`` (map building and occlusion reuse binding's)."""
    path = args.hparams
    if path is None and protocol == "streaming" and not args.tiny:
        for name in dict.fromkeys(n for n in (task, tuning_from) if n):
            default = RESULTS_DIR / f"{name}-streaming-tuning.json"
            if default.exists():
                path = default
                break
    if path is None:
        return {}, None
    chosen = json.loads(Path(path).read_text())["chosen"]
    try:
        shown = str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    return chosen, shown


def _compare_with_committed(result: dict, console: Console) -> None:
    """The demo's seed-0 numbers against seed 0 of the committed results (same config)."""
    path = RESULTS_DIR / f"{result['task']}-{result['protocol']}.json"
    if not path.exists():
        return
    committed = json.loads(path.read_text())

    def config(r: dict) -> dict:  # as JSON (tuples -> lists), the run's seed list aside
        plain = json.loads(json.dumps(r["config"]))
        plain["train"].pop("seeds", None)
        return plain

    if committed["seeds"][:1] != result["seeds"] or config(committed) != config(result):
        console.print(f"[dim]{path.name}: other config or seeds, not compared[/dim]")
        return
    mine = {(r["model"], r["setting"]): r["seeds"][0] for r in result["rows"]}
    theirs = {(r["model"], r["setting"]): r["seeds"][0] for r in committed["rows"]}
    same = all(theirs.get(k) == v for k, v in mine.items())
    env_mine, env_theirs = result["environment"], committed["environment"]
    differs = [f"{k} {env_theirs.get(k, 'not recorded')} there, {env_mine.get(k)} here"
               for k in sorted(set(env_mine) | set(env_theirs))
               if env_mine.get(k) != env_theirs.get(k)]
    console.print(f"seed 0 vs committed {path.name}: "
                  + ("[green]identical[/green]" if same else "[red]different[/red]")
                  + (f" (the recorded environment differs: {'; '.join(differs)}; float32 "
                     "results depend on the CPU's vector unit, thread count and versions)"
                     if differs else ""))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    if args.task == "render":
        from examples.diagnostics.render import render_files

        stale = render_files(check=args.check)
        for path in stale:
            console.print(f"{'stale' if args.check else 'rendered'}: {path}")
        return 1 if (args.check and stale) else 0
    if args.full and args.tiny:
        raise SystemExit("--full and --tiny are exclusive")
    torch.set_num_threads(args.threads)
    set_implementation(args.impl)
    scale = "full" if args.full else "tiny" if args.tiny else "cpu"
    command = "python -m examples.diagnostics " + " ".join(shlex.quote(a) for a in argv)
    if args.task == "sweep":  # always the authors' sizes unless --tiny (smoke tests)
        from examples.diagnostics import sweep

        scale = "tiny" if args.tiny else "full"
        seeds = tuple(args.seeds) if args.seeds else sweep.SEEDS
        parts = tuple(args.parts) if args.parts else None
        if args.estimate:
            sweep.estimate_sweep(args.out, parts=parts, scale=scale, seeds=seeds,
                                 steps=args.estimate_steps, threads=args.threads,
                                 console=console, command=command)
        else:
            sweep.run_sweep(args.out, parts=parts, scale=scale, seeds=seeds,
                            models=tuple(args.models) if args.models else None,
                            noises=tuple(args.noises) if args.noises else None,
                            settings=tuple(args.settings) if args.settings else None,
                            jobs=args.jobs,
                            threads=args.threads, cache=args.cache,
                            cached_only=args.cached_only, progress=not args.no_progress,
                            console=console, command=command)
        return 0
    if args.task == "demo":
        runs = DEMO
        seeds = tuple(args.seeds) if args.seeds else (0,)
    else:
        runs = ((args.task, args.protocol),)
        seeds = tuple(args.seeds) if args.seeds else None
    console.print(f"[bold]tmcore diagnostics[/bold]: {', '.join(f'{t} ({p})' for t, p in runs)} "
                  f"at {scale} scale, Tensor Memory from {adapter_name()}, "
                  f"{args.jobs} job(s) x {args.threads} thread(s)")
    start = time.perf_counter()
    results = []
    for task, protocol in runs:
        exp = make_experiment(task, scale, seeds, args.steps, protocol, args.segment,
                              authors_exact=args.authors_exact and args.task != "demo")
        if args.models:
            exp.entries = [e for e in exp.entries if e.label in args.models]
        if args.tune:
            run_tuning(exp, args.out, console=console, jobs=args.jobs, threads=args.threads,
                       command=command, steps=args.tune_steps, cache=args.cache)
            continue
        hparams, source = _hparams(args, task, protocol, exp.tuning_from)
        result = run_experiment(exp, args.out, framework=args.framework,
                                progress=not args.no_progress, console=console,
                                device=args.device, jobs=args.jobs, threads=args.threads,
                                command=command, hparams=hparams, hparams_from=source,
                                cache=args.cache, cached_only=args.cached_only)
        results.append(result)
        if args.task == "demo":
            _compare_with_committed(result, console)
    if len(results) > 1:
        console.rule("summary")
        for result in results:
            print_table(result, console)
    console.print(f"done in {time.perf_counter() - start:.0f}s; results under {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
