"""Checkpoints of the JAX adapter: a PyTorch adapter state dict to a parameter pytree and
back (:func:`params_from_state_dict` / :func:`state_dict_from_params`), and the leaf-by-leaf
comparison of two parameter pytrees that loading uses. A parameter pytree carries its
:class:`tmcore.layer.LayerConfig` under :data:`CONFIG`, a static pytree node; the torch state
dict stores only its grid (``_extra_state``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tmcore import layer as tl
from tmcore.runtime import validate

__all__ = ["CONFIG", "EXTRA_STATE", "params_from_state_dict", "state_dict_from_params"]

#: State-dict key (last part) under which the PyTorch adapter stores the grid shape.
EXTRA_STATE = "_extra_state"
#: Key of a parameter pytree's :class:`tmcore.layer.LayerConfig`.
CONFIG = "config"

# a config in a pytree is static (hashable, no array leaf): jax.grad, optax and
# jax.tree.map see the parameters only, and jit keys its traces by it
jax.tree_util.register_static(tl.LayerConfig)


def _find_prefix(keys: Sequence[str]) -> str:
    anchors = [k[: -len("write_proj.weight")] for k in keys if k.endswith("write_proj.weight")]
    if len(anchors) != 1:
        raise ValueError(f"sd: cannot infer the prefix ({len(anchors)} keys end in "
                         f"'write_proj.weight'); pass prefix=")
    anchor = anchors[0]
    outer = anchor[: -len("memory.")]
    if anchor.endswith("memory.") and f"{outer}gate" in keys:  # a gated residual
        return outer
    return anchor


def _options_of(names: Any, residual: bool) -> dict:
    """The parameter options (``dynamics``, ``flow``) a state dict's names hold: a
    ``warp_flow`` entry means ``flow=True`` (with ``dynamics="warp"``), a ``warp_net`` one
    ``dynamics="warp"``; neither, the default layer."""
    prefix = "memory." if residual else ""
    if any(name.startswith(f"{prefix}{tl.FLOW_GROUP}.") for name in names):
        return {"dynamics": "warp", "flow": True}
    if any(name.startswith(f"{prefix}{tl.WARP_GROUP}.") for name in names):
        return {"dynamics": "warp"}
    return {}


def _stored_grid(key: str, value: np.ndarray) -> tuple[int, ...]:
    if value.ndim != 1 or not 1 <= value.shape[0] <= 4 or not np.issubdtype(value.dtype,
                                                                             np.integer):
        raise ValueError(f"sd[{key!r}]: expected the grid shape a PyTorch checkpoint stores "
                         f"(1 to 4 ints), got {value!r}")
    return tuple(int(s) for s in value)


def _leaf_bytes(value: Any, dtype: Any) -> int:
    return int(np.prod(value.shape, dtype=np.int64)) * np.dtype(
        value.dtype if dtype is None else dtype).itemsize


def _layer_config(layer: Mapping[str, Any], names: Mapping[str, str], prefix: str,
                  config: Any, grid: Any, grid_key: str, options: Mapping[str, Any]
                  ) -> tl.LayerConfig:
    """``config`` (else the sizes the weights fix with the stored ``grid``), with every
    weight checked against it from shapes only; errors name the state-dict key."""
    try:
        if config is None:
            if grid is None:
                raise ValueError("config: the state dict stores no grid (no _extra_state "
                                 "entry); pass config=, the LayerConfig the weights are for")
            d, channels, _, length = tl.sizes_from_params(layer)
            config = tl.layer_config(d, channels, grid, length, **options)
        elif grid is not None and tl.stored_grid_error(grid, config.memory_shape, grid_key):
            raise ValueError(tl.stored_grid_error(grid, config.memory_shape, grid_key))
        tl.check_params(layer, config)
    except (ValueError, TypeError) as exc:  # name the key, not the pytree path
        message = str(exc)
        for spec in tl.param_specs(dataclasses.replace(tl.LayerConfig(1, 1, (1,), 1),
                                                       **options)):
            message = message.replace(f"params.{spec.name}",
                                      f"sd[{names[prefix + spec.name]!r}]")
        raise type(exc)(message) from None
    return config


def _check_residual(raw: Mapping[str, Any], names: Mapping[str, str], d: int) -> None:
    for name, shape in (("norm.weight", (d,)), ("norm.bias", (d,)), ("gate", tl.GATE_SHAPE)):
        if tuple(_lookup(raw, name).shape) != shape:
            raise ValueError(f"sd[{names[name]!r}]: expected shape {shape} (d from "
                             f"out_proj.weight), got {tuple(_lookup(raw, name).shape)}")


def _arrays(tree: Any) -> Any:
    """A parameter pytree without its config (the arrays that loading compares)."""
    if not isinstance(tree, Mapping):
        return tree
    return {k: _arrays(v) for k, v in tree.items() if k != CONFIG}


def _slot(tree: dict, name: str) -> tuple[dict, str]:
    """The dict of ``tree`` (made as needed) and key a dotted ``name``'s leaf goes in."""
    *path, leaf = name.split(".")
    for part in path:
        tree = tree.setdefault(part, {})
    return tree, leaf


