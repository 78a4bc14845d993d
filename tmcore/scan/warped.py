"""Warped dynamics (``dynamics="warp"``): the state resampled before each update.

Per chunk ``t``:

1. read ``h_{t-1}`` at ``read_coords[:, t]`` (from the state BEFORE the warp, so the
   read is the default layer's and a warp moves what later chunks read);
2. warp the state, ``(h, c) <- warp(h, c, shift[:, t])`` (:func:`tmcore.ops.warp.warp_state`:
   n-linear resampling at the cell centres plus the shift, border padding; exactly the
   identity for a zero shift);
3. write and update the warped state (the dense step, or the local one).

The shift is the layer's ``warp_net`` head on the chunk's write summary
(:class:`WarpInputs`), zero at initialization, so the layer starts as the default. With
a flow (the layer's ``flow=True``, group ``warp_flow``) a per-cell flow
``conv(h_{t-1}) (B, n, *S)`` (a factorized conv, ``C -> n``) is added to the shift.
:class:`WarpStep` keeps the state entering every ``checkpoint_every``-th step (the warp
moves every cell, so no undo log applies) and replays each segment; the replay repeats
the forward's operations, so the values and gradients are those of ``k = 1``, bit for
bit (NumPy, PyTorch; a compiler such as XLA may round the replayed program differently).

Cost per step: the warp's is the grid's, ``O(B C P sum(S_a))`` for a shift (``P``
cells), forward and backward, so a warped local step is no longer independent of the
grid. With a flow the warp gathers ``2^n`` corners per cell, ``O(2^n B C P)``, and the
state's VJP through it is their scatter-add on PyTorch and JAX (the table's
``scatter_add``; JAX off the CPU only with ``deterministic=False``); the generic path
keeps its ``O(B C P^2)`` contraction over tiles of cells (:mod:`tmcore.ops.warp`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tmcore.ops.warp import warp_bwd, warp_fwd
from tmcore.runtime.dispatch import ops_for
from tmcore.scan.base import read_point, read_point_vjp
from tmcore.scan.dense import DenseStep
from tmcore.scan.local import LocalStep
from tmcore.types import ConvParams, WarpParams

__all__ = [ "WarpStep"]


def _warp(xp: Any, h: Any, c: Any, shift: Any, flow_params: ConvParams | None):
    """``(h_w, c_w, residuals, flow stages)``: both halves of the state warped by
    ``shift (B, n)`` plus, with ``flow_params``, the flow ``conv(h) (B, n, *S)``."""
    channels = h.shape[1]
    flow = stages = None
    if flow_params is not None:
        flow, stages = ops_for(xp).conv_fwd(xp, h, flow_params)
    out, residuals = warp_fwd(xp, xp.concat([h, c], axis=1), shift, flow)
    return out[:, :channels, ...], out[:, channels:, ...], residuals, stages


class WarpStep(NamedTuple):
    """The warped chunk step (:class:`tmcore.scan.base.Step`): read, warp, then ``update``'s
    write and update on the warped state. ``params``: :class:`WarpParams`; ``x``: a
    :class:`WarpInputs`. Hashable (a static ``jit`` argument).

    Parameters
    ----------
    update : DenseStep or LocalStep
        The write and update after the warp.
    """

    update: DenseStep | LocalStep

    policy = "checkpoint"
    workspace = False

    def write(self, xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
        return self.update.write(xp, x, shape)

    def write_vjp(self, xp: Any, x: Any, W: Any, g_W: Any) -> tuple[Any, Any, Any]:
        return self.update.write_vjp(xp, x, W, g_W)

    def advance(self, xp: Any, params: WarpParams, h: Any, c: Any, x: Any, W: Any):
        read = read_point(xp, h, x.read_coords)
        h, c, _, _ = _warp(xp, h, c, x.shift, params.flow)
        return (read, *self.update.update(xp, params.cell, h, c, x, W), None)

    def advance_vjp(self, xp: Any, params: WarpParams, h: Any, c: Any, x: Any, W: Any,
                    log: Any, g_read: Any, g_h: Any, g_c: Any):
        channels = h.shape[1]
        h_w, c_w, residuals, stages = _warp(xp, h, c, x.shift, params.flow)
        d_h, d_c, g_W, d_cell = self.update.update_vjp(xp, params.cell, h_w, c_w, x, W, g_h,
                                                       g_c)
        d_volume, d_shift, d_flow = warp_bwd(xp, residuals, xp.concat([d_h, d_c], axis=1))
        d_h, d_c = d_volume[:, :channels, ...], d_volume[:, channels:, ...]
        d_flow_params = None
        if params.flow is not None:  # the flow conv(h) reads the step's input state
            d_h_flow, d_flow_params = ops_for(xp).conv_bwd(xp, stages, params.flow, d_flow)
            d_h = d_h + d_h_flow
        d_read_volume, d_coords = read_point_vjp(xp, h, x.read_coords, g_read)
        return (d_h + d_read_volume, d_c, d_coords, d_shift, g_W,
                WarpParams(d_cell, d_flow_params))

    # the warp makes new arrays every step (nothing is updated in place): the identities
    # of the dense step
    own_state = DenseStep.own_state
    own_cotangents = DenseStep.own_cotangents

    def fused(self, xp: Any) -> tuple[Callable, Callable] | None:
        return None
