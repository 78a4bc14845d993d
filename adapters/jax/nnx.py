"""Flax NNX modules of the JAX adapter: :class:`TensorMemory` and :class:`MemoryResidual`
hold the pure layer's pytree as ``nnx.Param`` leaves and its config as ``config``;
:func:`params_from_module` / :func:`load_params` convert."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tmcore import layer as tl
from tmcore.adapters.jax.checkpoints import CONFIG, _arrays, _mismatches
from tmcore.adapters.jax.functional import MemoryState, _run, init, init_state
from tmcore.adapters.jax.stack import _norm_and_gate

__all__ = ["MemoryResidual", "TensorMemory", "load_params", "params_from_module"]


def _to_variables(tree: Mapping[str, Any]) -> nnx.Dict:
    return nnx.Dict({k: _to_variables(v) if isinstance(v, Mapping) else nnx.Param(v)
                     for k, v in tree.items()})


def params_from_module(module: nnx.Module) -> dict:
    """The pure parameter pytree of a :class:`TensorMemory` or :class:`MemoryResidual`.

    Parameters
    ----------
    module : flax.nnx.Module
        The module (or any module holding them).

    Returns
    -------
    dict
        Its ``nnx.Param`` arrays as nested dicts, the names of :func:`init` /
        :func:`residual_init`, each :class:`TensorMemory`'s config under ``"config"``.
    """
    params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    for path, node in nnx.iter_graph(module):
        if isinstance(node, TensorMemory):
            _at(params, path)[CONFIG] = node.config
    return params


def _at(tree: Any, path: Sequence[Any]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _raw(variable: Any) -> Any:
    """A variable's array (``get_raw_value``: no per-read hooks, ~2 us instead of ~25)."""
    get = getattr(variable, "get_raw_value", None)
    return get() if get is not None else variable.value


def _layer_params(module: TensorMemory) -> dict:
    """:func:`params_from_module` of a :class:`TensorMemory`, read from its attributes
    (the layer's fixed names) instead of through ``nnx.state``: the per-call cost of the
    modules' ``__call__`` is a few dozen microseconds, not a millisecond."""
    out: dict = {CONFIG: module.config}
    for group, leaf in module.param_keys:
        out.setdefault(group, {})[leaf] = _raw(getattr(module, group)[leaf])
    return out


def _check_grids(module: Any, params: Mapping[str, Any], path: str) -> None:
    """The grid of each config in ``params`` against the module's at its place."""
    for key, value in params.items():
        if key == CONFIG and isinstance(getattr(module, "config", None), tl.LayerConfig):
            error = tl.stored_grid_error(value.memory_shape, module.config.memory_shape,
                                         f"{path}{key}")
            if error is not None:
                raise ValueError(error)
        elif isinstance(value, Mapping):
            _check_grids(getattr(module, str(key), None), value, f"{path}{key}.")


def load_params(module: nnx.Module, params: Mapping[str, Any]) -> None:
    """Overwrite ``module``'s parameters in place with a pure pytree of the same structure.

    Values are cast to the dtype of the parameter they replace (like
    ``torch``'s ``load_state_dict``). A config in ``params`` (:func:`init`,
    :func:`params_from_state_dict`) is not loaded: its grid is checked against the
    module's.

    Parameters
    ----------
    module : flax.nnx.Module
        A :class:`TensorMemory`, :class:`MemoryResidual` or a module holding them.
    params : dict
        A pytree like :func:`params_from_module` of ``module`` returns.

    Raises
    ------
    ValueError
        Naming the leaf, when ``params`` misses one of the module's
        parameters, has one it does not, has one of another shape or a
        non-floating one, or a stored grid differs from the module's (then
        nothing is changed).
    """
    state = nnx.state(module, nnx.Param)
    current = nnx.to_pure_dict(state)
    problems = _mismatches(current, _arrays(params), "")
    if problems:
        raise ValueError("params: not a pytree of this module's parameters (nothing loaded): "
                         + "; ".join(problems))
    _check_grids(module, params, "")
    params = _arrays(params)
    cast = jax.tree.map(lambda new, old: jnp.asarray(new, dtype=jnp.result_type(old)), params,
                        current)
    nnx.replace_by_pure_dict(state, cast)
    nnx.update(module, state)


