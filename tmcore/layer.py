"""The Tensor Memory layer, defined once against the array API (no framework).

The PyTorch and JAX adapters instantiate what is here and add only what their
framework needs (parameters as framework objects, the scan registered with
autograd / ``custom_vjp``, modules). A variant of the layer (an ablation, a
diagnostic) subclasses :class:`Layer` and overrides :meth:`Layer.heads` or
:meth:`Layer.read_out` instead of copying the layer.

Sizes: ``d`` = embed_dim, ``C`` = memory_channels, ``S`` = memory_shape
(``n = len(S)``, 1 to 4 axes), ``L`` = chunk_size, ``B`` batch, ``N`` tokens,
``T = ceil(N / L)`` chunks.

What lives here
---------------
- :class:`LayerConfig` / :func:`layer_config` -- every hyperparameter,
  validated once (``TypeError`` for the wrong kind of value: a float, a bool or
  a string where an int belongs; ``ValueError`` for a bad value; NumPy
  integers are accepted as sizes).
- :func:`param_specs` -- the parameters' names, shapes and initialization
  plan as data (:class:`ParamSpec`; the table in docs/LAYER.md), and
  :func:`init_params`, which realizes the plan with the caller's RNG.
  :func:`check_params` / :func:`sizes_from_params` check a parameter pytree
  ``{group: {leaf: array}}`` (the torch state-dict names split at the dot);
  :func:`cell_params` gives its ``cell`` group as :class:`tmcore.ConvParams`.
- :func:`heads` -- one chunk (or a stack of chunks) ``(..., L, d)`` to the
  scan's :class:`tmcore.StepInputs`; :func:`read_out` -- reads ``(..., C)`` to
  ``(..., d)``.
- :func:`chunk` / :func:`unchunk` -- tokens ``(B, N, d)`` to chunks
  ``(B, T, L, d)`` (a ragged last chunk zero-padded on the right) and
  per-chunk outputs ``(B, T, d)`` back to ``(B, N, d)`` (broadcast to the
  chunk's tokens, trimmed to ``N``).
- :func:`zero_state`, :func:`reset_state` -- the initial state and the
  per-sequence reset by a bool mask; :func:`check_tokens`,
  :func:`check_state`.
- The multi-layer modes :data:`MODES`: :func:`check_mode`,
  :func:`segment_states`, :func:`start_state`, :func:`final_state`.
- :func:`stored_grid_error` -- the check of a grid shape stored with the
  parameters (the torch ``_extra_state``).
- :class:`Layer` -- the forward of one layer given a ``scan`` callable
  (the adapter's differentiable :func:`tmcore.memory_scan`).

Per chunk ``t`` (docs/LAYER.md, "Per-chunk math"): ``read_coord = tanh(coord_net(first token))``;
``summary = write_proj(the chunk's L tokens, position-major)``;
``write_coord = tanh(coord_net(summary))`` (tied head); ``content =
content_net(summary)``; ``sigma = (softplus(sigma_net(summary)) + 1e-4) *
sigma_scale``; the scan reads the state before the chunk's write;
``out_proj(read_t)`` is broadcast to every token of chunk ``t``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import array_api_compat

from tmcore import _sizes
from tmcore._math import softplus
from tmcore._validate import (
    check_eps,
    check_finite,
    check_grid_shape,
    check_int,
    check_namespace,
    check_positive_scalar,
    check_radius,
)
from tmcore.addressing import MIN_SIGMA
from tmcore.conv import ConvParams, xavier_uniform_bound
from tmcore.dynamics import WarpInputs
from tmcore.scan import StepInputs
from tmcore.splat import DEFAULT_EPS

__all__ = [
    "GATE_SHAPE",
    "GROUPS",
    "DYNAMICS",
    "FLOW_GROUP",
    "MODES",
    "UPDATES",
    "WARP_GROUP",
    "Layer",
    "LayerConfig",
    "ParamSpec",
    "StreamState",
    "cell_params",
    "check_doc_starts",
    "check_mode",
    "check_params",
    "check_state",
    "check_tokens",
    "chunk",
    "doc_starts_from_offsets",
    "final_state",
    "heads",
    "init_params",
    "layer_config",
    "linear",
    "num_chunks",
    "param_groups",
    "param_specs",
    "read_out",
    "reset_state",
    "segment_states",
    "sizes_from_params",
    "split",
    "start_state",
    "stored_grid_error",
    "stream_state",
    "unchunk",
    "zero_state",
]

#: Multi-layer modes: ``"causal"`` (every layer scans from its own state at the
#: start of the segment) and ``"threaded"`` (the reference: layer ``l`` starts
#: from the state layer ``l - 1`` reached after the whole segment; not causal).
MODES = ("causal", "threaded")

#: Parameter groups of one layer, in state-dict order.
GROUPS = ("write_proj", "content_net", "sigma_net", "coord_net", "cell", "out_proj")

#: The group ``dynamics="warp"`` adds after :data:`GROUPS` (:func:`param_groups`).
WARP_GROUP = "warp_net"
#: The group ``flow=True`` adds after it.
FLOW_GROUP = "warp_flow"

#: Shape of the gated residual's gate logit (1-D so that FSDP can shard it; a
#: checkpoint with a 0-dim gate converts with ``reshape(GATE_SHAPE)``).
GATE_SHAPE = (1,)

Params = Mapping[str, Mapping[str, Any]]
State = tuple[Any, Any]


# --------------------------------------------------------------------------- config


def _size(name: str, value: Any) -> int:
    """A positive int (Python or NumPy, never bool or float)."""
    return check_int(name, value, 1)


def _grid(value: Any) -> tuple[int, ...]:
    """``memory_shape``: a sequence of 1 to 4 positive ints (a bare int is refused: ``4``
    could mean ``(4,)`` or ``(4, 4, 4)``)."""
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        raise TypeError(f"memory_shape: expected a sequence of 1 to 4 ints, e.g. ({value},) "
                        f"for a 1-D grid or ({value}, {value}, {value}) for a 3-D one, got "
                        f"the bare int {value!r}")
    return check_grid_shape("memory_shape", value)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The layer's hyperparameters, validated (build with :func:`layer_config`).

    Parameters
    ----------
    embed_dim, memory_channels, memory_shape, chunk_size : int, int, tuple of int, int
        The sizes ``d``, ``C``, ``S`` and ``L``.
    sigma_scale, checkpoint_every, radius, eps, forget_bias, zero_init : see layer_config
        The write spread's scale, the backward's checkpoint interval, the splat's
        truncation and offset, the initial forget-gate bias and the zero read-out,
        as :func:`layer_config` checks them.
    update, window, dynamics, flow : see layer_config
        The experimental options beyond the paper.
    """

    embed_dim: int
    memory_channels: int
    memory_shape: tuple[int, ...]
    chunk_size: int
    sigma_scale: float = 1.0
    checkpoint_every: int = 1
    radius: float | None = None
    eps: float = DEFAULT_EPS
    forget_bias: float = 0.0
    zero_init: bool = False
    #: ``"dense"`` (the paper's step) or ``"local"`` (write and update only a window of
    #: ``window`` cells per axis around the write, :mod:`tmcore.local`; experimental)
    update: str = "dense"
    window: int | None = None
    #: ``"none"`` or ``"warp"`` (the state is resampled at the cell centres plus a
    #: per-chunk shift predicted by ``warp_net`` before each update,
    #: :mod:`tmcore.dynamics`; experimental)
    dynamics: str = "none"
    #: with ``dynamics="warp"``: add a per-cell flow ``(B, n, *S)`` from a factorized
    #: depthwise conv of ``h`` (group ``warp_flow``, zero at init) to the shift
    flow: bool = False

    @property
    def ndim(self) -> int:
        """``n``, the number of spatial axes."""
        return len(self.memory_shape)

    def state_shape(self, batch: int) -> tuple[int, ...]:
        """The shape of ``h`` (and ``c``) for a batch.

        Parameters
        ----------
        batch : int
            ``B``.

        Returns
        -------
        tuple of int
            ``(B, C, *S)``.
        """
        return (batch, self.memory_channels, *self.memory_shape)


