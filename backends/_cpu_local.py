"""The fused CPU local scan for torch tensors (``update="local"``): C kernels per step.

Entries ``local_scan_fwd`` / ``local_scan_bwd`` of the torch backend's
:class:`~tmcore._dispatch.Ops` table (contract: :func:`tmcore.local.local_scan_fwd` /
``local_scan_bwd``, the same undo-log residuals). They return ``None`` whenever the
fused path does not apply, and tmcore's loop then runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["scan_fwd", "scan_bwd"]


def scan_fwd(xp: Any, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
             window: int, eps: float, radius: float | None, overwrite_state: bool, *,
             options: Any):
    """The fused forward, or ``None`` to decline."""
    return None


def scan_bwd(xp: Any, residuals, read_coords, write_coords, write_sigma, write_content,
             params, g_reads, g_h, g_c, window: int, eps: float, radius: float | None, *,
             options: Any):
    """The fused backward, or ``None`` to decline."""
    return None
