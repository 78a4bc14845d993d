"""Flax NNX modules of the JAX adapter: :class:`TensorMemory` and :class:`MemoryResidual`
hold the pure layer's pytree as ``nnx.Param`` leaves; :func:`params_from_module` /
:func:`load_params` convert."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tmcore import layer as tl
from tmcore.adapters.jax.checkpoints import EXTRA_STATE, _check_stored, _mismatches
from tmcore.adapters.jax.functional import MemoryState, apply, init, init_state
from tmcore.adapters.jax.stack import _norm_and_gate, residual_apply
from tmcore.ops.splat import DEFAULT_EPS

__all__ = ["GatedMemoryResidual", "MemoryResidual", "TensorMemory", "load_params",
           "params_from_module"]


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
        :func:`residual_init`.
    """
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _raw(variable: Any) -> Any:
    """A variable's array (``get_raw_value``: no per-read hooks, ~2 us instead of ~25)."""
    get = getattr(variable, "get_raw_value", None)
    return get() if get is not None else variable.value


def _layer_params(module: TensorMemory) -> dict:
    """:func:`params_from_module` of a :class:`TensorMemory`, read from its attributes
    (the layer's fixed names) instead of through ``nnx.state``: the per-call cost of the
    modules' ``__call__`` is a few dozen microseconds, not a millisecond."""
    out: dict = {}
    for group, leaf in module.param_keys:
        out.setdefault(group, {})[leaf] = _raw(getattr(module, group)[leaf])
    return out


#: the settings of a :class:`TensorMemory` its calls pass to :func:`apply`
_SETTINGS = ("memory_shape", "chunk_size", "sigma_scale", "eps", "radius", "checkpoint_every")
_DEFAULT_OPTIONS = {"update": "dense", "window": None, "dynamics": "none", "flow": False}


def _settings(module: TensorMemory) -> dict:
    """The settings of a :class:`TensorMemory` as :func:`apply`'s keywords; the
    experimental options only where not their default (so the default layer's call is
    unchanged)."""
    options = {k: getattr(module, k) for k in _DEFAULT_OPTIONS}
    return {**{k: getattr(module, k) for k in _SETTINGS},
            **{k: v for k, v in options.items() if v != _DEFAULT_OPTIONS[k]}}


def _without_extra_state(module: Any, params: Mapping[str, Any], path: str) -> dict:
    """``params`` less its ``_extra_state`` entries, each checked (when concrete) against
    the ``memory_shape`` of the submodule at its place."""
    out = {}
    for key, value in params.items():
        if key == EXTRA_STATE:
            grid = getattr(module, "memory_shape", None)
            if grid is not None:
                _check_stored(value, grid, f"{path}{key}")
        elif isinstance(value, Mapping):
            out[key] = _without_extra_state(getattr(module, str(key), None), value,
                                            f"{path}{key}.")
        else:
            out[key] = value
    return out


