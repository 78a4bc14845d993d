"""What the image and video examples share: the command line, determinism, provenance,
the training loop, step timing, results files, tables and README blocks.

Results files (``examples/<task>/results/<name>.json``)::

    task, command, commit, dirty, config, environment, seeds [the seeds],
    rows [{model, setting, metric, seeds: [one value per seed]}], params {model: n},
    seconds

Every number of the "Images and video" section of the experiments guide
(docs/guides/experiments.md) is rendered from one of
these by :func:`render_readme` (blocks ``<!-- vision-results: NAME -->`` ...
``<!-- /vision-results -->``), so the committed text always equals the
committed results (``tests/examples/test_examples_vision.py`` checks it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from examples.image.backbone import BackboneConfig
from examples.reporting import cpu_model, git, md_table, mean_std

__all__ = ["make_deterministic", "commit_info", "environment", "mean_std", "md_table",
           "write_json", "render_readme", "README", "ROOT", "interleaved_ms", "parser",
           "scale_config", "command_line", "load_committed", "timing_command", "result_name",
           "run_jobs", "lr_at", "make_optimizer", "fit", "training_summary", "measure_steps",
           "results_dict", "row_values", "source_line", "center_crop", "Run", "Example",
           "ExperimentConfig", "readme_block", "step_times", "model_rows",
           "pyplot", "save_figure", "scales", "TINY", "FULL"]

ROOT = Path(__file__).resolve().parents[1]
#: The page whose ``vision-results`` blocks :func:`render_readme` renders (the experiments guide).
README = ROOT / "docs" / "guides" / "experiments.md"
#: Paths whose uncommitted changes can change a run's numbers.
TRACKED = ("examples/image", "examples/video", "examples/vision_common.py", "tmcore", "backends",
           "adapters")
_BLOCK = re.compile(r"(<!-- vision-results: (?P<name>[\w./-]+) -->\n)(?P<body>.*?)"
                    r"(<!-- /vision-results -->)", re.DOTALL)


def make_deterministic(seed: int, threads: int = 1) -> torch.Generator:
    """Pin the thread count (float32 sums depend on it), deterministic algorithms and
    tmcore's deterministic option; seed torch. Returns a CPU generator seeded with ``seed``."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        import tmcore

        tmcore.options(deterministic=True)
    except (ImportError, AttributeError, TypeError):  # an older tmcore: nothing to pin
        pass
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def commit_info() -> dict:
    """``{"commit": HEAD, "dirty": bool}``; dirty counts code paths only (not results)."""
    status = git("status", "--porcelain", "--", *TRACKED) or ""
    paths = [line[3:] for line in status.splitlines()
             if "/results/" not in line and "/figures/" not in line]
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(paths)}


