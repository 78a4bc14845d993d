"""NumPy: the generic array-API path (no fast path measured to win on CPU).

Tried and dropped (``benchmarks/backend_fastpaths.py``, B=8 C=32 8^3 and B=32 C=16 6^3,
float32, one BLAS thread): depthwise taps by in-place slice arithmetic (slower than the
generic shifts) and tap gradients by ``einsum`` (within noise); ``scipy.ndimage.correlate1d``
needs a call per channel. The read, the write and the pointwise mix are BLAS already.
"""

from __future__ import annotations

from tmcore.backends.mixed import with_float32_compute
from tmcore.runtime.dispatch import Ops
from tmcore.runtime.options import Options

__all__ = ["make_ops"]


def make_ops(generic: Ops, options: Options) -> Ops:
    """The NumPy table: the generic path, with float16 computed in float32 (as in
    torch and JAX) because ``sigma**2`` and ``(2 sigma**2 + eps)**2`` under/overflow
    in float16 at the ends of the supported sigma range."""
    return with_float32_compute(generic)
