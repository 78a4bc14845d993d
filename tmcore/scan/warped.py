"""Warped dynamics (``dynamics="warp"``): per chunk read, warp the state
(:func:`tmcore.warp_state` by the chunk's shift, plus a flow ``conv(h_{t-1})`` with
``flow=True``), then the dense or local write and update; the backward checkpoints and
replays, as the warp moves every cell (docs/guides/local-and-warp.md).
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
    """``(h_w, c_w, residuals, flow stages)``: the state warped by ``shift (B, n)`` plus, with
    ``flow_params``, the flow ``conv(h) (B, n, *S)``."""
    channels = h.shape[1]
    flow = stages = None
    if flow_params is not None:
        flow, stages = ops_for(xp).conv_fwd(xp, h, flow_params)
    out, residuals = warp_fwd(xp, xp.concat([h, c], axis=1), shift, flow)
    return out[:, :channels, ...], out[:, channels:, ...], residuals, stages


class WarpStep(NamedTuple):
    """The warped chunk step: read, warp, then ``update``'s write and update (a :class:`DenseStep`
    or :class:`LocalStep`) on the warped state. ``params``: :class:`WarpParams`; ``x``: a
    :class:`WarpInputs`. Hashable (a static ``jit`` argument)."""

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
