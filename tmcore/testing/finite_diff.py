"""Central finite differences for checking vector-Jacobian products in float64.

``central_difference_vjp`` perturbs one input entry at a time and differentiates
the scalar ``L = sum(f(*args) * g)``; its result is what a correct VJP of ``f``
for cotangent ``g`` must return. Everything is plain float64 NumPy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["central_difference_vjp", "relative_error"]


def _pairing(out, g) -> float:
    """``sum(out * g)``, summed over every array when ``out`` is a tuple or list."""
    if isinstance(out, (tuple, list)):
        if not isinstance(g, (tuple, list)) or len(g) != len(out):
            raise ValueError("f returned a tuple; g must be a tuple of the same length")
        return float(sum(_pairing(o, gi) for o, gi in zip(out, g, strict=True)))
    return float(np.sum(np.asarray(out, dtype=np.float64) * np.asarray(g, dtype=np.float64)))


def central_difference_vjp(
    f: Callable[..., object],
    args: Sequence[np.ndarray],
    g,
    wrt: Sequence[int],
    step: float = 1e-6,
) -> list[np.ndarray]:
    """Gradients of ``L(args) = sum(f(*args) * g)`` with respect to ``args[i]``, ``i in wrt``.

    Args:
        f: a function of ``len(args)`` arrays returning one array or a tuple of arrays.
        args: the inputs (anything ``np.asarray`` accepts; used as float64 copies).
            Non-array arguments (ints, tuples, None) are passed through untouched
            and must not be listed in ``wrt``.
        g: the cotangent, shaped like ``f``'s output (a tuple of arrays if ``f``
            returns a tuple).
        wrt: indices of the arguments to differentiate.
        step: the perturbation ``h``; entry ``j`` of the gradient is
            ``(L(x + h e_j) - L(x - h e_j)) / (2 h)``.

    Returns:
        One float64 array per index in ``wrt``, each shaped like ``args[i]``.
    """
    work = [
        np.array(a, dtype=np.float64, copy=True) if isinstance(a, np.ndarray) else a
        for a in args
    ]
    grads = []
    for i in wrt:
        if not isinstance(work[i], np.ndarray):
            raise TypeError(f"args[{i}] is not an array and cannot be differentiated")
        x = work[i]
        grad = np.zeros_like(x)
        for j in np.ndindex(*x.shape):
            original = x[j]
            x[j] = original + step
            plus = _pairing(f(*work), g)
            x[j] = original - step
            minus = _pairing(f(*work), g)
            x[j] = original
            grad[j] = (plus - minus) / (2.0 * step)
        grads.append(grad)
    return grads


def relative_error(a, b, floor: float = float(np.finfo(np.float64).tiny)) -> float:
    """``max|a - b| / max(max|b|, floor)``: the worst error relative to ``b``'s scale.

    ``b`` is the trusted value (the reference or the finite difference). The
    error is scaled by the largest magnitude in ``b``, not entry by entry, so
    entries of ``b`` that are near zero do not blow it up. ``floor`` (by default
    the smallest normal float64) guards against ``b == 0``: then the result is
    ``max|a|`` divided by ``floor``, i.e. 0 only if ``a`` is also exactly 0. Pass a
    larger ``floor`` (an absolute scale) when ``b`` may legitimately be ~0.
    Empty arrays have error 0.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor))
