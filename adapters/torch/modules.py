"""The torch adapter's modules: :class:`TensorMemory` (the layer of :mod:`tmcore.layer`
holding its parameters), :class:`MemoryResidual`, :class:`ConvLSTMCell` and :class:`WarpFlow`."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tmcore import layer as tl
from tmcore.adapters.torch import bridge
from tmcore.adapters.torch.functional import option_scan
from tmcore.adapters.torch.tuners import computed, fold_tuned
from tmcore.backends.torch.token import LINEARS, decode_token, token_weights, weights_key
from tmcore.layer.state import check_stream_call
from tmcore.ops.addressing import MIN_SIGMA
from tmcore.ops.splat import DEFAULT_EPS
from tmcore.runtime.validate import check_finite, check_flag, check_int
from tmcore.scan.options import scan_options
from tmcore.types import ConvParams

__all__ = ["ConvLSTMCell", "MemoryResidual", "TensorMemory", "WarpFlow"]

State = tuple[Tensor, Tensor]
_XP = bridge.XP


def _check_like_params(name: str, value: Tensor, device: torch.device,
                       dtype: torch.dtype | None) -> None:
    """``ValueError`` unless ``value`` is on the parameters' ``device``, ``TypeError`` unless it
    has their ``dtype`` (``None``: any); ``name`` leads the message."""
    if value.device != device:
        raise ValueError(f"{name}: expected a tensor on the parameters' device {device}, "
                         f"got one on {value.device}")
    if dtype is not None and value.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the parameters'), got {value.dtype}")


def _kind(value: Any) -> str:
    """``value``'s type with its module, as an error names it."""
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _state_fields(state: Any) -> tuple[tuple[str, Tensor], ...]:
    """``(name, tensor)`` of a call's state (a :class:`tmcore.layer.StreamState`, or a pair
    ``(h, c)``; else none); ``TypeError`` naming a field that is not a torch tensor."""
    if isinstance(state, tl.StreamState):
        if not isinstance(state.count, (Tensor, tuple, list)):
            raise TypeError(f"state.count: expected a tuple of ints or an integer "
                            f"torch.Tensor (B,), got {_kind(state.count)} (convert with "
                            f"torch.as_tensor)")
        fields = (("h", state.h), ("c", state.c), ("pending", state.pending),
                  ("read", state.read))
    elif isinstance(state, (tuple, list)) and len(state) == 2:
        fields = (("h", state[0]), ("c", state[1]))
    else:
        return ()
    for name, value in fields:
        if not isinstance(value, Tensor):
            raise TypeError(f"state.{name}: expected a torch.Tensor, got {_kind(value)} "
                            f"(convert with torch.as_tensor)")
    return tuple((f"state: {name}", value) for name, value in fields)


@functools.lru_cache(maxsize=8)
def _autocast_available(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type)


def _init_from_plan(params: Mapping[str, Tensor], config: tl.LayerConfig, groups: Sequence[str]
                    ) -> None:
    """Fill ``params`` (``"group.leaf"`` -> parameter) by :func:`tmcore.layer.init_params`,
    drawing with torch's RNG in state-dict order."""
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


class _ConvGroup(nn.Module):
    """A module holding the four :class:`tmcore.ConvParams` tensors of a factorized conv."""

    def params(self) -> ConvParams:
        """Give the module's four tensors themselves (not copies) as the scan takes them.

        Returns
        -------
        ConvParams
            ``depthwise_weight``, ``depthwise_bias``, ``pointwise_weight``, ``pointwise_bias``.
        """
        return ConvParams(self.depthwise_weight, self.depthwise_bias, self.pointwise_weight,
                          self.pointwise_bias)


