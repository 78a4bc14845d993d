"""CuPy: the generic array-API path on the GPU.

No fused kernel is shipped: none has been measured to beat the generic path
(a few dense contractions, launched on the caller's current stream by CuPy
itself). This module exists so the registry has an explicit CuPy entry and a
place for a measured kernel later.
"""

from __future__ import annotations

from tmcore._dispatch import Ops
from tmcore.backends._mixed import with_float32_compute

__all__ = ["make_ops"]


def make_ops(generic: Ops) -> Ops:
    """The CuPy table: the generic path, float16 computed in float32 (as for NumPy)."""
    return with_float32_compute(generic)
