"""PyTorch adapter: autograd-aware ops, the Tensor Memory layer, attaching it to models.

Quick start::

    import torch
    from tmcore.adapters.torch import TensorMemory, MemoryResidual

    memory = TensorMemory(embed_dim=128, memory_channels=32, memory_shape=(8, 8, 8),
                          chunk_size=16)
    layer = MemoryResidual(memory, gate_init=0.0)    # x + sigmoid(gate) * memory(norm(x))
    x = torch.randn(8, 256, 128)                      # (B, N, d)
    y, state = layer(x)                               # a StreamState: h, c (B, C, *S), ...
    y2, state = layer(torch.randn(8, 256, 128), state)  # streaming: carry the state
    y3, (h, c) = layer(x, stream=False)               # the reference: ragged chunk padded

The layer itself (config checks, parameter plan, heads, chunking, reset, modes,
stored-grid check) is :mod:`tmcore.layer`; this module only holds it in
``nn.Module`` s, registers tmcore's VJPs with autograd and attaches memories to
models (:mod:`tmcore.adapters._torch_attach`).

Gradients come from tmcore's hand-written VJPs, registered as
``torch.library`` custom ops (``torch.ops.tmcore.*``, see
:mod:`tmcore.adapters._torch_ops`): they work in eager mode, under
``torch.compile`` (``fullgraph=True``, no graph breaks), with ``torch.func``
(``grad``, ``vmap`` by looping over the mapped dimension, per-sample
gradients), DDP and FSDP (FSDP1 and ``fully_shard``). Second-order gradients
work in eager mode (``create_graph=True``); third order, Hessians through
nested ``torch.func.grad`` and double backward of a compiled model do not.
Forward mode (``torch.func.jvp``, ``jacfwd``) is not available: it raises a
``NotImplementedError`` saying so. ``torch.jit.trace`` / ``torch.jit.script``
are not supported (the layer runs Python per chunk and calls custom ops with
Python-side validation); use ``torch.compile`` or ``torch.export``-free eager.
Returned gradients are contiguous. Under ``no_grad`` (or when nothing requires
grad) the scan keeps no checkpoints, so inference memory does not grow with
the sequence.

Multi-layer modes (:func:`attach_memory`): ``"causal"`` (every layer scans from
the segment's initial state, a read at chunk ``t`` sees only tokens before
chunk ``t`` plus the chunk's first token: right for language models) and
``"threaded"`` (the paper's reference: layer ``l`` starts from the state layer
``l-1`` reached after the whole sequence; NOT causal, every position sees
later tokens: only for bidirectional inputs such as images or clips).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tmcore import layer as tl
from tmcore.adapters import _torch_ops
from tmcore.adapters._torch_attach import MemoryHandle, blocks_of, detach_state
from tmcore.ops.conv import ConvParams, as_conv_params
from tmcore.ops.sample import validate_sample_inputs
from tmcore.ops.splat import DEFAULT_EPS, validate_splat_inputs
from tmcore.runtime.validate import check_finite, check_flag, check_int
from tmcore.scan.dense import validate_scan_inputs
from tmcore.scan.options import scan_options

__all__ = [
    "ConvLSTMCell",
    "GatedMemoryResidual",
    "MODES",
    "MemoryHandle",
    "MemoryResidual",
    "StreamState",
    "TensorMemory",
    "attach_memory",
    "convert_reference_state_dict",
    "detach_memory",
    "detach_state",
    "doc_starts_from_offsets",
    "gaussian_splat",
    "memory_scan",
    "option_scan",
    "state_from_dict",
    "state_to_dict",
    "trilinear_sample",
]

#: Multi-layer modes of :func:`attach_memory` (:data:`tmcore.layer.MODES`).
MODES = tl.MODES
State = tuple[Tensor, Tensor]
# The state between streamed calls (tmcore.layer.StreamState, documented there): (h, c) at
# the last chunk boundary plus the unfinished chunk's tokens, their count and its read.
StreamState = tl.StreamState
_XP = _torch_ops._XP


# --------------------------------------------------------------------------- functional ops


def trilinear_sample(volume: Tensor, coords: Tensor) -> Tensor:
    """Sample a volume at coordinates, with autograd (tmcore.trilinear_sample).

    Same checks (and validate mode), dispatch and float16 / bfloat16 rule as
    :func:`tmcore.trilinear_sample`; the gradient is its hand-written VJP.

    Parameters
    ----------
    volume : Tensor, shape ``(B, C, *S)``
        The volume, ``n = len(S)`` spatial axes (1 to 4).
    coords : Tensor, shape ``(B, Q, n)``
        Coordinates in ``[-1, 1]``, ``coords[..., k]`` addressing spatial axis
        ``n - 1 - k`` (``grid_sample``'s order); clamped to the border.

    Returns
    -------
    Tensor, shape ``(B, Q, C)``
        The n-linear interpolation of ``volume`` at each coordinate.

    Raises
    ------
    TypeError
        If an argument is not a floating tensor.
    ValueError
        If the shapes do not fit, or (validate mode) a value is not finite.
    """
    validated = not torch.compiler.is_compiling()  # (Dynamo cannot trace the validator)
    if validated:
        validate_sample_inputs(volume, coords)
    return _torch_ops.call(_torch_ops.TrilinearSampleFunction, _torch_ops.trilinear_sample_op,
                          volume, coords, validated=validated)


def gaussian_splat(
    content: Tensor, mu: Tensor, sigma: Tensor, shape: Sequence[int], *,
    eps: float = DEFAULT_EPS, radius: float | None = None,
) -> Tensor:
    """Write contents as Gaussians into a volume, with autograd (tmcore.gaussian_splat).

    Same checks (and validate mode), dispatch and float16 / bfloat16 rule as
    :func:`tmcore.gaussian_splat`; the gradient is its hand-written VJP.

    Parameters
    ----------
    content : Tensor, shape ``(B, K, C)``
        What each of the ``K`` writes adds.
    mu : Tensor, shape ``(B, K, n)``
        The writes' centres in ``[-1, 1]`` (``grid_sample``'s axis order).
    sigma : Tensor, shape ``(B, K)``
        The writes' spreads (> 0, normalized units).
    shape : sequence of int
        The grid ``S`` (``n`` = its length, 1 to 4).
    eps : float, default 1e-6
        Added to ``2 sigma^2`` in the exponent's denominator (>= 0).
    radius : float or None, default None
        Truncate each write at ``radius * sigma`` (None: dense).

    Returns
    -------
    Tensor, shape ``(B, C, *shape)``
        ``sum_k content[b, k] * exp(-|p - mu_bk|^2 / (2 sigma_bk^2 + eps))`` at every
        cell centre ``p``.

    Raises
    ------
    TypeError
        If an argument is not a floating tensor, or ``shape`` not ints.
    ValueError
        If the shapes do not fit, ``radius`` or ``eps`` is out of range, or
        (validate mode) a value is not finite or ``sigma <= 0``.
    """
    validated = not torch.compiler.is_compiling()  # (Dynamo cannot trace the validator)
    dims = validate_splat_inputs(content, mu, sigma, shape, radius=radius, eps=eps)[1] \
        if validated else tuple(shape)
    return _torch_ops.call(_torch_ops.GaussianSplatFunction, _torch_ops.gaussian_splat_op,
                          content, mu, sigma, list(dims), float(eps),
                          None if radius is None else float(radius), validated=validated)


#: ``checkpoint_every`` of a scan that needs no backward: larger than any ``T``, so only
#: the initial state is kept (``ceil(T / k) = 1``)
_NO_GRAD_CHECKPOINT_EVERY = 2**31 - 1


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def memory_scan(
    h0: Tensor, c0: Tensor, read_coords: Tensor, write_coords: Tensor, write_sigma: Tensor,
    write_content: Tensor, params: ConvParams, *, eps: float = DEFAULT_EPS,
    radius: float | None = None, checkpoint_every: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the chunk recurrence (read, write, update) with autograd (tmcore.memory_scan).

    The gradient is tmcore's hand-written scan VJP. ``checkpoint_every = k``
    keeps ``ceil(T / k)`` states for the backward; when no gradient is needed
    (``no_grad``, or no input requires grad) only the initial state is kept, so
    inference memory does not grow with ``T``. The arguments are checked by
    :func:`tmcore.scan.validate_scan_inputs` (once: the op does not check them
    again); under ``torch.compile`` the same shape checks run once, at trace
    time, in the op's fake implementation (values of fake tensors are never read).

    Parameters
    ----------
    h0 : Tensor, shape ``(B, C, *S)``
        The hidden state entering the first step.
    c0 : Tensor, shape ``(B, C, *S)``
        The cell state entering the first step.
    read_coords : Tensor, shape ``(B, T, n)``
        Each step's read position, ``[-1, 1]``.
    write_coords : Tensor, shape ``(B, T, n)``
        Each step's write centre.
    write_sigma : Tensor, shape ``(B, T)``
        Each step's write spread (> 0).
    write_content : Tensor, shape ``(B, T, C)``
        Each step's written content.
    params : ConvParams
        The gate conv's tensors (:meth:`ConvLSTMCell.params`).
    eps : float, default 1e-6
        As in :func:`gaussian_splat`.
    radius : float or None, default None
        As in :func:`gaussian_splat`.
    checkpoint_every : int, default 1
        Keep every ``k``-th state for the backward and recompute the rest.

    Returns
    -------
    reads : Tensor, shape ``(B, T, C)``
        Step ``t``'s read, of the state before its write.
    h : Tensor, shape ``(B, C, *S)``
        The final hidden state.
    c : Tensor, shape ``(B, C, *S)``
        The final cell state.

    Raises
    ------
    TypeError
        If an argument is not a tensor of a floating dtype, or ``params`` is
        not a 4-tuple (each error names the argument).
    ValueError
        If the shapes do not fit, a size option is out of range, or (validate
        mode) a value is not finite or ``write_sigma <= 0``.
    """
    params = as_conv_params(params)
    if not torch.compiler.is_compiling():  # Dynamo cannot trace the validator's ContextVar
        validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma, write_content,
                             params, checkpoint_every, radius, eps=eps)
    tensors = (h0, c0, read_coords, write_coords, write_sigma, write_content, *params)
    if not _needs_grad(*tensors):
        # one checkpoint (h0, c0) whatever T: a constant, not T itself, so that a compiled
        # no_grad call does not specialize on (and recompile for) each sequence length
        checkpoint_every = _NO_GRAD_CHECKPOINT_EVERY
    reads, h, c, _, _ = _torch_ops.call(
        _torch_ops.MemoryScanFunction, _torch_ops.memory_scan_op, *tensors,
        float(eps), None if radius is None else float(radius), int(checkpoint_every),
        validated=True,  # checked above (the op's eager forward would check them again)
    )
    return reads, h, c


