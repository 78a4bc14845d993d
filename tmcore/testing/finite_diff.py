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
    """Give the gradients of ``L(args) = sum(f(*args) * g)`` by central differences.

    Entry ``j`` of the gradient for ``args[i]`` is ``(L(x + h e_j) - L(x - h e_j))
    / (2 h)``, computed in float64 on copies of the arguments.

    Parameters
    ----------
    f : callable
        A function of ``len(args)`` arrays returning one array or a tuple of
        arrays.
    args : sequence
        The inputs (NumPy arrays are used as float64 copies). Non-array arguments
        (ints, tuples, None) are passed through untouched and must not be listed
        in ``wrt``.
    g : numpy.ndarray or tuple of numpy.ndarray
        The cotangent, shaped like ``f``'s output (a tuple of arrays if ``f``
        returns a tuple).
    wrt : sequence of int
        The indices of the arguments to differentiate.
    step : float, default 1e-6
        The perturbation ``h``.

    Returns
    -------
    list of numpy.ndarray
        One float64 array per index in ``wrt``, each shaped like ``args[i]``.

    Raises
    ------
    TypeError
        If an argument listed in ``wrt`` is not a NumPy array.

    Examples
    --------
    >>> import numpy as np
    >>> from tmcore.testing.finite_diff import central_difference_vjp
    >>> x = np.array([1.0, 2.0])
    >>> [grad] = central_difference_vjp(lambda a: a ** 2, [x], np.ones(2), wrt=[0])
    >>> np.round(grad, 6)
    array([2., 4.])
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
    """Give the worst error of ``a`` relative to ``b``'s scale: ``max|a - b| / max(max|b|, floor)``.

    ``b`` is the trusted value (the reference or the finite difference). The
    error is scaled by the largest magnitude in ``b``, not entry by entry, so
    entries of ``b`` that are near zero do not blow it up. Empty arrays have
    error 0.

    Parameters
    ----------
    a : array_like
        The value under test.
    b : array_like
        The trusted value, shaped like ``a``.
    floor : float, default: the smallest normal float64
        Guards against ``b == 0``: then the result is ``max|a|`` divided by
        ``floor``, i.e. 0 only if ``a`` is also exactly 0. Pass a larger
        ``floor`` (an absolute scale) when ``b`` may legitimately be about 0.

    Returns
    -------
    float
        The relative error.

    Raises
    ------
    ValueError
        If the shapes of ``a`` and ``b`` differ.

    Examples
    --------
    >>> from tmcore.testing.finite_diff import relative_error
    >>> relative_error([1.0, 2.0], [1.0, 2.5])
    0.2
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor))
