"""How long ``make test`` takes: wall and CPU time of one run, recorded with its commit.

``python -m benchmarks.suite_time [--out benchmarks/results/suite_time.json]`` runs
``make test`` in this checkout (the environment must already be built, so the time is
the suite's, not pip's), and writes the wall seconds, the user / system CPU seconds of
the run and every process it waited for (pytest's workers and the suites it starts in
subprocesses), the load average before, pytest's summary line, the commit and the
machine; then it renders the README's sentence about the suite from that file (``--render``
only renders it). Run it on an otherwise idle machine: the wall time is what a shared
machine inflates; the CPU time barely moves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "suite_time.json"
README = REPO / "README.md"
COMMAND = ("make", "test")
#: the README's lines between these markers are :func:`render`'s
MARKERS = ("<!-- suite_time: python -m benchmarks.suite_time --render -->",
           "<!-- /suite_time -->")


def time_suite(command: tuple[str, ...] = COMMAND) -> dict:
    """Run ``command`` at the repository root; its wall / CPU seconds and summary."""
    from benchmarks.common import machine_line
    from benchmarks.run import git_state

    stamp = REPO / ".venv" / ".tmcore-installed"
    if not stamp.exists():
        raise SystemExit("build the environment first (make test once): this times the "
                         "suite, not the install")
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = [line for line in done.stdout.splitlines()
               if re.search(r"\d+ passed", line)]
    return {"command": " ".join(command), "returncode": done.returncode,
            "wall_s": round(wall, 1),
            "user_cpu_s": round(after.ru_utime - before.ru_utime, 1),
            "system_cpu_s": round(after.ru_stime - before.ru_stime, 1),
            "load_average_before": round(load, 2),
            "pytest_summary": summary[-1].strip("= ") if summary else None,
            **({"output_tail": (done.stdout + done.stderr)[-3000:]} if done.returncode else {}),
            "workers": os.environ.get("TEST_WORKERS", "2"),
            **git_state(), "machine": machine_line()}


def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def render(result: dict) -> str:
    """The README's sentence about the suite, from a :func:`time_suite` result."""
    counts = dict((kind, int(number)) for number, kind in re.findall(
        r"(\d+) (passed|skipped|failed)", result["pytest_summary"] or ""))
    cpu = result["user_cpu_s"] + result["system_cpu_s"]
    return (f"`make test` took {_minutes(result['wall_s'])} ({_minutes(cpu)} of CPU time) at "
            f"commit {(result['commit'] or 'unknown')[:7]}, {result['workers']} workers on "
            f"{result['machine'].split(';')[0]} (load average {result['load_average_before']} "
            f"before): {counts.get('passed', 0):,} tests passed, "
            f"{counts.get('skipped', 0):,} skipped (`benchmarks/results/suite_time.json`).")


def render_readme(result: dict, readme: Path = README) -> str:
    """``readme``'s text with the lines between :data:`MARKERS` replaced by :func:`render`."""
    text = readme.read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    return f"{text[:start + len(MARKERS[0])]}\n{render(result)}\n{text[end:]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--render", action="store_true",
                        help="only render the README's sentence from --out")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(args.out.read_text())
    else:
        result = time_suite()
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        if result["returncode"]:
            raise SystemExit(result["returncode"])
    README.write_text(render_readme(result))


if __name__ == "__main__":
    main()