def _lookup(tree: Mapping[str, Any], name: str) -> Any:
    node: Any = tree
    for part in name.split("."):
        node = node[part]
    return node


#: a broadcast (stride-0) leaf materializing to more than this is refused: a trained
#: checkpoint never holds one, a hostile one claims gigabytes in a few bytes
_BROADCAST_LIMIT = 64 << 20


def params_from_state_dict(
    sd: Mapping[str, Any], prefix: str | None = None, *, config: Any = None,
    dtype: Any = None, expected: Any = None,
) -> dict:
    """A parameter pytree from a (PyTorch adapter) state dict of NumPy arrays.

    Dotted names become nested dicts: ``"write_proj.weight"`` ->
    ``params["write_proj"]["weight"]``, ``"memory.cell.pointwise_bias"`` ->
    ``params["memory"]["cell"]["pointwise_bias"]``. Only keys starting with
    ``prefix`` are taken, with it removed; ``prefix=None`` infers it from the
    single key ending in ``write_proj.weight`` (a memory layer, or a gated
    residual whose memory is ``memory``). Layouts are unchanged (torch's); the
    ``warp_net`` / ``warp_flow`` groups are carried when present.

    Every leaf's shape and dtype is checked BEFORE anything is converted, from
    shapes only: against the config and, with ``expected``, against its shapes.
    Then the bytes the ``jnp`` arrays will take are checked against the device
    (``MemoryError``), and a broadcast (stride-0) leaf that would materialize to
    more than 64 MiB is refused (``ValueError``; a trained checkpoint never holds
    one: materialize it yourself with ``np.ascontiguousarray`` if you mean it).

    Parameters
    ----------
    sd : mapping of str to numpy.ndarray
        The state dict (``{k: v.numpy() for k, v in module.state_dict().items()}``).
    prefix : str or None, default None
        Only keys starting with it are taken, with it removed; ``None`` infers
        it (see above).
    config : tmcore.layer.LayerConfig, optional
        The layer the weights are for (e.g. the torch module's ``config``); default
        the one the weights' shapes and the stored grid (``_extra_state``) fix, the
        other fields at their defaults.
    dtype : dtype, optional
        The weights' dtype; default their own (float64 needs x64 enabled).
    expected : dict, optional
        A parameter pytree (e.g. :func:`init` of the model the weights are for)
        whose shapes every leaf must have.

    Returns
    -------
    dict
        The nested pytree of ``jnp`` arrays with the layer's config under
        ``"config"`` (:func:`init`'s layout); :func:`state_dict_from_params` writes
        its grid back as ``_extra_state``.

    Raises
    ------
    KeyError
        If a parameter is missing.
    ValueError
        If a key under ``prefix`` is not one of the layer's (a typo, another
        module's weights: pass ``prefix=``), a leaf is misshapen or differs from
        ``expected`` or ``config``, the stored grid is not ``config``'s, there is
        neither a stored grid nor ``config``, the prefix cannot be inferred, or a
        broadcast leaf would materialize to more than 64 MiB.
    TypeError
        If a weight is not floating, ``sd`` is not a mapping with str keys, or
        ``config`` not a :class:`tmcore.layer.LayerConfig`.
    MemoryError
        If the arrays would not fit in the device's memory.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(f"sd: expected a mapping of str keys to arrays (a state dict), "
                        f"got {type(sd).__name__}")
    bad = [key for key in sd if not isinstance(key, str)]
    if bad:
        raise TypeError(f"sd: expected str keys (a state dict), got the key {bad[0]!r} "
                        f"({type(bad[0]).__name__})")
    if config is not None and not isinstance(config, tl.LayerConfig):
        raise TypeError(f"config: expected a LayerConfig, got {type(config).__name__}")
    keys = list(sd)
    prefix = _find_prefix(keys) if prefix is None else prefix
    names = {key[len(prefix):]: key for key in keys if key.startswith(prefix)}
    if not names:
        raise ValueError(f"sd: no key starts with prefix {prefix!r}")
    residual = any(name.startswith("memory.") for name in names)
    inner = "memory." if residual else ""
    options = _options_of(names, residual) if config is None else {
        "dynamics": config.dynamics, "flow": config.flow}
    unit = dataclasses.replace(tl.LayerConfig(1, 1, (1,), 1), **options)
    wanted = {inner + spec.name for spec in tl.param_specs(unit)}
    wanted |= {"norm.weight", "norm.bias", "gate"} if residual else set()
    unknown = sorted(f"{prefix}{name}" for name in names
                     if name not in wanted and name != inner + EXTRA_STATE)
    if unknown:
        raise ValueError(f"sd: keys under prefix {prefix!r} that are not parameters of a "
                         f"Tensor Memory {'residual' if residual else 'layer'}: {unknown} "
                         f"(pass prefix= to select one module)")
    missing = sorted(f"{prefix}{name}" for name in wanted - set(names))
    if missing:
        raise KeyError(f"sd: missing {', '.join(missing)}")
    raw: dict = {}  # NumPy views of the values (no copy), nested
    for name in wanted:
        node, leaf = _slot(raw, name)
        node[leaf] = value = np.asarray(sd[names[name]])
        if not np.issubdtype(value.dtype, np.floating):
            raise TypeError(f"sd[{names[name]!r}]: expected a floating array, "
                            f"got dtype {value.dtype}")
    grid_key = names.get(inner + EXTRA_STATE)
    grid = None if grid_key is None else _stored_grid(grid_key, np.asarray(sd[grid_key]))
    layer = raw["memory"] if residual else raw
    config = _layer_config(layer, names, inner, config, grid, grid_key, options)
    if residual:
        _check_residual(raw, names, config.embed_dim)
    if expected is not None:
        if not isinstance(expected, Mapping):
            raise TypeError(f"expected: a parameter pytree (from init, residual_init or "
                            f"params_from_module), got {type(expected).__name__}")
        problems = _mismatches(_arrays(expected), raw, "")
        if problems:
            raise ValueError("sd: does not fit expected (nothing converted): "
                             + "; ".join(problems))
    total = 0
    for name in wanted:
        value = _lookup(raw, name)
        nbytes = _leaf_bytes(value, dtype)
        total += nbytes
        if nbytes > _BROADCAST_LIMIT and value.ndim and 0 in value.strides:
            raise ValueError(f"sd[{names[name]!r}]: a broadcast (stride-0) array of shape "
                             f"{tuple(value.shape)} that would take {nbytes / 2**30:.1f} GiB "
                             f"once materialized; a trained checkpoint never holds one "
                             f"(materialize it with np.ascontiguousarray if you mean it)")
    validate.check_bytes("sd", total, "the parameters as jnp arrays", jnp)
    params = jax.tree.map(lambda v: jnp.asarray(v, dtype=v.dtype if dtype is None else dtype),
                          raw)
    (params["memory"] if residual else params)[CONFIG] = config
    return params


def state_dict_from_params(params: Mapping[str, Any], prefix: str = "") -> dict:
    """A parameter pytree as a flat state dict (the inverse of :func:`params_from_state_dict`).

    Parameters
    ----------
    params : dict
        A nested parameter pytree (:func:`init`, :func:`residual_init`, ...).
    prefix : str, default ""
        Prepended to every name (e.g. ``"blocks.0.memory."``).

    Returns
    -------
    dict of str to numpy.ndarray
        ``{dotted name: array}`` in the torch adapter's layouts; a config becomes its
        grid, the ``_extra_state`` entry the torch adapter stores.
    """
    out: dict = {}

    def walk(node: Any, name: str) -> None:
        if isinstance(node, tl.LayerConfig):
            out[name[: -len(CONFIG) - 1] + EXTRA_STATE] = np.asarray(node.memory_shape,
                                                                     np.int32)
        elif isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{name}{key}.")
        else:
            out[name[:-1]] = np.asarray(node)

    walk(params, prefix)
    return out


def _mismatches(expected: Mapping[str, Any], given: Any, path: str) -> list[str]:
    """Every leaf of ``given`` missing, unknown, not floating, or of another shape than
    in ``expected``."""
    if not isinstance(given, Mapping):
        return [f"{path[:-1]}: expected a dict of parameters, got {type(given).__name__}"]
    problems = [f"{path}{k}: missing" for k in expected if k not in given]
    problems += [f"{path}{k}: unknown to this module" for k in given if k not in expected]
    for key, want in expected.items():
        if key not in given:
            continue
        got = given[key]
        if isinstance(want, Mapping):
            problems += _mismatches(want, got, f"{path}{key}.")
        elif isinstance(got, Mapping):
            problems.append(f"{path}{key}: expected an array of shape "
                            f"{tuple(jnp.shape(want))}, got a dict")
        elif tuple(jnp.shape(got)) != tuple(jnp.shape(want)):
            problems.append(f"{path}{key}: expected shape {tuple(jnp.shape(want))}, "
                            f"got {tuple(jnp.shape(got))}")
        elif not jnp.issubdtype(jnp.result_type(got), jnp.floating):
            problems.append(f"{path}{key}: expected a floating array, got dtype "
                            f"{jnp.result_type(got)}")
    return problems

