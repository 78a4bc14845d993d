"""Configurations, timing, peak-memory measurement and the machine line.

Timing is the minimum over repetitions (the least disturbed run, which is
what the code can do on this machine) after one warm-up call; the median is
kept too. Peak memory of a step on the CPU is the growth of the process's
resident set high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) over the resident set before the step, measured in
a fresh subprocess with glibc's mmap threshold pinned so that freed buffers
go back to the system (``MALLOC_MMAP_THRESHOLD_``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "Config",
    "CONFIGS",
    "TINY",
    "time_fn",
    "machine_line",
    "peak_rss_growth",
    "run_isolated",
    "checkout_commit",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark shape: batch, width, channels, grid, chunk, tokens."""

    name: str
    batch: int
    embed_dim: int
    channels: int
    shape: tuple[int, ...]
    chunk: int
    tokens: int
    reps: int = 3  # timing repetitions (the biggest configs use fewer)

    @property
    def steps(self) -> int:
        return -(-self.tokens // self.chunk)

    @property
    def cells(self) -> int:
        size = 1
        for s in self.shape:
            size *= s
        return size

    def describe(self) -> str:
        grid = "x".join(map(str, self.shape))
        return (f"B={self.batch}, d={self.embed_dim}, C={self.channels}, grid {grid}, "
                f"chunk {self.chunk}, N={self.tokens} (T={self.steps} steps)")


CONFIGS = [
    Config("toy", 32, 64, 16, (6, 6, 6), 1, 28, reps=5),
    Config("lm-256", 8, 128, 32, (8, 8, 8), 16, 256, reps=5),
    Config("lm-1024", 8, 128, 32, (8, 8, 8), 16, 1024, reps=3),
    Config("lm-4096", 8, 128, 32, (8, 8, 8), 16, 4096, reps=1),
    Config("vit", 2, 512, 64, (8, 8, 8), 14, 196, reps=5),
]
TINY = Config("tiny", 2, 16, 4, (4, 4, 4), 4, 24, reps=1)


def time_fn(fn: Callable[[], Any], reps: int, warmup: int = 1) -> dict:
    """Run ``fn`` ``warmup`` times untimed, then ``reps`` times; seconds (min, median)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, reps)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"min": min(times), "median": statistics.median(times), "reps": len(times)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """CPU model, cores, memory, OS, Python and framework versions, in one line."""
    parts = [f"{_cpu_model()}, {os.cpu_count()} cores"]
    try:
        with open("/proc/meminfo") as f:
            total_kb = int(f.readline().split()[1])
        parts.append(f"{total_kb / 2**20:.0f} GiB RAM")
    except (OSError, ValueError, IndexError):
        pass
    parts.append(f"{platform.system()} {platform.release()}")
    parts.append(f"Python {platform.python_version()}")
    for name in ("numpy", "torch", "jax"):
        try:
            module = __import__(name)
            parts.append(f"{name} {module.__version__}")
        except ImportError:
            parts.append(f"{name} missing")
    return "; ".join(parts)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_rss_growth(fn: Callable[[], Any]) -> int:
    """Bytes by which the resident set's high-water mark rises above the current
    resident set while ``fn()`` runs (Linux; needs ``/proc/self/clear_refs``)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    result = fn()
    peak = _rss_kib("VmHWM")
    del result
    return (peak - before) * 1024


def run_isolated(module: str, args: list[str], timeout: float = 900) -> dict:
    """Run ``python -m module *args`` in a fresh process; parse its last stdout line as JSON."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checkout_commit(python: str) -> str:
    """The commit (``+changes``: with uncommitted library changes) and folder of the checkout
    that ``python``'s tmcore was installed from."""
    where = subprocess.run([python, "-c", "import tmcore, os; print(os.path.dirname("
                            "os.path.dirname(tmcore.__file__)))"],
                           capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", where, *args], capture_output=True,
                              text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "tmcore", "backends",
                "adapters")
    return f"{git('rev-parse', '--short=10', 'HEAD') or '?'}{'+changes' if dirty else ''} " \
           f"({where})"


def checkout_arguments(parser: Any, name: str) -> None:
    """The options of a benchmark that times checkouts side by side: ``--python`` (repeatable),
    ``--rounds``, ``--json`` / ``--md`` (default ``benchmarks/results/{name}.json`` / ``.md``)
    and ``--render``."""
    from pathlib import Path

    results = Path(__file__).resolve().parent / "results"
    parser.add_argument("--python", action="append", default=None,
                        help="an interpreter whose tmcore is the checkout to time (repeatable; "
                             "default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=results / f"{name}.json")
    parser.add_argument("--md", type=Path, default=results / f"{name}.md")
    parser.add_argument("--render", action="store_true", help="only rewrite --md from --json")


def interleaved_rounds(jobs: list, rounds: int, run: Callable[..., Any]) -> dict:
    """``{job: [run(*job) per round]}``, each round running every job once in an order rotated
    by one from the round before, so that a load that changes during a round slows every job
    alike; each result is printed to stderr as it comes."""
    results: dict = {job: [] for job in jobs}
    for index in range(rounds):
        for job in jobs[index % len(jobs):] + jobs[:index % len(jobs)]:
            results[job].append(run(*job))
            print(f"round {index}, {job}: {results[job][-1]}", file=sys.stderr)
    return results


def save_results(args: Any, result: dict, render: Callable[[dict], str]) -> None:
    """Write ``result`` to ``args.json`` and its page ``render(result)`` to ``args.md``, and print
    the page."""
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    args.md.write_text(render(result))
    print(render(result))