class ConvLSTMCell(_ConvGroup):
    """The ConvLSTM update of the memory grid: its gate conv's parameters and one step.

    The :class:`tmcore.ConvParams` tensors ``depthwise_weight (n, 2C, 3)``, ``depthwise_bias
    (n, 2C)``, ``pointwise_weight (4C, 2C)``, ``pointwise_bias (4C,)``, initialized by the plan
    of :func:`tmcore.layer.param_specs`.

    Parameters
    ----------
    channels : int
        ``C``, the channels of the state ``(h, c)``.
    ndim : int
        ``n``, the spatial axes of the grid (1 to 4).
    forget_bias : float, default 0.0
        The initial bias of the forget gate.
    device, dtype : optional
        The parameters' device and dtype.

    Raises
    ------
    TypeError
        If ``channels`` or ``ndim`` is not an int.
    ValueError
        If ``channels < 1``, ``ndim`` is not 1 to 4, or ``forget_bias`` is not finite.
    """

    def __init__(self, channels: int, ndim: int, *, forget_bias: float = 0.0,
                 device: Any = None, dtype: Any = None):
        super().__init__()
        self.channels, self.ndim = channels, ndim
        self.forget_bias = check_finite("forget_bias", forget_bias)
        self._config = tl.layer_config(1, channels, (1,) * ndim, 1,
                                       forget_bias=self.forget_bias)
        tl.check_param_bytes(_XP, self._config, dtype, device, groups=("cell",))
        kw = {"device": device, "dtype": dtype}
        for spec in tl.param_specs(self._config):
            if spec.group == "cell":
                self.register_parameter(spec.leaf, nn.Parameter(torch.empty(spec.shape, **kw)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the parameters by the plan of :func:`tmcore.layer.param_specs`."""
        _init_from_plan({f"cell.{k}": v for k, v in self.named_parameters()}, self._config,
                        ("cell",))

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, Tensor]:
        """One ConvLSTM step (:func:`tmcore.convlstm_step`) of the state by a written volume.

        Parameters
        ----------
        x : Tensor, shape ``(B, C, *S)``
            The written volume.
        state : pair of Tensor, shape ``(B, C, *S)`` each, optional
            ``(h, c)`` entering the step; ``None``: zeros.

        Returns
        -------
        h, c : Tensor, shape ``(B, C, *S)`` each
            The new state.

        Raises
        ------
        TypeError
            If ``x`` or a state field is not a tensor in the parameters' dtype.
        ValueError
            If ``x``, ``h``, ``c`` are not one shape ``(B, C, *S)`` with this cell's ``C`` and
            ``n``, or lie on another device than the parameters.
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
            _check_like_params(name, value, ref.device, ref.dtype)
        return bridge.call(bridge.ConvLSTMStepFunction, bridge.convlstm_step_op,
                           x, h, c, *self.params())


class WarpFlow(_ConvGroup):
    """The ``warp_flow`` group (``flow=True``): the per-cell flow's conv parameters.

    ``depthwise_weight (n, C, 3)``, ``depthwise_bias (n, C)``, ``pointwise_weight (n, C)``,
    ``pointwise_bias (n,)``, initialized by the plan of :func:`tmcore.layer.param_specs`.

    Parameters
    ----------
    channels, ndim : int
        ``C``, the state's channels, and ``n``, the grid's spatial axes.
    **kw
        ``device`` and ``dtype`` of the parameters.
    """

    def __init__(self, channels: int, ndim: int, **kw: Any):
        super().__init__()
        shapes = {"depthwise_weight": (ndim, channels, 3), "depthwise_bias": (ndim, channels),
                  "pointwise_weight": (ndim, channels), "pointwise_bias": (ndim,)}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, **kw)))


