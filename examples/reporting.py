"""Helpers every example's results files and tables share: git state, CPU name, mean ± std
over seeds and markdown tables (no framework imports)."""

from __future__ import annotations

import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["git", "cpu_model", "mean_std", "md_table", "ROOT"]

#: The repository root (git runs here).
ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str | None:
    """``git <args>``'s stripped output in the repository, or ``None`` when git fails or is
    missing (a results file then records no commit)."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def mean_std(values: Sequence[float], digits: int = 2) -> str:
    """``"24.31 ± 0.12"`` (sample std over seeds), one value alone, ``"-"`` for none."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table (a ``|`` inside a cell becomes ``/``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)
