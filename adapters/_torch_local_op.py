"""The local / warp scan as ``torch.library`` custom ops, for ``torch.compile``.

Eager calls use :class:`tmcore.adapters._torch_local.DynamicScanFunction` (it keeps the
scan's residuals, a Python structure, on its autograd context). While ``torch.compile``
traces, :meth:`tmcore.adapters.torch.TensorMemory._scan` calls :func:`layer_scan` here
instead: Dynamo cannot trace the scan's body (a Python loop with data-dependent window
positions and ``ContextVar`` lookups), so the scan is one opaque op in the graph, with a
fake implementation (the output shapes) and a registered autograd rule:

- ``tmcore::dynamic_scan(h0, c0, read_coords, write_coords, write_sigma, write_content,
  shift?, params[], options_id) -> (reads (B, T, C), h_T, c_T)`` runs
  :func:`tmcore.scan.warped.scan_fwd` without residuals;
- ``tmcore::dynamic_scan_backward(..., g_reads, g_h, g_c, options_id) -> grads[]``
  recomputes the forward with residuals, then runs :func:`tmcore.scan.warped.scan_bwd`:
  the eager Function's values and gradients, bit for bit, for one extra forward pass
  in the backward.

``params``: the cell's four :class:`tmcore.ConvParams` tensors, then (``flow=True``) the
flow's four. ``options_id``: the index of the call's
:class:`tmcore.scan.warped.ScanOptions` in this process's table (a custom op takes no
NamedTuple; the table keeps the schema independent of the options' fields).

First order only: the backward op has no autograd rule, so a double backward through
it raises a ``RuntimeError`` (as ``torch.compile``'s compiled backward refuses a double
backward anyway). No vmap rule, no ``torch.func`` transforms.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tmcore.ops.conv import ConvParams
from tmcore.scan import warped as dynamics
from tmcore.scan.dense import StepInputs

from ._torch_ops import _XP

__all__ = ["DOUBLE_BACKWARD", "layer_scan"]

#: The error of a double backward (``create_graph=True``) through the local / warp scan.
DOUBLE_BACKWARD = (
    "tmcore: double backward (create_graph=True) through the local / warp scan "
    "(update='local' or dynamics='warp') is not supported: its backward is first order "
    "only. Use the default layer for second-order gradients")

_OPTIONS: list[dynamics.ScanOptions] = []  # options_id -> ScanOptions (grows per config)
_FORWARD_SCHEMA = ("(Tensor h0, Tensor c0, Tensor read_coords, Tensor write_coords, "
                   "Tensor write_sigma, Tensor write_content, Tensor? shift, "
                   "Tensor[] params, int options_id")


@torch.compiler.assume_constant_result  # a constant of the traced graph
def _options_id(*fields: Any) -> int:
    """The table index of ``ScanOptions(*fields)`` (fields, not the NamedTuple: Dynamo
    passes a NamedTuple to this function wrongly)."""
    options = dynamics.ScanOptions(*fields)
    if options not in _OPTIONS:
        _OPTIONS.append(options)
    return _OPTIONS.index(options)


def _unpack(h0, c0, fields, shift, params, options_id):
    inputs = StepInputs(*fields) if shift is None else dynamics.WarpInputs(*fields, shift)
    flow = ConvParams(*params[4:]) if len(params) > 4 else None
    return inputs, ConvParams(*params[:4]), flow, _OPTIONS[options_id]


def _fresh(outputs: Any, inputs: Any) -> list[Tensor]:
    """``outputs`` as contiguous tensors owning their storage: a custom op's outputs may
    not share storage with its inputs nor with each other (a copy where one would)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    fresh = []
    for t in outputs:
        if t._base is not None or not t.is_contiguous() \
                or t.untyped_storage().data_ptr() in seen:
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        fresh.append(t)
    return fresh


@torch.library.custom_op("tmcore::dynamic_scan", mutates_args=(),
                         schema=_FORWARD_SCHEMA + ") -> (Tensor, Tensor, Tensor)")
def _scan_op(h0, c0, read_coords, write_coords, write_sigma, write_content, shift, params,
             options_id):
    fields = (read_coords, write_coords, write_sigma, write_content)
    inputs, cell, flow, options = _unpack(h0, c0, fields, shift, params, options_id)
    reads, h, c, _ = dynamics.scan_fwd(_XP, h0, c0, inputs, cell, options, keep=False,
                                       flow_params=flow)
    primals = (h0, c0, *fields, shift, *params)
    reads, h, c = _fresh((reads, h, c), primals)
    return reads, h, c


