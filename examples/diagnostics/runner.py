"""Experiments: which task, protocol, backbones and sizes; runs them and writes the results.

A run is a list of jobs ``(row, seed, setting group, hyper-parameters)``; each
job trains one model in its own deterministic state (``train.make_deterministic``,
seeded init, seeded data), so running them inline or in ``jobs`` worker
processes gives the same numbers. The results file
``<out>/<task>-<protocol>.json`` (``results.write_results``) holds the rows
``{model, setting, seeds: [...], reset: [...]}`` and everything needed to
trace them.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console

from examples.diagnostics import authors, protocols, report, results
from examples.diagnostics.config import (
    MEMORY_KINDS,
    MODEL_KINDS,
    STREAMING_KINDS,
    ModelConfig,
    TrainConfig,
    scaled,
)
from examples.diagnostics.jobstore import JobStore, job_key, ran_at, ran_at_of
from examples.diagnostics.memory import adapter_name, set_implementation
from examples.diagnostics.models import build_model, carried_numbers
from examples.diagnostics.tasks import (
    CoordinateBinding,
    MapBuilding,
    NoHarm,
    Occlusion,
    OcclusionFinalFrame,
    Task,
)
from examples.diagnostics.train import (
    TUNE_DATA_SEED,
    TUNE_EVAL_SEED,
    eval_batches,
    make_deterministic,
    train_and_evaluate,
)

__all__ = ["Entry", "Experiment", "EXPERIMENTS", "AUTHORS_EXACT", "make_experiment",
           "run_experiment", "run_tuning", "results_stem"]


@dataclass(frozen=True)
class Entry:
    """One row of a results table: a backbone, optional ablation switches and config changes."""

    label: str
    kind: str
    variant: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)
    #: task attributes this row changes (``Task.with_options``), e.g. the occlusion clock
    task_options: dict = field(default_factory=dict)
    #: training-config changes of this row (``TrainConfig`` fields), e.g. the collapse
    #: sweep's training budget
    train_overrides: dict = field(default_factory=dict)


@dataclass
class Experiment:
    """A task under a protocol, its sizes and the rows to train.

    ``per_setting``: one model per evaluation setting (the paper's protocol), else
    one model trained on the task's mixture covers every setting.
    """

    task: Task
    train: TrainConfig
    model: ModelConfig
    entries: list[Entry]
    protocol: str = "streaming"
    per_setting: bool = False
    scale: str = "cpu"
    picture: str | None = None  # label of the entry whose memory state is drawn
    task_config: dict = field(default_factory=dict)
    #: the experiment's name (``make_experiment``'s): results go to ``<name>-<protocol>.json``;
    #: the task's name when empty (the ablations train on binding but are not binding)
    name: str = ""
    #: the task whose committed tuning file gives the rows' hyper-parameters when this one
    #: has none (``<tuning_from>-<protocol>-tuning.json``; matched by row label, then kind)
    tuning_from: str | None = None


def _rows(kinds: tuple[str, ...]) -> list[Entry]:
    return [Entry(kind, kind) for kind in kinds]


def _binding_paper(scale: str) -> Experiment:
    task_kw, train, model = protocols.paper_binding(scale)
    task = CoordinateBinding(**task_kw)
    # the paper's grid: every noise level at every number of writes, one model each
    task.eval_settings = [{"writes": w, "noise": float(s)} for w in task_kw["writes"]
                          for s in task_kw["noises"]]
    return Experiment(task, train, model, _rows(MODEL_KINDS),
                      protocol="paper", per_setting=True, task_config=task_kw)


def _binding_streaming(scale: str) -> Experiment:
    task_kw, train, model = protocols.streaming_binding(scale)
    return Experiment(CoordinateBinding(**task_kw), train, model, _rows(STREAMING_KINDS),
                      protocol="streaming", picture="tensor_memory", task_config=task_kw)


def _noharm_streaming(scale: str) -> Experiment:
    task_kw, train, model = protocols.streaming_noharm(scale)
    return Experiment(NoHarm(**task_kw), train, model,
                      _rows(("transformer", "lstm_memory", "memory_slots", "tensor_memory")),
                      protocol="streaming", task_config=task_kw)


def _one_model_per_setting(task_cls: type[Task],
                           sizes: Callable[[str], tuple[dict, TrainConfig, ModelConfig]]
                           ) -> Callable[[str], Experiment]:
    """The builder of a paper-protocol experiment: the paper's rows, one model per
    setting, the whole stream in one window (``sizes(scale)`` from :mod:`protocols`)."""
    def build(scale: str) -> Experiment:
        task_kw, train, model = sizes(scale)
        return Experiment(task_cls(**task_kw), train, model, _rows(MODEL_KINDS),
                          protocol="paper", per_setting=True, task_config=task_kw)
    return build


def _mapping_streaming(scale: str) -> Experiment:
    task_kw, train, model = protocols.streaming_mapping(scale)
    return Experiment(MapBuilding(**task_kw), train, model, _rows(STREAMING_KINDS),
                      protocol="streaming", task_config=task_kw, tuning_from="binding")


def _occlusion_streaming(scale: str) -> Experiment:
    task_kw, train, model = protocols.streaming_occlusion(scale)
    rows = _rows(STREAMING_KINDS) + [Entry(f"{kind} +clock", kind, task_options={"clock": True})
                                     for kind in STREAMING_KINDS]
    return Experiment(Occlusion(**task_kw), train, model, rows, protocol="streaming",
                      task_config=task_kw, tuning_from="binding")


def _binding_collapse(scale: str) -> Experiment:
    """Where (if anywhere) attention collapses: binding under the paper protocol at many
    writes and three training budgets, for the plain transformer and Tensor Memory
    (:func:`protocols.paper_collapse`); one row per (model, budget), one model per
    number of writes, noise 0."""
    task_kw, train, model, budgets = protocols.paper_collapse(scale)
    task = CoordinateBinding(**task_kw)
    task.eval_settings = [{"writes": w, "noise": 0.0} for w in task_kw["writes"]]
    rows = [Entry(f"{kind}, {steps} steps", kind, train_overrides={"steps": steps})
            for kind in ("transformer", "tensor_memory") for steps in budgets]
    return Experiment(task, train, model, rows, protocol="paper", per_setting=True,
                      task_config={**task_kw, "budgets": list(budgets)})


def _ablations(scale: str) -> Experiment:
    base = {"write": "gaussian", "tied": True, "conv": "factorized"}  # forces the variant layer

    def row(label: str, overrides: dict | None = None, **switch: object) -> Entry:
        return Entry(label, "tensor_memory", {**base, **switch}, overrides or {})

    entries = [
        row("base (gauss, tied, factorized, 4^3, L=1)"),
        row("hard nearest-cell write", write="hard"),
        row("separate coord heads", tied=False),
        row("pointwise conv only", conv="pointwise"),
        row("grid 6^3", {"memory_shape": (6, 6, 6)}),
        row("grid 8^3", {"memory_shape": (8, 8, 8)}),
        row("chunk 2", {"chunk_size": 2}),
        row("chunk 4", {"chunk_size": 4}),
    ]
    task = CoordinateBinding(writes=(5, 10, 20), noises=())
    # Tensor Memory's streaming binding point (lr 3e-3, forget bias 3: the ModelConfig and
    # TrainConfig defaults), 3 seeds like every committed table
    return Experiment(task, TrainConfig(steps=600, warmup=60, seeds=(0, 1, 2)),
                      ModelConfig(memory_shape=(4, 4, 4)), entries)


#: The layer options' rows (``tmcore.layer.layer_config``): warped dynamics, and local updates
#: of a window of cells around the write (``memory.LAYER_OPTIONS``).
WARP = {"dynamics": "warp"}
OCCLUSION_WINDOW = 2  # half the occlusion's 4^3 grid per axis
ABLATION_WINDOW = 4  # fixed while the grid grows: the step's cost should follow the window


def _local(window: int) -> dict:
    return {"update": "local", "window": window}


def _occlusion_options(scale: str) -> Experiment:
    """Tensor Memory with the layer options on the harder occlusion (streaming): the base
    row again, with warped dynamics, and with both the warp and local updates. The same
    task, sizes, seeds and hyper-parameters as ``occlusion-streaming`` (the options' rows
    use Tensor Memory's chosen point; none was searched for them), so its other rows
    compare."""
    exp = _occlusion_streaming(scale)
    exp.entries = [Entry("tensor_memory", "tensor_memory"),
                   Entry("tensor_memory +warp", "tensor_memory", WARP),
                   Entry(f"tensor_memory +warp +local w={OCCLUSION_WINDOW}", "tensor_memory",
                         {**WARP, **_local(OCCLUSION_WINDOW)})]
    exp.tuning_from = "occlusion"
    return exp


def _ablations_options(scale: str) -> Experiment:
    """The streaming ablations' binding with local updates (window
    :data:`ABLATION_WINDOW`) as the grid grows, next to the dense base and dense grids:
    the same task, sizes, seeds and Tensor Memory point as ``ablations``. Declared rows
    may be left out of a run by cost (``--models``; the README says which)."""
    exp = _ablations(scale)
    base = exp.entries[0]

    def row(size: int, **options: object) -> Entry:
        label = f"grid {size}^3" + (f", local w={options['window']}" if options else "")
        return replace(base, label=label, variant={**base.variant, **options},
                       overrides={"memory_shape": (size,) * 3})

    exp.entries = [base, row(8), *(row(size, **_local(ABLATION_WINDOW)) for size in (8, 16, 32)),
                   row(16)]
    return exp


#: ``(task, protocol) -> builder(scale)``. The Tensor Memory ablations exist in the streaming
#: setting only (not redone under the new protocols: see the README).
EXPERIMENTS = {
    ("binding", "paper"): _binding_paper,
    ("binding", "streaming"): _binding_streaming,
    ("noharm", "streaming"): _noharm_streaming,
    ("mapping", "paper"): _one_model_per_setting(MapBuilding, protocols.paper_mapping),
    ("mapping", "streaming"): _mapping_streaming,
    ("occlusion", "paper"): _one_model_per_setting(OcclusionFinalFrame,
                                                   protocols.paper_occlusion),
    ("occlusion", "streaming"): _occlusion_streaming,
    ("ablations", "streaming"): _ablations,
    ("occlusion-options", "streaming"): _occlusion_options,
    ("ablations-options", "streaming"): _ablations_options,
    ("collapse", "paper"): _binding_collapse,
}
TASKS = tuple(dict.fromkeys(task for task, _ in EXPERIMENTS))

#: Minute versions of the tasks for ``--tiny`` (smoke tests).
TINY_TASKS = {
    "binding": lambda kw: CoordinateBinding(writes=(2, 4), n_queries=2,
                                            n_values=kw.get("n_values", 16), noises=()),
    "noharm": lambda kw: NoHarm(length=6),
    "mapping": lambda kw: MapBuilding(horizons=(2, 4), grid=4, n_queries=2),
    "occlusion": lambda kw: (OcclusionFinalFrame(lengths=(0, 2), frames=3, frame_size=4,
                                                 patch=2)
                             if "frame_size" in kw else Occlusion(lengths=(1, 2), frame=4,
                                                                  visible=2)),
    "ablations": lambda kw: CoordinateBinding(writes=(2, 3), n_queries=2, noises=()),
    "occlusion-options": lambda kw: Occlusion(lengths=(1, 2), frame=4, visible=2),
    "ablations-options": lambda kw: CoordinateBinding(writes=(2, 3), n_queries=2, noises=()),
    "collapse": lambda kw: CoordinateBinding(writes=(2, 4), n_queries=2, noises=()),
}
#: ``--authors-exact``: the label of the paper protocol run with the authors' own models
#: (:mod:`examples.diagnostics.authors`); results go to ``<task>-paper-exact[-full].json``
AUTHORS_EXACT = "paper-exact"


def _authors_rows() -> list[Entry]:
    """The authors' four rows, plus their Tensor Memory with a causal state (every block
    starts from the initial state instead of the previous block's final one)."""
    rows = [Entry(kind, kind, {"authors_exact": True}) for kind in authors.KINDS]
    return rows + [Entry("tensor_memory (causal)", "tensor_memory",
                         {"authors_exact": True, "threaded": False})]


def make_experiment(name: str, scale: str = "cpu", seeds: tuple[int, ...] | None = None,
                    steps: int | None = None, protocol: str = "streaming",
                    segment: int | None = None, authors_exact: bool = False) -> Experiment:
    """The named experiment under ``protocol`` at a scale (``cpu`` default, ``full``,
    ``tiny``); ``seeds`` / ``steps`` / ``segment`` override the protocol's.
    ``authors_exact`` (paper protocol, binding / mapping / occlusion): the same runs with
    the authors' own models (:data:`AUTHORS_EXACT`)."""
    if protocol not in protocols.PROTOCOLS:
        raise ValueError(f"protocol: expected one of {protocols.PROTOCOLS}, got {protocol!r}")
    if (name, protocol) not in EXPERIMENTS:
        raise ValueError(f"{name!r} is not offered under the {protocol!r} protocol "
                         f"(offered: {sorted(EXPERIMENTS)})")
    if authors_exact and (protocol != "paper" or name not in ("binding", "mapping",
                                                              "occlusion")):
        raise ValueError(f"authors_exact: offered for binding, mapping and occlusion under "
                         f"the paper protocol, not {name!r} / {protocol!r}")
    exp = EXPERIMENTS[name, protocol](scale)
    exp.scale, exp.name = scale, name
    if authors_exact:
        exp.entries, exp.protocol = _authors_rows(), AUTHORS_EXACT
    if scale == "tiny":
        exp.task = TINY_TASKS[name](exp.task_config)
        exp.task_config = {"tiny": True}
        exp.train, exp.model = scaled(exp.train, exp.model, "tiny")
        exp.entries = [replace(e, train_overrides={k: min(v, exp.train.steps) for k, v in
                                                   e.train_overrides.items()})
                       for e in exp.entries]
    elif scale == "full" and not exp.task_config:  # old-style tasks: the generic --full
        exp.train, exp.model = scaled(exp.train, exp.model, "full")
    if seeds:
        exp.train = replace(exp.train, seeds=tuple(seeds))
    if steps:
        exp.train = replace(exp.train, steps=steps, warmup=min(exp.train.warmup, steps // 4 + 1))
    if segment and protocol == "streaming":
        exp.model = replace(exp.model, segment=segment)
    if scale == "tiny":  # tiny grids keep the smoke test fast; ablated grids shrink too
        exp.entries = [replace(e, overrides={**e.overrides, "memory_shape": (3, 3, 3)})
                       if "memory_shape" in e.overrides else e for e in exp.entries]
        # and a local update's window to fit them
        exp.entries = [replace(e, variant={**e.variant, "window": min(
            e.variant["window"], *e.overrides.get("memory_shape", exp.model.memory_shape))})
            if "window" in e.variant else e for e in exp.entries]
    return exp


# -- jobs -------------------------------------------------------------------------------------
@dataclass
class Job:
    """One model to train: a row, a seed, the settings it covers, its hyper-parameters."""

    entry: Entry
    seed: int
    task: Task
    train: TrainConfig
    model: ModelConfig
    hparams: dict
    reset: str | None
    impl: str = "adapter"
    threads: int = 1
    progress: bool = False
    eval_seed: int | None = None
    data_seed: int | None = None
    keep_state: bool = False


def _apply_hparams(train: TrainConfig, model: ModelConfig, hparams: dict
                   ) -> tuple[TrainConfig, ModelConfig]:
    if "lr" in hparams:
        train = replace(train, lr=float(hparams["lr"]))
    if "forget_bias" in hparams:
        model = replace(model, forget_bias=float(hparams["forget_bias"]))
    return train, model


def _run_job(job: Job) -> dict:
    """Train and evaluate one job in this process (also the worker entry point)."""
    make_deterministic(job.threads)
    set_implementation(job.impl)
    train, model_cfg = _apply_hparams(job.train, job.model, job.hparams)
    cfg = replace(model_cfg, **job.entry.overrides)
    evals = eval_batches(job.task, train.eval_examples,
                         **({"seed": job.eval_seed} if job.eval_seed is not None else {}))
    torch.manual_seed(job.seed)
    variant = dict(job.entry.variant)
    if variant.pop("authors_exact", False):  # the authors' model (``--authors-exact``)
        model = authors.build_authors_model(job.entry.kind, job.task, cfg, **variant)
        carried = model.carried_numbers()
    else:
        model = build_model(job.entry.kind, job.task.in_features, job.task.n_classes, cfg,
                            variant)
        carried = carried_numbers(model)
    train = replace(train, **job.entry.train_overrides)
    run = train_and_evaluate(model, job.task, train, job.seed, job.entry.label, evals,
                             job.progress, reset=job.reset, data_seed=job.data_seed)
    run.hparams = dict(job.hparams)
    out = {"run": asdict(run), "carried": carried}
    if job.keep_state:
        out["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _setting_major(jobs: list[Job]) -> list[int]:
    """The order to start ``jobs`` in: every seed of one (row, setting) before the next,
    so a sweep stopped part-way leaves complete settings rather than one seed of each."""
    def setting(job: Job) -> tuple[str, str]:
        return job.entry.label, json.dumps(job.task.eval_settings, sort_keys=True)

    first_seen: dict[tuple[str, str], int] = {}
    for job in jobs:
        first_seen.setdefault(setting(job), len(first_seen))
    return sorted(range(len(jobs)), key=lambda i: (first_seen[setting(jobs[i])], i))


def _execute(jobs: list[Job], n_workers: int, console: Console, label: str,
             store: JobStore, cached_only: bool = False) -> list[dict]:
    """Run ``jobs`` inline (``n_workers <= 1``) or in spawned worker processes; results in
    job order either way, started setting-major (:func:`_setting_major`). The jobs
    ``store`` has finished are reused, and each job run is added to its cache. Every
    output's run records its job key (``run["job"]``) and where it ran (``run["ran_at"]``:
    commit and CPU), so its results file can serve a later run as a store."""
    found = [store.get(job) for job in jobs]
    if cached_only:  # assemble what has finished; the missing jobs are left out
        missing = sum(hit is None for hit in found)
        if missing:
            console.print(f"  [yellow]{label}: {missing} job(s) not finished (not in the "
                          f"cache or the results file), left out[/yellow]")
    else:
        todo = [i for i in _setting_major(jobs) if found[i] is None]
        if len(todo) < len(jobs):
            console.print(f"  [dim]{label}: {len(jobs) - len(todo)} job(s) already "
                          f"finished (cache or results file)[/dim]")
        now = ran_at()
        for i, res in zip(todo, _run_all([jobs[i] for i in todo], n_workers, console, label,
                                         store), strict=True):
            found[i] = {**res, "ran_at": now}
    kept = []
    for job, output in zip(jobs, found, strict=True):
        if output is None:
            continue
        at = ran_at_of(output)
        output["run"] = {**output["run"], "job": job_key(job),
                         "ran_at": at[0] if len(at) == 1 else at}
        kept.append(output)
    return kept


def _run_all(jobs: list[Job], n_workers: int, console: Console, label: str,
             store: JobStore) -> list[dict]:
    def note(job: Job, res: dict) -> None:
        store.put(job, res)
        acc = " ".join(f"{100 * v:.1f}" for v in res["run"]["accuracy"].values())
        console.print(f"  [dim]{label} {job.entry.label} seed {job.seed} "
                      f"{json.dumps(job.hparams) if job.hparams else ''}: {acc} "
                      f"({res['run']['seconds']:.0f}s)[/dim]")

    if n_workers <= 1:
        done = []
        for job in jobs:
            done.append(_run_job(job))
            note(job, done[-1])
        return done
    ctx = multiprocessing.get_context("spawn")  # no fork after OpenMP has started
    with concurrent.futures.ProcessPoolExecutor(n_workers, mp_context=ctx) as pool:
        futures = {pool.submit(_run_job, replace(job, progress=False)): i
                   for i, job in enumerate(jobs)}
        finished: dict[int, dict] = {}
        for future in concurrent.futures.as_completed(futures):  # cache each as it ends
            i = futures[future]
            finished[i] = future.result()
            note(jobs[i], finished[i])
    return [finished[i] for i in range(len(jobs))]


def _groups(exp: Experiment) -> list[Task]:
    """The tasks the models of one row train on: one per setting (paper) or the mixture."""
    if not exp.per_setting:
        return [exp.task]
    if isinstance(exp.task, CoordinateBinding):
        kw = {"n_values": exp.task.n_values, "n_queries": exp.task.n_queries}
        return [CoordinateBinding.only(s, **kw) for s in exp.task.eval_settings]
    return [exp.task.fixed_to(s) for s in exp.task.eval_settings]


def row_hparams(hparams: dict, entry: Entry) -> dict:
    """A row's chosen hyper-parameters: by its label, else by its kind (a row that adds a
    task option, e.g. ``tensor_memory +clock``, uses its kind's point)."""
    return dict(hparams.get(entry.label, hparams.get(entry.kind, {})))


def _reset_mode(exp: Experiment) -> str:
    return "segment" if exp.model.segment else "token"


def run_experiment(exp: Experiment, out_dir: Path, *, framework: str = "torch",
                   progress: bool = True, console: Console | None = None,
                   device: str = "cpu", jobs: int = 1, threads: int = 1,
                   command: str = "", hparams: dict | None = None,
                   hparams_from: str | None = None, cache: Path | None = None,
                   cached_only: bool = False, resume: bool = False) -> dict:
    """Train every row for every seed, evaluate, print the table, write the results file.

    ``hparams``: ``{row label: {"lr": ..., "forget_bias": ...}}`` (from a tuning
    file), applied per row. ``cache``: a folder of finished jobs to reuse and extend;
    ``resume``: also reuse the jobs recorded in the results file this run replaces
    (``jobstore``); ``cached_only``: train nothing, assemble the finished jobs. Returns
    the results dictionary (also written to ``out_dir/<task>-<protocol>.json``).
    """
    console = console or Console()
    task = exp.task
    name = exp.name or task.name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_cfg = replace(exp.model, max_len=max(exp.model.max_len, task.max_len()))
    hparams = hparams or {}
    start = time.perf_counter()
    groups = _groups(exp)
    impl = "variant" if adapter_name() == "VariantTensorMemory" else "adapter"
    stem = results_stem(name, exp.protocol, exp.scale)
    outputs: list[dict] = []
    if framework == "jax":
        from examples.diagnostics.jax_binding import train_and_evaluate_jax

        make_deterministic(threads)
        for seed in exp.train.seeds:
            for entry in exp.entries:
                if entry.kind != "tensor_memory":
                    continue
                for group in groups:
                    evals = eval_batches(group, exp.train.eval_examples)
                    run = train_and_evaluate_jax(group, exp.train,
                                                 replace(model_cfg, **entry.overrides), seed,
                                                 entry.label + " (jax)", evals, progress)
                    outputs.append({"run": asdict(run), "carried": model_cfg.state_numbers()})
    else:
        job_list = experiment_jobs(exp, hparams=hparams, impl=impl, threads=threads,
                                   progress=progress and jobs <= 1, picture=device == "cpu")
        if device != "cpu":
            raise SystemExit("this runner trains on the CPU (each job pins its threads)")
        store = JobStore(cache, out / f"{stem}.json" if resume else None)
        outputs = _execute(job_list, jobs, console, f"{name}/{exp.protocol}", store,
                           cached_only)
    runs = [o["run"] for o in outputs]
    # the commits the jobs ran at (reused jobs may predate this run's commit)
    places = sorted({json.dumps(at, sort_keys=True) for o in outputs for at in ran_at_of(o)})
    carried = {}
    for o in outputs:
        carried.setdefault(o["run"]["model"], o["carried"])
    settings = [task.label(s) for s in task.eval_settings]
    ceilings = {task.label(s): task.window_ceiling(s, model_cfg.segment)
                for s in task.eval_settings}
    references: dict[str, dict[str, float]] = {}
    for s in task.eval_settings:
        for rule, value in task.references(s).items():
            references.setdefault(rule, {})[task.label(s)] = value
    result = results.build_results(
        task=name, protocol=exp.protocol, scale=exp.scale, command=command,
        settings=settings, ceilings=ceilings, references=references, runs=runs,
        carried=carried,
        config={"task": exp.task_config or {"name": task.name},
                "train": asdict(exp.train), "model": asdict(model_cfg),
                "per_setting": exp.per_setting, "reset": _reset_mode(exp),
                "framework": framework, "layer": adapter_name(),
                "hparams": hparams, "hparams_from": hparams_from},
        environment=results.environment(threads),
        seconds=time.perf_counter() - start)
    result["cached_jobs_ran_at"] = [json.loads(r) for r in places]
    path = out / f"{stem}.json"
    results.write_results(result, path)
    report.plot_results(result, out / f"{stem}.png")
    picture = next((o for o in outputs if "state_dict" in o), None)
    if picture is not None:
        _draw_memory(exp, model_cfg, picture, out / f"{stem}-memory.png")
    report.print_table(result, console)
    console.print(f"results: {path}")
    return result


def experiment_jobs(exp: Experiment, *, hparams: dict | None = None, impl: str = "adapter",
                    threads: int = 1, progress: bool = False, picture: bool = True
                    ) -> list[Job]:
    """The jobs of ``exp`` in order (seed, row, setting group): what :func:`run_experiment`
    trains. ``picture``: the pictured row's first seed keeps its weights."""
    model_cfg = replace(exp.model, max_len=max(exp.model.max_len, exp.task.max_len()))
    groups = _groups(exp)
    return [Job(entry, seed, group.with_options(**entry.task_options), exp.train, model_cfg,
                row_hparams(hparams or {}, entry), _reset_mode(exp), impl, threads, progress,
                keep_state=(picture and entry.label == exp.picture
                            and seed == exp.train.seeds[0]))
            for seed in exp.train.seeds for entry in exp.entries for group in groups]


def results_stem(name: str, protocol: str, scale: str) -> str:
    """``<name>-<protocol>``, with ``-full`` at the authors' sizes (``--full``), so that a
    full-size run never overwrites the committed CPU-scale file of the same task."""
    return f"{name}-{protocol}" + ("-full" if scale == "full" else "")


def _draw_memory(exp: Experiment, model_cfg: ModelConfig, output: dict, path: Path) -> None:
    from examples.diagnostics.picture import memory_states, plot_memory_states

    entry = next(e for e in exp.entries if e.label == exp.picture)
    hp = output["run"].get("hparams", {})
    _, cfg = _apply_hparams(exp.train, replace(model_cfg, **entry.overrides), hp)
    torch.manual_seed(0)
    model = build_model(entry.kind, exp.task.in_features, exp.task.n_classes, cfg,
                        entry.variant)
    model.load_state_dict(output["state_dict"])
    setting = exp.task.eval_settings[min(1, len(exp.task.eval_settings) - 1)]
    norms = memory_states(model, exp.task, setting)
    plot_memory_states(norms, path, f"{exp.task.name} ({exp.protocol}), "
                       f"{exp.task.label(setting)}: ||h|| per cell (rows: step, columns: "
                       f"depth slice)")


def run_tuning(exp: Experiment, out_dir: Path, *, console: Console | None = None,
               jobs: int = 1, threads: int = 1, command: str = "",
               steps: int | None = None, cache: Path | None = None) -> dict:
    """The same hyper-parameter search for every row (``protocols.tuning_grid``: 4 points
    each), one seed, on the held-out tuning split: training streams from
    ``TUNE_DATA_SEED``, scored on examples drawn from ``TUNE_EVAL_SEED`` (never the
    evaluation examples). Writes ``<out>/<task>-<protocol>-tuning.json`` with every
    point's score and the chosen point per row (best mean accuracy over settings)."""
    console = console or Console()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_cfg = replace(exp.model, max_len=max(exp.model.max_len, exp.task.max_len()))
    train = exp.train if steps is None else replace(
        exp.train, steps=steps, warmup=min(exp.train.warmup, steps // 4 + 1))
    impl = "variant" if adapter_name() == "VariantTensorMemory" else "adapter"
    seed = exp.train.seeds[0]
    job_list = [Job(entry, seed, exp.task.with_options(**entry.task_options), train, model_cfg,
                    point, None, impl, threads,
                    eval_seed=TUNE_EVAL_SEED, data_seed=TUNE_DATA_SEED + seed)
                for entry in exp.entries
                for point in protocols.tuning_grid(entry.kind, train, model_cfg)]
    start = time.perf_counter()
    name = exp.name or exp.task.name
    outputs = _execute(job_list, jobs, console, f"tune {name}/{exp.protocol}",
                       JobStore(cache))
    rows, chosen = [], {}
    for entry in exp.entries:
        points = [(o["run"]["hparams"], o["run"]["accuracy"]) for o in outputs
                  if o["run"]["model"] == entry.label]
        scored = [{"hparams": hp, "accuracy": acc,
                   "mean": sum(acc.values()) / len(acc)} for hp, acc in points]
        best = max(scored, key=lambda p: p["mean"])  # first of equals: the grid's order
        chosen[entry.label] = best["hparams"]
        rows.append({"model": entry.label, "kind": entry.kind, "points": scored,
                     "chosen": best["hparams"]})
    result = {
        "task": name, "protocol": exp.protocol, "kind": "tuning", "scale": exp.scale,
        "command": command, **results.commit_info(),
        "config": {"task": exp.task_config, "train": asdict(train), "model": asdict(model_cfg),
                   "seed": seed, "data_seed": TUNE_DATA_SEED + seed,
                   "eval_seed": TUNE_EVAL_SEED,
                   "grid": {e.label: protocols.tuning_grid(e.kind, train, model_cfg)
                            for e in exp.entries},
                   "memory_kinds": list(MEMORY_KINDS)},
        "environment": results.environment(threads),
        "rows": rows, "chosen": chosen, "seconds": time.perf_counter() - start,
    }
    path = out / f"{name}-{exp.protocol}-tuning.json"
    results.write_results(result, path)
    report.print_tuning(result, console)
    console.print(f"tuning results: {path}")
    return result
