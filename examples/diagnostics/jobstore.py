"""Finished jobs kept between runs: the job cache and the committed results files.

A job (one model: a row, a seed, one setting group) is deterministic, so its numbers are
a function of its config and of the sources that compute them; :func:`job_key` hashes
both. A job whose key is known is not trained again but taken from

- the job cache (``--cache DIR``): ``DIR/<key>.json`` per finished job, written as each
  job ends, so an interrupted run resumes where it stopped; or
- a results file whose runs record their key (``run["job"]``, written by every run since
  the key was added). The committed results files are the store that survives a fresh
  checkout, so a sweep spread over sittings resumes from what the last sitting
  committed (``JobStore(..., results_file=...)``; the sweep passes its part's file).

Either way a reused job comes with the commit and the CPU it ran on (``"ran_at"``): the
numbers are the same for the same job on the same kind of CPU, and float32 rounding
differs between vector units (AVX2 / AVX-512), so a results file assembled over
sittings on different machines says which run came from which.

The library (``tmcore``, its backends and adapters) is not hashed: it changes often in
paths the jobs do not take, and ``make demo`` checks the path they do take against the
committed CPU-scale results; ``ran_at["commit"]`` names the code each job ran.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from examples.diagnostics import results
from examples.diagnostics.results import ran_at_of
from examples.reporting import cpu_features, cpu_model

__all__ = ["source_hash", "job_key", "JobStore", "ran_at", "ran_at_of"]

#: what a record says about where its job ran
RAN_AT = ("commit", "dirty", "cpu", "cpu_vector", "cpu_flags")

#: the modules (besides ``tasks/``) that decide a job's numbers; tables, rendering, the
#: CLI and the job bookkeeping are left out, so editing them keeps every key
NUMERIC_MODULES = ("config", "models", "slots", "recurrent", "memory", "variants", "train",
                   "authors")


@functools.cache
def source_hash() -> str:
    """Hash of the sources that decide a job's numbers (models, training, tasks), read
    once per process: the code this process runs, even if the files change under a long
    sweep."""
    digest = hashlib.sha1()
    root = Path(__file__).parent
    paths = [*(root / f"{n}.py" for n in NUMERIC_MODULES), *root.glob("tasks/*.py")]
    for path in sorted(paths):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _key(job: Any) -> str:
    data = {"entry": asdict(job.entry), "seed": job.seed, "task": type(job.task).__name__,
            "task_params": vars(job.task), "train": asdict(job.train),
            "model": asdict(job.model), "hparams": job.hparams, "reset": job.reset,
            "impl": job.impl, "threads": job.threads, "eval_seed": job.eval_seed,
            "data_seed": job.data_seed, "source": source_hash()}
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def job_key(job: Any) -> str:
    """The key of ``job`` (a ``runner.Job``): its config and :func:`source_hash`, with the
    run's seed list reduced to the job's own seed, so that a job finished by a run over
    some seeds (``--seeds 1``) is the same job as in a run over all of them."""
    return _key(replace(job, train=replace(job.train, seeds=(job.seed,))))


def ran_at() -> dict:
    """Where a job runs now: ``{"commit", "dirty", "cpu", "cpu_vector", "cpu_flags"}`` (the
    CPU's model name, and its vector unit and flags, which change float32 results, see
    ``reporting.cpu_features``)."""
    info = results.commit_info()
    return {"commit": info["commit"], "dirty": info["dirty"], **_this_cpu()}


@functools.cache
def _this_cpu() -> dict[str, str]:
    """This machine's CPU (model name, vector unit, flags hash), read once per process."""
    return {"cpu": cpu_model(), **cpu_features()}


class JobStore:
    """Finished jobs by :func:`job_key`: the cache folder ``folder`` (read and written)
    and the runs of ``results_file`` that record their key (read only). Either may be
    ``None``; a missing results file holds nothing."""

    def __init__(self, folder: Path | None, results_file: Path | None = None) -> None:
        self.folder = Path(folder) if folder else None
        self.archived: dict[str, dict] = {}
        if results_file is not None and Path(results_file).exists():
            self.archived = _archived_outputs(json.loads(Path(results_file).read_text()))

    def get(self, job: Any) -> dict | None:
        """The output of a finished ``job`` (``{"run", "carried", "ran_at"}``, plus
        ``"state_dict"`` where the job keeps its weights and the cache has them), else
        ``None``. A job from a results file comes without weights."""
        hit = self._cached(job)
        if hit is not None:
            return hit
        return self.archived.get(job_key(job))

    def _cached(self, job: Any) -> dict | None:
        if self.folder is None:
            return None
        # a cache written before keys dropped the seed list holds the job under the key
        # with the run's seed list
        for key in dict.fromkeys((job_key(job), _key(job))):
            path, weights = self.folder / f"{key}.json", self.folder / f"{key}.pt"
            if path.exists() and (weights.exists() or not job.keep_state):
                break
        else:
            return None
        record = json.loads(path.read_text())
        at = {k: record[k] for k in RAN_AT if k in record}
        if "cpu" not in at and at.get("cpu_flags") == _this_cpu()["cpu_flags"]:
            at["cpu"] = _this_cpu()["cpu"]  # written before records named the CPU: same flags
        output = {**record["output"], "ran_at": at}
        if job.keep_state:
            output["state_dict"] = torch.load(weights, weights_only=True)
        return output

    def put(self, job: Any, output: dict) -> None:
        """Write a finished job to the cache folder (atomically; no folder: nothing)."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        key = job_key(job)
        if "state_dict" in output:  # the trained weights of the pictured model
            torch.save(output["state_dict"], self.folder / f".{key}.pt.tmp")
            (self.folder / f".{key}.pt.tmp").replace(self.folder / f"{key}.pt")
            output = {k: v for k, v in output.items() if k != "state_dict"}
        record = {"output": output, **results.commit_info(), **_this_cpu()}
        tmp = self.folder / f".{key}.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.folder / f"{key}.json")


def _archived_outputs(result: dict) -> dict[str, dict]:
    """``{key: output}`` of a results file's runs that record their job key. A run
    without its own ``ran_at`` was keyed after it ran: it gets every commit the file's
    jobs ran at. A ``ran_at`` that does not name the CPU (written before it did) gets the
    file's recorded environment: the machine the file was assembled on, which for every
    file assembled so far is where those runs ran."""
    fallback = result.get("cached_jobs_ran_at") or [
        {"commit": result.get("commit"), "dirty": result.get("dirty")}]
    env = result.get("environment", {})
    cpu = {k: env[k] for k in ("cpu", "cpu_vector", "cpu_flags") if env.get(k) is not None}
    out = {}
    for run in result.get("runs", []):
        if "job" not in run:
            continue
        run = dict(run)
        key, at = run.pop("job"), run.pop("ran_at", None)
        places = [dict(a) for a in ran_at_of({"ran_at": at or fallback})]
        for place in places:
            if "cpu" not in place:
                place.update({k: v for k, v in cpu.items() if k not in place})
        out[key] = {"run": run, "carried": result["carried"][run["model"]],
                    "ran_at": places[0] if len(places) == 1 else places}
    return out