def layer_config(
    embed_dim: Any, memory_channels: Any, memory_shape: Any, chunk_size: Any,
    sigma_scale: Any = 1.0, *, checkpoint_every: Any = 1, radius: Any = None,
    eps: Any = DEFAULT_EPS, forget_bias: Any = 0.0, zero_init: Any = False,
    update: Any = "dense", window: Any = None, dynamics: Any = "none", flow: Any = False,
) -> LayerConfig:
    """Validate the layer's arguments once; returns a frozen :class:`LayerConfig`.

    Sizes are ints >= 1, Python or NumPy (bool and float are a ``TypeError``,
    < 1 a ``ValueError``).

    Parameters
    ----------
    embed_dim : int
        ``d``, the width of the tokens.
    memory_channels : int
        ``C``, the channels of the state.
    memory_shape : sequence of int
        ``S``, the grid: 1 to 4 sizes (a bare int is a ``TypeError``: ``4``
        could mean ``(4,)`` or ``(4, 4, 4)``).
    chunk_size : int
        ``L``, the tokens per chunk (one read and one write each).
    sigma_scale : float, default 1.0
        A finite number > 0 multiplying every write spread.
    checkpoint_every : int, default 1
        The backward keeps the state entering every ``checkpoint_every``-th
        chunk and replays the rest.
    radius : float or None, default None
        The splat's truncation radius in sigmas (> 0; ``None``: no truncation).
    eps : float, default 1e-6
        A finite number >= 0 added to the splat's ``2 sigma^2``.
    forget_bias : float, default 0.0
        The initial bias of the forget gate (a finite number).
    zero_init : bool, default False
        The read-out ``out_proj`` starts at zero (weight and bias), so the
        layer's output is exactly 0 at initialization while ``out_proj`` still
        gets a gradient (an attached memory is then an exact identity that
        trains).
    update : {"dense", "local"}, default "dense"
        Experimental (docs/guides/local-and-warp.md): ``"local"`` writes and
        updates only a window of cells around the write.
    window : int or None, default None
        With ``update="local"`` (and only then), the window's cells per axis:
        an int in ``[1, max(memory_shape)]`` (the whole axis on a shorter one).
    dynamics : {"none", "warp"}, default "none"
        Experimental: ``"warp"`` resamples the state by a per-chunk shift
        before each update and adds the zero-initialized ``warp_net`` group.
    flow : bool, default False
        With ``dynamics="warp"`` (and only then): add a per-cell flow, a
        factorized depthwise conv of ``h`` to ``n`` components (group
        ``warp_flow``, zero pointwise map at init), to the shift.

    Returns
    -------
    LayerConfig
        The validated hyperparameters (frozen, hashable).

    Raises
    ------
    TypeError
        If an argument has the wrong kind of value (a float, a bool or a string
        where an int belongs; a non-string ``update`` or ``dynamics``; an array
        ``sigma_scale``); each error names the argument.
    ValueError
        If a value is out of range, ``update`` or ``dynamics`` is not one of its
        options, ``window`` is missing with ``"local"`` or given with
        ``"dense"``, or the state or ``write_proj`` would have more elements
        than int64 indexes.
    """
    check_positive_scalar("sigma_scale", sigma_scale)
    if array_api_compat.is_array_api_obj(sigma_scale):
        raise TypeError(f"sigma_scale: expected a finite number > 0, got an array "
                        f"{type(sigma_scale).__name__}")
    return _sizes.check_config(LayerConfig(
        embed_dim=_size("embed_dim", embed_dim),
        memory_channels=_size("memory_channels", memory_channels),
        memory_shape=_grid(memory_shape),
        chunk_size=_size("chunk_size", chunk_size),
        sigma_scale=float(sigma_scale),
        checkpoint_every=_size("checkpoint_every", checkpoint_every),
        radius=check_radius(radius),
        eps=check_eps(eps),
        forget_bias=check_finite("forget_bias", forget_bias),
        zero_init=_flag("zero_init", zero_init),
        update=_choice("update", update, UPDATES),
        window=_window(update, window, memory_shape),
        dynamics=_choice("dynamics", dynamics, DYNAMICS),
        flow=_flow(flow, dynamics),
    ))


def _flow(flow: Any, dynamics: Any) -> bool:
    """``flow``: a bool, True only with ``dynamics="warp"``."""
    if _flag("flow", flow) and dynamics != "warp":
        raise ValueError(f"flow: a per-cell flow needs dynamics='warp', got "
                         f"dynamics={dynamics!r}")
    return bool(flow)


#: The ``update`` options of :func:`layer_config`.
UPDATES = ("dense", "local")
#: The ``dynamics`` options of :func:`layer_config`.
DYNAMICS = ("none", "warp")


def _choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    """One of ``options`` (a non-string is a ``TypeError``, another string a ``ValueError``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {options}, got {value!r}")
    if value not in options:
        raise ValueError(f"{name}: expected one of {options}, got {value!r}")
    return value


def _window(update: Any, window: Any, memory_shape: Any) -> int | None:
    """``window``: ``None`` unless ``update="local"``, then an int in ``[1, max(S)]``."""
    if update != "local":
        if window is not None:
            raise ValueError(f"window: only used with update='local', got window={window!r} "
                             f"with update={update!r}")
        return None
    if window is None:
        raise ValueError("window: update='local' needs window, the cells per axis of the "
                         "updated window (an int >= 1)")
    return check_int("window", window, 1, max(_grid(memory_shape)))


def _flag(name: str, value: Any) -> bool:
    """A Python or NumPy bool (an int or a string is a ``TypeError``)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{name}: expected True or False, got {value!r}")


# --------------------------------------------------------------------------- parameters


