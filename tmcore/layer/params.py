"""The layer's parameters as data: names, shapes and init (:func:`param_specs`), their
realization (:func:`init_params`) and checks of a parameter pytree ``{group: {leaf: array}}``
(the torch state-dict names split at the dot), and the stored-grid check.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import array_api_compat

from tmcore.layer.config import LayerConfig
from tmcore.ops.conv import xavier_uniform_bound
from tmcore.runtime import validate
from tmcore.runtime.validate import check_floating
from tmcore.types import ConvParams

__all__ = ["FLOW_GROUP", "GATE_SHAPE", "GROUPS", "WARP_GROUP", "ParamSpec", "Params",
           "cell_params", "check_param_bytes", "check_params", "init_params", "param_groups",
           "param_specs", "sizes_from_params", "stored_grid_error"]

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


@functools.lru_cache(maxsize=64)  # per config: a decode step checks its params per token
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
        xp = _NAMESPACES.get(type(value)) or _NAMESPACES.setdefault(
            type(value), array_api_compat.array_namespace(value))
        check_floating(xp, f"params.{spec.name}", value)


#: the array namespace of each array type seen (a lookup per leaf would cost microseconds)
_NAMESPACES: dict[type, Any] = {}


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


def check_param_bytes(xp: Any, config: Any, dtype: Any = None, device: Any = None,
                      groups: Sequence[str] | None = None) -> None:
    """Check, before a layer's parameters are made, that they fit and can be made.

    Their bytes must fit the device (or the bound ``TMCORE_MEMORY_LIMIT`` sets), and
    every constant the plan fills in (``forget_bias``) must be finite in ``dtype``.

    Parameters
    ----------
    xp : namespace
        The array namespace the parameters will be made in.
    config : LayerConfig
        The layer (its :func:`param_specs` give the shapes).
    dtype : dtype, optional
        The parameters' dtype (default: the namespace's default floating dtype).
    device : device, optional
        Where they will be made.
    groups : sequence of str, optional
        Only these groups (default: every group of the config).

    Raises
    ------
    MemoryError
        If they cannot fit; the error names ``embed_dim`` (or ``memory_channels`` when
        the cell's matrices dominate) and the bytes.
    ValueError
        If ``forget_bias`` overflows ``dtype``.
    """
    specs = [spec for spec in param_specs(config) if groups is None or spec.group in groups]
    count = sum(math.prod(spec.shape) for spec in specs)
    cell = sum(math.prod(spec.shape) for spec in specs if spec.group == "cell")
    d, length, c = config.embed_dim, config.chunk_size, config.memory_channels
    name, what = (("memory_channels", f"the parameters (the gates' pointwise map (4C, 2C) = "
                                      f"({4 * c}, {2 * c}) and the rest)")
                  if 2 * cell > count else
                  ("embed_dim", f"the parameters (write_proj.weight (d, L*d) = ({d}, "
                                f"{length * d}) and the rest)"))
    validate.check_bytes(name, count * validate.itemsize(xp, dtype), what, xp, device)
    if dtype is None:
        dtype = xp.asarray(0.0).dtype
    largest = float(xp.finfo(dtype).max)
    if abs(config.forget_bias) > largest:
        raise ValueError(f"forget_bias: {config.forget_bias!r} overflows the parameters' "
                         f"dtype {dtype} (largest finite value {largest:.4g})")