class TensorMemory(nnx.Module):
    """Flax NNX Tensor Memory layer; ``module(x, state=None, **kwargs) -> (out, state)``.

    Its ``nnx.Param`` leaves carry the names of :func:`init`'s pytree
    (``module.write_proj["weight"]``, ``module.cell["pointwise_weight"]``, ...) and
    ``module.config`` its :class:`tmcore.layer.LayerConfig`; :func:`params_from_module`
    and :func:`load_params` convert. Calling it is :func:`apply` with its parameters
    (``x (B, N, d)`` to ``out (B, N, d)`` and the state; ``kwargs`` are :func:`apply`'s
    keywords).

    Parameters
    ----------
    embed_dim, memory_channels, memory_shape, chunk_size : int, int, sequence of int, int
        The sizes ``d``, ``C``, ``S`` and ``L``, as in :func:`init`.
    sigma_scale : float, default 1.0
        Multiplies the write spread.
    rngs : flax.nnx.Rngs
        Where the initialization draws from (its ``params`` stream).
    dtype : dtype, default float32
        The parameters' dtype.
    **options
        The layer's other keywords, as in :func:`init`.

    Raises
    ------
    TypeError, ValueError
        As :func:`init` raises them.
    """

    def __init__(self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
                 chunk_size: int, sigma_scale: float = 1.0, *, rngs: nnx.Rngs,
                 dtype: Any = jnp.float32, **options: Any) -> None:
        params = init(rngs.params(), embed_dim, memory_channels, memory_shape, chunk_size,
                      sigma_scale, dtype=dtype, **options)
        self.config = params.pop(CONFIG)
        for name, group in params.items():
            setattr(self, name, _to_variables(group))
        # ``(group, leaf)`` of every parameter, in state-dict order
        self.param_keys = tuple((spec.group, spec.leaf) for spec in tl.param_specs(self.config))

    def init_state(self, batch: int, dtype: Any = jnp.float32) -> MemoryState:
        return init_state(batch, self.config.memory_channels, self.config.memory_shape, dtype)

    def __call__(self, x: jax.Array, state: Any = None, **kwargs: Any) -> tuple[jax.Array, Any]:
        return _run(_layer_params(self), x, state, None, **kwargs)


class MemoryResidual(nnx.Module):
    """Flax NNX gated residual ``x + sigmoid(gate) * memory(norm(x))`` (:func:`residual_apply`).

    ``module(x, state=None, **kwargs) -> (out, state)`` with ``x`` and ``out`` of shape
    ``(B, N, d)`` (``kwargs``: :func:`apply`'s keywords); ``module.memory`` is its
    :class:`TensorMemory`, ``module.norm`` the LayerNorm's ``weight`` / ``bias``
    ``(d,)``, ``module.gate`` ``(1,)``.

    Parameters
    ----------
    embed_dim, memory_channels, memory_shape, chunk_size : int, int, sequence of int, int
        The sizes ``d``, ``C``, ``S`` and ``L``, as in :func:`init`.
    sigma_scale : float, default 1.0
        Multiplies the write spread.
    gate_init : float, default 0.0
        As in :func:`residual_init`.
    rngs : flax.nnx.Rngs
        Where the initialization draws from.
    dtype : dtype, default float32
        The parameters' dtype.
    **options
        The layer's other keywords, as in :func:`init`.

    Raises
    ------
    TypeError, ValueError
        As :class:`TensorMemory` raises them; ``ValueError`` for a non-finite
        ``gate_init``.
    """

    def __init__(self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
                 chunk_size: int, sigma_scale: float = 1.0, *, gate_init: float = 0.0,
                 rngs: nnx.Rngs, dtype: Any = jnp.float32, **options: Any) -> None:
        self.memory = TensorMemory(embed_dim, memory_channels, memory_shape, chunk_size,
                                   sigma_scale, rngs=rngs, dtype=dtype, **options)
        norm, gate = _norm_and_gate(embed_dim, gate_init, dtype)
        self.norm, self.gate = _to_variables(norm), nnx.Param(gate)

    def __call__(self, x: jax.Array, state: Any = None, **kwargs: Any) -> tuple[jax.Array, Any]:
        residual = ({"weight": _raw(self.norm["weight"]), "bias": _raw(self.norm["bias"])},
                    _raw(self.gate))
        return _run(_layer_params(self.memory), x, state, residual, **kwargs)


def _constructor_signature(cls: type) -> None:
    """Give an NNX module class its ``__init__``'s signature (less ``self``): NNX's
    metaclass makes ``inspect.signature(cls)`` ``(*args, **kwargs)``, which the docs and
    their numpydoc check would read."""
    init_sig = inspect.signature(cls.__init__)
    cls.__signature__ = init_sig.replace(  # type: ignore[attr-defined]
        parameters=list(init_sig.parameters.values())[1:],
        return_annotation=inspect.Signature.empty)


_constructor_signature(TensorMemory)
_constructor_signature(MemoryResidual)
