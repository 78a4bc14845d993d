"""Checkpoints of the JAX adapter: a PyTorch adapter state dict to a parameter pytree and
back (:func:`params_from_state_dict` / :func:`state_dict_from_params`), the stored grid
shape as a static pytree node (:class:`StoredGrid`), and the leaf-by-leaf comparison of
two parameter pytrees that loading uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tmcore import layer as tl
from tmcore.runtime import sizes as _sizes

__all__ = ["EXTRA_STATE", "StoredGrid", "params_from_state_dict", "state_dict_from_params"]

#: State-dict key (last part) under which the PyTorch adapter stores the grid shape.
EXTRA_STATE = "_extra_state"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class StoredGrid:
    """The grid shape a PyTorch checkpoint stores (its ``_extra_state``), as a pytree node.

    A static node of a parameter pytree: it has no array leaf, so ``jax.grad``,
    ``optax`` and ``jax.tree.map`` see only the floating parameters, while
    :func:`apply` / :func:`load_params` check it and :func:`state_dict_from_params`
    writes it back.

    Parameters
    ----------
    shape : tuple of int
        The grid shape ``S`` the checkpoint was trained with.
    """

    shape: tuple[int, ...]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.shape, dtype=np.int64 if dtype is None else dtype)


def _check_stored(value: Any, grid: Any, name: str) -> None:
    """A ``ValueError`` (:func:`tmcore.layer.stored_grid_error`'s) when the stored grid
    ``value`` (a :class:`StoredGrid` or an array) is not ``grid``; ``name`` names it."""
    error = tl.stored_grid_error(value.shape if isinstance(value, StoredGrid) else value,
                                 grid, name)
    if error is not None:
        raise ValueError(error)


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


def _option_config(d: int, channels: int, n: int, length: int, options: Mapping[str, Any]
                   ) -> tl.LayerConfig:
    """The sizes and parameter options as a config (a unit grid: no parameter depends
    on the grid's sizes)."""
    return dataclasses.replace(tl.LayerConfig(d, channels, (1,) * n, length), **options)


def _expected_names(residual: bool, options: Mapping[str, Any]) -> set[str]:
    layer = {spec.name for spec in tl.param_specs(_option_config(1, 1, 1, 1, options))}
    layer |= {EXTRA_STATE}
    if not residual:
        return layer
    return {f"memory.{name}" for name in layer} | {"norm.weight", "norm.bias", "gate"}


def _stored_grid(key: str, value: np.ndarray) -> StoredGrid:
    if value.ndim != 1 or not 1 <= value.shape[0] <= 4 or not np.issubdtype(value.dtype,
                                                                             np.integer):
        raise ValueError(f"sd[{key!r}]: expected the grid shape a PyTorch checkpoint stores "
                         f"(1 to 4 ints), got {value!r}")
    return StoredGrid(tuple(int(s) for s in value))


def _leaf_bytes(value: Any, dtype: Any) -> int:
    return int(np.prod(value.shape, dtype=np.int64)) * np.dtype(
        value.dtype if dtype is None else dtype).itemsize


def _check_layout(raw: Mapping[str, Any], names: Mapping[str, str], residual: bool,
                  expected: Any, options: Mapping[str, Any]) -> None:
    """Every leaf's shape and dtype against the layer's layout (the one ``write_proj``,
    ``out_proj`` and ``coord_net`` fix, or ``expected``'s), from shapes only: nothing
    is copied before this passes. Errors name the state-dict key."""
    layer = raw["memory"] if residual else raw
    for name, key in names.items():
        value = _lookup(raw, name)
        if name.endswith(EXTRA_STATE):
            continue
        if not np.issubdtype(value.dtype, np.floating):
            raise TypeError(f"sd[{key!r}]: expected a floating array, got dtype {value.dtype}")
    try:
        d, channels, n, length = tl.sizes_from_params(layer)
        tl.check_params(layer, _option_config(d, channels, n, length, options))
    except (ValueError, TypeError) as exc:  # name the key, not the pytree path
        prefix = "memory." if residual else ""
        message = str(exc)
        for spec in tl.param_specs(_option_config(1, 1, 1, 1, options)):
            message = message.replace(f"params.{spec.name}",
                                      f"sd[{names[prefix + spec.name]!r}]")
        raise type(exc)(message) from None
    if residual:
        for name, shape in (("norm.weight", (d,)), ("norm.bias", (d,))):
            if tuple(_lookup(raw, name).shape) != shape:
                raise ValueError(f"sd[{names[name]!r}]: expected shape (d,) = {shape} (d from "
                                 f"out_proj.weight), got {tuple(_lookup(raw, name).shape)}")
        if tuple(_lookup(raw, "gate").shape) not in ((), tl.GATE_SHAPE):
            raise ValueError(f"sd[{names['gate']!r}]: expected shape {tl.GATE_SHAPE} or (), "
                             f"got {tuple(_lookup(raw, 'gate').shape)}")
    if expected is not None:
        if not isinstance(expected, Mapping):
            raise TypeError(f"expected: a parameter pytree (from init, residual_init or "
                            f"params_from_module), got {type(expected).__name__}")
        given = {k: v for k, v in raw.items() if k != EXTRA_STATE}
        if residual:
            given["memory"] = {k: v for k, v in given["memory"].items() if k != EXTRA_STATE}
        want = {k: v for k, v in expected.items() if k != EXTRA_STATE}
        if residual and isinstance(want.get("memory"), Mapping):
            want["memory"] = {k: v for k, v in want["memory"].items() if k != EXTRA_STATE}
        if residual and "gate" in want and "gate" in given \
                and tuple(np.shape(given["gate"])) == ():
            given["gate"] = np.reshape(given["gate"], tl.GATE_SHAPE)
        problems = _mismatches(want, given, "")
        if problems:
            raise ValueError("sd: does not fit expected (nothing converted): "
                             + "; ".join(problems))


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
    sd: Mapping[str, Any], prefix: str | None = None, *, dtype: Any = None,
    expected: Any = None,
) -> dict:
    """A parameter pytree from a (PyTorch adapter) state dict of NumPy arrays.

    Dotted names become nested dicts: ``"write_proj.weight"`` ->
    ``params["write_proj"]["weight"]``, ``"memory.cell.pointwise_bias"`` ->
    ``params["memory"]["cell"]["pointwise_bias"]``. Only keys starting with
    ``prefix`` are taken, with it removed; ``prefix=None`` infers it from the
    single key ending in ``write_proj.weight`` (a memory layer, or a gated
    residual whose memory is ``memory``). Layouts are unchanged (torch's); a
    0-dim ``gate`` (older checkpoints) becomes ``(1,)``. The ``warp_net`` group
    of a layer with ``dynamics="warp"`` (``(n, d)``, ``(n,)``) and the
    ``warp_flow`` group of one with ``flow=True`` (``(n, C, 3)``, ``(n, C)``,
    ``(n, C)``, ``(n,)``; it needs ``warp_net``) are carried when present, checked
    like the others; pass the same options to :func:`apply`.

    Every leaf's shape and dtype is checked BEFORE anything is converted, from
    shapes only: against the layer's layout (the sizes ``write_proj.weight (d,
    L*d)``, ``out_proj.weight (d, C)`` and ``coord_net.weight (n, d)`` fix), and,
    with ``expected`` (a parameter pytree such as :func:`init` returns, e.g. of
    the model the weights are for), against its shapes. Then the bytes the
    ``jnp`` arrays will take are checked against the device (``MemoryError``),
    and a broadcast (stride-0) leaf that would materialize to more than 64 MiB is
    refused (``ValueError``; a trained checkpoint never holds one: materialize it
    yourself with ``np.ascontiguousarray`` if you mean it).

    Parameters
    ----------
    sd : mapping of str to numpy.ndarray
        The state dict (``{k: v.numpy() for k, v in module.state_dict().items()}``).
    prefix : str or None, default None
        Only keys starting with it are taken, with it removed; ``None`` infers
        it (see above).
    dtype : dtype, optional
        The weights' dtype; default their own (float64 needs x64 enabled).
    expected : dict, optional
        A parameter pytree (e.g. :func:`init` of the model the weights are for)
        whose shapes every leaf must have.

    Returns
    -------
    dict
        The nested pytree of ``jnp`` arrays. An ``_extra_state`` entry (the grid
        shape the PyTorch adapter stores) becomes a :class:`StoredGrid` node (no
        array leaf, so ``jax.grad`` and optax accept the pytree); :func:`apply`
        checks it against the grid and :func:`state_dict_from_params` writes it
        back.

    Raises
    ------
    KeyError
        If a parameter is missing.
    ValueError
        If a key under ``prefix`` is not one of the layer's (a typo, another
        module's weights: pass ``prefix=``), a leaf is misshapen or differs from
        ``expected``, the prefix cannot be inferred, or a broadcast leaf would
        materialize to more than 64 MiB.
    TypeError
        If a weight is not floating or ``sd`` is not a mapping with str keys.
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
    keys = list(sd)
    prefix = _find_prefix(keys) if prefix is None else prefix
    names = {key[len(prefix):]: key for key in keys if key.startswith(prefix)}
    if not names:
        raise ValueError(f"sd: no key starts with prefix {prefix!r}")
    residual = any(name.startswith("memory.") for name in names)
    options = _options_of(names, residual)  # warp_net / warp_flow present: those layers
    expected_names = _expected_names(residual, options)
    unknown = sorted(f"{prefix}{name}" for name in names if name not in expected_names)
    if unknown:
        raise ValueError(f"sd: keys under prefix {prefix!r} that are not parameters of a "
                         f"Tensor Memory {'residual' if residual else 'layer'}: {unknown} "
                         f"(pass prefix= to select one module)")
    missing = sorted(f"{prefix}{name}" for name in expected_names - set(names)
                     if not name.endswith(EXTRA_STATE))
    if missing:
        raise KeyError(f"sd: missing {', '.join(missing)}")
    raw: dict = {}  # NumPy views of the values (no copy), nested
    for name, key in names.items():
        node, leaf = _slot(raw, name)
        value = np.asarray(sd[key])
        node[leaf] = _stored_grid(key, value) if leaf == EXTRA_STATE else value
    _check_layout(raw, names, residual, expected, options)
    total = 0
    for name, key in names.items():
        if name.endswith(EXTRA_STATE):
            continue
        value = _lookup(raw, name)
        nbytes = _leaf_bytes(value, dtype)
        total += nbytes
        if nbytes > _BROADCAST_LIMIT and value.ndim and 0 in value.strides:
            raise ValueError(f"sd[{key!r}]: a broadcast (stride-0) array of shape "
                             f"{tuple(value.shape)} that would take {nbytes / 2**30:.1f} GiB "
                             f"once materialized; a trained checkpoint never holds one "
                             f"(materialize it with np.ascontiguousarray if you mean it)")
    _sizes.check_bytes("sd", total, "the parameters as jnp arrays", jnp)
    params: dict = {}
    for name in names:
        node, leaf = _slot(params, name)
        value = _lookup(raw, name)
        if leaf == EXTRA_STATE:
            node[leaf] = value
            continue
        if name == "gate" and value.ndim == 0:
            value = np.reshape(value, tl.GATE_SHAPE)
        node[leaf] = jnp.asarray(value, dtype=dtype if dtype is not None else value.dtype)
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
        ``{dotted name: array}`` in the torch adapter's layouts; a
        :class:`StoredGrid` node becomes its ``_extra_state`` entry.
    """
    out: dict = {}

    def walk(node: Any, name: str) -> None:
        if isinstance(node, Mapping):
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

