"""A decode token of the torch module in one native call: on the CPU the C kernel ``token_fwd``
(backends/native/token.inc), on CUDA the Triton launches of :mod:`tmcore.backends.triton.token`.

Generation feeds one token per call. Without autograd the whole token (what it computes:
``token_fwd`` in backends/native/kernels.c) is one kernel call on the CPU and one to four
launches on CUDA, instead of some twenty torch ops.

The weights are checked once into a :class:`TokenWeights` (kind, dtype, device, layout and
the config's shapes: the kernels index them by those); a token compares only what could
have changed since (:func:`weights_key`). :func:`decode_token` checks the state per call and
returns ``None`` where it does not apply, so that the layer's own path runs (the reference it
is tested against).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from tmcore.backends.fused import untraced
from tmcore.backends.native.calls import call
from tmcore.backends.triton import launch as triton
from tmcore.backends.triton import token as triton_token
from tmcore.layer.config import LayerConfig
from tmcore.layer.params import GATE_SHAPE, param_specs
from tmcore.layer.state import StreamState
from tmcore.runtime.options import get_options

from .scan import _centres, _small, scan_kernels

__all__ = ["LINEARS", "TokenWeights", "decode_token", "run_token", "token_weights",
           "weights_key"]

#: the weights' slots of the kernel's inputs: the norm's weight and bias, then each linear's
LINEARS = ("coord_net", "content_net", "sigma_net", "write_proj", "out_proj")
_CELL = ("depthwise_weight", "depthwise_bias", "pointwise_weight", "pointwise_bias")
_GATE = 2 + 2 * len(LINEARS)  # its slot
_OPTIONAL = (0, 1, _GATE)  # the norm's weight and bias, the gate (the memory alone: none)
_PTR, _SIZE, _CONTIGUOUS = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.is_contiguous


def weights_key(weights: Sequence[torch.Tensor | None], norm_eps: float | None) -> tuple:
    """What the kernel trusts of ``weights`` that may change between tokens, cheap to compare:
    each tensor object, its address, sizes and contiguity (``p.data = ...`` keeps the object
    and may change the other three; in-place updates change none of them and need no
    check: the kernel reads the values at each call), and the norm's eps."""
    present = [t for t in weights if t is not None]
    return (norm_eps, *map(id, weights), *map(_PTR, present), *map(_SIZE, present),
            *map(_CONTIGUOUS, present))


class TokenWeights(NamedTuple):
    """A decode token's weights, checked (:func:`token_weights`).

    ``key`` is :func:`weights_key` of ``tensors`` (kept here, so that their ids stay
    theirs: a replaced weight's memory is freed when its module's next token rebuilds this,
    or the module is collected); ``pointers`` their addresses in the C kernel's order, then
    the cell centres';
    ``scalars`` the kernel's constants; ``sizes`` its sizes per batch and row stride.
    """

    key: tuple
    tensors: tuple[torch.Tensor | None, ...]
    dtype: torch.dtype
    device: torch.device
    residual: bool
    layer_norm: bool
    pointers: tuple[int | None, ...]
    scalars: ctypes.Array
    sizes: dict[tuple[int, int], ctypes.Array]


def token_weights(weights: Sequence[torch.Tensor | None], config: LayerConfig, *,
                  norm_eps: float | None, min_sigma: float,
                  softplus_threshold: Callable[[torch.dtype], float]) -> TokenWeights | None:
    """Check a decode token's weights once, or ``None`` where the kernel cannot take them.

    Parameters
    ----------
    weights : sequence of Tensor or None
        The norm's weight and bias (``(d,)`` each, or None), the weight and bias of each of
        :data:`LINEARS` (the config's shapes), the gate ``(1,)`` (None: the memory alone,
        no residual), the cell's ``depthwise_weight, depthwise_bias, pointwise_weight,
        pointwise_bias``.
    config : LayerConfig
        The layer's (the paper's dense update).
    norm_eps : float or None
        The LayerNorm's eps, or None for no norm.
    min_sigma : float
        The heads' least sigma (the layer's).
    softplus_threshold : callable
        The layer's softplus threshold for a dtype.

    Returns
    -------
    TokenWeights or None
        None unless every tensor is a plain untraced contiguous float32 / float64 tensor of
        one dtype and device with the shape the kernels index it by.
    """
    specs = {(spec.group, spec.leaf): spec.shape for spec in param_specs(config)}
    d = config.embed_dim
    shapes = [(d,), (d,), *(specs[name, leaf] for name in LINEARS for leaf in ("weight", "bias")),
              GATE_SHAPE, *(specs["cell", leaf] for leaf in _CELL)]
    present = [t for t in weights if t is not None]
    if len(weights) != len(shapes) or not untraced(tuple(present)) \
            or any(t is None for i, t in enumerate(weights) if i not in _OPTIONAL):
        return None
    dtype, device = present[0].dtype, present[0].device
    if dtype not in (torch.float32, torch.float64):
        return None
    for t, shape in zip(weights, shapes, strict=True):
        if t is not None and (tuple(t.shape) != shape or not t.is_contiguous()
                              or t.device != device or t.layout != torch.strided or t.is_nested):
            return None
    centres = _centres(config.memory_shape, dtype, device)[0]
    scalars = (0.0 if norm_eps is None else float(norm_eps), config.eps,
               -1.0 if config.radius is None else float(config.radius), config.sigma_scale,
               min_sigma, softplus_threshold(dtype))
    return TokenWeights(weights_key(weights, norm_eps), tuple(weights), dtype, device,
                        weights[_GATE] is not None, norm_eps is not None,
                        (*(None if t is None else t.data_ptr() for t in weights),
                         centres.data_ptr()),
                        (ctypes.c_double * len(scalars))(*scalars), {})


