"""How long ``make test`` takes: wall and CPU time of one run, recorded with its commit.

``python -m benchmarks.suite_time [--out benchmarks/results/suite_time.json]`` runs
``make test`` in this checkout (the environment must already be built, so the time is
the suite's, not pip's), and writes the wall seconds, the user / system CPU seconds of
the run and every process it waited for (pytest's workers and the suites it starts in
subprocesses), the load average before, pytest's summary line, the commit and the
machine. Run it on an otherwise idle machine: the wall time is what a shared machine
inflates; the CPU time barely moves.
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

from benchmarks.common import machine_line
from benchmarks.run import REPO, git_state

OUT = REPO / "benchmarks" / "results" / "suite_time.json"
COMMAND = ("make", "test")


def time_suite(command: tuple[str, ...] = COMMAND) -> dict:
    """Run ``command`` at the repository root; its wall / CPU seconds and summary."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = time_suite()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if result["returncode"]:
        raise SystemExit(result["returncode"])


if __name__ == "__main__":
    main()
