"""PyTorch autograd for the layer's scan with local updates and / or warped dynamics.

:class:`DynamicScanFunction` runs :func:`tmcore.scan.warped.scan_fwd` (tmcore's array-API
code on torch tensors: the local scan's box fast path, the warp) and registers
:func:`tmcore.scan.warped.scan_bwd` as its backward. :func:`layer_scan` is what
:class:`tmcore.adapters.torch.TensorMemory` calls when its config asks for
``update="local"`` or ``dynamics="warp"``; the default layer keeps its custom-op scan.

The backward's residuals are those of :func:`tmcore.scan.warped.scan_fwd`: with a warp,
the state entering every ``options.checkpoint_every``-th chunk (the layer's
``checkpoint_every``), ``ceil(T / k)`` states of ``h`` and ``c``, each segment replayed
in the backward; without warp, the local scan's undo log.

Eager autograd, first order: a double backward raises a ``RuntimeError``. While
``torch.compile`` traces, the module calls the custom op of
:mod:`tmcore.adapters._torch_local_op` instead. No ``torch.func`` transforms. The local
scan without warp runs the backend's fused local scan where it applies (C kernels on
the CPU, Triton on CUDA); the warp is the generic path on any device, with the
backend's fast ops inside it. Experimental, like the options.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tmcore.ops.conv import ConvParams
from tmcore.scan import warped as dynamics
from tmcore.scan.dense import StepInputs

from . import _torch_local_op
from ._torch_ops import _XP

__all__ = ["DynamicScanFunction", "WarpFlow", "layer_scan"]


class WarpFlow(nn.Module):
    """The ``warp_flow`` group (``flow=True``): the :class:`tmcore.ConvParams` of the
    per-cell flow ``conv(h) (B, n, *S)``: ``depthwise_weight (n, C, 3)``,
    ``depthwise_bias (n, C)``, ``pointwise_weight (n, C)``, ``pointwise_bias (n,)``
    (initialized by :func:`tmcore.layer.param_specs`: identity taps, zeros)."""

    def __init__(self, channels: int, ndim: int, **kw: Any):
        super().__init__()
        shapes = {"depthwise_weight": (ndim, channels, 3), "depthwise_bias": (ndim, channels),
                  "pointwise_weight": (ndim, channels), "pointwise_bias": (ndim,)}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, **kw)))

    def params(self) -> ConvParams:
        return ConvParams(self.depthwise_weight, self.depthwise_bias, self.pointwise_weight,
                          self.pointwise_bias)


def _own(t: Tensor) -> Tensor:
    """``t``, or a copy when it is a view (outputs of the Function own their storage)."""
    return t if t._base is None else t.clone()


class DynamicScanFunction(torch.autograd.Function):
    """``apply(options, keep, h0, c0, read_coords, write_coords, write_sigma, write_content,
    shift or None, *params, *flow_params) -> (reads (B, T, C), h_T, c_T)``; ``keep``: store
    the residuals for a backward (``ctx.residuals``, a
    :class:`tmcore.scan.warped.DynamicResiduals`: with a shift, the ``ceil(T / k)``
    checkpoint states, ``k = options.checkpoint_every``); ``flow_params``: none, or the
    four tensors of the per-cell flow's :class:`tmcore.ConvParams` (with a shift)."""

    @staticmethod
    def forward(ctx: Any, options: dynamics.ScanOptions, keep: bool, h0: Tensor, c0: Tensor,
                read_coords: Tensor, write_coords: Tensor, write_sigma: Tensor,
                write_content: Tensor, shift: Tensor | None, *tensors: Tensor):
        fields = (read_coords, write_coords, write_sigma, write_content)
        inputs = StepInputs(*fields) if shift is None else dynamics.WarpInputs(*fields, shift)
        params = ConvParams(*tensors[:4])
        flow = ConvParams(*tensors[4:]) if len(tensors) > 4 else None
        options = dynamics.check_options(options)
        reads, h, c, residuals = dynamics.scan_fwd(_XP, h0, c0, inputs, params, options,
                                                   keep=keep, flow_params=flow)
        ctx.options, ctx.residuals, ctx.has_shift = options, residuals, shift is not None
        ctx.has_flow = flow is not None
        ctx.save_for_backward(*fields, *((shift,) if shift is not None else ()), *tensors)
        return _own(reads), _own(h), _own(c)

    @staticmethod
    def backward(ctx: Any, g_reads: Tensor, g_h: Tensor, g_c: Tensor):
        if torch.is_grad_enabled():  # create_graph=True: refused, not silently first order
            raise RuntimeError(_torch_local_op.DOUBLE_BACKWARD)
        if ctx.residuals is None:
            raise RuntimeError("tmcore: this local / warp scan ran without residuals "
                               "(no input required grad when it ran)")
        saved = ctx.saved_tensors
        split = 5 if ctx.has_shift else 4
        fields, params = saved[:split], ConvParams(*saved[split:split + 4])
        flow = ConvParams(*saved[split + 4:]) if ctx.has_flow else None
        inputs = dynamics.WarpInputs(*fields) if ctx.has_shift else StepInputs(*fields)
        d_h, d_c, d_inputs, d_params, *d_flow = dynamics.scan_bwd(
            _XP, ctx.residuals, inputs, params, ctx.options, g_reads.contiguous(),
            g_h.contiguous(), g_c.contiguous(), flow_params=flow)
        d_shift = d_inputs.shift if ctx.has_shift else None
        return (None, None, d_h, d_c, *d_inputs[:4], d_shift, *d_params,
                *(d_flow[0] if d_flow else ()))


def layer_scan(options: dynamics.ScanOptions, h0: Tensor, c0: Tensor, inputs: Any,
               params: ConvParams, flow_params: ConvParams | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's ``scan(h0, c0, inputs)`` with ``options``
    (:func:`tmcore.scan.warped.scan_options` of the layer's config) and autograd.

    ``inputs``: :class:`tmcore.StepInputs` or :class:`tmcore.scan.warped.WarpInputs` of
    ``(B, T, ...)`` tensors (from :func:`tmcore.layer.heads`); ``flow_params``: the
    ``warp_flow`` group's :class:`tmcore.ConvParams` (``flow=True``)."""
    shift = getattr(inputs, "shift", None)
    tensors = (h0, c0, *inputs[:4], shift, *params, *(flow_params or ()))
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return DynamicScanFunction.apply(options, keep, *tensors)
