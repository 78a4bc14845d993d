"""What the image and video examples share: determinism, provenance, tables, README blocks.

Results files (``examples/<task>/results/<name>.json``)::

    task, command, commit, dirty, config, environment, seeds [the seeds],
    rows [{model, setting, metric, seeds: [one value per seed]}], params {model: n},
    seconds

Every README number of the "Images and video" section is rendered from one of
these by :func:`render_readme` (blocks ``<!-- vision-results: NAME -->`` ...
``<!-- /vision-results -->``), so the committed text always equals the
committed results (``tests/test_examples_vision.py`` checks it).
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["make_deterministic", "commit_info", "environment", "mean_std", "md_table",
           "write_json", "render_readme", "README", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Paths whose uncommitted changes can change a run's numbers.
TRACKED = ("examples/image", "examples/video", "tmcore", "backends", "adapters")
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


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def commit_info() -> dict:
    """``{"commit": HEAD, "dirty": bool}``; dirty counts code paths only (not results)."""
    status = _git("status", "--porcelain", "--", *TRACKED) or ""
    paths = [line[3:] for line in status.splitlines()
             if "/results/" not in line and "/figures/" not in line]
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(paths)}


def environment(threads: int, device: str) -> dict:
    """Versions, CPU, threads and device: what a bitwise rerun must match."""
    import numpy

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "cpu": cpu, "threads": threads, "device": device}


def mean_std(values: Sequence[float], digits: int = 2) -> str:
    """``"24.31 ± 0.12"`` (sample std over seeds), one value alone, ``"-"`` for none."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


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
    import time

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