class ParamSpec(NamedTuple):
    """One parameter: ``group.leaf`` (the torch state-dict name), its shape and its init.

    Parameters
    ----------
    group, leaf : str
        The parameter's group (one of :func:`param_groups`) and its name in it.
    shape : tuple of int
        Its shape for the config that made it.
    layout : str
        The shape in symbols, e.g. ``"(4C, 2C)"``.
    init : str
        How it starts:

        - ``"uniform"``: uniform in ``[-bound, bound]`` (``torch.nn.Linear``'s
          default, ``bound = 1 / sqrt(fan_in)``);
        - ``"xavier_uniform"``: uniform in ``[-bound, bound]``, ``bound =
          sqrt(6 / (fan_in + fan_out))``;
        - ``"constant"``: every entry ``value``;
        - ``"identity_taps"``: depthwise taps ``(0, 1, 0)`` on the last axis;
        - ``"forget_bias"``: zeros except the forget-gate quarter ``[C:2C]`` =
          ``value``.
    bound : float, default 0.0
        The half-width of the uniform inits.
    value : float, default 0.0
        The value of the constant and forget-bias inits.
    """

    group: str
    leaf: str
    shape: tuple[int, ...]
    layout: str
    init: str
    bound: float = 0.0
    value: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.group}.{self.leaf}"


def _linear_specs(group: str, out_features: int, in_features: int, out: str, inp: str,
                  bias_value: float | None = None) -> list[ParamSpec]:
    bound = 1.0 / math.sqrt(in_features)
    bias = (ParamSpec(group, "bias", (out_features,), f"({out},)", "uniform", bound)
            if bias_value is None else
            ParamSpec(group, "bias", (out_features,), f"({out},)", "constant", value=bias_value))
    return [ParamSpec(group, "weight", (out_features, in_features), f"({out}, {inp})",
                      "uniform", bound), bias]


def param_specs(config: LayerConfig) -> tuple[ParamSpec, ...]:
    """Every parameter of one layer, in state-dict order (the plan in docs/LAYER.md).

    Parameters
    ----------
    config : LayerConfig
        The layer whose parameters are planned (its sizes, ``forget_bias``,
        ``zero_init`` and ``dynamics`` decide them).

    Returns
    -------
    tuple of ParamSpec
        One per leaf of :func:`param_groups`' groups (``warp_net`` only with
        ``dynamics="warp"``).
    """
    d, c, n, length = config.embed_dim, config.memory_channels, config.ndim, config.chunk_size
    return (
        *_linear_specs("write_proj", d, length * d, "d", "L*d"),
        *_linear_specs("content_net", c, d, "C", "d"),
        *_linear_specs("sigma_net", 1, d, "1", "d", bias_value=1.0),
        *_linear_specs("coord_net", n, d, "n", "d"),
        ParamSpec("cell", "depthwise_weight", (n, 2 * c, 3), "(n, 2C, 3)", "identity_taps"),
        ParamSpec("cell", "depthwise_bias", (n, 2 * c), "(n, 2C)", "constant", value=0.0),
        ParamSpec("cell", "pointwise_weight", (4 * c, 2 * c), "(4C, 2C)", "xavier_uniform",
                  xavier_uniform_bound(2 * c, 4 * c)),
        ParamSpec("cell", "pointwise_bias", (4 * c,), "(4C,)", "forget_bias",
                  value=config.forget_bias),
        *(_zero_specs("out_proj", d, c) if config.zero_init
          else _linear_specs("out_proj", d, c, "d", "C")),
        # dynamics="warp" only (so the default's names and order are untouched): the
        # per-chunk shift (B, T, n) from the write summary, zero at init (no motion)
        *(_zero_specs(WARP_GROUP, n, d, "n", "d") if config.dynamics == "warp" else ()),
        # flow=True only: the per-cell flow (B, n, *S) = conv(h), a factorized conv like
        # the cell's (depthwise taps identity) with a zero pointwise map (no flow at init)
        *((ParamSpec(FLOW_GROUP, "depthwise_weight", (n, c, 3), "(n, C, 3)", "identity_taps"),
           ParamSpec(FLOW_GROUP, "depthwise_bias", (n, c), "(n, C)", "constant"),
           ParamSpec(FLOW_GROUP, "pointwise_weight", (n, c), "(n, C)", "constant"),
           ParamSpec(FLOW_GROUP, "pointwise_bias", (n,), "(n,)", "constant"))
          if config.flow else ()),
    )


def param_groups(config: LayerConfig) -> tuple[str, ...]:
    """The parameter groups of a layer, in state-dict order.

    Parameters
    ----------
    config : LayerConfig
        The layer (only its ``dynamics`` and ``flow`` matter).

    Returns
    -------
    tuple of str
        :data:`GROUPS`, plus ``"warp_net"`` with ``dynamics="warp"``, plus
        ``"warp_flow"`` with ``flow=True``.
    """
    return (GROUPS + ((WARP_GROUP,) if config.dynamics == "warp" else ())
            + ((FLOW_GROUP,) if config.flow else ()))


def _zero_specs(group: str, out_features: int, in_features: int, out: str = "d",
                inp: str = "C") -> list[ParamSpec]:
    """A linear map that starts at exactly zero (``zero_init``, ``warp_net``)."""
    return [ParamSpec(group, "weight", (out_features, in_features), f"({out}, {inp})",
                      "constant"),
            ParamSpec(group, "bias", (out_features,), f"({out},)", "constant")]