def load_params(module: nnx.Module, params: Mapping[str, Any]) -> None:
    """Overwrite ``module``'s parameters in place with a pure pytree of the same structure.

    Values are cast to the dtype of the parameter they replace (like
    ``torch``'s ``load_state_dict``). ``_extra_state`` entries (the grid shape
    of a PyTorch checkpoint, see :func:`params_from_state_dict`) are checked
    against the module's ``memory_shape`` and not loaded.

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
    params = _without_extra_state(module, params, "")
    problems = _mismatches(current, params, "")
    if problems:
        raise ValueError("params: not a pytree of this module's parameters (nothing loaded): "
                         + "; ".join(problems))
    cast = jax.tree.map(lambda new, old: jnp.asarray(new, dtype=jnp.result_type(old)), params,
                        current)
    nnx.replace_by_pure_dict(state, cast)
    nnx.update(module, state)


class TensorMemory(nnx.Module):
    """Flax NNX Tensor Memory layer; ``module(x, state=None, *, reset=None) -> (out, state)``.

    Its ``nnx.Param`` leaves carry the names of :func:`init`'s pytree
    (``module.write_proj["weight"]``, ``module.cell["pointwise_weight"]``, ...);
    :func:`params_from_module` and :func:`load_params` convert. Calling it is
    :func:`apply` with its parameters and settings (``x (B, N, d)`` to ``out
    (B, N, d)`` and the state; keywords ``reset``, ``stream``, ``doc_starts``,
    ``valid``, ``max_documents``). Mixed precision as in :func:`apply` (float32 parameters with a
    bfloat16 ``x`` compute and keep the state in float32).

    Parameters
    ----------
    embed_dim : int
        The token width ``d``.
    memory_channels : int
        The grid channels ``C``.
    memory_shape : sequence of int
        The grid shape ``S`` (1 to 4 positive ints).
    chunk_size : int
        The tokens per chunk ``L``.
    sigma_scale : float, default 1.0
        Multiplies the write spread.
    rngs : flax.nnx.Rngs
        Where the initialization draws from (its ``params`` stream).
    dtype : dtype, default float32
        The parameters' dtype.
    eps : float, default 1e-6
        As in :func:`tmcore.gaussian_splat`.
    radius : float or None, default None
        As in :func:`tmcore.gaussian_splat`.
    forget_bias : float, default 0.0
        As in :func:`init`.
    checkpoint_every : int, default 1
        As in :func:`apply`.
    update : {"dense", "local"}, default "dense"
        As in :func:`apply` (experimental).
    window : int or None, default None
        As in :func:`apply` (with ``update="local"``).
    dynamics : {"none", "warp"}, default "none"
        As in :func:`init` and :func:`apply`: ``"warp"`` adds the ``warp_net``
        parameters (zero at init).
    flow : bool, default False
        As in :func:`init` and :func:`apply`: adds the ``warp_flow`` parameters.

    Raises
    ------
    TypeError, ValueError
        As :func:`tmcore.layer.layer_config` and :func:`init` raise them.
    """

    def __init__(self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
                 chunk_size: int, sigma_scale: float = 1.0, *, rngs: nnx.Rngs,
                 dtype: Any = jnp.float32, eps: float = DEFAULT_EPS,
                 radius: float | None = None, forget_bias: float = 0.0,
                 checkpoint_every: int = 1, update: str = "dense", window: int | None = None,
                 dynamics: str = "none", flow: bool = False) -> None:
        config = tl.layer_config(embed_dim, memory_channels, memory_shape, chunk_size,
                                 sigma_scale, checkpoint_every=checkpoint_every, radius=radius,
                                 eps=eps, forget_bias=forget_bias, update=update,
                                 window=window, dynamics=dynamics, flow=flow)
        params = init(rngs.params(), embed_dim, memory_channels, memory_shape, chunk_size,
                      sigma_scale, forget_bias=forget_bias, dtype=dtype, dynamics=dynamics,
                      flow=flow)
        for name, group in params.items():
            setattr(self, name, _to_variables(group))
        for name in ("memory_channels", *_SETTINGS, *_DEFAULT_OPTIONS):
            setattr(self, name, getattr(config, name))
        # ``(group, leaf)`` of every parameter (LAYER_KEYS, plus warp_net / warp_flow)
        self.param_keys = tuple((spec.group, spec.leaf) for spec in tl.param_specs(config))

    def init_state(self, batch: int, dtype: Any = jnp.float32) -> MemoryState:
        return init_state(batch, self.memory_channels, self.memory_shape, dtype)

    def __call__(self, x: jax.Array, state: Any = None, *, reset: jax.Array | None = None,
                 stream: bool | None = None, doc_starts: Any = None, valid: Any = None,
                 max_documents: int | None = None) -> tuple[jax.Array, Any]:
        return apply(_layer_params(self), x, state, reset=reset, stream=stream,
                     doc_starts=doc_starts, valid=valid, max_documents=max_documents,
                     **_settings(self))


class MemoryResidual(nnx.Module):
    """Flax NNX gated residual ``x + sigmoid(gate) * memory(norm(x))`` (:func:`residual_apply`).

    The torch adapter's ``MemoryResidual``; :class:`GatedMemoryResidual` is the same
    class under its earlier name. ``module(x, state=None, *, reset=None) -> (out,
    state)`` with ``x`` and ``out`` of shape ``(B, N, d)``; ``module.memory`` is its
    :class:`TensorMemory`, ``module.norm`` the LayerNorm's ``weight`` / ``bias``
    ``(d,)``, ``module.gate`` ``(1,)``.

    Parameters
    ----------
    embed_dim : int
        The token width ``d``.
    memory_channels : int
        The grid channels ``C``.
    memory_shape : sequence of int
        The grid shape ``S`` (1 to 4 positive ints).
    chunk_size : int
        The tokens per chunk ``L``.
    sigma_scale : float, default 1.0
        Multiplies the write spread.
    gate_init : float, default 0.0
        As in :func:`residual_init`.
    rngs : flax.nnx.Rngs
        Where the initialization draws from.
    dtype, eps, radius, forget_bias, checkpoint_every : see TensorMemory
        As for :class:`TensorMemory` (the parameters' dtype, the splat's offset
        and truncation, the forget-gate bias, the checkpoint interval).
    update, window, dynamics, flow : see TensorMemory
        The experimental layer options, as for :class:`TensorMemory`.

    Raises
    ------
    TypeError, ValueError
        As :class:`TensorMemory` raises them; ``ValueError`` for a non-finite
        ``gate_init``.
    """

    def __init__(self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
                 chunk_size: int, sigma_scale: float = 1.0, *, gate_init: float = 0.0,
                 rngs: nnx.Rngs, dtype: Any = jnp.float32, eps: float = DEFAULT_EPS,
                 radius: float | None = None, forget_bias: float = 0.0,
                 checkpoint_every: int = 1, update: str = "dense", window: int | None = None,
                 dynamics: str = "none", flow: bool = False) -> None:
        self.memory = TensorMemory(embed_dim, memory_channels, memory_shape, chunk_size,
                                   sigma_scale, rngs=rngs, dtype=dtype, eps=eps, radius=radius,
                                   forget_bias=forget_bias, checkpoint_every=checkpoint_every,
                                   update=update, window=window, dynamics=dynamics, flow=flow)
        norm, gate = _norm_and_gate(embed_dim, gate_init, dtype)
        self.norm, self.gate = _to_variables(norm), nnx.Param(gate)

    def __call__(self, x: jax.Array, state: Any = None, *, reset: jax.Array | None = None,
                 stream: bool | None = None, doc_starts: Any = None, valid: Any = None,
                 max_documents: int | None = None) -> tuple[jax.Array, Any]:
        params = {"norm": {"weight": _raw(self.norm["weight"]),
                           "bias": _raw(self.norm["bias"])},
                  "memory": _layer_params(self.memory), "gate": _raw(self.gate)}
        return residual_apply(params, x, state, reset=reset, stream=stream,
                              doc_starts=doc_starts, valid=valid,
                              max_documents=max_documents, **_settings(self.memory))


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

# The earlier name of MemoryResidual (kept: the same class; the docs show its page).
GatedMemoryResidual = MemoryResidual
