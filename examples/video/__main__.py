"""``python -m examples.video [--full | --tiny] [--data PATH] [...]`` and ``... render [--check]``.

Trains a joint space-time transformer, the same with register tokens and the
same with Tensor Memory (equal depth and width) to recognise actions in
procedurally generated clips (``--data``: extracted frames in the UCF-101
layout), ``--seeds`` seeds each; reports top-1 / top-5 on held-out clips and the
wall-clock of a training step (``--models ... memory_warp memory_warp_local``: Tensor
Memory with the layer options beyond the paper too, see ``train.OPTION_MODELS``).
Writes ``<out>/results/<name>.json`` (name
``actions``, ``actions-full``, ``actions-tiny`` or ``actions-<data folder>``), a
plot and, for the procedural clips, one example clip per class under
``<out>/figures/``. The default ``--out`` is this folder, so the command
reproduces the committed files. ``render`` rewrites the experiments guide's video table
and plot from the committed results (``--check``: compare only, exit 1 if stale).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from examples.video.report import build_results, markdown, plot_clips, plot_results, table
from examples.video.runner import load, run_one
from examples.video.train import CHOICES
from examples.vision_common import Example, Run, md_table

#: The help of the options whose meaning is this example's.
HELP = {"data": "extracted frames root/<class>/<clip>/<frame> "
                "(UCF-101 layout) instead of the procedural clips",
        "limit": "--data: at most this many clips per class",
        "jobs": "worker processes (same accuracies as 1; step times then share the CPU)"}


def _plot(result: dict, timing: dict | None, figures: Path) -> None:
    """The committed results' plot."""
    plot_results(result, figures / "accuracy.png", timing)


def _describe(record: dict) -> str:
    return (f"{record['model']:>10} seed {record['seed']}: top-1 "
            f"{100 * record['top1']:.1f}  top-5 {100 * record['top5']:.1f}  "
            f"({record['step_ms']:.0f} ms/step)")


def _run(run: Run) -> dict:
    """The ``run`` command: every (model, seed), then results, plots and table."""
    args, config = run.args, run.config
    data_name = (f"frames in {args.data.resolve().name}" if args.data
                 else "procedural motion clips")
    # worker processes: the same accuracies; step times share the CPU
    records = run.execute(run_one, _describe)
    _, (test_x, test_y), classes = load(dataclasses.replace(config, train_count=10,
                                                            test_count=config.test_count),
                                        run.data_spec, config.seeds[0])
    result = build_results(records, config.as_dict(), run.command, data_name, classes,
                           args.threads, args.device, time.perf_counter() - run.start,
                           run.provenance)
    run.save(result)
    plot_results(result, run.figures / f"accuracy{run.suffix}.png")
    plot_clips(test_x, test_y, classes, run.figures / f"clips{run.suffix}.png")
    header, rows = table(result)
    print(md_table(header, rows))
    return result


EXAMPLE = Example("examples.video", __doc__, "actions", CHOICES, HELP, markdown, _plot, _run)
HERE, COMMITTED, render, main = EXAMPLE.here, EXAMPLE.committed, EXAMPLE.render, EXAMPLE.main

if __name__ == "__main__":
    sys.exit(main())