def init_params(
    xp: Any, config: LayerConfig, uniform: Callable[[ParamSpec], Any], *, dtype: Any = None,
    device: Any = None, groups: Sequence[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Realize :func:`param_specs` as a parameter pytree ``{group: {leaf: array}}``.

    Parameters
    ----------
    xp : namespace
        The array namespace to create the constant parameters in.
    config : LayerConfig
        The layer.
    uniform : callable
        ``uniform(spec)`` draws an array of ``spec.shape`` uniformly in
        ``[-spec.bound, spec.bound]`` with the caller's RNG (in ``dtype`` on
        ``device``); it is called in state-dict order, once per random
        parameter.
    dtype : dtype, optional
        The constant parameters' dtype (default: the namespace's default).
    device : device, optional
        Where to create the constant parameters.
    groups : sequence of str, optional
        The groups to make (default: every group of the config,
        :func:`param_groups`).

    Returns
    -------
    dict of dict of array
        ``{group: {leaf: array}}`` for the groups asked for.
    """
    kw = {"dtype": dtype, "device": device}
    params: dict[str, dict[str, Any]] = {}
    groups = param_groups(config) if groups is None else groups
    for spec in param_specs(config):
        if spec.group not in groups:
            continue
        if spec.init in ("uniform", "xavier_uniform"):
            value = uniform(spec)
        elif spec.init == "constant":
            value = xp.full(spec.shape, spec.value, **kw)
        elif spec.init == "identity_taps":
            value = xp.zeros(spec.shape, **kw)
            value = xp.where(xp.arange(3, device=device) == 1, xp.ones_like(value), value)
        elif spec.init == "forget_bias":
            c = config.memory_channels
            index = xp.arange(spec.shape[0], device=device)
            forget = (index >= c) & (index < 2 * c)
            value = xp.where(forget, xp.full(spec.shape, spec.value, **kw),
                             xp.zeros(spec.shape, **kw))
        else:  # pragma: no cover - the table above is closed
            raise AssertionError(spec.init)
        params.setdefault(spec.group, {})[spec.leaf] = value
    return params


def cell_params(params: Params) -> ConvParams:
    """The ``"cell"`` group as :class:`tmcore.ConvParams` (the scan's gate parameters).

    Parameters
    ----------
    params : dict of dict of array
        A layer's parameter pytree ``{group: {leaf: array}}``.

    Returns
    -------
    ConvParams
        ``params["cell"]``'s four leaves, in :class:`tmcore.ConvParams`' field
        order (the arrays themselves, not copies).

    Raises
    ------
    KeyError
        If the ``cell`` group or one of its leaves is missing.
    """
    return ConvParams(*(params["cell"][field] for field in ConvParams._fields))


def sizes_from_params(params: Any) -> tuple[int, int, int, int]:
    """The layer sizes a parameter pytree fixes.

    Parameters
    ----------
    params : dict of dict of array
        A layer's parameter pytree ``{group: {leaf: array}}``; read are
        ``out_proj.weight (d, C)``, ``coord_net.weight (n, d)`` and
        ``write_proj.weight (d, L*d)``.

    Returns
    -------
    tuple of int
        ``(d, C, n, L)``: ``embed_dim``, ``memory_channels``, the number of
        spatial axes and ``chunk_size``.

    Raises
    ------
    TypeError
        If ``params`` is not a mapping or a leaf is not an array.
    KeyError
        If a leaf is missing.
    ValueError
        If one of the three weights is not a matrix of the shape above (``n``
        must be 1 to 4).
    """
    _require_leaves(params)

    def shape(group: str, leaf: str) -> tuple[int, ...]:
        return tuple(params[group][leaf].shape)

    for group in ("out_proj", "write_proj", "coord_net"):
        if len(shape(group, "weight")) != 2:
            raise ValueError(f"params.{group}.weight: expected a matrix (out, in), "
                             f"got shape {shape(group, 'weight')}")
    d, c = shape("out_proj", "weight")
    n = shape("coord_net", "weight")[0]
    in_features = shape("write_proj", "weight")[1]
    length = in_features // d if d else 0
    if d < 1 or c < 1 or length < 1 or length * d != in_features:
        raise ValueError(f"params.write_proj.weight: expected shape (d, L*d) with d = {d} "
                         f"(from out_proj.weight), got {shape('write_proj', 'weight')}")
    if not 1 <= n <= 4:
        raise ValueError(f"params.coord_net.weight: expected shape (n, d) with n = 1 to 4 "
                         f"spatial axes, got {shape('coord_net', 'weight')}")
    return d, c, n, length


def _require_leaves(params: Any) -> None:
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a nested dict {{group: {{leaf: array}}}}, "
                        f"got {type(params).__name__}")
    for spec in param_specs(LayerConfig(1, 1, (1,), 1)):
        group = params.get(spec.group)
        if not isinstance(group, Mapping) or spec.leaf not in group:
            raise KeyError(f"params: missing {spec.name}")
        if not hasattr(group[spec.leaf], "shape"):
            raise TypeError(f"params.{spec.name}: expected an array, "
                            f"got {type(group[spec.leaf]).__name__}")


def check_params(params: Any, config: LayerConfig) -> None:
    """Check that every parameter is present, with its shape and a real floating dtype.

    Parameters
    ----------
    params : dict of dict of array
        A layer's parameter pytree ``{group: {leaf: array}}`` (the torch
        state-dict names split at the dot).
    config : LayerConfig
        The layer whose :func:`param_specs` give the expected leaves and shapes.

    Raises
    ------
    KeyError
        If a leaf is missing.
    ValueError
        If a leaf's shape is not the one :func:`param_specs` gives.
    TypeError
        If ``params`` is not a mapping, or a leaf is not an array or not of a
        real floating dtype; each error names the leaf.
    """
    _require_leaves(params)
    for spec in param_specs(config):
        if not isinstance(params.get(spec.group), Mapping) or spec.leaf not in params[spec.group]:
            raise KeyError(f"params: missing {spec.name}")  # (warp_net: dynamics="warp")
        value = params[spec.group][spec.leaf]
        if tuple(value.shape) != spec.shape:
            raise ValueError(f"params.{spec.name}: expected shape {spec.layout} = {spec.shape}, "
                             f"got {tuple(value.shape)}")
        _check_floating(f"params.{spec.name}", value)


def _check_floating(name: str, value: Any) -> None:
    xp = array_api_compat.array_namespace(value)
    if not xp.isdtype(value.dtype, "real floating"):
        raise TypeError(f"{name}: expected a real floating dtype, got {value.dtype}")


# --------------------------------------------------------------------------- heads


def linear(xp: Any, p: Mapping[str, Any], x: Any) -> Any:
    """``x @ weight.T + bias``, a linear map in torch's layout.

    Parameters
    ----------
    xp : namespace
        The array namespace of the arrays.
    p : dict of array
        ``{"weight": (out, in), "bias": (out,)}``.
    x : array, shape ``(..., in)``
        The inputs.

    Returns
    -------
    array, shape ``(..., out)``
        The mapped inputs.
    """
    return xp.matmul(x, xp.matrix_transpose(p["weight"])) + p["bias"]


Linear = Callable[[Any, Mapping[str, Any], Any], Any]


def split(xp: Any, x: Any, sizes: Sequence[int]) -> tuple[Any, ...]:
    """Cut an array along its last axis into consecutive pieces.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``x``.
    x : array, shape ``(..., sum(sizes))``
        The array to cut.
    sizes : sequence of int
        The width of each piece, in order.

    Returns
    -------
    tuple of array
        One slice ``(..., size)`` per entry of ``sizes`` (an adapter may pass one
        op that makes all of them instead, e.g. ``torch.split``).
    """
    pieces, start = [], 0
    for size in sizes:
        pieces.append(x[..., start:start + size])
        start += size
    return tuple(pieces)


def heads(xp: Any, params: Params, chunk: Any, config: LayerConfig, *,
          linear: Linear = linear, softplus: Callable[[Any, Any], Any] = softplus,
          split: Callable[[Any, Any, Sequence[int]], tuple[Any, ...]] = split,
          flat_rows: bool = False) -> StepInputs:
    """The layer's linear heads: chunks of tokens to the scan's step inputs.

    ``...`` is ``(B,)`` for one chunk or ``(B, T)`` for all of them; the layer
    calls it once on all ``(B, T)`` chunks, so the number of operations does not
    grow with the sequence. (Streamed pieces then equal one call to rounding,
    not bit for bit: a matmul over ``B*T`` rows may block its sums differently
    from one over fewer rows.)

    The three heads that read a ``d``-vector (``coord_net``, tied between the read
    query and the write summary, ``content_net`` and ``sigma_net``) run as ONE
    matrix product: their weights stacked ``(n + C + 1, d)``, applied to the
    stacked rows ``[first token, summary]`` ``(..., 2, d)`` (the content and sigma
    columns of the first-token row are not used). The math is the per-head one;
    the fusion saves the dispatches (kernel launches on a GPU) of four products.

    ``linear(xp, p, x)`` computes every linear map (default :func:`linear`; an
    adapter may pass its framework's fused kernel, e.g. torch's ``F.linear``,
    which also follows autocast); ``softplus(xp, x)`` likewise (default the
    overflow-free :func:`tmcore._math.softplus`).

    Parameters
    ----------
    xp : namespace
        The array namespace of the arrays.
    params : dict of dict of array
        The layer's parameter pytree ``{group: {leaf: array}}`` (the heads read
        ``write_proj``, ``coord_net``, ``content_net``, ``sigma_net`` and, with
        ``dynamics="warp"``, ``warp_net``).
    chunk : array, shape ``(..., L, d)``
        One chunk per batch element ``(B, L, d)``, or all of them ``(B, T, L, d)``.
    config : LayerConfig
        The layer's sizes, ``sigma_scale`` and ``dynamics``.
    linear : callable, default :func:`linear`
        ``linear(xp, p, x)``, every linear map.
    softplus : callable, default :func:`tmcore._math.softplus`
        ``softplus(xp, x)``, the sigma head's softplus.
    split : callable, default :func:`split`
        ``split(xp, x, sizes)``, the cut of the fused product's output
        ``(..., 2 (n + C + 1))`` into the four heads' outputs (one op instead of
        one slice per head: the backward then has one op for them, too).
    flat_rows : bool, default False
        Give the products 2-D operands (one row per chunk, ``M = prod(...)``)
        instead of ``(..., L*d)`` and ``(..., 2, d)`` ones: the same products
        where the framework's linear map flattens the leading axes itself (torch's
        ``F.linear``), without a reshape around each. Off by default: XLA sums the
        bias gradients over the leading axes in another order when they are
        flattened (equal to rounding, not bit for bit).

    Returns
    -------
    StepInputs
        ``read_coords (..., n)`` and ``write_coords (..., n)`` in ``(-1, 1)``,
        ``write_sigma (...)`` > 0 and ``write_content (..., C)``; with
        ``dynamics="warp"`` a :class:`tmcore.dynamics.WarpInputs`, which adds
        the warp's ``shift (..., n)``.
    """
    lead = tuple(chunk.shape[:-2])
    length, d = chunk.shape[-2:]
    n = config.ndim
    c = config.memory_channels
    k = n + c + 1
    fused = {key: xp.concat([params[g][key] for g in ("coord_net", "content_net", "sigma_net")],
                            axis=0) for key in ("weight", "bias")}
    # the rows [first token, summary] of every chunk go through one product; its output
    # is cut into the four heads' outputs by one split (same values, fewer dispatches)
    if flat_rows:  # 2-D operands, one row per chunk: no reshape around each product
        rows = math.prod(lead)
        flat = xp.reshape(chunk, (rows, length * d))                    # (M, L*d)
        summary = linear(xp, params["write_proj"], flat)                # (M, d)
        pairs = xp.reshape(xp.stack([flat[:, :d], summary], axis=1), (2 * rows, d))
    else:
        summary = linear(xp, params["write_proj"], xp.reshape(chunk, (*lead, length * d)))
        pairs = xp.stack([chunk[..., 0, :], summary], axis=-2)          # (..., 2, d)
    out = xp.reshape(linear(xp, fused, pairs), (*lead, 2 * k))          # (..., 2 (n + C + 1))
    # the first k + n columns: the read coordinates, the first-token row's unused content
    # and sigma columns (their tanh is never used: a zero gradient), the write coordinates
    coords, content, sigma = split(xp, out, (k + n, c, 1))
    read_coords, _, write_coords = split(xp, xp.tanh(coords), (n, k - n, n))
    sigma = softplus(xp, xp.reshape(sigma, lead)) + MIN_SIGMA
    if config.sigma_scale != 1.0:  # (a product by 1.0 is exact: skipped, same bits)
        sigma = sigma * config.sigma_scale
    inputs = StepInputs(read_coords=read_coords, write_coords=write_coords,
                        write_sigma=sigma, write_content=content)
    if config.dynamics == "warp":  # + the shift (..., n) from the summary (tmcore.dynamics)
        shift = linear(xp, params[WARP_GROUP], summary)                 # (M or ..., n)
        return WarpInputs(*inputs, shift=xp.reshape(shift, (*lead, n)))
    return inputs


def read_out(xp: Any, params: Params, reads: Any, *, linear: Linear = linear) -> Any:
    """The read-out: ``out_proj`` on the reads.

    Parameters
    ----------
    xp : namespace
        The array namespace of the arrays.
    params : dict of dict of array
        The layer's parameter pytree (its ``out_proj`` group is read).
    reads : array, shape ``(..., C)``
        What the scan read, e.g. ``(B, T, C)``.
    linear : callable, default :func:`linear`
        ``linear(xp, p, x)``, the linear map.

    Returns
    -------
    array, shape ``(..., d)``
        The layer's output per read.
    """
    return linear(xp, params["out_proj"], reads)


# --------------------------------------------------------------------------- chunking


def num_chunks(tokens: int, chunk_size: int) -> int:
    """The number of chunks of a sequence, ``T = ceil(N / L)``.

    Parameters
    ----------
    tokens : int
        ``N``, the sequence length.
    chunk_size : int
        ``L``, the tokens per chunk.

    Returns
    -------
    int
        ``T``; a ragged last chunk counts.
    """
    return -(-tokens // chunk_size)


def chunk(xp: Any, x: Any, chunk_size: int) -> Any:
    """Split tokens into chunks of ``L``.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``x``.
    x : array, shape ``(B, N, d)``
        The tokens.
    chunk_size : int
        ``L``, the tokens per chunk.

    Returns
    -------
    array, shape ``(B, T, L, d)``
        ``T = ceil(N / L)`` chunks, the last one zero-padded on the right.
    """
    batch, tokens, d = x.shape
    steps = num_chunks(tokens, chunk_size)
    pad = steps * chunk_size - tokens
    if pad:
        # zeros like x (dtype, device, sharding) without asking for a device, which
        # torch.compile would trace through array_api_compat's type checks
        zeros = xp.broadcast_to(xp.zeros_like(x[:, :1, :]), (batch, pad, d))
        x = xp.concat([x, zeros], axis=1)
    return xp.reshape(x, (batch, steps, chunk_size, d))


def unchunk(xp: Any, per_chunk: Any, tokens: int, chunk_size: int) -> Any:
    """Spread one row per chunk back over the chunk's tokens.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``per_chunk``.
    per_chunk : array, shape ``(B, T, d)``
        One row per chunk.
    tokens : int
        ``N``, the number of real tokens (at most ``T * L``).
    chunk_size : int
        ``L``, the tokens per chunk.

    Returns
    -------
    array, shape ``(B, N, d)``
        Chunk ``t``'s row on each of its tokens, trimmed to the first ``N``.
    """
    batch, steps, d = per_chunk.shape
    out = xp.broadcast_to(per_chunk[:, :, None, :], (batch, steps, chunk_size, d))
    out = xp.reshape(out, (batch, steps * chunk_size, d))
    return out if tokens == steps * chunk_size else out[:, :tokens, :]


# --------------------------------------------------------------------------- state


def _device(x: Any) -> Any:
    """``x``'s device: the standard ``.device`` attribute where it is one (cheap, and
    traceable by torch.compile), else ``array_api_compat.device``."""
    try:
        device = x.device
    except Exception:  # e.g. an array spread over several devices
        device = None
    return array_api_compat.device(x) if device is None or callable(device) else device


def zero_state(xp: Any, config: LayerConfig, batch: int, *, dtype: Any = None,
               device: Any = None) -> State:
    """The zero state of a layer.

    Parameters
    ----------
    xp : namespace
        The array namespace to create the state in.
    config : LayerConfig
        The layer's sizes (``C`` and ``S``).
    batch : int
        ``B``, the number of sequences.
    dtype : dtype, optional
        The state's dtype (default: the namespace's default floating dtype).
    device : device, optional
        Where to create the state (default: the namespace's default device).

    Returns
    -------
    h, c : array, shape ``(B, C, *S)``
        Two zero arrays.

    Raises
    ------
    ValueError, MemoryError
        If the state (and one scan step over it) cannot be indexed or does not
        fit the device; the error names ``memory_shape``.
    """
    _sizes.check_state(xp, config, batch, dtype, device)  # sizes before allocating
    shape = config.state_shape(batch)
    return xp.zeros(shape, dtype=dtype, device=device), xp.zeros(shape, dtype=dtype,
                                                                 device=device)


def check_tokens(xp: Any, x: Any, config: LayerConfig) -> None:
    """Check a layer's tokens.

    Parameters
    ----------
    xp : namespace
        The array namespace of the layer's call.
    x : array, shape ``(B, N, d)``
        The tokens: a real floating array with ``d = embed_dim``.
    config : LayerConfig
        The layer (its ``embed_dim``).

    Raises
    ------
    TypeError
        If ``x`` is not an array or not of a real floating dtype.
    ValueError
        If ``x`` is not 3-D or its last axis is not ``embed_dim``.
    """
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x: expected an array of shape (B, N, d), got {type(x).__name__}")
    if x.ndim != 3:
        raise ValueError(f"x: expected shape (B, N, d) (3 dims), got {tuple(x.shape)}")
    if x.shape[-1] != config.embed_dim:
        raise ValueError(f"x: expected shape (B, N, d) with d = {config.embed_dim} "
                         f"(embed_dim = {config.embed_dim}), got {tuple(x.shape)}")
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"x: expected a real floating dtype, got {x.dtype}")


def check_state(xp: Any, state: Any, batch: int, config: LayerConfig) -> State:
    """Check a layer state ``(h, c)``.

    Parameters
    ----------
    xp : namespace
        The array namespace of the layer's call.
    state : pair of arrays
        ``(h, c)``, each of shape ``(B, C, *S)`` and a real floating dtype (a
        tuple or a list).
    batch : int
        The expected ``B``.
    config : LayerConfig
        The layer's sizes (``C`` and ``S``).

    Returns
    -------
    h, c : array, shape ``(B, C, *S)``
        The state as a tuple.

    Raises
    ------
    ValueError
        If ``state`` is not a pair, or ``h`` or ``c`` has another shape.
    TypeError
        If ``h`` or ``c`` is not an array or not of a real floating dtype.
    """
    expected = config.state_shape(batch)
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise ValueError(f"state: expected a pair (h, c) of shape (B, C, *S) = {expected} "
                         f"or None, got {type(state).__name__}")
    for name, value in zip(("h", "c"), state, strict=True):
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise TypeError(f"state.{name}: expected an array of shape (B, C, *S) = "
                            f"{expected}, got {type(value).__name__}")
        if tuple(value.shape) != expected:
            raise ValueError(f"state.{name}: expected shape (B, C, *S) = {expected}, "
                             f"got {tuple(value.shape)}")
        if not xp.isdtype(value.dtype, "real floating"):
            raise TypeError(f"state.{name}: expected a real floating dtype, got {value.dtype}")
    return state[0], state[1]


def reset_state(xp: Any, state: State, mask: Any) -> State:
    """Zero ``(h, c)`` of the sequences where the bool ``mask (B,)`` is True.

    Parameters
    ----------
    xp : namespace
        The array namespace of the state.
    state : pair of arrays, shape ``(B, C, *S)`` each
        The state ``(h, c)``.
    mask : bool array, shape ``(B,)``
        True for the sequences to reset (named ``reset`` in errors).

    Returns
    -------
    h, c : array, shape ``(B, C, *S)``
        The state with the masked rows zeroed.

    Raises
    ------
    TypeError
        If ``mask`` is not an array of ``xp``'s kind or not of dtype bool (a
        float mask would silently mean "anything non-zero"; compare
        explicitly, e.g. ``mask > 0.5``).
    ValueError
        If ``mask`` does not have shape ``(B,)``.
    """
    h, c = state
    batch = h.shape[0]
    _require_bool_array(xp, mask, "reset", "(B,)", (batch,),
                        hint=" (compare explicitly, e.g. mask > 0.5)")
    where = xp.reshape(mask, (batch,) + (1,) * (h.ndim - 1))
    return (xp.where(where, xp.zeros_like(h), h), xp.where(where, xp.zeros_like(c), c))


def _require_bool_array(xp: Any, value: Any, name: str, axes: str,
                        shape: tuple[int, ...], hint: str = "") -> None:
    """Raise unless ``value`` is a bool array of ``shape`` (named ``axes``, e.g. ``"(B,)"``):
    ``TypeError`` for a non-array or another dtype, ``ValueError`` for another shape."""
    expected = f"of shape {axes} = ({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"
    if not array_api_compat.is_array_api_obj(value):
        raise TypeError(f"{name}: expected a bool array {expected}, got {type(value).__name__}")
    check_namespace(xp, name, value, f"a bool array {expected}")
    if not xp.isdtype(value.dtype, "bool"):
        raise TypeError(f"{name}: expected a bool mask {expected}, got dtype {value.dtype}{hint}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected a bool mask {expected}, got {tuple(value.shape)}")


# --------------------------------------------------------------------------- modes


def check_mode(mode: Any) -> str:
    """Check a multi-layer mode.

    Parameters
    ----------
    mode : str
        One of :data:`MODES`.

    Returns
    -------
    str
        ``mode``.

    Raises
    ------
    ValueError
        If ``mode`` is not in :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode


