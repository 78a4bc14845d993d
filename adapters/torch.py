"""PyTorch adapter: autograd-aware ops, the Tensor Memory layer, attaching it to models.

Quick start::

    import torch
    from tmcore.adapters.torch import TensorMemory, MemoryResidual

    memory = TensorMemory(embed_dim=128, memory_channels=32, memory_shape=(8, 8, 8),
                          chunk_size=16)
    layer = MemoryResidual(memory, gate_init=0.0)    # x + sigmoid(gate) * memory(norm(x))
    x = torch.randn(8, 256, 128)                      # (B, N, d)
    y, state = layer(x)                               # state = (h, c), each (B, C, *S)
    y2, state = layer(torch.randn(8, 256, 128), state)  # streaming: carry the state

Gradients come from tmcore's hand-written VJPs, registered as
``torch.library`` custom ops (``torch.ops.tmcore.*``, see
:mod:`tmcore.adapters._torch_ops`): they work in eager mode, under
``torch.compile`` (``fullgraph=True``, no graph breaks), with ``torch.func``
(``grad``, ``vmap`` by looping over the mapped dimension, per-sample
gradients) and with DDP. Second-order gradients work in eager mode
(``create_graph=True``); third order, Hessians through nested
``torch.func.grad`` and double backward of a compiled model do not.
Returned gradients are contiguous.

Multi-layer modes (:func:`attach_memory`): ``"causal"`` (every layer scans from
the segment's initial state, a read at chunk ``t`` sees only tokens before
chunk ``t`` plus the chunk's first token: right for language models) and
``"threaded"`` (the paper's reference: layer ``l`` starts from the state layer
``l-1`` reached after the whole sequence; NOT causal, every position sees
later tokens: only for bidirectional inputs such as images or clips).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tmcore._validate import check_finite
from tmcore.adapters import _torch_ops
from tmcore.addressing import MIN_SIGMA
from tmcore.conv import ConvParams, as_conv_params, conv_params_from_pointwise
from tmcore.scan import validate_scan_inputs
from tmcore.splat import DEFAULT_EPS

__all__ = [
    "ConvLSTMCell",
    "MemoryHandle",
    "MemoryResidual",
    "TensorMemory",
    "attach_memory",
    "convert_reference_state_dict",
    "detach_memory",
    "gaussian_splat",
    "memory_scan",
    "trilinear_sample",
]

MODES = ("causal", "threaded")
State = tuple[Tensor, Tensor]


# --------------------------------------------------------------------------- functional ops


def trilinear_sample(volume: Tensor, coords: Tensor) -> Tensor:
    """``tmcore.trilinear_sample`` with autograd: ``(B, C, *S), (B, Q, n) -> (B, Q, C)``."""
    if volume.dim() not in (3, 4, 5, 6):
        raise ValueError(f"volume: expected shape (B, C, *S) with 1 to 4 spatial axes, "
                         f"got {tuple(volume.shape)}")
    if coords.dim() != 3 or coords.shape[0] != volume.shape[0] \
            or coords.shape[2] != volume.dim() - 2:
        raise ValueError(f"coords: expected shape (B, Q, n) = ({volume.shape[0]}, Q, "
                         f"{volume.dim() - 2}), got {tuple(coords.shape)}")
    return _torch_ops.call(_torch_ops.TrilinearSampleFunction, _torch_ops.trilinear_sample_op,
                          volume, coords)


def gaussian_splat(
    content: Tensor, mu: Tensor, sigma: Tensor, shape: Sequence[int], *,
    eps: float = DEFAULT_EPS, radius: float | None = None,
) -> Tensor:
    """``tmcore.gaussian_splat`` with autograd.

    ``content (B, K, C)``, ``mu (B, K, n)``, ``sigma (B, K)`` -> ``(B, C, *shape)``.
    """
    shape = [int(s) for s in shape]
    if not 1 <= len(shape) <= 4 or min(shape) < 1:
        raise ValueError(f"shape: expected 1 to 4 positive ints, got {tuple(shape)}")
    if content.dim() != 3:
        raise ValueError(f"content: expected shape (B, K, C), got {tuple(content.shape)}")
    batch, writes = content.shape[:2]
    if tuple(mu.shape) != (batch, writes, len(shape)):
        raise ValueError(f"mu: expected shape (B, K, n) = {(batch, writes, len(shape))}, "
                         f"got {tuple(mu.shape)}")
    if tuple(sigma.shape) != (batch, writes):
        raise ValueError(f"sigma: expected shape (B, K) = {(batch, writes)}, "
                         f"got {tuple(sigma.shape)}")
    return _torch_ops.call(_torch_ops.GaussianSplatFunction, _torch_ops.gaussian_splat_op,
                          content, mu, sigma, shape, float(eps), radius)


def memory_scan(
    h0: Tensor, c0: Tensor, read_coords: Tensor, write_coords: Tensor, write_sigma: Tensor,
    write_content: Tensor, params: ConvParams, *, eps: float = DEFAULT_EPS,
    radius: float | None = None, checkpoint_every: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """``tmcore.memory_scan`` with autograd (the hand-written scan VJP).

    ``h0, c0 (B, C, *S)``, ``read_coords, write_coords (B, T, n)``,
    ``write_sigma (B, T)``, ``write_content (B, T, C)``, ``params``: a
    :class:`tmcore.ConvParams` of tensors. Returns ``(reads (B, T, C), h_T, c_T)``.
    ``checkpoint_every = k`` keeps ``ceil(T / k)`` states for the backward.

    The arguments are checked by :func:`tmcore.scan.validate_scan_inputs`
    (``TypeError`` / ``ValueError`` naming the argument; in tmcore's validate
    mode also finite values and ``write_sigma > 0``). Under ``torch.compile``
    the same shape checks run once, at trace time, in the op's fake
    implementation (values of fake tensors are never read).
    """
    params = as_conv_params(params)
    if not torch.compiler.is_compiling():  # Dynamo cannot trace the validator's ContextVar
        validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma, write_content,
                             params, checkpoint_every, radius, eps=eps)
    reads, h, c, _, _ = _torch_ops.call(
        _torch_ops.MemoryScanFunction, _torch_ops.memory_scan_op,
        h0, c0, read_coords, write_coords, write_sigma, write_content, *params,
        float(eps), None if radius is None else float(radius), int(checkpoint_every),
    )
    return reads, h, c


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


def _softplus(x: Tensor) -> Tensor:
    """``tmcore``'s overflow-free softplus ``max(x, 0) + log1p(exp(-|x|))`` in torch ops."""
    return torch.clamp_min(x, 0.0) + torch.log1p(torch.exp(-x.abs()))


