"""Render the results tables of the suite's README and the experiments guide from the
committed results files.

``python -m examples.diagnostics render`` rewrites every block

    <!-- results: binding-streaming -->
    ... (generated) ...
    <!-- /results -->

in the READMEs (:data:`READMES`) with the table of
``examples/diagnostics/results/binding-streaming.json`` (a ``-tuning`` file
gives the tuning table); ``--check`` only compares and exits 1 on a
difference. ``tests/examples/test_diagnostics_smoke.py`` runs the check, so the
committed tables always equal the committed results.
"""

from __future__ import annotations

import re
from pathlib import Path

from examples.diagnostics.report import (
    collapse_verdict,
    cost_table,
    gate_reach,
    table,
    title,
)
from examples.diagnostics.results import RESULTS_DIR, load_results, ran_at_of
from examples.reporting import md_table

__all__ = ["markdown", "render_text", "render_files", "READMES"]

_ROOT = Path(__file__).resolve().parents[2]
READMES = (Path(__file__).with_name("README.md"), _ROOT / "docs" / "guides" / "experiments.md")
_BLOCK = re.compile(r"(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)",
                    re.DOTALL)


def _source(result: dict, name: str) -> str:
    commit = (result.get("commit") or "unknown")[:10]
    dirty = " + uncommitted changes" if result.get("dirty") else ""
    env = result.get("environment", {})
    return (f"Source: `examples/diagnostics/results/{name}.json`, made by `{result['command']}` "
            f"at commit {commit}{dirty} ({env.get('threads', '?')} torch thread(s), fused "
            f"kernels {'on' if env.get('native_kernels') else 'off'}).")


def markdown(name: str, result: dict) -> str:
    """The markdown block of one results file (title, table, source line)."""
    if result.get("kind") == "tuning":
        header = ["model", "grid point", "tuning-split mean %", "chosen"]
        rows = [[row["model"], ", ".join(f"{k} {v:g}" for k, v in p["hparams"].items()),
                 f"{100 * p['mean']:.1f}", "yes" if p["hparams"] == row["chosen"] else ""]
                for row in result["rows"] for p in row["points"]]
        head = (f"*Tuning, {result['task']} / {result['protocol']}: every row searched the "
                f"same number of points, seed {result['config']['seed']}, "
                f"{result['config']['train']['steps']} steps, scored on the held-out tuning "
                f"split.*")
        return "\n\n".join([head, md_table(header, rows), _source(result, name)]) + "\n"
    if result.get("kind") == "estimate":
        return _estimate_markdown(name, result)
    header, rows = table(result)
    parts = [f"*{title(result)}*", md_table(header, rows), _source(result, name)]
    if any(r[-1] not in ("-", "") for r in rows):
        reach = gate_reach(result["config"]["train"])
        parts[-1] += (f" A gate logit can move at most about ±{reach:.1f} from its initial 0 "
                      f"in this schedule (Adam: ≤ ~lr per step).")
    verdict = collapse_verdict(result)
    if verdict:
        parts.append("Collapse sweep, per number of writes: " + "; ".join(verdict) + ".")
    marks = cost_marks(result)
    cost = cost_table(result, marks)
    if cost is not None:
        env = result.get("environment", {})
        where = ("; a number's letters say where its seeds ran, and numbers from "
                 "different CPUs do not compare" if marks else "")
        parts.append(f"*Cost ({result['scale']} scale, {env.get('threads', '?')} torch "
                     f"thread(s) per job on {runs_cpus(result)}{where}): ms per "
                     f"training step, mean over seeds.*")
        parts.append(md_table(*cost))
    return "\n\n".join(parts) + "\n"


def _place_name(place: dict) -> str | None:
    """A CPU's model name and vector unit (``"Intel Xeon (AVX-512)"``), else ``None``."""
    if not place.get("cpu"):
        return None
    vector = place.get("cpu_vector")
    return place["cpu"] + (f" ({vector})" if vector else "")


def _run_cpu(run: dict) -> str | None:
    """Where one run ran (``"A or B"`` for a run whose record lists several places)."""
    names = sorted({n for n in map(_place_name, ran_at_of(run)) if n})
    return " or ".join(names) if names else None


def _cpu_counts(result: dict) -> list[tuple[str, int]]:
    """``[(cpu, runs)]`` over a results file's runs, the most frequent first."""
    counts: dict[str, int] = {}
    for run in result.get("runs", []):
        if (cpu := _run_cpu(run)) is not None:
            counts[cpu] = counts.get(cpu, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])