def _is_pair(state: Any) -> bool:
    """One layer's state: an ``(h, c)`` pair or a :class:`StreamState`."""
    if isinstance(state, StreamState):
        return True
    return (isinstance(state, (tuple, list)) and len(state) == 2
            and all(hasattr(s, "shape") for s in state))


def segment_states(mode: str, state: Any, layers: int) -> Any:
    """The state a stack of ``layers`` starts a segment from, normalized.

    Parameters
    ----------
    mode : {"causal", "threaded"}
        The stack's mode (:data:`MODES`).
    state : None, a state or a sequence of states
        ``None``, one layer state (an ``(h, c)`` pair or a
        :class:`StreamState`) or a sequence of per-layer states.
    layers : int
        The number of layers of the stack.

    Returns
    -------
    list or state or None
        ``"causal"``: a list of ``layers`` per-layer states (``None`` entries:
        zeros; one given state is used for every layer). ``"threaded"``: one
        state or ``None``; a per-layer sequence (as a causal stack returns)
        gives its last layer's state.

    Raises
    ------
    ValueError
        If ``mode`` is not in :data:`MODES`, or a causal ``state`` sequence does
        not hold ``layers`` states.
    """
    check_mode(mode)
    if mode == "threaded":
        if state is None or _is_pair(state):
            return state
        states = list(state)
        return states[-1] if states else None
    if state is None or _is_pair(state):
        return [state] * layers
    states = list(state)
    if len(states) != layers:
        raise ValueError(f"state: expected {layers} per-layer (h, c) pairs in causal mode, "
                         f"got {len(states)}")
    return states