class ConvLSTMCell(nn.Module):
    """The four :class:`tmcore.ConvParams` tensors of the ConvLSTM gates.

    ``depthwise_weight (n, 2C, 3)``, ``depthwise_bias (n, 2C)``,
    ``pointwise_weight (4C, 2C)``, ``pointwise_bias (4C,)``. Initialized by
    :func:`tmcore.conv_params_from_pointwise` around a Xavier-uniform pointwise
    matrix (identity taps, zero biases), then the forget-gate quarter of the
    pointwise bias (gate order ``i, f, o, g``) set to ``forget_bias``.
    """

    def __init__(self, channels: int, ndim: int, *, forget_bias: float = 0.0,
                 device: Any = None, dtype: Any = None):
        super().__init__()
        self.channels, self.ndim = channels, ndim
        self.forget_bias = check_finite("forget_bias", forget_bias)
        kw = {"device": device, "dtype": dtype}
        self.depthwise_weight = nn.Parameter(torch.empty(ndim, 2 * channels, 3, **kw))
        self.depthwise_bias = nn.Parameter(torch.empty(ndim, 2 * channels, **kw))
        self.pointwise_weight = nn.Parameter(torch.empty(4 * channels, 2 * channels, **kw))
        self.pointwise_bias = nn.Parameter(torch.empty(4 * channels, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        pointwise = nn.init.xavier_uniform_(torch.empty_like(self.pointwise_weight))
        for param, value in zip(self.params(), conv_params_from_pointwise(pointwise, self.ndim),
                                strict=True):
            param.copy_(value)
        self.pointwise_bias[self.channels : 2 * self.channels] = self.forget_bias

    def params(self) -> ConvParams:
        return ConvParams(self.depthwise_weight, self.depthwise_bias, self.pointwise_weight,
                          self.pointwise_bias)


class TensorMemory(nn.Module):
    """Tensor Memory layer: chunked read / write / ConvLSTM update of a voxel state.

    Parameters
    ----------
    embed_dim : token width ``d``.
    memory_channels : ``C``, channels of the state ``(h, c)``.
    memory_shape : spatial grid ``S``, 1 to 4 positive ints (3 in the paper).
    chunk_size : ``L`` tokens per chunk (one read and one write per chunk).
    sigma_scale : multiplies the predicted write spread.
    checkpoint_every : the backward keeps every k-th state and recomputes the rest.
    radius : optional truncation of the Gaussian write, in units of sigma.
    eps : added to ``2 sigma^2`` in the Gaussian.
    forget_bias : initial bias of the ConvLSTM forget gate (default 0, DESIGN's
        init: the cell starts keeping ``sigmoid(0) = 1/2`` of its state per chunk).
        A positive value (e.g. 3: ``sigmoid(3) = 0.95``) starts the memory
        remembering across many chunks, which long-range tasks need to discover
        it at all (see examples/diagnostics/README.md).

    Per chunk ``t`` (DESIGN): ``read_coord = tanh(coord_net(first token))``;
    ``summary = write_proj(concat of the chunk's L tokens)``; ``write_coord =
    tanh(coord_net(summary))`` (tied head); ``content = content_net(summary)``;
    ``sigma = (softplus(sigma_net(summary)) + 1e-4) * sigma_scale``; the read
    (from the state before the chunk's write) goes through ``out_proj`` and is
    broadcast to every token of the chunk. A ragged last chunk is zero-padded
    on the right and the output trimmed. The chunk grid is per call: for
    streaming to equal one long call, feed pieces whose lengths are multiples
    of ``chunk_size`` (a ragged piece writes a zero-padded chunk into the state).
    """

    def __init__(
        self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
        chunk_size: int, sigma_scale: float = 1.0, *, checkpoint_every: int = 1,
        radius: float | None = None, eps: float = DEFAULT_EPS, forget_bias: float = 0.0,
        device: Any = None, dtype: Any = None,
    ):
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("memory_channels", memory_channels),
                            ("chunk_size", chunk_size), ("checkpoint_every", checkpoint_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if isinstance(memory_shape, int):
            memory_shape = (memory_shape,)
        shape = tuple(memory_shape)
        if not 1 <= len(shape) <= 4 or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"memory_shape: expected 1 to 4 positive ints, got {memory_shape!r}")
        if not sigma_scale > 0:
            raise ValueError(f"sigma_scale: expected > 0, got {sigma_scale!r}")
        if radius is not None and not radius > 0:
            raise ValueError(f"radius: expected a positive number of sigmas or None, "
                             f"got {radius!r}")
        self.embed_dim, self.memory_channels = embed_dim, memory_channels
        self.memory_shape, self.chunk_size = shape, chunk_size
        self.sigma_scale, self.checkpoint_every = float(sigma_scale), checkpoint_every
        self.radius = None if radius is None else float(radius)
        self.eps = float(eps)
        n, d, c = len(shape), embed_dim, memory_channels
        kw = {"device": device, "dtype": dtype}
        self.write_proj = nn.Linear(chunk_size * d, d, **kw)
        self.content_net = nn.Linear(d, c, **kw)
        self.sigma_net = nn.Linear(d, 1, **kw)
        self.coord_net = nn.Linear(d, n, **kw)
        self.cell = ConvLSTMCell(c, n, forget_bias=forget_bias, **kw)
        self.out_proj = nn.Linear(c, d, **kw)
        with torch.no_grad():
            self.sigma_net.bias.fill_(1.0)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, memory_channels={self.memory_channels}, "
                f"memory_shape={self.memory_shape}, chunk_size={self.chunk_size}, "
                f"sigma_scale={self.sigma_scale}, checkpoint_every={self.checkpoint_every}, "
                f"radius={self.radius}, forget_bias={self.cell.forget_bias}")

    # ----------------------------------------------------------------- checkpoints

    def get_extra_state(self) -> Tensor:
        """The grid shape ``memory_shape`` as an int32 tensor (state-dict key ``_extra_state``).

        The parameters do not show the grid (only its number of axes), so the
        state dict carries it, and loading refuses a checkpoint of another grid.
        A tensor, so that safetensors and ``torch.load(weights_only=True)`` keep it.
        """
        return torch.tensor(self.memory_shape, dtype=torch.int32)

    def _grid_error(self, value: Any, key: str) -> str | None:
        """Why ``value`` (a stored ``_extra_state``) does not fit this model, or ``None``."""
        malformed = (f"memory_shape: {key} should hold a grid shape (a 1-D int tensor of "
                     f"1 to 4 sizes), got {value!r}")
        try:
            stored = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return malformed
        if stored.device.type == "meta":
            return None  # no values to compare
        if (stored.dim() != 1 or not 1 <= stored.numel() <= 4 or stored.dtype == torch.bool
                or stored.is_floating_point() or stored.is_complex()):
            return malformed
        saved = tuple(int(s) for s in stored.tolist())
        if saved != self.memory_shape:
            return (f"memory_shape: the checkpoint was saved from a grid {saved} ({key}), "
                    f"this model's memory_shape is {self.memory_shape}")
        return None

    def set_extra_state(self, state: Any) -> None:
        """Check a stored grid shape (see :meth:`get_extra_state`); ``ValueError`` on mismatch."""
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
        """Zero state ``(h, c)``, each ``(batch, C, *S)`` (defaults: the parameters')."""
        ref = self.out_proj.weight
        shape = (batch, self.memory_channels, *self.memory_shape)
        kw = {"device": ref.device if device is None else device,
              "dtype": ref.dtype if dtype is None else dtype}
        return torch.zeros(shape, **kw), torch.zeros(shape, **kw)

    def _check(self, x: Tensor, state: State | None, reset: Tensor | None) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a tensor of shape (B, N, d), got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"x: expected shape (B, N, d), got {tuple(x.shape)}")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected shape (B, N, d) with d = embed_dim = "
                             f"{self.embed_dim}, got {tuple(x.shape)}")
        ref = self.out_proj.weight
        # under autocast the tokens may come in a lower precision than the parameters
        device_type = x.device.type
        check_dtype = not (torch.amp.is_autocast_available(device_type)
                           and torch.is_autocast_enabled(device_type))
        _check_like_params("x", x, ref, check_dtype)
        expected = (x.shape[0], self.memory_channels, *self.memory_shape)
        if state is not None:
            if not isinstance(state, (tuple, list)) or len(state) != 2:
                raise ValueError("state: expected a pair (h, c) or None")
            for name, value in zip(("h", "c"), state, strict=True):
                if not isinstance(value, Tensor):
                    raise TypeError(f"state: expected {name} to be a tensor of shape "
                                    f"(B, C, *S) = {expected}, got {type(value).__name__}")
                if tuple(value.shape) != expected:
                    raise ValueError(f"state: expected {name} of shape (B, C, *S) = "
                                     f"{expected}, got {tuple(value.shape)}")
                _check_like_params(f"state: {name}", value, ref, check_dtype)
        if reset is not None:
            if not isinstance(reset, Tensor) or tuple(reset.shape) != (x.shape[0],):
                got = tuple(reset.shape) if isinstance(reset, Tensor) else type(reset).__name__
                raise ValueError(f"reset: expected a bool mask of shape (B,) = "
                                 f"({x.shape[0]},), got {got}")
            if reset.device != x.device:
                raise ValueError(f"reset: expected a mask on x's device {x.device}, "
                                 f"got one on {reset.device}")

    def _heads(self, chunk: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One chunk ``(B, L, d)`` -> ``read_coord (B, n)``, ``write_coord (B, n)``,
        ``content (B, C)``, ``sigma (B,)``."""
        summary = self.write_proj(chunk.reshape(chunk.shape[0], -1))
        read_coord = torch.tanh(self.coord_net(chunk[:, 0]))
        write_coord = torch.tanh(self.coord_net(summary))
        content = self.content_net(summary)
        sigma = (_softplus(self.sigma_net(summary)[:, 0]) + MIN_SIGMA) * self.sigma_scale
        return read_coord, write_coord, content, sigma

    def forward(
        self, x: Tensor, state: State | None = None, *, reset: Tensor | None = None
    ) -> tuple[Tensor, State]:
        """Run the memory over ``x (B, N, d)``.

        ``state``: ``(h, c)`` from a previous call (``None``: zeros). ``reset``:
        optional ``(B,)`` bool mask; those sequences start from zeros (document
        boundaries when streaming). Returns ``(out (B, N, d), (h, c))``.
        """
        self._check(x, state, reset)
        batch, tokens, d = x.shape
        if state is None:
            state = self.init_state(batch, x.device, x.dtype)
        h0, c0 = state
        if reset is not None:
            mask = reset.reshape((batch,) + (1,) * (h0.dim() - 1)).to(torch.bool)
            h0 = torch.where(mask, torch.zeros_like(h0), h0)
            c0 = torch.where(mask, torch.zeros_like(c0), c0)
        if tokens == 0:
            return x.new_zeros(x.shape), (h0, c0)
        size = self.chunk_size
        steps = (tokens + size - 1) // size
        if steps * size != tokens:
            x = nn.functional.pad(x, (0, 0, 0, steps * size - tokens))
        chunks = x.reshape(batch, steps, size, d)
        # Chunk by chunk, so that every chunk's arithmetic has the same shapes
        # whatever the number of chunks in the call (BLAS kernels and vectorized
        # elementwise loops may round differently for other sizes): streaming
        # pieces then equals one long call bit for bit.
        heads = [self._heads(chunks[:, t]) for t in range(steps)]
        read_coords, write_coords, content, sigma = (
            torch.stack(v, 1) for v in zip(*heads, strict=True))
        reads, h, c = memory_scan(h0, c0, read_coords, write_coords, sigma, content,
                                  self.cell.params(), eps=self.eps, radius=self.radius,
                                  checkpoint_every=self.checkpoint_every)
        out = torch.stack([self.out_proj(reads[:, t]) for t in range(steps)], 1)
        out = out[:, :, None, :].expand(batch, steps, size, d)
        return out.reshape(batch, steps * size, d)[:, :tokens], (h, c)


class MemoryResidual(nn.Module):
    """Gated residual ``x + sigmoid(gate) * memory(norm(x))``.

    ``norm``: a module, a class called as ``norm(embed_dim)``, or ``None`` for
    ``nn.LayerNorm(embed_dim)`` (pass ``nn.Identity()`` for none). ``gate_init``
    is the initial logit (the paper uses 0.0 and -2.0). ``forward(x, state=None,
    *, reset=None) -> (y, state)``.
    """

    def __init__(self, memory: TensorMemory, norm: Any = None, gate_init: float = 0.0):
        super().__init__()
        self.memory = memory
        ref = memory.out_proj.weight
        kw = {"device": ref.device, "dtype": ref.dtype}
        if norm is None:
            norm = nn.LayerNorm(memory.embed_dim, **kw)
        elif isinstance(norm, type):
            norm = norm(memory.embed_dim, **kw)
        self.norm = norm
        self.gate = nn.Parameter(torch.full((), float(gate_init), **kw))

    def forward(
        self, x: Tensor, state: State | None = None, *, reset: Tensor | None = None
    ) -> tuple[Tensor, State]:
        out, state = self.memory(self.norm(x), state, reset=reset)
        return x + torch.sigmoid(self.gate) * out, state


# --------------------------------------------------------------------------- attach / detach


def _blocks_of(blocks: Any) -> tuple[list[nn.Module], bool | None]:
    if isinstance(blocks, nn.TransformerEncoder):
        layers = list(blocks.layers)
    elif isinstance(blocks, (nn.ModuleList, nn.Sequential)) or (
            isinstance(blocks, Iterable) and not isinstance(blocks, nn.Module)):
        layers = list(blocks)
    else:
        raise TypeError(f"blocks: expected an nn.ModuleList, nn.Sequential, "
                        f"nn.TransformerEncoder or a list of modules, got {type(blocks).__name__}")
    if not layers or not all(isinstance(b, nn.Module) for b in layers):
        raise ValueError("blocks: expected at least one nn.Module block")
    attn = getattr(layers[0], "self_attn", None)
    return layers, getattr(attn, "batch_first", None)


class MemoryHandle(nn.Module):
    """The memories attached to a model's blocks, their streaming state and hooks.

    Holds one :class:`MemoryResidual` per block (``handle.memories[l]``), each
    with its own parameters: give ``handle.parameters()`` to the optimizer
    (and, for DDP, wrap a module that holds both the model and the handle).
    After every model call, ``handle.state[l]`` is the ``(h, c)`` layer ``l``
    reached. With ``streaming=True`` the next call starts from it (per layer in
    ``causal`` mode; from the last layer's state in ``threaded`` mode), else
    every call starts from zeros. The hooks assume the blocks run in order,
    once each, per model call.
    """

    def __init__(self, blocks: list[nn.Module], memories: list[MemoryResidual], mode: str,
                 streaming: bool, batch_first: bool):
        super().__init__()
        self.memories = nn.ModuleList(memories)
        self.mode, self.streaming, self.batch_first = mode, streaming, batch_first
        self.state: list[State] | None = None
        self._reset: Tensor | None = None
        self._carried: list[State] | None = None
        self._current: list[State | None] = []
        self._hooks = [block.register_forward_hook(self._hook(layer))
                       for layer, block in enumerate(blocks)]

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, streaming={self.streaming}, attached={self.attached}"

    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    def _hook(self, layer: int):
        def hook(module, args, output):
            if isinstance(output, tuple):
                return (self._apply(layer, output[0]), *output[1:])
            return self._apply(layer, output)

        return hook

    def _apply(self, layer: int, y: Tensor) -> Tensor:
        if layer == 0:
            self._carried = self.state if self.streaming else None
            self._current = [None] * len(self.memories)
        x = y if self.batch_first else y.transpose(0, 1)
        carried = self._carried
        if self.mode == "causal":
            init = None if carried is None else carried[layer]
            reset = self._reset
        elif layer == 0:
            init = None if carried is None else carried[-1]
            reset = self._reset
        else:
            init, reset = self._current[layer - 1], None
        out, state = self.memories[layer](x, init, reset=reset)
        self._current[layer] = state
        if layer == len(self.memories) - 1:
            self.state, self._reset, self._carried = list(self._current), None, None
        return out if self.batch_first else out.transpose(0, 1)

    def reset_state(self, mask: Tensor | None = None) -> None:
        """Forget the state (``mask=None``), or start the sequences where the
        ``(B,)`` bool ``mask`` is True from zeros at the next call."""
        if mask is None:
            self.state, self._reset = None, None
        else:
            self._reset = mask if self._reset is None else (self._reset | mask)

    def detach_state(self) -> None:
        """Cut the graph to the previous calls (truncated backprop through time)."""
        if self.state is not None:
            self.state = [(h.detach(), c.detach()) for h, c in self.state]

    def set_state(self, state: Sequence[State] | None) -> None:
        """Replace the per-layer state (``None``: zeros at the next call)."""
        if state is not None and len(state) != len(self.memories):
            raise ValueError(f"state: expected {len(self.memories)} per-layer (h, c) pairs, "
                             f"got {len(state)}")
        self.state = None if state is None else [tuple(s) for s in state]

    def remove(self) -> None:
        """Remove the hooks: the model computes exactly what it did before attaching."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.state, self._reset, self._carried, self._current = None, None, None, []

    def __enter__(self) -> MemoryHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def attach_memory(
    blocks: Any, mode: str = "causal", *, gate_init: float = 0.0, norm: Any = None,
    streaming: bool = False, batch_first: bool | None = None, **memory_kwargs: Any,
) -> MemoryHandle:
    """Add a gated Tensor Memory after every block of an existing model, via forward hooks.

    Parameters
    ----------
    blocks : an ``nn.ModuleList`` / ``nn.Sequential`` / list of blocks, or an
        ``nn.TransformerEncoder`` (its ``layers``). Blocks are not edited; each
        block's output ``y`` (or ``y[0]`` if it returns a tuple) becomes
        ``y + sigmoid(gate_l) * memory_l(norm_l(y))``.
    mode : ``"causal"`` (every layer scans from the segment's initial state;
        causal) or ``"threaded"`` (the paper's reference: layer ``l`` starts from
        the state layer ``l-1`` reached after the whole sequence; NOT causal).
    gate_init, norm : as in :class:`MemoryResidual`.
    streaming : carry ``handle.state`` from one model call to the next.
    batch_first : layout of the block outputs; ``None`` reads it from
        ``block.self_attn.batch_first`` when present, else assumes True.
    **memory_kwargs : :class:`TensorMemory` arguments (``embed_dim``, ...);
        device and dtype default to the blocks' parameters.

    Returns
    -------
    :class:`MemoryHandle`; ``handle.remove()`` (or :func:`detach_memory`) undoes it.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    layers, detected = _blocks_of(blocks)
    if batch_first is None:
        batch_first = True if detected is None else bool(detected)
    ref = next((p for b in layers for p in b.parameters()), None)
    if ref is not None:
        memory_kwargs.setdefault("device", ref.device)
        memory_kwargs.setdefault("dtype", ref.dtype)
    memories = [MemoryResidual(TensorMemory(**memory_kwargs), norm=norm, gate_init=gate_init)
                for _ in layers]
    return MemoryHandle(layers, memories, mode, streaming, batch_first)


def detach_memory(handle: MemoryHandle) -> None:
    """Same as ``handle.remove()``."""
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


def convert_reference_state_dict(
    sd: Mapping[str, Tensor], prefix: str = ""
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
    ``memory_shape``). Raises ``ValueError`` on missing, unknown or misshapen
    entries.
    """
    own = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not own:
        raise ValueError(f"sd: no key starts with prefix {prefix!r}")
    expected = set(_RENAMED) | set(_IGNORED) | {"gate_conv.pointwise.weight",
                                                "gate_conv.pointwise.bias"}
    expected |= {f"{m}.{p}" for m in _DEPTHWISE for p in ("weight", "bias")}
    unknown = sorted(set(own) - expected)
    missing = sorted(expected - set(own) - set(_IGNORED))
    if unknown or missing:
        raise ValueError(f"sd: not a reference memory state dict under prefix {prefix!r}; "
                         f"unknown keys {unknown}, missing keys {missing}")
    out = {new: own[old].detach().clone() for old, new in _RENAMED.items()}
    pointwise = own["gate_conv.pointwise.weight"]
    c4, c2 = pointwise.shape[:2]
    if tuple(pointwise.shape) != (c4, c2, 1, 1, 1) or c4 != 2 * c2:
        raise ValueError(f"gate_conv.pointwise.weight: expected shape (4C, 2C, 1, 1, 1), "
                         f"got {tuple(pointwise.shape)}")
    taps, biases = [], []
    for axis, name in enumerate(_DEPTHWISE):
        weight = own[f"{name}.weight"]
        kernel = [1, 1, 1]
        kernel[axis] = 3
        if tuple(weight.shape) != (c2, 1, *kernel):
            raise ValueError(f"{name}.weight: expected shape {(c2, 1, *kernel)}, "
                             f"got {tuple(weight.shape)}")
        taps.append(weight.reshape(c2, 3))
        biases.append(own[f"{name}.bias"].reshape(c2))
    out["cell.depthwise_weight"] = torch.stack(taps).detach().clone()
    out["cell.depthwise_bias"] = torch.stack(biases).detach().clone()
    out["cell.pointwise_weight"] = pointwise.reshape(c4, c2).detach().clone()
    out["cell.pointwise_bias"] = own["gate_conv.pointwise.bias"].detach().clone()
    if "grid_cache" in own:
        grid = own["grid_cache"]
        if grid.dim() != 5 or tuple(grid.shape[:2]) != (1, 3) or min(grid.shape[2:]) < 1:
            raise ValueError(f"grid_cache: expected shape (1, 3, D, H, W), "
                             f"got {tuple(grid.shape)}")
        out["_extra_state"] = torch.tensor(tuple(grid.shape[2:]), dtype=torch.int32)
    return out