def cpu_letters(result: dict) -> dict[str, str]:
    """``{cpu: "A" | "B" | ...}`` for a file whose runs ran on more than one CPU (the
    most frequent is A), else ``{}``: the cost table marks each number with where its
    seeds ran, since wall times from different machines are not comparable."""
    counts = _cpu_counts(result)
    if len(counts) < 2:
        return {}
    return {cpu: chr(ord("A") + i) if i < 26 else str(i) for i, (cpu, _) in
            enumerate(counts)}


def cost_marks(result: dict) -> dict[tuple[str, str], str]:
    """``{(model, setting): " (A)"}``: the CPUs (:func:`cpu_letters`) of the runs behind
    each cost-table number (``" (A, B)"`` where its seeds ran on two, ``?`` for a run
    whose record names no CPU); empty for a file from one CPU."""
    letters = cpu_letters(result)
    if not letters:
        return {}
    cells: dict[tuple[str, str], set[str]] = {}
    for run in result.get("runs", []):
        cpu = _run_cpu(run)
        for setting in run.get("accuracy", {}):
            cells.setdefault((run["model"], setting), set()).add(
                letters[cpu] if cpu is not None else "?")
    return {cell: f" ({', '.join(sorted(marks))})" for cell, marks in cells.items()}


def runs_cpus(result: dict) -> str:
    """The CPUs a results file's runs ran on, from each run's ``ran_at`` (model name and
    vector unit, e.g. ``"AMD EPYC (AVX2) for 9 runs (A), Intel Xeon (AVX-512) for 3 (B)"``,
    the letters those of :func:`cpu_letters`), else the file's environment: a file
    assembled over sittings can mix machines, whose wall times are not comparable."""
    counts = _cpu_counts(result)
    if not counts:
        return result.get("environment", {}).get("cpu", "an unrecorded CPU")
    if len(counts) == 1:
        return counts[0][0]
    letters = cpu_letters(result)
    return ", ".join(f"{cpu} for {n} run{'s' if n > 1 else ''} ({letters[cpu]})"
                     for cpu, n in counts)


def _estimate_markdown(name: str, result: dict) -> str:
    """The cost estimate of the full-size sweep (``sweep --estimate``)."""
    header = ["part", "model", "setting", "CPU ms / step", "wall ms / step", "steps", "jobs",
              "CPU hours"]
    rows = [[r["part"], r["model"], r["setting"], f"{r['ms_per_step']:,.0f}",
             f"{r.get('wall_ms_per_step', 0):,.0f}", f"{r['steps']:,}", str(r["jobs"]),
             f"{r['cpu_hours']:.2f}"]
            for r in result["rows"]]
    totals = ", ".join(f"{k} {v:.1f} h" for k, v in result["cpu_hours"].items())
    env = result.get("environment", {})
    load = result.get("load_average_at_start")
    head = (f"*Estimated cost of the full-size sweep ({result['scale']} scale, seeds "
            f"{result['seeds']}): {result['timed_steps']} timed training step(s) per row and "
            f"length after one warm-up (CPU time of the timing process), "
            f"{env.get('threads', '?')} torch thread(s) on "
            f"{env.get('cpu', 'an unrecorded CPU')}"
            + (f", load average {load:.1f} when timing began" if load is not None else "")
            + ". Evaluation is not counted.*")
    total = (f"CPU hours by part: {totals}; total {result['cpu_hours_total']:.1f} h "
             f"(one core per job).")
    commit = (result.get("commit") or "unknown")[:10]
    source = (f"Source: `examples/diagnostics/results/{name}.json`, made by "
              f"`{result['command']}` at commit {commit}"
              + (" + uncommitted changes" if result.get("dirty") else "") + ".")
    return "\n\n".join([head, md_table(header, rows), total, source]) + "\n"


def render_text(text: str, results: dict[str, dict]) -> str:
    """``text`` with every results block replaced by its rendering (unknown names are
    left as they are)."""
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in results:
            return match.group(0)
        return match.group(1) + markdown(name, results[name]) + match.group(4)

    return _BLOCK.sub(replace, text)


def render_files(check: bool = False, folder: Path = RESULTS_DIR,
                 readmes: tuple[Path, ...] = READMES) -> list[Path]:
    """Render every README; returns the files that differ (rewritten unless ``check``)."""
    found = load_results(folder)
    stale = []
    for path in readmes:
        if not path.exists():
            continue
        old = path.read_text()
        new = render_text(old, found)
        if new != old:
            stale.append(path)
            if not check:
                path.write_text(new)
    return stale