def start_state(mode: str, layer: int, segment: Any, previous: State | None) -> tuple[Any, bool]:
    """Where layer ``layer`` of a stack starts.

    Causal: the layer's own segment state, and the reset mask applies.
    Threaded: layer 0 the segment state (reset applies), every later layer the
    previous layer's final state (already reset upstream).

    Parameters
    ----------
    mode : {"causal", "threaded"}
        The stack's mode (checked by :func:`segment_states`).
    layer : int
        The layer's index in the stack.
    segment : list or state or None
        :func:`segment_states`' result.
    previous : pair of arrays or None
        The state layer ``layer - 1`` reached in this segment.

    Returns
    -------
    state : state or None
        The state the layer starts from (``None``: zeros).
    reset : bool
        Whether the call's reset mask applies to it.
    """
    if mode == "causal":
        return segment[layer], True
    if layer == 0:
        return segment, True
    return previous, False


def final_state(mode: str, finals: Sequence[State]) -> Any:
    """The state a stack of layers returns.

    Parameters
    ----------
    mode : {"causal", "threaded"}
        The stack's mode.
    finals : sequence of states
        Each layer's state at the end of the segment, first layer first.

    Returns
    -------
    tuple of states or state
        Causal: the per-layer states as a tuple; threaded: the last one.
    """
    return tuple(finals) if mode == "causal" else finals[-1]


