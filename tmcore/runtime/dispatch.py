"""Choose, per array namespace, the implementation of each primitive's forward and VJP.

Every public function and the scan step ask :func:`ops_for` for an
:class:`Ops` table. Registration is pushed here, never pulled by name: :mod:`tmcore.ops`
registers the generic array-API table (:func:`register_generic`) and
:mod:`tmcore.backends` the function that finds a namespace's backend table
(:func:`register_resolver`); a namespace it does not accelerate, and any primitive a
backend leaves out, uses the generic functions. Tables are cached per namespace and
per :class:`tmcore.runtime.options.Options` value (an option changed between calls
takes effect on the next one); registering anything empties the cache. Under
``jax.jit`` the choice is made while tracing.

The contract of each entry, with shapes, is :class:`Ops`'s docstring (the generic
functions are the reference). ``with tmcore.options(generic=True): ...`` (or
``TMCORE_GENERIC=1``) forces the generic path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

from tmcore.runtime.options import ENV_VARS, Options, get_options

__all__ = ["Ops", "ops_for", "generic_ops", "register_generic", "register_resolver",
           "clear_cache", "no_workspace", "ENV_VAR"]

#: The environment variable forcing the generic path (the ``generic`` option's default).
ENV_VAR = ENV_VARS["generic"]


class Ops(NamedTuple):
    """One implementation of every primitive's forward and VJP.

    The contract of each entry; the generic functions are the reference every backend's
    entries must agree with. ``residuals`` are opaque: only the ``*_bwd`` of the same
    table consumes them (the generic conv's are the list of stage inputs ``[x, after
    axis 0, ...]``).

    Parameters
    ----------
    sample_fwd : callable
        ``(xp, volume (B, C, *S), coords (B, Q, n)) -> (B, Q, C)``.
    sample_bwd : callable
        ``(xp, volume, coords, g (B, Q, C)) -> (d_volume, d_coords)``.
    splat_fwd : callable
        ``(xp, content (B, K, C), mu (B, K, n), sigma (B, K), shape, eps, radius)
        -> (B, C, *shape)``.
    splat_bwd : callable
        ``(xp, content, mu, sigma, shape, g (B, C, *shape), eps, radius) ->
        (d_content, d_mu, d_sigma)``.
    conv_fwd : callable
        ``(xp, x (B, C_in, *S), params) -> (z (B, C_out, *S), residuals)``.
    conv_bwd : callable
        ``(xp, residuals, params, g (B, C_out, *S)) -> (d_x, d_params)``.
    gates_fwd : callable
        ``(xp, z (B, 4C, *S), c (B, C, *S)) -> (h', c', residuals)`` (the LSTM update).
    gates_bwd : callable
        ``(xp, residuals, g_h, g_c (B, C, *S)) -> (d_z (B, 4C, *S), d_c)``.
    gates_residuals : callable
        ``(xp, z, c) -> residuals``: what ``gates_fwd`` would return as residuals,
        for the backward's recomputation, which needs no ``h', c'`` (a backend whose
        ``gates_bwd`` recomputes the gates returns ``(z, c)`` at no cost).
    workspace : callable
        ``(xp) -> context manager`` entered around the scan's loops, which consume
        each step's residuals before making the next step's; inside it a backend may
        reuse the memory of its per-step temporaries (the generic one does nothing).
    scan_fwd : callable or None, default None
        A fused whole-scan forward with the signature and results of
        :func:`tmcore.memory_scan_fwd` (positional, after ``xp``: the arrays, then
        ``eps, radius, checkpoint_every``; the keywords ``reset, active``: the per-step
        masks, ``None`` or bool ``(B, T)``); it returns None to decline (also for masks
        it cannot run), and the scan then runs its per-step loop.
    scan_bwd : callable or None, default None
        A fused whole-scan backward like :func:`tmcore.memory_scan_bwd` (the same
        conventions); returns None to decline.
    scatter_add : callable or None, default None
        ``(xp, out (N,), index (M,) integers, values (M,)) -> (N,)``, ``out`` with
        every ``values[i]`` added at ``index[i]`` (repeated indices sum; ``out`` may
        be updated in place: pass a buffer the caller owns and use the result). The
        array API has no scatter-add, so the generic table has none;
        :mod:`tmcore.ops.warp`'s flow VJP uses it when present (``O(2^n B C P)``
        instead of its generic ``O(B C P^2)`` tile contraction).
    local_scan_fwd : callable or None, default None
        A fused local scan (``update="local"``, the fast method) with the signature
        and results of :func:`tmcore.scan.local.local_scan_fwd` (positional, after
        ``xp``: the arrays, then ``window, eps, radius, overwrite_state``) and the
        same undo-log residuals (:class:`tmcore.scan.local.LocalScanResiduals`), so
        a forward on one path and a backward on the other agree; returns None to
        decline.
    local_scan_bwd : callable or None, default None
        Its backward, like :func:`tmcore.scan.local.local_scan_bwd` (after ``xp``:
        the arrays, then ``window, eps, radius``); returns None to decline.
    """

    sample_fwd: Any
    sample_bwd: Any
    splat_fwd: Any
    splat_bwd: Any
    conv_fwd: Any
    conv_bwd: Any
    gates_fwd: Any
    gates_bwd: Any
    gates_residuals: Any
    workspace: Any
    scan_fwd: Any = None  # optional fused memory_scan_fwd (tmcore.scan); None: per-step loop
    scan_bwd: Any = None  # optional fused memory_scan_bwd; either may return None to decline
    scatter_add: Any = None  # optional flat scatter-add (the flow warp's VJP); None: none
    local_scan_fwd: Any = None  # optional fused local scan (tmcore.scan.local); None: the loop
    local_scan_bwd: Any = None  # its backward; either may return None to decline


def no_workspace(xp: Any) -> contextlib.AbstractContextManager:
    """The generic ``workspace`` entry: nothing to reuse."""
    return contextlib.nullcontext()


#: ``(xp, generic, options) -> Ops``: a namespace's table (set by tmcore.backends)
Resolver = Callable[[Any, Ops, Options], Ops]
_GENERIC: list[Ops] = []
_RESOLVER: list[Resolver] = []
_CACHE: dict[tuple[Any, Options], Ops] = {}  # (namespace module, options) -> table


def generic_ops() -> Ops:
    """Give the generic array-API table (:data:`tmcore.ops.GENERIC`).

    Returns
    -------
    Ops
        The reference implementation of every primitive.
    """
    if not _GENERIC:  # importing tmcore (any of its modules) imports tmcore.ops
        raise RuntimeError("no generic table is registered: import tmcore first")
    return _GENERIC[0]


def register_generic(table: Ops) -> None:
    """Set the generic table (called once, by :mod:`tmcore.ops`)."""
    _GENERIC[:] = [table]
    clear_cache()


def register_resolver(resolve: Resolver) -> None:
    """Set how a namespace's table is found (called once, by :mod:`tmcore.backends`)."""
    _RESOLVER[:] = [resolve]
    clear_cache()


def clear_cache() -> None:
    """Forget every table built so far (a backend was registered or unregistered)."""
    _CACHE.clear()


def ops_for(xp: Any) -> Ops:
    """Give the :class:`Ops` table for a namespace under the current options.

    Parameters
    ----------
    xp : namespace
        The array namespace.

    Returns
    -------
    Ops
        The generic table when ``generic`` is forced or no backend accelerates
        ``xp``, else the backend's.
    """
    options = get_options()
    if options.generic or not _RESOLVER:
        return generic_ops()
    key = (xp, options)
    ops = _CACHE.get(key)
    if ops is None:
        ops = _CACHE[key] = _RESOLVER[0](xp, generic_ops(), options)
    return ops