@functools.lru_cache(maxsize=64)
def _param_names(config: tl.LayerConfig) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``((group, (leaf, ...)), ...)`` of a config's :func:`param_specs`, cached per config
    (a decode step is one call per token)."""
    groups: dict[str, list[str]] = {}
    for spec in tl.param_specs(config):
        groups.setdefault(spec.group, []).append(spec.leaf)
    return tuple((group, tuple(leaves)) for group, leaves in groups.items())


def _softplus_threshold(dtype: torch.dtype) -> float:
    # above it torch's softplus returns x, whose error exp(-x) / x is below half an ulp
    # there (float64: exp(-40) / 40 ~ 1e-19): the generic form to rounding
    return 40.0 if dtype == torch.float64 else 20.0


#: torch's forward hooks on every module (its dicts, filled in place): they would miss the
#: norm's and the memory's calls that a decode token's one native call replaces
_GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, name, {})
                      for name in ("_global_forward_pre_hooks", "_global_forward_hooks"))

#: each memory's decode-token weights, checked (rebuilt when :func:`weights_key` changes)
_TOKEN_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plain_weights(module: nn.Module) -> tuple[Tensor, Tensor] | None:
    """``(weight, bias)`` of a plain ``nn.Linear`` / ``nn.LayerNorm`` (registered parameters, no
    hook, no tuner or parametrization: its class exactly), else None."""
    if type(module) not in (nn.Linear, nn.LayerNorm) or module._forward_pre_hooks \
            or module._forward_hooks:
        return None
    registered = module._parameters
    weight, bias = registered.get("weight"), registered.get("bias")
    if (weight is None and getattr(module, "weight", None) is not None) \
            or (bias is None and getattr(module, "bias", None) is not None):
        return None  # an attribute, not a parameter (FSDP1's flat-parameter views)
    return weight, bias


class _TorchLayer(tl.Layer):
    """:mod:`tmcore.layer`'s layer with torch's fused primitives (``F.linear``, the read's custom
    op, ``F.softplus``, ``torch.split``): the same math in fewer dispatched ops."""

    flat_rows = True

    @staticmethod
    def linear(xp: Any, p: Mapping[str, Tensor], x: Tensor) -> Tensor:
        return F.linear(x, p["weight"], p["bias"])

    @staticmethod
    def sample(volume: Tensor, coords: Tensor) -> Tensor:
        return bridge.call(bridge.TrilinearSampleFunction, bridge.trilinear_sample_op, volume,
                           coords, validated=True)  # (the layer's own inputs)

    @staticmethod
    def softplus(xp: Any, x: Tensor) -> Tensor:
        return F.softplus(x, threshold=_softplus_threshold(x.dtype))

    @staticmethod
    def split(xp: Any, x: Tensor, sizes: Sequence[int]) -> tuple[Tensor, ...]:
        return x.split_with_sizes(list(sizes), dim=-1)  # (the op itself: no Python frames)


class TensorMemory(nn.Module):
    """Tensor Memory layer: chunked read / write / ConvLSTM update of a voxel state.

    The math is :class:`tmcore.layer.Layer`'s (``layer_class``; a variant subclasses it); every
    argument is checked once by :func:`tmcore.layer.layer_config`.

    Parameters
    ----------
    embed_dim, memory_channels, memory_shape, chunk_size : int, int, sequence of int, int
        The sizes ``d``, ``C``, ``S`` (1 to 4 axes) and ``L``.
    sigma_scale, checkpoint_every, radius, eps, forget_bias, zero_init : see layer_config
        As in :func:`tmcore.layer.layer_config` (e.g. ``forget_bias=3.0`` starts the memory
        remembering across chunks).
    update, window, dynamics, flow : see layer_config
        The experimental options; their scan has a first-order backward only.
    device, dtype : optional
        The parameters' device and dtype.

    Raises
    ------
    TypeError
        If an argument has the wrong type (a float or bool size, ...); the error names it.
    ValueError
        If a value is out of range (each error names the argument).
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
        tl.check_param_bytes(_XP, config, dtype, device)  # before any parameter is made
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
        """Zero the read-out ``out_proj`` and keep it zero on reset (``zero_init``)."""
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
            ``"embed_dim=..., memory_channels=..., ..."``: the sizes, and the config's other
            fields where they differ from their defaults.
        """
        values = [(f.name, getattr(self.config, f.name), f.default)
                  for f in dataclasses.fields(self.config)]
        return ", ".join(f"{name}={value!r}" for name, value, default in values
                         if default is dataclasses.MISSING or value != default)

    def params(self) -> dict[str, dict[str, Tensor]]:
        """Give the parameters as :mod:`tmcore.layer`'s pytree.

        Read by attribute, not ``named_parameters()``: FSDP1's flat parameters unregister them
        and leave views as attributes. A PEFT LoRA layer gives its effective weight
        (:func:`tmcore.adapters.torch.tuners.effective_weight`).

        Returns
        -------
        dict of dict of Tensor
            ``{group: {leaf: tensor}}`` (the state-dict names split at the dot), the
            parameters themselves.
        """
        params: dict[str, dict[str, Tensor]] = {}
        tuned: dict[str, nn.Module] = {}
        modules = self._modules
        for group, leaves in _param_names(self.config):
            module = modules.get(group)
            if module is None:
                module = getattr(self, group)
            if "base_layer" in module._modules:  # a PEFT tuner wraps it: LoRA folded in below
                params[group] = tuned[group] = module  # (a placeholder keeps the group order)
                continue
            registered = module._parameters
            # else the attribute: FSDP1's flat-parameter views, an old weight_norm's weight
            params[group] = {leaf: registered[leaf] if registered.get(leaf) is not None
                             else computed(module, leaf) for leaf in leaves}
        if tuned:
            params.update(fold_tuned(tuned))
        return params

    # ----------------------------------------------------------------- checkpoints

    def get_extra_state(self) -> Tensor:
        """Store the grid shape (which the parameters do not show) under ``_extra_state``.

        A tensor, so that safetensors and ``torch.load(weights_only=True)`` keep it; loading
        refuses a checkpoint of another grid.

        Returns
        -------
        Tensor, shape ``(n,)``, int32
            ``memory_shape``.
        """
        return torch.tensor(self.memory_shape, dtype=torch.int32)

    def set_extra_state(self, state: Any) -> None:
        """Check a stored grid shape against this model's (:meth:`get_extra_state`).

        Parameters
        ----------
        state : Tensor or sequence of int
            The stored ``_extra_state``, shape ``(n,)``.

        Raises
        ------
        ValueError
            If it is malformed or another grid than ``memory_shape``.
        """
        error = tl.stored_grid_error(state, self.memory_shape, "_extra_state")
        if error is not None:
            raise ValueError(error)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "_extra_state"
        if key in state_dict:
            error = tl.stored_grid_error(state_dict[key], self.memory_shape, key)
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
        device, dtype : optional
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

    def _check(self, x: Tensor, state: Any, masks: dict[str, Any]) -> None:
        """The torch side of a call's checks (the layer's check the shapes): ``x`` and the
        state's fields are torch tensors on the parameters' device, in their dtype unless
        autocast is on; the masks are torch tensors on ``x``'s device."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a tensor of shape (B, N, d), got {type(x).__name__}")
        ref, device_type = self.out_proj.weight, x.device.type
        # (under autocast the dtype is autocast's)
        dtype = None if (_autocast_available(device_type)
                         and torch.is_autocast_enabled(device_type)) else ref.dtype
        for name, value in (("x", x), *_state_fields(state)):
            _check_like_params(name, value, ref.device, dtype)
        if masks["reset"] is not None and not isinstance(masks["reset"], Tensor):
            raise TypeError(f"reset: expected a bool torch.Tensor of shape (B,), got "
                            f"{_kind(masks['reset'])} (convert with torch.as_tensor)")
        for name, mask in masks.items():
            if isinstance(mask, Tensor) and mask.device != x.device:
                raise ValueError(f"{name}: expected a mask on x's device {x.device}, "
                                 f"got one on {mask.device}")

    def _scan(self, h0: Tensor, c0: Tensor, inputs: Any, *, reset: Tensor | None = None,
              active: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        config = self.config
        if config.update != "dense" or config.dynamics != "none":  # (the paper's scan below)
            return option_scan(scan_options(config), h0, c0, inputs, self.cell.params(),
                               self.warp_flow.params() if config.flow else None,
                               reset=reset, active=active)
        return bridge.dense_scan(h0, c0, inputs, self.cell.params(), eps=config.eps,
                                 radius=config.radius, checkpoint_every=config.checkpoint_every,
                                 reset=reset, active=active, validated=True)

    def _token(self, x: Any, state: Any, *, stream: bool, reset: Any, doc_starts: Any,
               valid: Any, norm: nn.Module | None = None,
               gate: Tensor | None = None) -> tuple[Tensor, Any] | None:
        """A streamed decode token as one native call (:func:`tmcore.backends.torch.token.
        decode_token`): ``x (B, 1, d)`` and a :class:`StreamState` of the paper's layer with
        plain linears (and ``norm`` a plain ``nn.LayerNorm`` over ``d`` or none), no mask;
        else None."""
        config = self.config
        if stream is not True or reset is not None or doc_starts is not None \
                or valid is not None or torch.compiler.is_compiling():
            return None  # (masks, the paper's call; a traced call: the layer's ops, one graph)
        if type(state) is not tl.StreamState or type(x) is not Tensor or x.dim() != 3 \
                or x.shape[1] != 1 or type(self.layer) is not _TorchLayer \
                or config.update != "dense" or config.dynamics != "none" \
                or type(self._modules["cell"]) is not ConvLSTMCell:
            return None
        norm_eps, weights = None, [None, None]
        if norm is not None and type(norm) is not nn.Identity:
            found = _plain_weights(norm)
            if found is None or type(norm) is not nn.LayerNorm \
                    or tuple(norm.normalized_shape) != (config.embed_dim,):
                return None
            norm_eps, weights = norm.eps, list(found)
        modules = self._modules
        for name in LINEARS:
            found = _plain_weights(modules[name])
            if found is None:
                return None
            weights += found
        weights.append(gate)
        cell = modules["cell"]._parameters
        weights += [cell.get(name) for name in ConvParams._fields]
        try:
            key = weights_key(weights, norm_eps)
        except RuntimeError:  # a tensor without storage (a functorch transform's)
            return None
        checked = _TOKEN_WEIGHTS.get(self)
        if checked is None or checked.key != key:
            checked = token_weights(weights, config, norm_eps=norm_eps, min_sigma=MIN_SIGMA,
                                    softplus_threshold=_softplus_threshold)
            if checked is None:
                return None
            _TOKEN_WEIGHTS[self] = checked
        return decode_token(x, state, config, checked)

    def forward(
        self, x: Tensor, state: Any = None, *, reset: Tensor | None = None,
        doc_starts: Tensor | None = None, valid: Tensor | None = None, stream: bool = True,
    ) -> tuple[Tensor, Any]:
        """Run the memory over a sequence of tokens.

        Streams by default (:meth:`tmcore.layer.Layer.forward_stream`: pieces of any lengths
        with the returned state equal one long call); ``stream=False`` is the paper's call
        (:meth:`tmcore.layer.Layer.forward`).

        Parameters
        ----------
        x : Tensor, shape ``(B, N, d)``
            The tokens, on the parameters' device, in their dtype (lower under autocast).
        state : None, pair of Tensor or StreamState, optional
            ``(h, c)`` (each ``(B, C, *S)``) or the :class:`StreamState` a previous call
            returned; ``None``: zeros.
        reset : Tensor, shape ``(B,)``, bool, optional
            Those rows start from zeros.
        doc_starts, valid : Tensor, shape ``(B, N)``, bool, optional
            Document starts and the padding mask (``stream=True`` only), as in
            :meth:`tmcore.layer.Layer.forward_stream`.
        stream : bool, default True
            Return a :class:`StreamState`; ``False``: ``(h, c)``.

        Returns
        -------
        out : Tensor, shape ``(B, N, d)``
            Each token's output.
        state : StreamState or pair of Tensor
            The new state.

        Raises
        ------
        TypeError
            If an argument is not a tensor of the right kind or dtype (each error names it).
        ValueError
            If an argument has the wrong shape or device, or a stream-only argument comes with
            ``stream=False``.
        """
        done = self._token(x, state, stream=stream, reset=reset, doc_starts=doc_starts,
                           valid=valid)
        if done is not None:
            return done
        self._check(x, state, {"reset": reset, "doc_starts": doc_starts, "valid": valid})
        if check_stream_call(stream, state, doc_starts, valid):
            return self.layer.forward_stream(_XP, self.params(), x, state, scan=self._scan,
                                             reset=reset, doc_starts=doc_starts, valid=valid)
        return self.layer.forward(_XP, self.params(), x, state, scan=self._scan, reset=reset)


class MemoryResidual(nn.Module):
    """Gated residual ``x + sigmoid(gate) * memory(norm(x))`` around a Tensor Memory.

    Parameters
    ----------
    memory : TensorMemory
        The memory (its ``embed_dim``, device and dtype size the norm and the gate).
    norm : nn.Module, type or None, default None
        A module, a class called as ``norm(embed_dim)``, or ``None`` for ``nn.LayerNorm``
        (``nn.Identity()`` for none).
    gate_init : float, default 0.0
        The initial gate logit (the paper uses 0.0 and -2.0); the gate has shape ``(1,)``.
    zero_init : bool, default False
        Zero the memory's read-out (:class:`TensorMemory`'s ``zero_init``): the residual is
        exactly ``x`` at initialization, and still trains.

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
        if norm is None or isinstance(norm, type):  # (a class: called with d)
            norm = (norm or nn.LayerNorm)(memory.embed_dim, **kw)
        self.norm = norm
        self.gate = nn.Parameter(torch.full(tl.GATE_SHAPE, gate_init, **kw))

    def forward(
        self, x: Tensor, state: Any = None, *, reset: Tensor | None = None,
        doc_starts: Tensor | None = None, valid: Tensor | None = None, stream: bool = True,
    ) -> tuple[Tensor, Any]:
        """Add the gated memory read to the tokens: ``x + sigmoid(gate) * memory(norm(x))``.

        Parameters
        ----------
        x : Tensor, shape ``(B, N, d)``
            The tokens.
        state, reset, doc_starts, valid, stream : see TensorMemory.forward
            Passed to the memory unchanged.

        Returns
        -------
        out : Tensor, shape ``(B, N, d)``
            ``x + sigmoid(gate) * memory(norm(x), state)``.
        state : StreamState or pair of Tensor
            The memory's new state.

        Raises
        ------
        TypeError, ValueError
            As :meth:`TensorMemory.forward`.
        """
        memory = self.memory  # (hooks on it would not run: the layer's path then)
        done = None if memory._forward_hooks or memory._forward_pre_hooks or any(_GLOBAL_HOOKS) \
            else memory._token(x, state, stream=stream, reset=reset, doc_starts=doc_starts,
                               valid=valid, norm=self.norm, gate=self.gate)
        if done is not None:
            return done
        out, state = self.memory(self.norm(x), state, reset=reset, doc_starts=doc_starts,
                                 valid=valid, stream=stream)
        return x + torch.sigmoid(self.gate) * out, state