def environment(threads: int, device: str) -> dict:
    """Versions, CPU, threads and device: what a bitwise rerun must match."""
    import numpy

    return {"python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "cpu": cpu_model(), "threads": threads, "device": device}


def write_json(obj: dict, path: Path) -> None:
    """Indented JSON (the folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def render_readme(renderers: dict[str, Callable[[], str]], check: bool = False,
                  path: Path = README) -> bool:
    """Replace each ``<!-- vision-results: NAME -->`` block whose NAME is in ``renderers``
    with ``renderers[NAME]()``. Returns whether the file differed (rewritten unless
    ``check``). Blocks of other names are left as they are."""
    old = path.read_text()

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in renderers:
            return match.group(0)
        return match.group(1) + renderers[name]().rstrip("\n") + "\n" + match.group(4)

    new = _BLOCK.sub(replace, old)
    if new != old and not check:
        path.write_text(new)
    return new != old


def interleaved_ms(steps: dict[str, Callable[[], None]], count: int, warmup: int = 3
                   ) -> dict[str, list[float]]:
    """Wall-clock (ms) of ``count`` calls of each training-step closure, taken in turn
    (the order rotates every round) so that a machine whose load changes slows every
    model alike; ``warmup`` rounds first are not timed."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + count):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps[name]()
            if round_ >= warmup:
                times[name].append(1000 * (time.perf_counter() - start))
    return times


# --------------------------------------------------------------------------- configs


@dataclasses.dataclass
class ExperimentConfig:
    """What every example's config has: the sizes of its backbone and its training schedule
    (an example adds its input sizes, ``grid`` and ``models``, and may change defaults)."""

    size: int = 32
    patch: int = 4
    width: int = 64
    depth: int = 4
    heads: int = 4
    registers: int = 4
    memory_channels: int = 16
    forget_bias: float = 3.0
    steps: int = 300
    batch: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup: int = 20
    train_count: int = 8192
    test_count: int = 256
    seeds: tuple[int, ...] = (0, 1, 2)

    @property
    def grid(self) -> tuple[int, ...]:
        raise NotImplementedError

    def backbone(self) -> BackboneConfig:
        """The backbone's sizes: ``grid`` and the fields this config shares with
        :class:`BackboneConfig` (the others keep their defaults)."""
        own = {f.name for f in dataclasses.fields(self)}
        return BackboneConfig(grid=self.grid, **{f.name: getattr(self, f.name)
                                                 for f in dataclasses.fields(BackboneConfig)
                                                 if f.name != "grid" and f.name in own})

    def as_dict(self) -> dict:
        """The fields, and ``grid`` as a list (what results files record)."""
        out = dataclasses.asdict(self)
        out["grid"] = list(self.grid)
        return out


#: What the ``tiny`` (smoke test) and ``full`` (meant for a GPU) scales set in every example.
TINY = {"width": 32, "heads": 2, "memory_channels": 4, "steps": 3, "batch": 4, "warmup": 1,
        "seeds": (0,)}
FULL = {"width": 256, "depth": 8, "heads": 8, "memory_channels": 32, "steps": 20_000,
        "lr": 5e-4, "warmup": 1000}


def scales(config: type[ExperimentConfig], tiny: dict, full: dict
           ) -> dict[str, ExperimentConfig]:
    """An example's ``SCALES``: ``tiny`` (:data:`TINY` and ``tiny``), ``cpu`` (the config's
    defaults) and ``full`` (:data:`FULL` and ``full``)."""
    return {"tiny": config(**{**TINY, **tiny}), "cpu": config(),
            "full": config(**{**FULL, **full})}


# --------------------------------------------------------------------------- command line


def parser(package: str, doc: str, models: Sequence[str], helps: dict[str, str],
           out: Path) -> argparse.ArgumentParser:
    """The command line of ``python -m <package>`` (``run``, ``render``, ``timing``);
    ``helps``: the help of ``--data``, ``--limit`` and ``--jobs`` (keys ``data``, ``limit``,
    ``jobs``), whose meaning is the example's."""
    p = argparse.ArgumentParser(prog=f"python -m {package}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="run", choices=["run", "render", "timing"])
    p.add_argument("--rounds", type=int, default=20, help="timing: timed steps per model")
    p.add_argument("--full", action="store_true", help="larger sizes, meant for a GPU")
    p.add_argument("--tiny", action="store_true", help="a few steps on tiny inputs (smoke)")
    p.add_argument("--data", type=Path, help=helps["data"])
    p.add_argument("--limit", type=int, help=helps["limit"])
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--steps", type=int)
    p.add_argument("--models", nargs="+", choices=models)
    p.add_argument("--out", type=Path, default=out, help="results/ and figures/ go here")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--jobs", type=int, default=1, help=helps["jobs"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check", action="store_true", help="render: compare only")
    p.add_argument("--no-progress", action="store_true")
    return p


def scale_config(args: argparse.Namespace, scales: dict[str, ExperimentConfig]
                 ) -> tuple[str, ExperimentConfig]:
    """``(scale, config)``: ``--full`` / ``--tiny`` / the CPU default, a copy of its config
    with ``--seeds``, ``--steps`` and ``--models`` applied."""
    if args.full and args.tiny:
        raise SystemExit("--full and --tiny are exclusive")
    scale = "full" if args.full else "tiny" if args.tiny else "cpu"
    config = dataclasses.replace(scales[scale])
    if args.seeds:
        config.seeds = tuple(args.seeds)
    if args.steps:
        config.steps = args.steps
    if args.models:
        config.models = tuple(args.models)
    return scale, config


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The command as a shell would take it (recorded in the results)."""
    return prog + " " + " ".join(shlex.quote(a) for a in argv)


def result_name(committed: str, scale: str, data: Path | None) -> tuple[str, str]:
    """``(results name, figure suffix)``: ``committed`` for the CPU scale on the default data,
    else ``committed-<scale>`` or ``committed-<data folder>[-<scale>]``; the suffix is empty
    for the committed name."""
    name = committed if scale == "cpu" else f"{committed}-{scale}"
    if data:
        name = f"{committed}-{data.resolve().name}" + ("" if scale == "cpu" else f"-{scale}")
    return name, ("" if name == committed else f"-{name}")


def load_committed(here: Path, committed: str) -> tuple[dict, dict | None]:
    """The committed results and, if there is one, the committed timing file."""
    result = json.loads((here / "results" / f"{committed}.json").read_text())
    timing_path = here / "results" / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else None
    return result, timing


def timing_command(args: argparse.Namespace, argv: Sequence[str], prog: str,
                   scales: dict[str, ExperimentConfig], measure: Callable[..., dict]) -> int:
    """``timing``: ``measure(config, rounds, command, threads, device)`` ->
    ``<out>/results/timing[-<scale>].json``, and its table printed."""
    scale, config = scale_config(args, scales)
    result = measure(config, args.rounds, command_line(prog, argv), args.threads, args.device)
    name = "timing" if scale == "cpu" else f"timing-{scale}"
    write_json(result, args.out / "results" / f"{name}.json")
    print(md_table(["model", "median ms per step, per seed"],
                   [[r["model"], ", ".join(f"{v:.0f}" for v in r["seeds"])]
                    for r in result["rows"]]))
    return 0


@dataclasses.dataclass
class Run:
    """A ``run`` command once its arguments are read: the scale and config, the results
    name and figure suffix (:func:`result_name`), the recorded command, the start time and
    provenance, and ``data_spec`` = ``(--data, --limit)`` or None."""

    args: argparse.Namespace
    scale: str
    config: ExperimentConfig
    name: str
    suffix: str
    command: str
    start: float
    provenance: dict
    data_spec: tuple[str, int | None] | None

    def execute(self, run_one: Callable[..., Any], describe: Callable[[Any], str],
                extra: Callable[[int], tuple] = lambda seed: ()) -> list[Any]:
        """``run_one(kind, seed, config, data_spec, device, threads, inner progress,
        *extra(seed))`` for every seed and model (:func:`run_jobs`, ``--jobs`` workers)."""
        a = self.args
        jobs = [(kind, seed, self.config, self.data_spec, a.device, a.threads,
                 not a.no_progress and a.jobs == 1, *extra(seed))
                for seed in self.config.seeds for kind in self.config.models]
        return run_jobs(run_one, jobs, a.jobs, not a.no_progress, describe)

    @property
    def figures(self) -> Path:
        return self.args.out / "figures"

    def save(self, result: dict) -> None:
        """``<out>/results/<name>.json``."""
        write_json(result, self.args.out / "results" / f"{self.name}.json")


@dataclasses.dataclass(frozen=True)
class Example:
    """One example's command line, ``python -m <package>``: ``run`` (the default),
    ``render [--check]`` and ``timing``.

    ``package`` (e.g. ``examples.image``) holds ``train.SCALES``, ``timing.measure`` and
    the ``results/`` and ``figures/`` folders; ``doc``: the ``--help`` text; ``committed``:
    the committed results name; ``models``: the ``--models`` choices; ``helps``: see
    :func:`parser`; ``markdown(result, name, timing)``: the README block (named after the
    package's last part); ``plot(result, timing, figures folder)``: the committed plot;
    ``run(Run) -> results``: the experiment."""

    package: str
    doc: str
    committed: str
    models: Sequence[str]
    helps: dict[str, str]
    markdown: Callable[[dict, str, dict | None], str]
    plot: Callable[[dict, dict | None, Path], None]
    run: Callable[[Run], dict]

    @property
    def here(self) -> Path:
        import importlib

        return Path(importlib.import_module(self.package).__file__).resolve().parent

    def render(self, check: bool = False) -> bool:
        """The README block and the plot from the committed results (``check``: compare
        only, write nothing); returns whether the README was stale."""
        result, timing = load_committed(self.here, self.committed)
        if not check:
            self.plot(result, timing, self.here / "figures")
        block = self.package.rsplit(".", 1)[-1]
        return render_readme({block: lambda: self.markdown(result, self.committed, timing)},
                             check=check)

    def main(self, argv: Sequence[str] | None = None) -> int:
        """The command line (``argv``: default ``sys.argv[1:]``); the exit status."""
        import importlib

        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser(self.package, self.doc, self.models, self.helps,
                      self.here).parse_args(argv)
        if args.command == "render":
            stale = self.render(args.check)
            print(("stale" if args.check else "rendered") if stale else "up to date")
            return 1 if (args.check and stale) else 0
        prog = f"python -m {self.package}"
        scales = importlib.import_module(f"{self.package}.train").SCALES
        if args.command == "timing":  # interleaved step times -> <out>/results/timing.json
            measure = importlib.import_module(f"{self.package}.timing").measure
            return timing_command(args, argv, prog, scales, measure)
        scale, config = scale_config(args, scales)
        name, suffix = result_name(self.committed, scale, args.data)
        command = command_line(prog, argv)
        print(f"tmcore {self.package.rsplit('.', 1)[-1]} example: {scale} scale, "
              f"{len(config.models)} models x {len(config.seeds)} seeds, {config.steps} "
              f"steps, device {args.device}")
        start = time.perf_counter()
        result = self.run(Run(args, scale, config, name, suffix, command, start,
                              commit_info(), (str(args.data), args.limit) if args.data else None))
        print(f"done in {result['seconds']:.0f}s: {args.out / 'results' / (name + '.json')}")
        return 0


def run_jobs(run_one: Callable[..., Any], jobs: list[tuple], workers: int, progress: bool,
             describe: Callable[[Any], str]) -> list[Any]:
    """``run_one(*job)`` for every job, in order, in ``workers`` spawned processes when more
    than one (each run seeds itself, so the numbers are those of one process); a progress bar
    over the runs and one line ``describe(output)`` per finished run."""
    from tqdm.auto import tqdm

    outputs = []
    outer = tqdm(total=len(jobs), desc="runs", disable=not progress, dynamic_ncols=True)
    if workers > 1:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        done: Iterable[Any] = pool.map(run_one, *zip(*jobs, strict=True))
    else:
        pool, done = None, (run_one(*job) for job in jobs)
    for output in done:
        outputs.append(output)
        outer.update()
        outer.write(describe(output))
    outer.close()
    if pool is not None:
        pool.shutdown()
    return outputs


# --------------------------------------------------------------------------- training


def lr_at(step: int, config: ExperimentConfig) -> float:
    """Linear warmup over ``config.warmup`` steps, then cosine to 10 % of ``config.lr``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    t = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: nn.Module, config: ExperimentConfig) -> torch.optim.Optimizer:
    """AdamW, weight decay on the matrices other than position embeddings only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "pos" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=config.lr)


def fit(model: nn.Module, config: ExperimentConfig, seed: int,
        draw: Callable[[np.random.Generator], Callable[[], Tensor]], *, device: str,
        progress: bool, desc: str, loss_digits: int) -> tuple[list[float], list[float]]:
    """``config.steps`` training steps of ``model``; returns ``(losses, seconds per step)``.

    ``draw(batch_rng)`` picks a batch (untimed; ``batch_rng`` is seeded with ``seed +
    1000``) and returns the closure that computes its loss; the timed step is that
    closure, the backward pass, gradient clipping at norm 1 and the optimizer step."""
    from tqdm.auto import tqdm

    opt = make_optimizer(model, config)
    batch_rng = np.random.default_rng(seed + 1_000)
    losses, times = [], []
    bar = tqdm(range(config.steps), desc=desc, disable=not progress, leave=False,
               dynamic_ncols=True)
    model.train()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, config)
        batch_loss = draw(batch_rng)
        start = time.perf_counter()
        loss = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.{loss_digits}f}")
    model.eval()
    return losses, times


def training_summary(losses: list[float], times: list[float], steps: int,
                     digits: int) -> dict:
    """The record's ``loss_curve`` (means over about 50 windows), ``step_ms`` (median, the
    first fifth of the steps left out as warmup) and ``train_seconds``."""
    every = max(1, steps // 50)
    return {
        "loss_curve": [[i, round(sum(losses[i:i + every]) / len(losses[i:i + every]), digits)]
                       for i in range(0, len(losses), every)],
        "step_ms": round(1000 * statistics.median(times[len(times) // 5:] or times), 2),
        "train_seconds": round(sum(times), 2),
    }


def measure_steps(config: ExperimentConfig, rounds: int, command: str, threads: int, device: str,
                  prepare: Callable[[int], tuple[Callable[[str], nn.Module],
                                                 Callable[[nn.Module], Tensor]]]) -> dict:
    """The timing results: for each seed, ``prepare(seed)`` gives ``(build, loss)`` (it seeds
    and draws one batch); every model ``build(kind)`` takes AdamW steps on ``loss(model)``
    in turn (:func:`interleaved_ms`); the median per model and seed goes to ``rows``."""
    provenance = commit_info()
    per_seed: dict[str, list[float]] = {kind: [] for kind in config.models}
    for seed in config.seeds:
        build, loss_of = prepare(seed)
        steps = {}
        for kind in config.models:
            model = build(kind).to(device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=config.lr)

            def step(model=model, opt=opt, loss_of=loss_of) -> None:
                loss = loss_of(model)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if device != "cpu":
                    torch.cuda.synchronize()

            steps[kind] = step
        for kind, ms in interleaved_ms(steps, rounds).items():
            per_seed[kind].append(round(statistics.median(ms), 2))
    return {"task": "step time", "command": command, **provenance,
            "config": {**config.as_dict(), "rounds": rounds},
            "environment": environment(threads, device), "seeds": list(config.seeds),
            "rows": [{"model": kind, "metric": "step_ms", "setting": "interleaved",
                      "seeds": per_seed[kind]} for kind in config.models]}


# --------------------------------------------------------------------------- results


def results_dict(task: str, records: list[dict], metric_rows: Callable[[str, dict, list], list],
                 config: dict, command: str, data: str, threads: int, device: str,
                 seconds: float, provenance: dict | None = None,
                 extra: dict | None = None) -> dict:
    """The results dictionary from per-run records: ``metric_rows(model, by_seed, seeds)``
    gives a model's metric rows, followed by its ``step_ms`` row; ``extra`` entries follow
    ``data``; ``provenance``: :func:`commit_info` taken when the run started (default: now)."""
    seeds = sorted({r["seed"] for r in records})
    models = list(dict.fromkeys(r["model"] for r in records))
    rows = []
    for model in models:
        by_seed = {r["seed"]: r for r in records if r["model"] == model}
        rows += metric_rows(model, by_seed, seeds)
        rows.append({"model": model, "metric": "step_ms", "setting": "train",
                     "seeds": [by_seed[s]["step_ms"] for s in seeds]})
    return {"task": task, "command": command, **(provenance or commit_info()),
            "data": data, **(extra or {}), "config": config,
            "environment": environment(threads, device), "seeds": seeds, "rows": rows,
            "params": {m: next(r["params"] for r in records if r["model"] == m)
                       for m in models},
            "gates": {m: [r["gates"] for r in records if r["model"] == m] for m in models},
            "runs": records, "seconds": round(seconds, 1)}


def row_values(result: dict, model: str, metric: str, where: str | None = None
               ) -> list[float]:
    """The per-seed values of the row ``(model, metric[, setting])``."""
    return next(r["seeds"] for r in result["rows"] if r["model"] == model
                and r["metric"] == metric and (where is None or r["setting"] == where))


def step_times(result: dict, timing: dict | None, model: str) -> list[float]:
    """``model``'s ms per training step, per seed: from ``timing`` (the interleaved
    measurement) when given, else from the training runs in ``result``."""
    return row_values(timing if timing is not None else result, model, "step_ms")


def model_rows(result: dict, timing: dict | None, labels: dict[str, str],
               cells: Callable[[str, list[float]], list[str]]) -> list[list[str]]:
    """One table row per model: its label, its parameter count, then ``cells(model, ms per
    step per seed)`` (:func:`step_times`)."""
    return [[labels.get(m, m), f"{result['params'][m]:,}", *cells(m, step_times(result, timing, m))]
            for m in result["params"]]


def readme_block(task: str, name: str, head: str, result: dict, timing: dict | None,
                 table: Callable[[dict, dict | None], tuple[list[str], list[list[str]]]]
                 ) -> str:
    """A README block: the title line ``head``, ``table(result, timing)`` as markdown and
    the :func:`source_line`."""
    header, rows = table(result, timing)
    return "\n\n".join([head, md_table(header, rows), source_line(task, name, result, timing)]
                       ) + "\n"


def source_line(task: str, name: str, result: dict, timing: dict | None) -> str:
    """The README block's last line: which files, commands and commit the numbers came from."""
    env = result["environment"]
    source = (f"Source: `examples/{task}/results/{name}.json`, made by `{result['command']}` "
              f"at commit {(result.get('commit') or 'unknown')[:10]}"
              f"{' + uncommitted changes' if result.get('dirty') else ''} "
              f"({env['threads']} torch thread(s) on {env['device']}, "
              f"{result['seconds'] / 60:.1f} min in all).")
    if timing is not None:
        source += (f" Step times: `examples/{task}/results/timing.json`, made by "
                   f"`{timing['command']}` (the models take steps in turn on one batch, "
                   f"median of {timing['config']['rounds']} steps per seed).")
    return source


# --------------------------------------------------------------------------- figures


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (figures go to files; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """Lay out ``fig``, write it to ``path`` (the folder is created) and close it."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


# --------------------------------------------------------------------------- data


def center_crop(path: Path, size: int, resample: int) -> np.ndarray:
    """One image file -> ``(3, size, size)`` float32 in [0, 1]: RGB, shorter side resized to
    ``size`` with ``resample`` (a ``PIL.Image.Resampling``), centre crop."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        scale = size / min(w, h)
        im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), resample)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        array = np.asarray(im.crop((left, top, left + size, top + size)), np.float32) / 255.0
    return np.ascontiguousarray(array.transpose(2, 0, 1))