# --------------------------------------------------------------------------- stored grid


def stored_grid_error(stored: Any, memory_shape: Sequence[int], where: str) -> str | None:
    """Why a grid shape stored with the parameters does not fit ``memory_shape``.

    Parameters
    ----------
    stored : array or sequence of int
        The stored grid shape: a 1-D integer array (e.g. torch's
        ``_extra_state``) or a sequence of 1 to 4 ints.
    memory_shape : sequence of int
        The grid shape of the model loading it.
    where : str
        Where ``stored`` came from, for the message (e.g. a state-dict key).

    Returns
    -------
    str or None
        The error message (a malformed ``stored``, or another grid), or ``None``
        when it fits or its values cannot be read (a tracer, a meta tensor).
    """
    malformed = (f"memory_shape: {where} should hold a grid shape (a 1-D int array of "
                 f"1 to 4 sizes), got {stored!r}")
    if array_api_compat.is_array_api_obj(stored):
        xp = array_api_compat.array_namespace(stored)
        if stored.ndim != 1 or not 1 <= stored.shape[0] <= 4 \
                or not xp.isdtype(stored.dtype, "integral"):
            return malformed
        try:
            saved = tuple(int(stored[i]) for i in range(stored.shape[0]))
        except Exception:  # not concrete (each framework raises its own type)
            return None
    else:
        if isinstance(stored, (str, bytes)) or not isinstance(stored, Sequence):
            return malformed
        try:
            saved = tuple(operator.index(s) for s in stored)
        except TypeError:
            return malformed
        if not 1 <= len(saved) <= 4 or any(isinstance(s, bool) for s in stored):
            return malformed
    if saved != tuple(memory_shape):
        return (f"memory_shape: the checkpoint was saved from a grid {saved} ({where}), "
                f"this model's memory_shape is {tuple(memory_shape)}")
    return None


# --------------------------------------------------------------------------- the layer

Scan = Callable[[Any, Any, StepInputs], tuple[Any, Any, Any]]


