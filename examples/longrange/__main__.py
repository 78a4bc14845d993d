"""``python -m examples.longrange run | cost | render`` (see the README).

- ``run``: the search and 3 seeds of every row on both recall tasks; writes
  ``results/recall.json``.
- ``cost``: streams 16k tokens through full attention, the window and window + Tensor Memory
  (a fresh process per row); writes ``results/cost.json``.
- ``search``: what makes Tensor Memory address (:mod:`examples.longrange.search`): the
  variants, each with the same search budget; writes ``results/search.json`` as it goes.
- ``render``: the README's tables and the plots (``results/*.png``) from the results files;
  ``--check`` only compares the README and exits 1 when it is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "recall.json"
COST = HERE / "results" / "cost.json"
SEARCH = HERE / "results" / "search.json"


def _config(args: argparse.Namespace):  # -> Config
    from examples.longrange.models import ROWS
    from examples.longrange.train import Config

    config = Config.tiny() if args.tiny else Config()
    model, task, train = config.model, config.task, config.train
    if args.window is not None:
        model = dataclasses.replace(model, window=args.window)
    if args.memory_channels is not None:
        model = dataclasses.replace(model, memory_channels=args.memory_channels)
    if args.distances is not None:
        task = dataclasses.replace(task, distances=tuple(args.distances))
    if args.keys is not None:
        task = dataclasses.replace(task, keys=tuple(args.keys))
    if args.examples is not None:
        task = dataclasses.replace(task, eval_examples=args.examples)
    if args.steps is not None:
        train = dataclasses.replace(train, steps=args.steps, tune_steps=args.steps)
    if args.batch is not None:
        train = dataclasses.replace(train, batch=args.batch)
    if args.lrs is not None:
        train = dataclasses.replace(train, lrs=tuple(args.lrs))
    rows = tuple(args.rows) if args.rows else config.rows
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; expected some of {ROWS}")
    seeds = tuple(args.seeds) if args.seeds is not None else config.seeds
    return dataclasses.replace(config, model=model, task=task, train=train, rows=rows,
                               seeds=seeds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.longrange")
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="the search and every row x seed on both tasks")
    run_p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    run_p.add_argument("--seeds", type=int, nargs="+", default=None)
    run_p.add_argument("--rows", nargs="+", default=None, help="a subset of the rows")
    run_p.add_argument("--window", type=int, default=None, help="the attention window W")
    run_p.add_argument("--distances", type=int, nargs="+", default=None)
    run_p.add_argument("--keys", type=int, nargs="+", default=None, help="key counts")
    run_p.add_argument("--steps", type=int, default=None, help="training steps (the search too)")
    run_p.add_argument("--batch", type=int, default=None)
    run_p.add_argument("--lrs", type=float, nargs="+", default=None, help="the search's grid")
    run_p.add_argument("--memory-channels", type=int, default=None,
                       help="Tensor Memory's C (the baselines' sizes follow)")
    run_p.add_argument("--examples", type=int, default=None, help="evaluation examples / setting")
    run_p.add_argument("--out", type=Path, default=None,
                       help="results file (default results/recall.json; --tiny writes none "
                            "unless given)")
    run_p.add_argument("--no-progress", action="store_true")
    cost_p = sub.add_parser("cost", help="peak memory and tokens/s streaming a long document")
    cost_p.add_argument("--tokens", type=int, default=None, help="tokens streamed (16384)")
    cost_p.add_argument("--piece", type=int, default=None, help="tokens per call (1)")
    cost_p.add_argument("--rows", nargs="+", default=None)
    cost_p.add_argument("--chunk", type=int, default=None,
                        help="the memory's chunk size (default: the model config's, 1)")
    cost_p.add_argument("--tiny", action="store_true")
    cost_p.add_argument("--out", type=Path, default=None)
    cost_p.add_argument("--row-worker", default=None, help=argparse.SUPPRESS)
    cost_p.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    search_p = sub.add_parser("search", help="Tensor Memory variants at equal state")
    search_p.add_argument("--variants", nargs="+", default=None,
                          help="names of examples.longrange.search.VARIANTS (default: all)")
    search_p.add_argument("--plot", nargs="*", default=(),
                          help="variants whose first seed's probe traces are drawn")
    search_p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    search_p.add_argument("--out", type=Path, default=None,
                          help="results file (default results/search.json; --tiny writes "
                               "none unless given)")
    render_p = sub.add_parser("render", help="README tables and plots from the results files")
    render_p.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = parser.parse_args(argv)

    if args.command == "render":
        from examples.longrange.render import render_all

        stale = render_all(check=args.check)
        if args.check and stale:
            print("stale: " + ", ".join(stale) + " (run python -m examples.longrange render)")
            sys.exit(1)
        return
    if args.command == "cost":
        from examples.longrange import cost

        if args.row_worker is not None:
            cost.worker(args.row_worker, json.loads(args.config_json))
            return
        results = cost.run(cost.CostConfig.make(args.tiny, args.tokens, args.piece, args.rows,
                                                args.chunk))
        out = args.out if args.out is not None else (None if args.tiny else COST)
        _write(results, out)
        print(cost.table(results))
        return
    if args.command == "search":
        from examples.longrange.search import VARIANTS, search
        from examples.longrange.train import Config

        out = args.out if args.out is not None else (None if args.tiny else SEARCH)
        search(list(args.variants or VARIANTS), Config.tiny() if args.tiny else Config(), out,
               plots=out.parent if args.plot and out is not None else None,
               plot_names=tuple(args.plot))
        return
    from examples.longrange.render import tables
    from examples.longrange.train import run

    config = _config(args)
    results = run(config, progress=not args.no_progress)
    out = args.out if args.out is not None else (None if args.tiny else RESULTS)
    _write(results, out)
    print(tables(results))


def _write(results: dict, out: Path | None) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