#: The layer's scan with its options beyond the paper (``update="local"``,
#: ``dynamics="warp"``), with autograd (:func:`tmcore.adapters._torch_ops.option_scan`).
option_scan = _torch_ops.option_scan


def doc_starts_from_offsets(offsets: Sequence[Any], tokens: int, *, device: Any = None
                            ) -> Tensor:
    """Turn ``cu_seqlens``-style document offsets into a per-token document-start mask.

    Parameters
    ----------
    offsets : sequence of int, or sequence of sequences of int
        For one row, the increasing start offsets of its documents (e.g. ``[0, 5,
        12]``, optionally ending with ``tokens``); or one such list per row.
    tokens : int
        ``N``, the tokens per row.
    device : torch.device, str or None, optional
        Where the mask is made.

    Returns
    -------
    Tensor, shape ``(B, tokens)``, bool
        True at each document start: :meth:`TensorMemory.forward`'s
        ``doc_starts`` (:func:`tmcore.layer.doc_starts_from_offsets`).

    Raises
    ------
    ValueError
        If the offsets of a row are not increasing or not in ``[0, tokens]``.
    """
    return tl.doc_starts_from_offsets(_XP, offsets, tokens, device=device)


# --------------------------------------------------------------------------- layer


def _check_like_params(name: str, value: Tensor, ref: Tensor, check_dtype: bool) -> None:
    """``ValueError`` unless ``value`` is on ``ref``'s device; ``TypeError`` unless it has
    ``ref``'s dtype (when ``check_dtype``). ``name`` leads the message."""
    if value.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on the parameters' device {ref.device}, "
                         f"got one on {value.device}")
    if check_dtype and value.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (the parameters'), "
                        f"got {value.dtype}")


def _init_from_plan(params: Mapping[str, Tensor], config: tl.LayerConfig, groups: Sequence[str]
                    ) -> None:
    """Fill ``params`` (``"group.leaf"`` -> parameter) from :func:`tmcore.layer.param_specs`,
    drawing the random ones with torch's RNG in state-dict order."""
    ref = next(iter(params.values()))

    def uniform(spec: tl.ParamSpec) -> Tensor:
        return torch.empty(spec.shape, dtype=ref.dtype, device=ref.device).uniform_(
            -spec.bound, spec.bound)

    values = tl.init_params(_XP, config, uniform, dtype=ref.dtype, device=ref.device,
                            groups=groups)
    with torch.no_grad():
        for group, leaves in values.items():
            for leaf, value in leaves.items():
                params[f"{group}.{leaf}"].copy_(value)


def _cell_config(channels: int, ndim: int, forget_bias: float) -> tl.LayerConfig:
    return tl.layer_config(1, channels, (1,) * ndim, 1, forget_bias=forget_bias)


