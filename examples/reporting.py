"""Helpers every example's results files and tables share: git state, CPU name, mean ± std
over seeds and markdown tables (no framework imports)."""

from __future__ import annotations

import hashlib
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["git", "cpu_model", "cpu_features", "mean_std", "md_table", "ROOT"]

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


def cpu_features(cpuinfo: str | None = None) -> dict[str, str]:
    """``{"cpu_vector": widest SIMD unit, "cpu_flags": hash of the feature flags}`` of
    this CPU (or of the text ``cpuinfo``, in ``/proc/cpuinfo``'s format).

    Two CPUs with one model name can differ in both (virtual machines often hide the
    name), and both change float32 results: the math libraries pick their kernels by
    vector width (AVX2 and AVX-512 sum in other orders) and compiled-here kernels
    (``-march=native``) use every flag.
    """
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = line.split(":", 1)[1]
            break
    names = set(flags.split())
    widths = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse2", "SSE2"),
              ("sve", "SVE"), ("asimd", "NEON"))
    vector = next((label for flag, label in widths if flag in names),
                  platform.machine() or "unknown")
    digest = hashlib.sha1(" ".join(sorted(names)).encode()).hexdigest()[:12]
    return {"cpu_vector": vector, "cpu_flags": digest if names else "unknown"}


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
