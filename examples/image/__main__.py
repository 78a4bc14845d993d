"""``python -m examples.image [--full | --tiny] [--data PATH] [...]`` and ``... render [--check]``.

Trains Base ViT, Local ViT, Registers ViT and the Spatial ViT with Tensor
Memory (equal depth and width) on masked-patch reconstruction, ``--seeds`` seeds
each, and evaluates PSNR / SSIM on held-out images at every mask ratio.
Writes ``<out>/results/<name>.json`` (name ``masked``, ``masked-full``,
``masked-tiny`` or ``masked-<data folder>``), the metric plot and one picture
per model (masked input / reconstruction / target) under ``<out>/figures/``.
The default ``--out`` is this folder, so the command reproduces the committed files.
``render`` rewrites the experiments guide's image table and the metric plot from the
committed results (``--check``: compare only, exit 1 if stale).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from examples.image.backbone import KINDS
from examples.image.report import build_results, markdown, picture, plot_metrics, table
from examples.image.runner import load, run_one
from examples.image.train import LABELS
from examples.vision_common import Example, Run

#: The help of the options whose meaning is this example's.
HELP = {"data": "an ImageFolder-style directory root/<class>/<image> "
                "(e.g. CUB-200-2011's images/) instead of the bundled photographs",
        "limit": "--data: at most this many images per class",
        "jobs": "worker processes (same numbers as 1; each uses --threads threads)"}


def _plot(result: dict, timing: dict | None, figures: Path) -> None:
    """The committed results' plot."""
    plot_metrics(result, figures / "metrics.png")


def _describe(output: tuple[dict, tuple | None]) -> str:
    record = output[0]
    return (f"{record['model']:>10} seed {record['seed']}: PSNR "
            + " ".join(f"{v:.2f}" for v in record["psnr"].values()) + "  SSIM "
            + " ".join(f"{v:.3f}" for v in record["ssim"].values())
            + f"  ({record['step_ms']:.0f} ms/step)")


def _run(run: Run) -> dict:
    """The ``run`` command: every (model, seed), then results, plots, pictures and table."""
    args, config = run.args, run.config
    data_name = (f"folder {args.data.resolve().name}" if args.data
                 else "scikit-image's bundled photographs (crops)")
    # worker processes, one thread each: the same numbers as one job
    outputs = run.execute(run_one, _describe, lambda seed: (seed == config.seeds[0],))
    records = [record for record, _ in outputs]
    pictures = {record["model"]: shown for record, shown in outputs if shown is not None}
    _, test = load(config, run.data_spec, config.seeds[0])
    result = build_results(records, config.as_dict(), run.command, data_name, args.threads,
                           args.device, time.perf_counter() - run.start, run.provenance)
    run.save(result)
    plot_metrics(result, run.figures / f"metrics{run.suffix}.png")
    for kind, (masks, recons) in pictures.items():
        picture(np.asarray(test[:4]), masks, recons,
                config.patch, f"{LABELS[kind]}: masked input / reconstruction / target",
                run.figures / f"{kind}{run.suffix}.png")
    header, rows = table(result)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    return result


EXAMPLE = Example("examples.image", __doc__, "masked", KINDS, HELP, markdown, _plot, _run)
HERE, COMMITTED, render, main = EXAMPLE.here, EXAMPLE.committed, EXAMPLE.render, EXAMPLE.main

if __name__ == "__main__":
    sys.exit(main())
