"""JAX ``custom_vjp`` for the layer's scan with local updates and / or warped dynamics.

:func:`dynamic_scan` runs :func:`tmcore.scan.warped.scan_fwd` on JAX arrays (the local
scan's box fast path writes its boxes back with ``.at[].set``, :mod:`tmcore.ops.gather`)
and registers :func:`tmcore.scan.warped.scan_bwd` as its VJP. :class:`LayerScan` is the
layer's ``scan`` callable that :func:`tmcore.adapters.jax.apply` uses when the config
asks for ``update="local"`` or ``dynamics="warp"``.

The chunk loop is a Python loop (unrolled under ``jit``: compile time grows with the
number of chunks of one call; a streaming decode step compiles one chunk). Reverse mode
only. The residuals are the local scan's undo log, or with a warp the state entering
every ``options.checkpoint_every``-th chunk (the layer's ``checkpoint_every``,
``ceil(T / k)`` states of ``h`` and ``c``; the backward replays each segment).
Experimental, like the options.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tmcore.ops.conv import ConvParams
from tmcore.scan import warped as dynamics

__all__ = ["LayerScan", "dynamic_scan"]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def dynamic_scan(options: dynamics.ScanOptions, h0: jax.Array, c0: jax.Array, inputs: Any,
                 params: ConvParams, flow: ConvParams | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`tmcore.scan.warped.scan_fwd` with tmcore's VJP: ``(reads (B, T, C), h_T, c_T)``.

    ``inputs``: :class:`tmcore.StepInputs` or :class:`tmcore.scan.warped.WarpInputs` of
    ``(B, T, ...)`` arrays; ``options`` static (:func:`tmcore.scan.warped.scan_options`);
    ``flow``: the per-cell flow's :class:`tmcore.ConvParams` (``flow=True``) or ``None``.
    """
    reads, h, c, _ = _scan_fwd(options, False, h0, c0, inputs, params, flow)
    return reads, h, c


# jitted (inlined under an outer trace): called eagerly, one compiled function per shape
# instead of one dispatch (and one small compilation) per array operation of the loop
@partial(jax.jit, static_argnums=(0, 1))
def _scan_fwd(options, keep, h0, c0, inputs, params, flow):
    options = dynamics.check_options(options)  # (at trace time: options are static)
    return dynamics.scan_fwd(jnp, h0, c0, inputs, params, options, keep=keep,
                             flow_params=flow)


@partial(jax.jit, static_argnums=(0,))
def _scan_bwd(options, residuals, inputs, params, flow, g_reads, g_h, g_c):
    grads = dynamics.scan_bwd(jnp, residuals, inputs, params, options, g_reads, g_h, g_c,
                              flow_params=flow)
    return grads if flow is not None else (*grads, None)


def _fwd(options, h0, c0, inputs, params, flow):
    reads, h, c, residuals = _scan_fwd(options, True, h0, c0, inputs, params, flow)
    return (reads, h, c), (residuals, inputs, params, flow)


def _bwd(options, saved, cotangents):
    residuals, inputs, params, flow = saved
    return _scan_bwd(options, residuals, inputs, params, flow, *cotangents)


dynamic_scan.defvjp(_fwd, _bwd)


class LayerScan(NamedTuple):
    """The layer's ``scan`` callable for the local / warp options (the config's
    :class:`tmcore.scan.warped.ScanOptions`, the cell's parameters); its ``cond`` lets
    :mod:`tmcore.layer.stream` skip a decode step's update (``lax.cond``)."""

    options: dynamics.ScanOptions
    cell: ConvParams
    flow: ConvParams | None = None

    def __call__(self, h: jax.Array, c: jax.Array, inputs: Any) -> tuple[Any, Any, Any]:
        return dynamic_scan(self.options, h, c, inputs, self.cell, self.flow)

    @staticmethod
    def cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        return lax.cond(pred, true_fn, false_fn)