class ConvLSTMCell(nn.Module):
    """The ConvLSTM update of the memory grid: its gate conv's parameters and one step.

    The four :class:`tmcore.ConvParams` tensors ``depthwise_weight (n, 2C, 3)``,
    ``depthwise_bias (n, 2C)``, ``pointwise_weight (4C, 2C)``, ``pointwise_bias
    (4C,)`` are initialized by the plan of :func:`tmcore.layer.param_specs`
    (identity taps, zero biases, a Xavier-uniform pointwise matrix, the
    forget-gate quarter of the pointwise bias (gate order ``i, f, o, g``) set to
    ``forget_bias``). :meth:`forward` is one :func:`tmcore.convlstm_step` with
    its hand-written VJP registered with autograd.

    Parameters
    ----------
    channels : int
        ``C``, the channels of the state ``(h, c)``.
    ndim : int
        ``n``, the spatial axes of the grid (1 to 4).
    forget_bias : float, default 0.0
        The initial bias of the forget gate.
    device : torch.device, str or None, optional
        Where the parameters live.
    dtype : torch.dtype or None, optional
        The parameters' dtype.

    Raises
    ------
    TypeError
        If ``channels`` or ``ndim`` is not an int.
    ValueError
        If ``channels < 1``, ``ndim`` is not 1 to 4, or ``forget_bias`` is not
        finite.
    """

    def __init__(self, channels: int, ndim: int, *, forget_bias: float = 0.0,
                 device: Any = None, dtype: Any = None):
        super().__init__()
        self.channels, self.ndim = channels, ndim
        self.forget_bias = check_finite("forget_bias", forget_bias)
        self._config = _cell_config(channels, ndim, self.forget_bias)
        kw = {"device": device, "dtype": dtype}
        for spec in tl.param_specs(self._config):
            if spec.group == "cell":
                self.register_parameter(spec.leaf, nn.Parameter(torch.empty(spec.shape, **kw)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the parameters by the plan of :func:`tmcore.layer.param_specs`."""
        _init_from_plan({f"cell.{k}": v for k, v in self.named_parameters()}, self._config,
                        ("cell",))

    def params(self) -> ConvParams:
        """The gate conv's parameters as the scan takes them.

        Returns
        -------
        ConvParams
            ``(depthwise_weight, depthwise_bias, pointwise_weight,
            pointwise_bias)``, the module's parameters themselves (not copies).
        """
        return ConvParams(self.depthwise_weight, self.depthwise_bias, self.pointwise_weight,
                          self.pointwise_bias)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, Tensor]:
        """One ConvLSTM step of the state ``(h, c)`` by a written volume ``x``.

        ``z = conv(concat([x, h], channel axis))`` split into the gates ``(i, f, o,
        g)``; ``c' = sigmoid(f) c + sigmoid(i) tanh(g)``, ``h' = sigmoid(o)
        tanh(c')`` (:func:`tmcore.convlstm_step`, with its VJP as the gradient).

        Parameters
        ----------
        x : Tensor, shape ``(B, C, *S)``
            The written volume (e.g. :func:`gaussian_splat`'s output), ``n =
            len(S)`` spatial axes.
        state : pair of Tensor, shape ``(B, C, *S)`` each, optional
            ``(h, c)`` entering the step; ``None``: zeros like ``x``.

        Returns
        -------
        h : Tensor, shape ``(B, C, *S)``
            The new hidden state.
        c : Tensor, shape ``(B, C, *S)``
            The new cell state.

        Raises
        ------
        TypeError
            If ``x`` or a state field is not a tensor or not in the parameters'
            dtype.
        ValueError
            If ``x``, ``h`` and ``c`` are not one shape ``(B, C, *S)`` with this
            cell's ``C`` and ``n``, or lie on another device than the parameters.
        """
        if state is None:
            h = c = torch.zeros_like(x) if isinstance(x, Tensor) else x
        elif isinstance(state, (tuple, list)) and len(state) == 2:
            h, c = state
        else:
            raise TypeError(f"state: expected a pair (h, c) of tensors (B, C, *S) or None, "
                            f"got {type(state).__name__}")
        expected = f"(B, C, *S) with C = {self.channels} and {self.ndim} spatial axes"
        ref = self.pointwise_weight
        for name, value in (("x", x), ("state: h", h), ("state: c", c)):
            if not isinstance(value, Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor of shape {expected}, "
                                f"got {type(value).__name__}")
            if value.dim() != 2 + self.ndim or value.shape[1] != self.channels \
                    or value.shape != x.shape:
                raise ValueError(f"{name}: expected shape {expected}"
                                 + ("" if name == "x" else f" like x {tuple(x.shape)}")
                                 + f", got {tuple(value.shape)}")
            _check_like_params(name, value, ref, check_dtype=True)
        return _torch_ops.call(_torch_ops.ConvLSTMStepFunction, _torch_ops.convlstm_step_op,
                               x, h, c, *self.params())


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
        """The four tensors as :class:`tmcore.ConvParams`."""
        return ConvParams(self.depthwise_weight, self.depthwise_bias, self.pointwise_weight,
                          self.pointwise_bias)


class _TorchChecks(NamedTuple):
    """The torch-side checks of a layer call's state and masks (``check=`` of
    :meth:`tmcore.layer.Layer.forward` / ``forward_stream``), run after the layer's
    generic checks of ``x`` and the state: devices (and dtypes, unless ``check_dtype``
    is off under autocast) against the parameters' ``ref``."""

    ref: Tensor
    check_dtype: bool

    def __call__(self, x: Tensor, state: Any, *, reset: Any = None, doc_starts: Any = None,
                 valid: Any = None) -> None:
        ref, check_dtype = self.ref, self.check_dtype
        if isinstance(state, tl.StreamState):
            _check_like_params("state: pending", state.pending, ref, check_dtype)
            _check_like_params("state: read", state.read, ref, check_dtype)
        if state is not None:
            _check_like_params("state: h", state[0], ref, check_dtype)
            _check_like_params("state: c", state[1], ref, check_dtype)
        for name, mask in (("reset", reset), ("doc_starts", doc_starts), ("valid", valid)):
            if isinstance(mask, Tensor) and mask.device != x.device:
                raise ValueError(f"{name}: expected a mask on x's device {x.device}, "
                                 f"got one on {mask.device}")


class _TorchLayer(tl.Layer):
    """The layer of :mod:`tmcore.layer` with torch's fused kernels for the heads.

    ``F.linear`` (follows autocast), ``F.softplus`` and ``torch.split``: the same
    math as the generic heads, in fewer dispatched ops.

    Parameters
    ----------
    config : LayerConfig
        The layer's hyperparameters (:func:`tmcore.layer.layer_config`).
    """

    def heads(self, xp: Any, params: Mapping[str, Any], chunk: Tensor) -> Any:
        # 2-D operands for the products (flat_rows) where F.linear would flatten the
        # chunks to the same addmm itself (contiguous tokens): the same bits without its
        # reshapes (dispatches); a non-contiguous view F.linear multiplies by matmul and
        # then adds the bias to, so it keeps the N-D operands (and those bits)
        return tl.heads(xp, params, chunk, self.config, linear=self.linear,
                        softplus=self.softplus, split=self.split,
                        flat_rows=chunk.is_contiguous())

    @staticmethod
    def linear(xp: Any, p: Mapping[str, Tensor], x: Tensor) -> Tensor:
        return F.linear(x, p["weight"], p["bias"])

    @staticmethod
    def softplus(xp: Any, x: Tensor) -> Tensor:
        # one fused op (and one in the backward) instead of the generic form's eight;
        # above the threshold torch returns x, whose error exp(-x) / x is below half an
        # ulp there (float64: exp(-40) / 40 ~ 1e-19), so the two agree to rounding
        return F.softplus(x, threshold=40.0 if x.dtype == torch.float64 else 20.0)

    @staticmethod
    def sample(volume: Tensor, coords: Tensor) -> Tensor:
        # the custom op (traced by torch.compile as one node); its inputs are the layer's
        return _torch_ops.call(_torch_ops.TrilinearSampleFunction,
                               _torch_ops.trilinear_sample_op, volume, coords, validated=True)

    @staticmethod
    def split(xp: Any, x: Tensor, sizes: Sequence[int]) -> tuple[Tensor, ...]:
        # one op (views) instead of a slice per piece; its backward is one op too
        return torch.split(x, list(sizes), dim=-1)


class TensorMemory(nn.Module):
    """Tensor Memory layer: chunked read / write / ConvLSTM update of a voxel state.

    Every argument is checked once by :func:`tmcore.layer.layer_config` (sizes
    are ints, Python or NumPy: a float or bool is a ``TypeError``, a size < 1 a
    ``ValueError``). The math per chunk is :class:`tmcore.layer.Layer`'s
    (``layer_class``; a variant subclasses it). Streaming by default:
    :meth:`forward` returns a :class:`StreamState` that carries the unfinished
    chunk, so feeding a sequence back in pieces of any lengths with the returned
    state equals one long call; ``stream=False`` pads the ragged last chunk with
    zeros and writes it into the state (a plain ``(h, c)``; the paper's reference
    behaviour).

    Parameters
    ----------
    embed_dim : int
        ``d``, the token width.
    memory_channels : int
        ``C``, the channels of the state ``(h, c)``.
    memory_shape : sequence of int
        The spatial grid ``S``, 1 to 4 positive ints (3 in the paper).
    chunk_size : int
        ``L``, tokens per chunk (one read and one write per chunk).
    sigma_scale : float, default 1.0
        Multiplies the predicted write spread.
    checkpoint_every : int, default 1
        The backward keeps every k-th state and recomputes the rest.
    radius : float or None, default None
        Optional truncation of the Gaussian write, in units of sigma.
    eps : float, default 1e-6
        Added to ``2 sigma^2`` in the Gaussian (>= 0).
    forget_bias : float, default 0.0
        Initial bias of the ConvLSTM forget gate (the layer's init: the cell
        starts keeping ``sigmoid(0) = 1/2`` of its state per chunk). A positive
        value (e.g. 3: ``sigmoid(3) = 0.95``) starts the memory remembering
        across many chunks, which long-range tasks need to discover it at all.
    zero_init : bool, default False
        Start the read-out ``out_proj`` at zero (weight and bias): the layer's
        output is exactly 0 at initialization (an attached memory is an exact
        identity) while ``out_proj`` still gets a gradient.
    update : {"dense", "local"}, default "dense"
        Experimental (:func:`tmcore.layer.layer_config`): ``"local"`` updates
        only a window of ``window`` cells per axis around the write.
    window : int or None, default None
        The window's cells per axis with ``update="local"``.
    dynamics : {"none", "warp"}, default "none"
        Experimental: ``"warp"`` resamples the state at displaced cell centres
        before each update (adds the zero-initialized ``warp_net``).
    flow : bool, default False
        With ``dynamics="warp"``, also ``warp_flow``, a per-cell flow from a conv
        of ``h``. The experimental options' scan is a custom op with a first-order
        backward (eager, ``torch.compile``; a double backward is refused).
    device : torch.device, str or None, optional
        Where the parameters live.
    dtype : torch.dtype or None, optional
        The parameters' dtype.

    Raises
    ------
    TypeError
        If a size is not an int (a float, a bool) or another argument has the
        wrong type.
    ValueError
        If a size is < 1, ``memory_shape`` does not have 1 to 4 axes, or a
        number is out of range (each error names the argument).
    """

    layer_class: type[tl.Layer] = _TorchLayer

    def __init__(
        self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
        chunk_size: int, sigma_scale: float = 1.0, *, checkpoint_every: int = 1,
        radius: float | None = None, eps: float = DEFAULT_EPS, forget_bias: float = 0.0,
        zero_init: bool = False, update: str = "dense", window: int | None = None,
        dynamics: str = "none", flow: bool = False, device: Any = None, dtype: Any = None,
    ):
        super().__init__()
        config = tl.layer_config(embed_dim, memory_channels, memory_shape, chunk_size,
                                 sigma_scale, checkpoint_every=checkpoint_every,
                                 radius=radius, eps=eps, forget_bias=forget_bias,
                                 zero_init=zero_init, update=update, window=window,
                                 dynamics=dynamics, flow=flow)
        self.config = config
        self.layer = self.layer_class(config)
        d, c, n = config.embed_dim, config.memory_channels, config.ndim
        kw = {"device": device, "dtype": dtype}
        self.write_proj = nn.Linear(config.chunk_size * d, d, **kw)
        self.content_net = nn.Linear(d, c, **kw)
        self.sigma_net = nn.Linear(d, 1, **kw)
        self.coord_net = nn.Linear(d, n, **kw)
        self.cell = ConvLSTMCell(c, n, forget_bias=config.forget_bias, **kw)
        self.out_proj = nn.Linear(c, d, **kw)
        if config.dynamics == "warp":  # the shift head (tmcore.scan.warped), zero at init
            self.warp_net = nn.Linear(d, n, **kw)
        if config.flow:  # the per-cell flow conv(h) (tmcore.scan.warped), zero at init
            self.warp_flow = WarpFlow(c, n, **kw)
        self.reset_parameters()

    # config fields as attributes (read-only views of self.config)
    embed_dim = property(lambda self: self.config.embed_dim)
    memory_channels = property(lambda self: self.config.memory_channels)
    memory_shape = property(lambda self: self.config.memory_shape)
    chunk_size = property(lambda self: self.config.chunk_size)
    sigma_scale = property(lambda self: self.config.sigma_scale)
    checkpoint_every = property(lambda self: self.config.checkpoint_every)
    radius = property(lambda self: self.config.radius)
    eps = property(lambda self: self.config.eps)
    forget_bias = property(lambda self: self.config.forget_bias)
    zero_init = property(lambda self: self.config.zero_init)

    def reset_parameters(self) -> None:
        """Initialize every parameter by the plan of :func:`tmcore.layer.param_specs`."""
        _init_from_plan(dict(self.named_parameters()), self.config,
                        tl.param_groups(self.config))

    def zero_read_out_(self) -> None:
        """Zero the read-out ``out_proj`` (weight and bias), and keep it zero on reset.

        ``zero_init=True`` goes into the config (so :meth:`reset_parameters` keeps
        it): the output is exactly 0 from here on until ``out_proj`` trains.
        """
        self.config = dataclasses.replace(self.config, zero_init=True)
        self.layer.config = self.config
        with torch.no_grad():
            self.out_proj.weight.zero_()
            self.out_proj.bias.zero_()

    def extra_repr(self) -> str:
        """Describe the configuration in the module's ``repr``.

        Returns
        -------
        str
            ``"embed_dim=..., memory_channels=..., ..."``.
        """
        return (f"embed_dim={self.embed_dim}, memory_channels={self.memory_channels}, "
                f"memory_shape={self.memory_shape}, chunk_size={self.chunk_size}, "
                f"sigma_scale={self.sigma_scale}, checkpoint_every={self.checkpoint_every}, "
                f"radius={self.radius}, forget_bias={self.cell.forget_bias}"
                + (", zero_init=True" if self.zero_init else "")
                + (f", update='local', window={self.config.window}"
                   if self.config.update == "local" else "")
                + (", dynamics='warp'" if self.config.dynamics == "warp" else "")
                + (", flow=True" if self.config.flow else ""))

    def params(self) -> dict[str, dict[str, Tensor]]:
        """The parameters as :mod:`tmcore.layer`'s pytree.

        Read by attribute (``self.write_proj.weight``, ...), not through
        ``named_parameters()``: FSDP1 with flat parameters (its default) unregisters
        the parameters and sets each attribute to a view of the flat one.

        Returns
        -------
        dict of dict of Tensor
            ``{group: {leaf: tensor}}`` (the state-dict names split at the dot),
            the module's parameters themselves.
        """
        params: dict[str, dict[str, Tensor]] = {}
        for spec in tl.param_specs(self.config):
            params.setdefault(spec.group, {})[spec.leaf] = getattr(getattr(self, spec.group),
                                                                   spec.leaf)
        return params

    # ----------------------------------------------------------------- checkpoints

    def get_extra_state(self) -> Tensor:
        """Store the grid shape in the state dict (key ``_extra_state``).

        The parameters do not show the grid (only its number of axes), so the
        state dict carries it, and loading refuses a checkpoint of another grid.
        A tensor, so that safetensors and ``torch.load(weights_only=True)`` keep it.

        Returns
        -------
        Tensor, shape ``(n,)``, int32
            ``memory_shape``.
        """
        return torch.tensor(self.memory_shape, dtype=torch.int32)

    def _grid_error(self, value: Any, key: str) -> str | None:
        if isinstance(value, Tensor) and value.device.type == "meta":
            return None  # no values to compare
        if not isinstance(value, Tensor) and isinstance(value, Sequence) \
                and not isinstance(value, (str, bytes)):
            value = list(value)
        return tl.stored_grid_error(value, self.memory_shape, key)

    def set_extra_state(self, state: Any) -> None:
        """Check a stored grid shape against this model's (see :meth:`get_extra_state`).

        Parameters
        ----------
        state : Tensor or sequence of int
            The stored ``_extra_state``, a 1-D int tensor ``(n,)``.

        Raises
        ------
        ValueError
            If it is malformed or another grid than ``memory_shape``.
        """
        error = self._grid_error(state, "_extra_state")
        if error is not None:
            raise ValueError(error)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "_extra_state"
        if key in state_dict:
            error = self._grid_error(state_dict[key], key)
            if error is not None:
                # reported with torch's other loading errors (one RuntimeError naming all)
                error_msgs.append(error)
                state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if key in missing_keys:
            # state dicts from before the grid was stored (or from the JAX adapter's params):
            # the grid cannot be checked, the parameters still are
            missing_keys.remove(key)

    # ----------------------------------------------------------------- forward

    def init_state(self, batch: int, device: Any = None, dtype: Any = None) -> State:
        """Make the zero state ``(h, c)``.

        Parameters
        ----------
        batch : int
            ``B`` (>= 0).
        device : torch.device, str or None, optional
            Default: the parameters'.
        dtype : torch.dtype or None, optional
            Default: the parameters'.

        Returns
        -------
        h, c : Tensor, shape ``(batch, C, *S)`` each
            Zeros.

        Raises
        ------
        TypeError
            If ``batch`` is not an int.
        ValueError
            If ``batch < 0`` or the state would not fit the device.
        """
        ref = self.out_proj.weight
        return tl.zero_state(_XP, self.config, check_int("batch", batch, 0),
                             dtype=ref.dtype if dtype is None else dtype,
                             device=ref.device if device is None else device)

    def _check(self, x: Tensor, state: Any, reset: Tensor | None) -> _TorchChecks:
        """The torch-side checks :class:`tmcore.layer.Layer` cannot make, of ``x`` (a
        tensor, on the parameters' device, in their dtype: autocast allows
        lower-precision tokens); those of the state and the masks run inside the layer's
        call, after its generic checks of ``x`` and the state (:class:`_TorchChecks`), so
        that every input is checked once per call."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a tensor of shape (B, N, d), got {type(x).__name__}")
        _require_torch(state, reset)  # NumPy state / mask: a TypeError naming the field
        ref = self.out_proj.weight
        device_type = x.device.type
        check_dtype = not (torch.amp.is_autocast_available(device_type)
                           and torch.is_autocast_enabled(device_type))
        _check_like_params("x", x, ref, check_dtype)
        return _TorchChecks(ref, check_dtype)

    def _scan(self, h0: Tensor, c0: Tensor, inputs: Any) -> tuple[Tensor, Tensor, Tensor]:
        config = self.config
        if config.update != "dense" or config.dynamics != "none":  # local / warp options
            return _torch_ops.option_scan(scan_options(config), h0, c0, inputs,
                                          self.cell.params(),
                                          self.warp_flow.params() if config.flow else None)
        return memory_scan(h0, c0, *inputs, self.cell.params(), eps=config.eps,
                           radius=config.radius, checkpoint_every=config.checkpoint_every)

    def forward(
        self, x: Tensor, state: Any = None, *, reset: Tensor | None = None,
        doc_starts: Tensor | None = None, valid: Tensor | None = None, stream: bool = True,
    ) -> tuple[Tensor, Any]:
        """Run the memory over a sequence of tokens.

        By default the call streams (:meth:`tmcore.layer.Layer.forward_stream`):
        the returned :class:`StreamState` holds ``(h, c)`` at the last chunk
        boundary plus the unfinished chunk, so feeding a sequence back in pieces
        of any lengths (one token at a time included) with the returned state
        equals one long call. ``stream=False`` is the paper's reference: the
        ragged last chunk is zero-padded and written, and continuing from the
        plain ``(h, c)`` is NOT one long call unless every piece is a multiple of
        ``chunk_size``.

        Parameters
        ----------
        x : Tensor, shape ``(B, N, d)``
            The tokens, on the parameters' device, in their dtype (autocast allows
            a lower precision).
        state : None, pair of Tensor or StreamState, optional
            ``(h, c)`` (each ``(B, C, *S)``) or the :class:`StreamState` a previous
            call returned; ``None``: zeros.
        reset : Tensor, shape ``(B,)``, bool, optional
            Those rows start from zeros (a float mask is a ``TypeError``).
        doc_starts : Tensor, shape ``(B, N)``, bool, optional
            True at document starts (packed documents, each equal to running it
            alone; :func:`doc_starts_from_offsets`); needs ``stream=True``.
        valid : Tensor, shape ``(B, N)``, bool, optional
            False at padding: those tokens never enter the state nor the chunk
            grid and their outputs are zeros; needs ``stream=True``.
        stream : bool, default True
            Return a :class:`StreamState`, so that pieces of any lengths equal one
            call; ``False``: pad the ragged last chunk with zeros, write it, and
            return ``(h, c)``.

        Returns
        -------
        out : Tensor, shape ``(B, N, d)``
            Each token's output: its chunk's read, read out.
        state : StreamState or pair of Tensor
            A :class:`StreamState`, or ``(h, c)`` with ``stream=False``.

        Raises
        ------
        TypeError
            If an argument is not a tensor of the right kind or dtype (each error
            names it).
        ValueError
            If an argument has the wrong shape or device, or a stream-only
            argument comes with ``stream=False``.
        """
        check = self._check(x, state, reset)
        if stream:
            return self.layer.forward_stream(_XP, self.params(), x, state, scan=self._scan,
                                             reset=reset, doc_starts=doc_starts, valid=valid,
                                             check=check)
        if isinstance(state, tl.StreamState):
            raise ValueError("state: a StreamState continues a stream; leave stream=True")
        if doc_starts is not None:
            raise ValueError("doc_starts: packed documents need stream=True (the default)")
        if valid is not None:
            raise ValueError("valid: a padding mask needs stream=True (the default)")
        return self.layer.forward(_XP, self.params(), x, state, scan=self._scan, reset=reset,
                                  check=check)


class MemoryResidual(nn.Module):
    """Gated residual ``x + sigmoid(gate) * memory(norm(x))`` around a Tensor Memory.

    The gate is stored with shape ``(1,)`` (FSDP shards no 0-dim parameter);
    checkpoints saved with the older 0-dim gate still load.
    :class:`GatedMemoryResidual` is the same class (the JAX adapter's name).

    Parameters
    ----------
    memory : TensorMemory
        The memory (its ``embed_dim``, device and dtype size the norm and gate).
    norm : nn.Module, type or None, default None
        A module, a class called as ``norm(embed_dim)``, or ``None`` for
        ``nn.LayerNorm(embed_dim)`` (pass ``nn.Identity()`` for none).
    gate_init : float, default 0.0
        The initial gate logit (the paper uses 0.0 and -2.0).
    zero_init : bool, default False
        Zero the memory's read-out ``out_proj`` (see :class:`TensorMemory`): the
        residual is then exactly ``x`` at initialization, and the memory still
        trains.

    Raises
    ------
    TypeError
        If ``memory`` is not a :class:`TensorMemory`, or ``zero_init`` not a bool.
    ValueError
        If ``gate_init`` is not finite or the parameters' dtype cannot hold it.
    """

    def __init__(self, memory: TensorMemory, norm: Any = None, gate_init: float = 0.0, *,
                 zero_init: bool = False):
        super().__init__()
        if not isinstance(memory, TensorMemory):
            raise TypeError(f"memory: expected a TensorMemory, got {type(memory).__name__}")
        ref = memory.out_proj.weight
        gate_init = check_finite("gate_init", gate_init)
        limit = torch.finfo(ref.dtype).max
        if abs(gate_init) > limit:
            raise ValueError(f"gate_init: expected a finite logit that {ref.dtype} can hold "
                             f"(|gate_init| <= {limit:.4g}), got {gate_init!r}")
        if check_flag("zero_init", zero_init) and not memory.zero_init:
            memory.zero_read_out_()
        self.memory = memory
        kw = {"device": ref.device, "dtype": ref.dtype}
        if norm is None:
            norm = nn.LayerNorm(memory.embed_dim, **kw)
        elif isinstance(norm, type):
            norm = norm(memory.embed_dim, **kw)
        self.norm = norm
        self.gate = nn.Parameter(torch.full(tl.GATE_SHAPE, gate_init, **kw))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "gate"
        value = state_dict.get(key)
        if isinstance(value, Tensor) and value.dim() == 0:  # saved before the gate was (1,)
            state_dict = {**state_dict, key: value.reshape(tl.GATE_SHAPE)}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def forward(
        self, x: Tensor, state: Any = None, *, reset: Tensor | None = None,
        doc_starts: Tensor | None = None, valid: Tensor | None = None, stream: bool = True,
    ) -> tuple[Tensor, Any]:
        """Add the gated memory read to the tokens: ``x + sigmoid(gate) * memory(norm(x))``.

        The state returned is the memory's.

        Parameters
        ----------
        x : Tensor, shape ``(B, N, d)``
            The tokens, as in :meth:`TensorMemory.forward`.
        state, reset, doc_starts, valid, stream : see TensorMemory.forward
            Passed to the memory unchanged (the state, row resets, document starts,
            the padding mask and the streaming switch).

        Returns
        -------
        out : Tensor, shape ``(B, N, d)``
            ``x + sigmoid(gate) * memory(norm(x), state)``.
        state : StreamState or pair of Tensor
            The memory's new state.

        Raises
        ------
        TypeError
            If an argument is not a tensor of the right kind or dtype (each error
            names it).
        ValueError
            If an argument has the wrong shape or device, or a stream-only
            argument comes with ``stream=False``.
        """
        out, state = self.memory(self.norm(x), state, reset=reset, doc_starts=doc_starts,
                                 valid=valid, stream=stream)
        return x + torch.sigmoid(self.gate) * out, state


# The same class under the JAX adapter's older name (both adapters have both names).
GatedMemoryResidual = MemoryResidual


# --------------------------------------------------------------------------- attach / detach
# (the hooks and the per-call bookkeeping: tmcore.adapters._torch_attach)


def attach_memory(
    blocks: Any, mode: str = "causal", *, gate_init: float = 0.0, norm: Any = None,
    zero_init: bool = False, streaming: bool = False, batch_first: bool | None = None,
    **memory_kwargs: Any,
) -> MemoryHandle:
    """Add a gated Tensor Memory after every block of an existing model.

    Each block gets a submodule ``tensor_memory`` (a :class:`MemoryResidual`) and a
    forward hook; its code is not edited. The block's output ``y`` (or ``y[0]`` if
    it returns a tuple) becomes ``y + sigmoid(gate_l) * memory_l(norm_l(y))``.

    Parameters
    ----------
    blocks : nn.ModuleList, nn.Sequential, nn.TransformerEncoder or list of nn.Module
        The blocks (a ``TransformerEncoder``: its ``layers``); their outputs are
        ``(B, N, d)`` (or ``(N, B, d)`` with ``batch_first=False``).
    mode : {"causal", "threaded"}, default "causal"
        ``"causal"``: every layer scans from the segment's initial state (a read
        at chunk ``t`` sees only earlier tokens and the chunk's first one);
        ``"threaded"``: the paper's reference, layer ``l`` starts from the state
        layer ``l-1`` reached after the whole sequence (NOT causal).
    gate_init : float, default 0.0
        The gates' initial logit (:class:`MemoryResidual`).
    norm : nn.Module, type or None, default None
        Each memory's input norm (:class:`MemoryResidual`; ``None``: a
        ``LayerNorm``).
    zero_init : bool, default False
        Start the memories' read-outs at zero, so the model is exactly unchanged
        until they train.
    streaming : bool, default False
        Carry ``handle.state`` from one model call to the next. In ``"causal"``
        mode each layer's state is a :class:`StreamState` (it carries the
        unfinished chunk), so calls of any lengths (one token at a time:
        generation) equal one long call.
    batch_first : bool or None, default None
        Layout of the block outputs; ``None`` reads it from
        ``block.self_attn.batch_first`` when present, else assumes True.
    **memory_kwargs
        :class:`TensorMemory` arguments (``embed_dim``, ...); ``device`` and
        ``dtype`` default to the blocks' parameters'.

    Returns
    -------
    MemoryHandle
        ``handle.remove()`` (or :func:`detach_memory`) undoes the attachment;
        ``handle.memories[l]`` is block ``l``'s :class:`MemoryResidual`.

    Raises
    ------
    TypeError
        If ``blocks`` is not a list or container of modules, or a
        :class:`TensorMemory` argument has the wrong type.
    ValueError
        If there is no block, ``mode`` is unknown, or a :class:`TensorMemory`
        argument has a bad value.
    """
    tl.check_mode(mode)
    layers, detected = blocks_of(blocks)
    if batch_first is None:
        batch_first = True if detected is None else bool(detected)
    ref = next((p for b in layers for p in b.parameters()), None)
    if ref is not None:
        memory_kwargs.setdefault("device", ref.device)
        memory_kwargs.setdefault("dtype", ref.dtype)
    memories = [MemoryResidual(TensorMemory(zero_init=zero_init, **memory_kwargs), norm=norm,
                               gate_init=gate_init) for _ in layers]
    return MemoryHandle(layers, memories, mode, streaming, batch_first)


def detach_memory(handle: MemoryHandle) -> None:
    """Remove the memories :func:`attach_memory` added (same as ``handle.remove()``).

    Parameters
    ----------
    handle : MemoryHandle
        What :func:`attach_memory` returned; the blocks are then exactly what
        they were before.
    """
    handle.remove()

# --------------------------------------------------------------------------- reference weights

_RENAMED = {
    "write_proj.weight": "write_proj.weight",
    "write_proj.bias": "write_proj.bias",
    "writer.content_net.weight": "content_net.weight",
    "writer.content_net.bias": "content_net.bias",
    "writer.sigma_net.weight": "sigma_net.weight",
    "writer.sigma_net.bias": "sigma_net.bias",
    "coord_net.weight": "coord_net.weight",
    "coord_net.bias": "coord_net.bias",
    "out_proj.weight": "out_proj.weight",
    "out_proj.bias": "out_proj.bias",
}
_DEPTHWISE = ("gate_conv.conv_d", "gate_conv.conv_h", "gate_conv.conv_w")
_IGNORED = ("grid_cache",)
_POINTWISE = ("gate_conv.pointwise.weight", "gate_conv.pointwise.bias")


def _require_torch(state: Any, reset: Any) -> None:
    """``TypeError`` naming the field when a state or a reset mask holds arrays of another
    kind (NumPy, JAX): the torch layer needs tensors (called first by
    :meth:`TensorMemory._check`)."""
    def kind(value: Any) -> str:
        return f"{type(value).__module__}.{type(value).__qualname__}"

    fields: dict[str, Any] = {}
    if isinstance(state, tl.StreamState):
        fields = {k: v for k, v in state._asdict().items() if k != "count"}
        count = state.count
        if not isinstance(count, (Tensor, tuple, list)):
            raise TypeError(f"state.count: expected a tuple of ints or an integer torch.Tensor "
                            f"(B,), got {kind(count)} (convert with torch.as_tensor)")
    elif isinstance(state, (tuple, list)) and len(state) == 2:
        fields = {"h": state[0], "c": state[1]}
    for name, value in fields.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"state.{name}: expected a torch.Tensor, got {kind(value)} "
                            f"(convert with torch.as_tensor)")
    if reset is not None and not isinstance(reset, Tensor):
        raise TypeError(f"reset: expected a bool torch.Tensor of shape (B,), got {kind(reset)} "
                        f"(convert with torch.as_tensor)")


def _reference_layout(d: int, c: int, length: int, grid: Sequence[int] | None
                      ) -> dict[str, tuple[tuple[int | None, ...], str]]:
    """Every reference key -> (expected shape, layout); ``None`` entries are free (the
    grid, when no target says it)."""
    layout: dict[str, tuple[tuple[int | None, ...], str]] = {
        "write_proj.weight": ((d, length * d), "(d, L*d)"),
        "write_proj.bias": ((d,), "(d,)"),
        "writer.content_net.weight": ((c, d), "(C, d)"),
        "writer.content_net.bias": ((c,), "(C,)"),
        "writer.sigma_net.weight": ((1, d), "(1, d)"),
        "writer.sigma_net.bias": ((1,), "(1,)"),
        "coord_net.weight": ((3, d), "(3, d)"),
        "coord_net.bias": ((3,), "(3,)"),
        "out_proj.weight": ((d, c), "(d, C)"),
        "out_proj.bias": ((d,), "(d,)"),
        "gate_conv.pointwise.weight": ((4 * c, 2 * c, 1, 1, 1), "(4C, 2C, 1, 1, 1)"),
        "gate_conv.pointwise.bias": ((4 * c,), "(4C,)"),
        "grid_cache": ((1, 3, *(grid or (None, None, None))), "(1, 3, D, H, W)"),
    }
    for axis, name in enumerate(_DEPTHWISE):
        kernel: list[int] = [1, 1, 1]
        kernel[axis] = 3
        layout[f"{name}.weight"] = ((2 * c, 1, *kernel), f"(2C, 1, {', '.join(map(str, kernel))})")
        layout[f"{name}.bias"] = ((2 * c,), "(2C,)")
    return layout


def _reference_sizes(own: Mapping[str, Tensor], prefix: str) -> tuple[int, int, int]:
    """``(d, C, L)`` of a reference state dict (n = 3), from ``out_proj.weight (d, C)``
    and ``write_proj.weight (d, L*d)`` (shapes only); ``ValueError`` naming the key."""
    out_proj, write_proj = own["out_proj.weight"], own["write_proj.weight"]
    if out_proj.dim() != 2 or min(out_proj.shape) < 1:
        raise ValueError(f"{prefix}out_proj.weight: expected shape (d, C), "
                         f"got {tuple(out_proj.shape)}")
    d, c = (int(s) for s in out_proj.shape)
    if write_proj.dim() != 2 or write_proj.shape[0] != d or write_proj.shape[1] % d \
            or write_proj.shape[1] == 0:
        raise ValueError(f"{prefix}write_proj.weight: expected shape (d, L*d) with d = {d} "
                         f"(from out_proj.weight), got {tuple(write_proj.shape)}")
    return d, c, int(write_proj.shape[1]) // d


def _target_state(target: Any) -> Mapping[str, Tensor]:
    """The state dict a target names: a :class:`TensorMemory` (its own) or a mapping."""
    if isinstance(target, TensorMemory):
        return target.state_dict()
    if isinstance(target, Mapping):
        return target
    raise TypeError(f"target: expected a TensorMemory or its state dict, "
                    f"got {type(target).__name__}")


def convert_reference_state_dict(
    sd: Mapping[str, Tensor], prefix: str = "", *, target: Any = None,
) -> dict[str, Tensor]:
    """Turn the paper's reference memory state dict into :class:`TensorMemory`'s.

    Only keys starting with ``prefix`` (e.g. ``"layers.0.memory."``) are read;
    the prefix is stripped. The reference's factorized conv (three depthwise
    ``Conv3d`` with kernels ``(3,1,1)``, ``(1,3,1)``, ``(1,1,3)`` and a 1x1x1
    pointwise ``Conv3d``) becomes ``cell.*``; ``writer.*`` loses its prefix;
    the ``grid_cache`` buffer ``(1, 3, D, H, W)`` (coordinates, recomputed by
    tmcore) becomes ``_extra_state``, the grid shape ``(D, H, W)`` (see
    :meth:`TensorMemory.get_extra_state`), so that loading refuses a model of
    another grid (without ``grid_cache`` there is no ``_extra_state`` and the
    grid is not checked). The result loads with
    ``TensorMemory(...).load_state_dict(result, strict=True)`` (a 3-D
    ``memory_shape``).

    ``target``: optionally the :class:`TensorMemory` (or its state dict) the result
    is for; every tensor's shape and dtype is then checked against the target's
    (and the grid against its ``memory_shape``), else against the layout that
    ``out_proj.weight (d, C)`` and ``write_proj.weight (d, L*d)`` fix.

    Everything is checked BEFORE anything is copied, from shapes and dtypes
    only, and nothing is copied that loading does not need: the result holds
    views of ``sd``'s tensors (renamed, reshaped; only the three depthwise
    kernels, ``O(C)`` values, are stacked into new tensors), so a hostile
    checkpoint of broadcast (stride-0) tensors claiming gigabytes converts in
    bytes, and its size mismatch with a target is refused before any
    allocation. Clone the result if you mean to modify it and keep ``sd``.

    Parameters
    ----------
    sd : mapping of str to Tensor
        The reference's state dict (or a model's holding it under ``prefix``).
    prefix : str, default ""
        Only keys starting with it are read (e.g. ``"layers.0.memory."``).
    target : TensorMemory, mapping of str to Tensor, or None, optional
        The model (or its state dict) the result is for: shapes, dtypes and
        the grid are checked against it.

    Returns
    -------
    dict of str to Tensor
        :class:`TensorMemory`'s state dict (views of ``sd``'s tensors where
        possible), ``_extra_state`` the grid ``(D, H, W)`` when ``sd`` has
        ``grid_cache``.

    Raises
    ------
    TypeError
        For an ``sd`` that is not a mapping with str keys, a value that is not a
        floating tensor (NumPy arrays and lists included: convert with
        ``torch.as_tensor``), or a dtype other than the target's.
    ValueError
        On missing, unknown or misshapen entries, each naming the key.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(f"sd: expected a mapping of str keys to tensors (a state dict), "
                        f"got {type(sd).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    for key in sd:
        if not isinstance(key, str):
            raise TypeError(f"sd: expected str keys (a state dict), got the key {key!r} "
                            f"({type(key).__name__})")
    own = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not own:
        raise ValueError(f"sd: no key starts with prefix {prefix!r}")
    expected = set(_RENAMED) | set(_IGNORED) | set(_POINTWISE)
    expected |= {f"{m}.{p}" for m in _DEPTHWISE for p in ("weight", "bias")}
    unknown = sorted(set(own) - expected)
    missing = sorted(expected - set(own) - set(_IGNORED))
    if unknown or missing:
        raise ValueError(f"sd: not a reference memory state dict under prefix {prefix!r}; "
                         f"unknown keys {unknown}, missing keys {missing}")
    for key, value in own.items():
        if not isinstance(value, Tensor) or not value.is_floating_point():
            got = f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__
            raise TypeError(f"{prefix}{key}: expected a floating torch.Tensor, got {got} "
                            f"(convert with torch.as_tensor first)")
    theirs = None if target is None else _target_state(target)
    if theirs is None:
        d, c, length = _reference_sizes(own, prefix)
        grid = None
    else:
        for name in ("out_proj.weight", "write_proj.weight"):
            if name not in theirs:
                raise ValueError(f"target: not a TensorMemory state dict (no {name})")
        d, c = (int(s) for s in theirs["out_proj.weight"].shape)
        length = int(theirs["write_proj.weight"].shape[1]) // d
        stored = theirs.get("_extra_state")
        grid = tuple(int(s) for s in stored.tolist()) \
            if isinstance(stored, Tensor) and stored.dim() == 1 else None
        if grid is not None and len(grid) != 3:
            raise ValueError(f"target: the reference is 3-D; the target's memory_shape is {grid}")
    sizes = f"d = {d}, C = {c}, L = {length}" + (" (the target's)" if theirs is not None
                                                  else " (from out_proj / write_proj)")
    for key, (shape, layout) in _reference_layout(d, c, length, grid).items():
        if key not in own:
            continue
        got = tuple(own[key].shape)
        if len(got) != len(shape) or any(w is not None and w != g for w, g in
                                         zip(shape, got, strict=False)) \
                or (key == "grid_cache" and min(got[2:], default=0) < 1):
            want = tuple("?" if w is None else w for w in shape)
            raise ValueError(f"{prefix}{key}: expected shape {layout} = {want} ({sizes}), "
                             f"got {got}")
    out = {new: own[old].detach() for old, new in _RENAMED.items()}
    out["cell.depthwise_weight"] = torch.stack(
        [own[f"{name}.weight"].detach().reshape(2 * c, 3) for name in _DEPTHWISE])
    out["cell.depthwise_bias"] = torch.stack([own[f"{name}.bias"].detach()
                                              for name in _DEPTHWISE])
    out["cell.pointwise_weight"] = own["gate_conv.pointwise.weight"].detach().reshape(
        4 * c, 2 * c)
    out["cell.pointwise_bias"] = own["gate_conv.pointwise.bias"].detach()
    if "grid_cache" in own:
        out["_extra_state"] = torch.tensor(tuple(own["grid_cache"].shape[2:]), dtype=torch.int32)
    if theirs is not None:
        source = {new: old for old, new in _RENAMED.items()}
        source.update({"cell.depthwise_weight": f"{_DEPTHWISE[0]}.weight",
                       "cell.depthwise_bias": f"{_DEPTHWISE[0]}.bias",
                       "cell.pointwise_weight": _POINTWISE[0],
                       "cell.pointwise_bias": _POINTWISE[1]})
        for name, value in out.items():
            want = theirs.get(name)
            if name == "_extra_state" or not isinstance(want, Tensor):
                continue
            if tuple(value.shape) != tuple(want.shape):
                raise ValueError(f"{prefix}{source[name]}: converts to {name} of shape "
                                 f"{tuple(value.shape)}, the target's is {tuple(want.shape)}")
            if value.dtype != want.dtype:
                raise TypeError(f"{prefix}{source[name]}: expected dtype {want.dtype} (the "
                                f"target's {name}), got {value.dtype} (cast the checkpoint "
                                f"first, or convert without target=)")
    return out


# --------------------------------------------------------------------------- saving a stream

_STATE_FIELDS = ("h", "c", "pending", "count", "read")


def state_to_dict(state: Any) -> dict[str, Any]:
    """Turn a stream state into a plain dict of tensors, for ``torch.save``.

    ``torch.load(..., weights_only=True)`` reads it back with nothing registered;
    :func:`state_from_dict` restores it. (Importing this module also registers
    :class:`StreamState` with ``torch.serialization.add_safe_globals``, so a saved
    ``StreamState`` itself loads with ``weights_only=True`` in a process that
    imported ``tmcore.adapters.torch``.)

    Parameters
    ----------
    state : StreamState or pair of Tensor
        A :class:`StreamState`, or an ``(h, c)`` pair.

    Returns
    -------
    dict
        ``{"h", "c" (B, C, *S), "pending" (B, L, d), "count" (B,) int64, "read"
        (B, C), "count_kind"}`` (``"count_kind"``: ``"tuple"`` or ``"tensor"``, the
        form ``count`` had), or ``{"h", "c"}`` for a pair. Tensors are detached,
        not copied.

    Raises
    ------
    TypeError
        If ``state`` is neither, or a field is not a tensor.
    """
    if isinstance(state, tl.StreamState):
        count = state.count
        as_tensor = isinstance(count, Tensor)
        out = {name: getattr(state, name) for name in _STATE_FIELDS if name != "count"}
        for name, value in out.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"state.{name}: expected a torch.Tensor, "
                                f"got {type(value).__name__}")
        out = {name: value.detach() for name, value in out.items()}
        out["count"] = count.detach().to(torch.int64) if as_tensor else torch.tensor(
            [int(k) for k in count], dtype=torch.int64)
        out["count_kind"] = "tensor" if as_tensor else "tuple"
        return out
    if isinstance(state, (tuple, list)) and len(state) == 2 \
            and all(isinstance(s, Tensor) for s in state):
        return {"h": state[0].detach(), "c": state[1].detach()}
    raise TypeError(f"state: expected a StreamState or a pair (h, c) of tensors, "
                    f"got {type(state).__name__}")