@_scan_op.register_fake
def _scan_fake(h0, c0, read_coords, write_coords, write_sigma, write_content, shift, params,
               options_id):
    batch, steps = read_coords.shape[:2]
    reads = h0.new_empty((batch, steps, h0.shape[1]))
    return reads, torch.empty_like(h0), torch.empty_like(c0)


@torch.library.custom_op("tmcore::dynamic_scan_backward", mutates_args=(),
                         schema=_FORWARD_SCHEMA.replace(
                             ", int options_id", ", Tensor g_reads, Tensor g_h, Tensor g_c, "
                             "int options_id") + ") -> Tensor[]")
def _scan_backward_op(h0, c0, read_coords, write_coords, write_sigma, write_content, shift,
                      params, g_reads, g_h, g_c, options_id):
    fields = (read_coords, write_coords, write_sigma, write_content)
    inputs, cell, flow, options = _unpack(h0, c0, fields, shift, params, options_id)
    _, _, _, residuals = dynamics.scan_fwd(_XP, h0, c0, inputs, cell, options, keep=True,
                                           flow_params=flow)
    d_h, d_c, d_inputs, d_cell, *d_flow = dynamics.scan_bwd(
        _XP, residuals, inputs, cell, options, g_reads.contiguous(), g_h.contiguous(),
        g_c.contiguous(), flow_params=flow)
    grads = [d_h, d_c, *d_inputs[:4], *((d_inputs.shift,) if shift is not None else ()),
             *d_cell, *(d_flow[0] if d_flow else ())]
    return _fresh(grads, (h0, c0, *fields, shift, *params, g_reads, g_h, g_c))


@_scan_backward_op.register_fake
def _scan_backward_fake(h0, c0, read_coords, write_coords, write_sigma, write_content, shift,
                        params, g_reads, g_h, g_c, options_id):
    primals = (h0, c0, read_coords, write_coords, write_sigma, write_content,
               *((shift,) if shift is not None else ()), *params)
    return [torch.empty_like(p) for p in primals]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    *tensors, shift, params, options_id = inputs
    ctx.save_for_backward(*tensors, *((shift,) if shift is not None else ()), *params)
    ctx.has_shift, ctx.options_id = shift is not None, options_id


def _grad(ctx: Any, g_reads: Tensor, g_h: Tensor, g_c: Tensor) -> tuple:
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
        raise RuntimeError(DOUBLE_BACKWARD)
    saved = ctx.saved_tensors
    split = 7 if ctx.has_shift else 6
    tensors, shift, params = saved[:6], saved[6] if ctx.has_shift else None, saved[split:]
    h0, c0, read_coords = tensors[:3]
    if g_reads is None:  # an unused output: zeros of its shape
        g_reads = h0.new_zeros((*read_coords.shape[:2], h0.shape[1]))
    g_h = torch.zeros_like(h0) if g_h is None else g_h
    g_c = torch.zeros_like(c0) if g_c is None else g_c
    grads = _scan_backward_op(*tensors, shift, list(params), g_reads, g_h, g_c,
                              ctx.options_id)
    d_shift = grads[6] if ctx.has_shift else None
    return (*grads[:6], d_shift, list(grads[split:]), None)


_scan_op.register_autograd(_grad, setup_context=_setup)


def layer_scan(options: dynamics.ScanOptions, h0: Tensor, c0: Tensor, inputs: Any,
               params: ConvParams, flow_params: ConvParams | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`tmcore.adapters._torch_local.layer_scan` as the custom op ``tmcore::dynamic_scan``
    (what ``torch.compile`` traces): ``inputs`` a :class:`tmcore.StepInputs` or
    :class:`tmcore.scan.warped.WarpInputs` of ``(B, T, ...)`` tensors, ``h0, c0 (B, C, *S)``;
    returns ``reads (B, T, C), h_T, c_T``."""
    shift = getattr(inputs, "shift", None)
    return _scan_op(h0, c0, *inputs[:4], shift, [*params, *(flow_params or ())],
                    _options_id(*options))