def _sizes(weights: TokenWeights, config: LayerConfig, batch: int,
           row_stride: int) -> ctypes.Array:
    """The kernel's sizes, made once per batch and row stride."""
    sizes = weights.sizes.get((batch, row_stride))
    if sizes is None:
        shape = config.memory_shape
        values = (batch, config.embed_dim, config.chunk_size, config.memory_channels,
                  len(shape), int(weights.residual), int(weights.layer_norm), row_stride, *shape)
        sizes = weights.sizes[batch, row_stride] = (ctypes.c_int64 * len(values))(*values)
    return sizes


def decode_token(x: torch.Tensor, state: StreamState, config: LayerConfig,
                 weights: TokenWeights) -> tuple[torch.Tensor, StreamState] | None:
    """One token ``x (B, 1, d)`` of every row, or ``None`` to decline.

    Parameters
    ----------
    x : Tensor, shape ``(B, 1, d)``
        The token (the residual's input; the memory reads its norm).
    state : StreamState
        ``h, c (B, C, *S)``, ``pending (B, L, d)``, ``count (B,)`` int32, ``read (B, C)``.
    config : LayerConfig
        The layer's (the paper's dense update: no option of :mod:`tmcore.scan.options`).
    weights : TokenWeights
        Its weights (:func:`token_weights`), in ``x``'s dtype.

    Returns
    -------
    (out, state) or None
        ``out (B, 1, d)`` (``x + sigmoid(gate) * read_out`` with a gate, else the read-out)
        and the new :class:`StreamState`, as the layer's decode step gives them (to
        rounding); None where no kernel applies (autograd on; not a plain call in the
        weights' dtype and device; on the CPU a grid above the one-call step's bound, on
        CUDA 4 spatial axes; a state of other shapes or counts out of range).
    """
    h, c, pending, count, read = state
    batch, _, d = x.shape
    length, channels, shape = config.chunk_size, config.memory_channels, config.memory_shape
    if torch.is_grad_enabled() or not batch or not isinstance(count, torch.Tensor) \
            or count.dtype != torch.int32 or tuple(count.shape) != (batch,) \
            or tuple(h.shape) != (batch, channels, *shape) or c.shape != h.shape \
            or d != config.embed_dim or tuple(pending.shape) != (batch, length, d) \
            or tuple(read.shape) != (batch, channels) or x.stride(2) != 1:
        return None  # (x's rows may lie apart: a slice of a longer sequence)
    if x.dtype != weights.dtype or x.device != weights.device \
            or torch.is_autocast_enabled(x.device.type) or not untraced((count,)) \
            or count.device != x.device:
        return None
    kernels = scan_kernels(get_options(), h, c, pending, read, x)
    on_triton = kernels is None and triton.usable(h, c, pending, read, x)
    if (kernels is None or not _small(h)) and not on_triton:
        return None
    state = StreamState(h.contiguous(), c.contiguous(), pending.contiguous(),
                        count.contiguous(), read.contiguous())  # (views: copied dense)
    slots = state.count.tolist()  # (on CUDA a sync, as the layer's path has)
    if min(slots) < 0 or max(slots) >= length:
        return None
    if on_triton:
        return triton_token.decode_token(x, state, slots, config, weights)
    return run_token(x, state, slots, config, weights, kernels)


def run_token(x: torch.Tensor, state: StreamState, slots: list[int], config: LayerConfig,
              weights: TokenWeights, kernels: tuple) -> tuple[torch.Tensor, StreamState]:
    """:func:`decode_token`'s kernel call on what it checked: ``state`` dense, ``slots`` its
    counts (each in ``0 .. L-1``), ``kernels`` for ``x``'s dtype. Nothing is checked here
    (benchmarks time it as the floor of any checks around the kernel)."""
    h, c, pending, count, read = state
    batch, _, d = x.shape
    length, channels, dtype = config.chunk_size, config.memory_channels, x.dtype
    complete = length - 1 in slots
    y = torch.empty((batch, 1, d), dtype=dtype)
    pending_out = torch.empty((batch, length, d), dtype=dtype)
    read_out = torch.empty((batch, channels), dtype=dtype) if complete or 0 in slots else read
    h_out, c_out = (torch.empty_like(h), torch.empty_like(c)) if complete else (h, c)
    count_out = torch.empty_like(count)
    in_ptrs = (ctypes.c_void_p * 24)(x.data_ptr(), pending.data_ptr(), h.data_ptr(),
                                     c.data_ptr(), read.data_ptr(), *weights.pointers,
                                     count.data_ptr())
    out_ptrs = (ctypes.c_void_p * 6)(y.data_ptr(), pending_out.data_ptr(), read_out.data_ptr(),
                                     h_out.data_ptr(), c_out.data_ptr(), count_out.data_ptr())
    call(kernels, "token_fwd", in_ptrs, out_ptrs, _sizes(weights, config, batch, x.stride(0)),
         weights.scalars)
    return y, StreamState(h_out, c_out, pending_out, count_out, read_out)