def state_from_dict(data: Mapping[str, Any]) -> Any:
    """Restore the stream state :func:`state_to_dict` made.

    Parameters
    ----------
    data : dict
        What :func:`state_to_dict` returned (e.g. after ``torch.load``).

    Returns
    -------
    StreamState or tuple of Tensor
        A :class:`StreamState` (``count`` in the form it was saved in), or an
        ``(h, c)`` tuple.

    Raises
    ------
    TypeError
        If ``data`` is not a mapping or a field is not a tensor.
    ValueError
        If the keys, ``count`` or ``count_kind`` are not what
        :func:`state_to_dict` writes.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"data: expected the dict state_to_dict made, got {type(data).__name__}")
    keys = set(data)
    if keys == {"h", "c"}:
        return (data["h"], data["c"])
    wanted = set(_STATE_FIELDS) | {"count_kind"}
    if keys != wanted:
        raise ValueError(f"data: expected the keys {sorted(wanted)} (or just h and c), "
                         f"got {sorted(map(str, keys))}")
    for name in _STATE_FIELDS:
        if not isinstance(data[name], Tensor):
            raise TypeError(f"data[{name!r}]: expected a torch.Tensor, "
                            f"got {type(data[name]).__name__}")
    count = data["count"]
    if count.dim() != 1 or count.dtype.is_floating_point or count.dtype == torch.bool:
        raise ValueError(f"data['count']: expected an integer tensor (B,), got "
                         f"{count.dtype} of shape {tuple(count.shape)}")
    kind = data["count_kind"]
    if kind not in ("tuple", "tensor"):
        raise ValueError(f"data['count_kind']: expected 'tuple' or 'tensor', got {kind!r}")
    if kind == "tuple":
        count = tuple(int(k) for k in count.tolist())
    return tl.StreamState(data["h"], data["c"], data["pending"], count, data["read"])


# a StreamState (a NamedTuple of tensors and ints) saved whole loads with weights_only=True
torch.serialization.add_safe_globals([tl.StreamState])
