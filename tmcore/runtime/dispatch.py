"""Choose, per array namespace, the implementation of each primitive's forward and VJP.

Every public function and the scan step ask :func:`ops_for` for an :class:`Ops` table.
Registration is pushed here, never pulled by name: :mod:`tmcore.ops` registers the generic
table, :mod:`tmcore.backends` the resolver that finds a namespace's backend table. Tables
are cached per namespace and :class:`~tmcore.runtime.options.Options` value (under
``jax.jit``: chosen while tracing); registering anything empties the cache.
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

    The generic functions are the reference every backend's entries agree with (the guide:
    docs/guides/adding-a-backend.md). ``residuals`` are opaque: only the same table's
    ``*_bwd`` consumes them. The optional entries may return None to decline a call; the
    per-step loop then runs.

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
        ``(xp, z, c) -> residuals``: those of ``gates_fwd`` without ``h', c'`` (the
        backward's recomputation).
    workspace : callable
        ``(xp) -> context manager`` around the scan's loops, inside which a backend may reuse
        its per-step temporaries (each step's residuals are consumed before the next).
    scan_fwd, scan_bwd : callable or None, default None
        A fused whole scan with the signature and results of :func:`tmcore.memory_scan_fwd` /
        ``memory_scan_bwd`` (positional after ``xp``: the arrays, then ``eps, radius,
        checkpoint_every``; the keyword masks ``reset, active``, bool ``(B, T)`` or None).
    scatter_add : callable or None, default None
        ``(xp, out (N,), index (M,), values (M,)) -> (N,)``: ``out`` (updated in place or
        not) plus every ``values[i]`` at ``index[i]``; the flow warp's VJP uses it (the array
        API has no scatter-add).
    local_scan_fwd, local_scan_bwd : callable or None, default None
        A fused local scan like :func:`tmcore.scan.local.local_scan_fwd` /
        ``local_scan_bwd`` (after ``xp``: the arrays, then ``window, eps, radius`` and, forward,
        ``overwrite_state``), with the same undo-log residuals.
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
    scan_fwd: Any = None
    scan_bwd: Any = None
    scatter_add: Any = None
    local_scan_fwd: Any = None
    local_scan_bwd: Any = None


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