class Layer:
    """One Tensor Memory layer over a parameter pytree ``{group: {leaf: array}}``.

    Adapters build one per module; a variant overrides :meth:`heads` (e.g. untied
    coordinate heads) or :meth:`read_out`. :meth:`forward` needs a ``scan``:
    ``scan(h0, c0, inputs) -> (reads (B, T, C), h_T, c_T)`` with ``inputs`` a
    :class:`tmcore.StepInputs` of ``(B, T, ...)`` arrays (the adapter's
    differentiable :func:`tmcore.memory_scan`, or any variant of it).

    Parameters
    ----------
    config : LayerConfig
        The layer's hyperparameters (from :func:`layer_config`).

    Raises
    ------
    TypeError
        If ``config`` is not a :class:`LayerConfig`.
    """

    #: the linear map of every head (see :func:`heads`); a subclass may replace it
    linear: Linear = staticmethod(linear)
    #: the sigma head's softplus (see :func:`heads`); a subclass may replace it
    softplus: Callable[[Any, Any], Any] = staticmethod(softplus)
    #: the cut of the fused heads' output (see :func:`heads`); a subclass may replace it
    split: Callable[[Any, Any, Sequence[int]], tuple[Any, ...]] = staticmethod(split)
    #: whether the heads' products take 2-D operands (see :func:`heads`)
    flat_rows: bool = False

    def __init__(self, config: LayerConfig):
        if not isinstance(config, LayerConfig):
            raise TypeError(f"config: expected a LayerConfig (from layer_config), "
                            f"got {type(config).__name__}")
        self.config = config

    def heads(self, xp: Any, params: Params, chunk: Any) -> StepInputs:
        """The layer's heads (:func:`heads` with this layer's config, linear and softplus).

        Parameters
        ----------
        xp, params, chunk : see heads
            As in :func:`heads`: the namespace, the parameter pytree and the
            chunks ``(..., L, d)``.

        Returns
        -------
        StepInputs
            The step inputs of the chunks (leading axes ``...``), as
            :func:`heads` gives them.
        """
        return heads(xp, params, chunk, self.config, linear=self.linear,
                     softplus=self.softplus, split=self.split, flat_rows=self.flat_rows)

    def read_out(self, xp: Any, params: Params, reads: Any) -> Any:
        """The layer's read-out (:func:`read_out` with this layer's linear map).

        Parameters
        ----------
        xp, params, reads : see read_out
            As in :func:`read_out`: the namespace, the parameter pytree and the
            reads ``(..., C)``.

        Returns
        -------
        array, shape ``(..., d)``
            The layer's output per read.
        """
        return read_out(xp, params, reads, linear=self.linear)

    def forward(self, xp: Any, params: Params, x: Any, state: State | None, *, scan: Scan,
                reset: Any = None, check: Callable[..., None] | None = None
                ) -> tuple[Any, State]:
        """The layer on a whole sequence: ``x (B, N, d)`` -> ``(out (B, N, d), (h, c))``.

        Checks ``x``, ``state`` and ``reset`` (:func:`check_tokens`,
        :func:`check_state`, :func:`reset_state`); the heads and the read-out
        run once over all chunks (``(B, T, ...)``), the scan steps through them.
        A ragged last chunk is zero-padded and written.
        ``N = 0`` or ``B = 0`` returns zeros and the (reset) state.

        Parameters
        ----------
        xp : namespace
            The array namespace of the arrays.
        params : dict of dict of array
            The layer's parameter pytree ``{group: {leaf: array}}``.
        x : array, shape ``(B, N, d)``
            The tokens.
        state : pair of arrays, shape ``(B, C, *S)`` each, or None
            The state ``(h, c)`` entering the sequence; ``None``: zeros.
        scan : callable
            ``scan(h0, c0, inputs) -> (reads (B, T, C), h_T, c_T)``, e.g. the
            adapter's differentiable :func:`tmcore.memory_scan`.
        reset : bool array, shape ``(B,)``, optional
            True for the rows whose state is zeroed first.
        check : callable, optional
            An adapter's own checks (devices, dtypes against the parameters),
            called as ``check(x, state, reset=reset)`` once ``x`` and ``state``
            passed the generic ones (``state``: the checked pair, or ``None``)
            and before ``reset``'s, so that every input is checked once per call.

        Returns
        -------
        out : array, shape ``(B, N, d)``
            Each token's output: its chunk's read, read out.
        state : pair of arrays, shape ``(B, C, *S)`` each
            ``(h, c)`` after the last chunk.

        Raises
        ------
        TypeError
            If ``x``, ``state`` or ``reset`` is not an array of the right kind
            or dtype (each error names the argument).
        ValueError
            If ``x``, ``state`` or ``reset`` has the wrong shape.
        ValueError or MemoryError
            With ``state=None``, if the zero state cannot be indexed or does not
            fit the device (:func:`zero_state`).
        """
        config = self.config
        check_tokens(xp, x, config)
        batch, tokens, d = x.shape
        if state is not None:
            state = check_state(xp, state, batch, config)
        if check is not None:
            check(x, state, reset=reset)
        if state is None:
            state = zero_state(xp, config, batch, dtype=x.dtype, device=_device(x))
        if reset is not None:
            state = reset_state(xp, state, reset)
        if tokens == 0 or batch == 0:  # nothing to scan (the scan refuses empty arrays)
            return xp.zeros_like(x), state
        # the heads and the read-out run once over all B*T chunk rows: the operations a
        # call dispatches do not grow with the sequence (only the scan steps through it)
        inputs = self.heads(xp, params, chunk(xp, x, config.chunk_size))  # (B, T, ...) each
        reads, h, c = scan(state[0], state[1], inputs)
        out = self.read_out(xp, params, reads)                            # (B, T, d)
        return unchunk(xp, out, tokens, config.chunk_size), (h, c)

    def forward_stream(self, xp: Any, params: Params, x: Any, state: Any, *, scan: Scan,
                       reset: Any = None, doc_starts: Any = None, valid: Any = None,
                       check: Callable[..., None] | None = None) -> tuple[Any, StreamState]:
        """Streaming and packed documents: ``x (B, N, d)`` -> ``(out (B, N, d), StreamState)``.

        ``state``: ``None`` (zeros), an ``(h, c)`` pair (a chunk boundary) or the
        :class:`StreamState` a previous call returned. The call continues each row's
        unfinished chunk, so feeding a sequence in pieces of ANY lengths (one token at
        a time included) gives the outputs and the state of one long call. A chunk's
        output is known from its first token (its read); its write happens when its
        ``L``-th token arrives.

        ``doc_starts``: optional bool ``(B, N)``, True where a new document starts
        (packed documents, see :func:`doc_starts_from_offsets`): the state and the
        unfinished chunk are dropped there and the chunk grid restarts, so each
        document's outputs equal running it alone. ``reset (B,)`` is a document start
        at the first token of the row. The grid is decided on the host (the masks are
        read there), and the scan is cut only where some row starts a document or
        ends with an unfinished chunk.

        ``valid``: optional bool ``(B, N)``, False at tokens to skip (padding, e.g. a
        Hugging Face attention mask, left or right): they never enter the state nor the
        chunk grid, their outputs are zeros, and each row's stream is its valid tokens
        only (the returned state is the one running them alone gives).

        Parameters
        ----------
        xp, params : namespace, dict of dict of array
            The array namespace and the layer's parameter pytree, as in
            :meth:`forward`.
        x : array, shape ``(B, N, d)``
            The next piece of each row's stream (``N`` may be 0).
        state : None, pair of arrays or StreamState
            ``None`` (zeros), an ``(h, c)`` pair ``(B, C, *S)`` or the
            :class:`StreamState` a previous call returned.
        scan : callable
            ``scan(h0, c0, inputs) -> (reads (B, T, C), h_T, c_T)``; one with a
            ``cond(pred, true_fn, false_fn)`` attribute (JAX: ``lax.cond``) lets
            a step that completes no chunk skip the update.
        reset : bool array, shape ``(B,)``, optional
            A document start at the first token of the marked rows.
        doc_starts : bool array, shape ``(B, N)``, optional
            True where a new document starts (read on the host).
        valid : bool array, shape ``(B, N)``, optional
            False at tokens to skip.
        check : callable, optional
            An adapter's own checks, called as ``check(x, state, reset=reset,
            doc_starts=doc_starts, valid=valid)`` once ``x`` and ``state`` passed
            the generic ones (``state``: ``None``, the checked pair or the checked
            :class:`StreamState`, as given) and before the masks'.

        Returns
        -------
        out : array, shape ``(B, N, d)``
            Each token's output (zeros where ``valid`` is False).
        state : StreamState
            The state after the last token, to pass to the next call.

        Raises
        ------
        TypeError
            If an argument is not an array of the right kind or dtype, or
            ``doc_starts`` (or, with it, ``state.count``, ``reset`` or ``valid``)
            is traced: packed documents are planned on the host.
        ValueError
            If an argument has the wrong shape, or ``state.count`` is not ``B``
            ints in ``[0, L)``.
        """
        return forward_stream(self, xp, params, x, state, scan=scan, reset=reset,
                              doc_starts=doc_starts, valid=valid, check=check)


# the streaming half of the layer lives in tmcore.stream (imported last: it builds on
# the names above); its public names are re-exported here
from tmcore.stream import (  # noqa: E402
    StreamState,
    check_doc_starts,
    doc_starts_from_offsets,
    forward_stream,
    stream_state,
)
