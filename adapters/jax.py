"""JAX adapter: tmcore's hand-written VJPs as ``jax.custom_vjp``, a pure layer, a Flax module.

Three levels, each a thin layer over the one below:

1. **Primitives** -- :func:`trilinear_sample`, :func:`gaussian_splat` and
   :func:`memory_scan` are ``jax.custom_vjp`` functions whose forward and
   backward are tmcore's own. The scan is ONE checkpointing ``lax.scan``
   (:mod:`tmcore.adapters._jax_scan`) built from ``tmcore.scan.step_fwd`` /
   ``step_bwd``; its backward keeps every ``checkpoint_every``-th state and
   replays the segments in between. They work under ``jit``, ``vmap``,
   ``grad`` and ``shard_map`` (default ``check_vma=True``). Second order:
   reverse-over-reverse (``grad(grad(f))``) works; forward mode (``jvp``,
   ``jacfwd``, ``hessian``) is not available for ``custom_vjp`` functions and
   raises a ``TypeError`` saying so and what to use instead.
2. **Pure layer** -- :func:`init` / :func:`apply` over a nested-dict parameter
   pytree whose keys and layouts equal the PyTorch adapter's state dict
   (``weight`` is ``(out, in)``), the gated residual :func:`residual_init` /
   :func:`residual_apply`, the multi-layer :func:`stack_apply` (modes
   ``"causal"`` and ``"threaded"``), streaming (state in, state out,
   :func:`detach_state`, a per-sequence bool ``reset`` mask), and
   :func:`params_from_state_dict` / :func:`state_dict_from_params`.
3. **Flax NNX** -- :class:`TensorMemory` and :class:`MemoryResidual`
   hold the same pytree as ``nnx.Param`` leaves; :func:`params_from_module` /
   :func:`load_params` convert.

The layer itself (configuration checks, parameter plan, heads, chunking,
reset, modes, stored-grid check, streaming) is :mod:`tmcore.layer` /
:mod:`tmcore.layer.stream`, shared with the PyTorch adapter: :func:`apply` calls
``Layer.forward`` (``stream=False``) or ``Layer.forward_stream`` (the default)
with :func:`memory_scan` as the scan, as the torch adapter does; the heads and
``out_proj`` run once over all chunks, so the compiled program does not grow
with the number of chunks. This module adds JAX's side: the scan registered
with ``custom_vjp``, pytrees, dtype promotion and sharding-friendly zero states.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from tmcore import layer as tl
from tmcore.layer import sizes as layer_sizes
from tmcore.ops.conv import ConvParams
from tmcore.ops.sample import validate_sample_inputs
from tmcore.ops.splat import DEFAULT_EPS, validate_splat_inputs
from tmcore.runtime import sizes as _sizes
from tmcore.runtime.validate import check_finite, check_int, check_values, validation_enabled
from tmcore.scan.dense import DenseStep, StepInputs, validate_scan_inputs
from tmcore.scan.options import scan_options, step_for
from tmcore.scan.warped import WarpParams

from . import _jax_scan as _scan_mod
from ._jax_scan import forward_mode_guard

__all__ = [
    "MODES",
    "STREAM_CACHE_SIZE",
    "MemoryState",
    "GatedMemoryResidual",
    "MemoryResidual",
    "StoredGrid",
    "StreamState",
    "TensorMemory",
    "apply",
    "conv_params",
    "detach_state",
    "doc_starts_from_offsets",
    "empty_stream_state",
    "gaussian_splat",
    "init",
    "init_state",
    "load_params",
    "memory_scan",
    "params_from_module",
    "params_from_state_dict",
    "residual_apply",
    "reset_state",
    "residual_init",
    "stack_apply",
    "state_dict_from_params",
    "trilinear_sample",
]

#: Multi-layer modes of :func:`stack_apply` (:data:`tmcore.layer.MODES`).
MODES = tl.MODES

#: Parameter names of one memory layer, ``(group, leaf)``, torch state-dict order.
LAYER_KEYS = tuple((spec.group, spec.leaf)
                   for spec in tl.param_specs(tl.LayerConfig(1, 1, (1,), 1)))

_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default

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


def _stored(value: Any) -> Any:
    """A stored grid as :func:`tmcore.layer.stored_grid_error` reads it."""
    return value.shape if isinstance(value, StoredGrid) else value


# --------------------------------------------------------------------------- primitives


def _is_concrete(*arrays: Any) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def _check_values_eagerly(arrays: dict[str, Any]) -> None:
    """Validate mode: finite values, for arrays that are concrete (not under a trace)."""
    if validation_enabled() and _is_concrete(*arrays.values()):
        check_values(jnp, arrays)


def trilinear_sample(
    volume: jax.Array,  # [B, C, *S]
    coords: jax.Array,  # [B, Q, n]
) -> jax.Array:  # [B, Q, C]
    """:func:`tmcore.trilinear_sample` with tmcore's VJP registered with JAX.

    Works under ``jit``, ``vmap``, ``grad`` and ``shard_map``; forward mode
    (``jvp``) is refused with a ``TypeError`` saying what to use instead.

    Parameters
    ----------
    volume : jax.Array, shape ``(B, C, *S)``
        The grid to read, with 1 to 4 spatial axes ``S``.
    coords : jax.Array, shape ``(B, Q, n)``
        ``Q`` query positions per batch element in ``[-1, 1]``;
        ``coords[..., k]`` addresses spatial axis ``n - 1 - k``.

    Returns
    -------
    jax.Array, shape ``(B, Q, C)``
        The n-linear interpolation of ``volume`` at ``coords`` (border padding).

    Raises
    ------
    TypeError
        If an argument is not an array or not real floating, or under forward
        mode differentiation.
    ValueError
        If the shapes do not match the layouts above, or (validate mode, concrete
        arrays) an array holds NaN or inf.
    """
    volume, coords = jnp.asarray(volume), jnp.asarray(coords)
    validate_sample_inputs(volume, coords)
    _check_values_eagerly({"volume": volume, "coords": coords})
    return forward_mode_guard("trilinear_sample", lambda: _scan_mod.sample(volume, coords))


def _static_radius(radius: float | None) -> float | None:
    return None if radius is None else float(radius)


def gaussian_splat(
    content: jax.Array,  # [B, K, C]
    mu: jax.Array,  # [B, K, n]
    sigma: jax.Array,  # [B, K]
    shape: Sequence[int],
    *,
    eps: float = DEFAULT_EPS,
    radius: float | None = None,
) -> jax.Array:  # [B, C, *shape]
    """:func:`tmcore.gaussian_splat` with tmcore's VJP registered with JAX.

    Parameters
    ----------
    content : jax.Array, shape ``(B, K, C)``
        ``K`` content vectors per batch element.
    mu : jax.Array, shape ``(B, K, n)``
        Their normalized centres in ``[-1, 1]`` (``mu[..., k]`` addresses
        spatial axis ``n - 1 - k``).
    sigma : jax.Array, shape ``(B, K)``
        Their spreads in normalized units, > 0.
    shape : sequence of int
        The grid shape ``S`` (``n = len(S)``, 1 to 4 axes); static.
    eps : float, default 1e-6
        Added to ``2 sigma^2`` in the Gaussian's denominator; static.
    radius : float or None, default None
        Truncation radius in units of sigma (``None``: the whole grid); static.

    Returns
    -------
    jax.Array, shape ``(B, C, *shape)``
        The written volume, ``sum_k content[b, k] * w_bk(p)`` at every cell ``p``.

    Raises
    ------
    TypeError
        If an array argument is not an array or not real floating, or under
        forward mode differentiation.
    ValueError
        If the shapes do not match the layouts above, ``eps`` or ``radius`` is
        out of range, or (validate mode, concrete arrays) a value is not finite
        or a sigma is not > 0.
    """
    content, mu, sigma = map(jnp.asarray, (content, mu, sigma))
    _, dims = validate_splat_inputs(content, mu, sigma, shape, radius=radius, eps=eps)
    _check_values_eagerly({"content": content, "mu": mu, "sigma": sigma})
    return forward_mode_guard("gaussian_splat", lambda: _scan_mod.splat(
        content, mu, sigma, tuple(dims), float(eps), _static_radius(radius)))


def _time_major(x: jax.Array) -> jax.Array:
    return jnp.moveaxis(x, 1, 0)


def _batch_major(x: jax.Array) -> jax.Array:
    return jnp.moveaxis(x, 0, 1)


def _promote(name: str, arrays: Sequence[Any]) -> Any:
    """The common floating dtype of ``arrays`` (JAX's promotion), or a ``TypeError``."""
    dtype = jnp.result_type(*arrays)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name}: expected floating arrays, got dtypes "
                        f"{sorted({str(jnp.asarray(a).dtype) for a in arrays})}")
    return dtype


def memory_scan(
    h0: jax.Array,  # [B, C, *S]
    c0: jax.Array,  # [B, C, *S]
    read_coords: jax.Array,  # [B, T, n]
    write_coords: jax.Array,  # [B, T, n]
    write_sigma: jax.Array,  # [B, T]
    write_content: jax.Array,  # [B, T, C]
    params: ConvParams,
    *,
    eps: float = DEFAULT_EPS,
    radius: float | None = None,
    checkpoint_every: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # reads [B, T, C], h_T, c_T [B, C, *S]
    """:func:`tmcore.memory_scan` as a ``lax.scan`` with tmcore's backward registered.

    The backward keeps the state entering every ``checkpoint_every``-th step
    (``ceil(T / k)`` states of shape ``(B, C, *S)`` for ``h`` and for ``c``) and
    replays each segment before differentiating it step by step with
    ``tmcore.scan.step_bwd``; the gradients do not depend on ``k``. Mixed
    floating dtypes are promoted to a common one (JAX's rules).

    Parameters
    ----------
    h0 : jax.Array, shape ``(B, C, *S)``
        The initial hidden state, with 1 to 4 spatial axes.
    c0 : jax.Array, shape ``(B, C, *S)``
        The initial cell state.
    read_coords : jax.Array, shape ``(B, T, n)``
        The normalized read position of each step.
    write_coords : jax.Array, shape ``(B, T, n)``
        The normalized write centre of each step.
    write_sigma : jax.Array, shape ``(B, T)``
        The write spread of each step, > 0.
    write_content : jax.Array, shape ``(B, T, C)``
        The content vector each step writes.
    params : tmcore.ConvParams
        The ConvLSTM's gate conv (``C_in = 2C``, ``C_out = 4C``; :func:`conv_params`).
    eps : float, default 1e-6
        As in :func:`gaussian_splat`.
    radius : float or None, default None
        As in :func:`gaussian_splat`.
    checkpoint_every : int, default 1
        ``k``: the backward stores every ``k``-th state and recomputes the rest.

    Returns
    -------
    reads : jax.Array, shape ``(B, T, C)``
        What each step read (before its write).
    h_T : jax.Array, shape ``(B, C, *S)``
        The final hidden state.
    c_T : jax.Array, shape ``(B, C, *S)``
        The final cell state.

    Raises
    ------
    TypeError
        If an argument is not an array, the arrays are not floating,
        ``params`` is not a 4-tuple or ``checkpoint_every`` is not an int, or
        under forward mode differentiation.
    ValueError
        If a shape does not match the layouts above, ``T`` is 0,
        ``checkpoint_every < 1``, ``eps`` or ``radius`` is out of range, or
        (validate mode, concrete arrays) a value is not finite.
    """
    arrays = [jnp.asarray(a) for a in (h0, c0, read_coords, write_coords, write_sigma,
                                       write_content, *params)]
    dtype = _promote("memory_scan", arrays)
    h0, c0, read_coords, write_coords, write_sigma, write_content, *cell = (
        a.astype(dtype) for a in arrays)
    _, params = validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma,
                                     write_content, ConvParams(*cell), checkpoint_every, radius,
                                     eps=eps)
    _check_values_eagerly({"h0": h0, "c0": c0, "read_coords": read_coords,
                           "write_coords": write_coords, "write_sigma": write_sigma,
                           "write_content": write_content})
    static = _scan_mod.ScanStatic(DenseStep(float(eps), _static_radius(radius)),
                                  int(checkpoint_every), _scan_mod.options_key())
    xs = StepInputs(*map(_time_major, (read_coords, write_coords, write_sigma, write_content)))
    reads, h, c = forward_mode_guard(
        "memory_scan", lambda: _scan_mod.checkpoint_scan(static, params, xs, h0, c0))
    return _batch_major(reads), h, c


# --------------------------------------------------------------------------- pure layer


class MemoryState(NamedTuple):
    """The recurrent state ``(h, c)`` at a chunk boundary (a pytree).

    Parameters
    ----------
    h : jax.Array, shape ``(B, C, *S)``
        The hidden state.
    c : jax.Array, shape ``(B, C, *S)``
        The cell state.
    """

    h: jax.Array
    c: jax.Array


def init_state(batch: int, memory_channels: int, memory_shape: Sequence[int],
               dtype: Any = jnp.float32) -> MemoryState:
    """A zero :class:`MemoryState`.

    Parameters
    ----------
    batch : int
        ``B`` (>= 0).
    memory_channels : int
        ``C``.
    memory_shape : sequence of int
        The grid shape ``S`` (1 to 4 positive ints).
    dtype : dtype, default float32
        The state's dtype.

    Returns
    -------
    MemoryState
        ``h`` and ``c`` of zeros, each ``(batch, memory_channels, *memory_shape)``.

    Raises
    ------
    TypeError
        If a size is not an int.
    ValueError
        If a size is out of range.
    """
    config = tl.layer_config(1, memory_channels, memory_shape, 1)
    return MemoryState(*tl.zero_state(jnp, config, check_int("batch", batch, 0), dtype=dtype))


def empty_stream_state(config_or_params: Any, batch: int, *,
                       memory_shape: Sequence[int] | None = None,
                       dtype: Any = None) -> tl.StreamState:
    """Make an empty :class:`StreamState` (zeros, ``count`` 0) for ``batch`` rows.

    It is what :func:`apply` returns the state as, so it is a ``lax.scan`` /
    ``fori_loop`` carry whose type is the same in and out
    (``lax.scan(step, empty_stream_state(params, B, memory_shape=S), xs)``).

    Parameters
    ----------
    config_or_params : tmcore.layer.LayerConfig or dict
        The layer's config, or its parameter pytree (:func:`init`; then
        ``memory_shape`` is required: no parameter depends on the grid).
    batch : int
        ``B`` (>= 0).
    memory_shape : sequence of int, optional
        The grid ``S``; with a parameter pytree only.
    dtype : dtype, optional
        The floating fields' dtype; default the parameters' (float32 for a config).

    Returns
    -------
    StreamState
        ``h``, ``c`` ``(B, C, *S)``, ``pending`` ``(B, L, d)``, ``read`` ``(B, C)`` of
        zeros and ``count`` int32 zeros ``(B,)``.

    Raises
    ------
    TypeError
        If ``batch`` is not an int, or ``config_or_params`` is neither a config nor a
        parameter pytree.
    ValueError
        If ``memory_shape`` is missing with parameters (given with a config) or a size
        is out of range.
    """
    if isinstance(config_or_params, tl.LayerConfig):
        if memory_shape is not None:
            raise ValueError("memory_shape: the config fixes the grid; pass it only with "
                             "a parameter pytree")
        config = config_or_params
        dtype = jnp.float32 if dtype is None else dtype
    elif isinstance(config_or_params, Mapping):
        if memory_shape is None:
            raise ValueError("memory_shape: required with a parameter pytree (it cannot "
                             "be inferred from params)")
        d, channels, _, length = tl.sizes_from_params(config_or_params)
        config = tl.layer_config(d, channels, memory_shape, length)
        if dtype is None:
            dtype = jnp.result_type(*(config_or_params[g][k] for g, k in LAYER_KEYS))
    else:
        raise TypeError(f"config_or_params: expected a LayerConfig or a parameter pytree, "
                        f"got {type(config_or_params).__name__}")
    batch = check_int("batch", batch, 0)
    tokens = jnp.zeros((batch, 0, config.embed_dim), dtype)  # fixes B, dtype, device
    return tl.stream_state(jnp, None, tokens, config)


# The state between streamed calls (tmcore.layer.StreamState): (h, c) at the last chunk
# boundary plus the unfinished chunk's tokens, their count and its read. A plain comment,
# not a doc comment: the docs show the class (its page), not a constant of that name.
StreamState = tl.StreamState


def detach_state(state: Any) -> Any:
    """Cut backprop between streamed segments (``lax.stop_gradient`` on every array).

    Parameters
    ----------
    state : StreamState, MemoryState or pytree
        A state :func:`apply` or :func:`stack_apply` returned (a tuple of
        per-layer states included).

    Returns
    -------
    pytree
        The same structure and values, without gradient paths (a
        :class:`StreamState`'s integer ``count`` passes through unchanged).
    """
    def cut(s: Any) -> Any:
        if isinstance(s, tl.StreamState):
            return s._replace(h=lax.stop_gradient(s.h), c=lax.stop_gradient(s.c),
                              pending=lax.stop_gradient(s.pending),
                              read=lax.stop_gradient(s.read))
        return lax.stop_gradient(s)
    return jax.tree.map(cut, state, is_leaf=lambda s: isinstance(s, tl.StreamState))


def doc_starts_from_offsets(offsets: Sequence[Any], tokens: int) -> jax.Array:
    """``cu_seqlens``-style document offsets to the mask :func:`apply` takes as ``doc_starts``.

    Parameters
    ----------
    offsets : sequence of int, or sequence of sequences of int
        For one row, the increasing start offsets of its documents (e.g.
        ``[0, 5, 12]``, optionally ending with ``tokens``); or one such list per
        row.
    tokens : int
        ``N``, the tokens per row.

    Returns
    -------
    jax.Array of bool, shape ``(B, tokens)``
        True at each document start (``B = 1`` for a single row of offsets).

    Raises
    ------
    ValueError
        If a row's offsets are not strictly increasing or not in ``[0, tokens]``.
    """
    return tl.doc_starts_from_offsets(jnp, offsets, tokens)


def init(
    key: jax.Array,
    embed_dim: int,
    memory_channels: int,
    memory_shape: Sequence[int],
    chunk_size: int,
    sigma_scale: float = 1.0,
    *,
    forget_bias: float = 0.0,
    dtype: Any = jnp.float32,
    dynamics: str = "none",
    flow: bool = False,
) -> dict:
    """Parameters of one Tensor Memory layer, initialized like the PyTorch adapter.

    The plan is :func:`tmcore.layer.param_specs` (docs/LAYER.md): linear layers
    as ``torch.nn.Linear`` (uniform ``+-1/sqrt(fan_in)``), ``sigma_net.bias =
    1.0``; the cell's depthwise taps identity, its pointwise matrix
    Xavier-uniform, its biases zero except the forget-gate quarter of the
    pointwise bias, ``forget_bias``. The random leaves are drawn from ``key``
    in state-dict order. Arrays are made without a device (uncommitted), so
    ``jit`` places them next to sharded inputs.

    Parameters
    ----------
    key : jax.Array
        A ``jax.random`` key.
    embed_dim : int
        The token width ``d``.
    memory_channels : int
        The grid channels ``C``.
    memory_shape : sequence of int
        The grid shape ``S`` (1 to 4 positive ints; ``n = len(S)``).
    chunk_size : int
        The tokens per chunk ``L``.
    sigma_scale : float, default 1.0
        Not a parameter; accepted for signature parity with the PyTorch
        constructor and checked (> 0). Pass it to :func:`apply`.
    forget_bias : float, default 0.0
        The initial bias of the ConvLSTM forget gate (e.g. 3 starts the memory
        keeping 95 % of its state per chunk).
    dtype : dtype, default float32
        The parameters' dtype.
    dynamics : {"none", "warp"}, default "none"
        ``"warp"`` adds the zero-initialized ``warp_net`` group
        (``{"weight" (n, d), "bias" (n,)}``) that :func:`apply` with
        ``dynamics="warp"`` needs (experimental; docs/guides/local-and-warp.md).
    flow : bool, default False
        With ``dynamics="warp"``: adds the ``warp_flow`` group (a per-cell flow
        from a conv of ``h``, zero pointwise map at init).

    Returns
    -------
    dict
        ``{"write_proj": {"weight" (d, L*d), "bias" (d,)}, "content_net": {(C, d), (C,)},
        "sigma_net": {(1, d), (1,)}, "coord_net": {(n, d), (n,)}, "cell":
        {"depthwise_weight" (n, 2C, 3), "depthwise_bias" (n, 2C), "pointwise_weight"
        (4C, 2C), "pointwise_bias" (4C,)}, "out_proj": {(d, C), (d,)}}``.

    Raises
    ------
    TypeError
        If a size is not an int (a float or bool is refused, never truncated;
        NumPy ints are fine).
    ValueError
        If a size is < 1, ``memory_shape`` has not 1 to 4 axes, ``sigma_scale``
        is not > 0 or ``dynamics`` is unknown (:func:`tmcore.layer.layer_config`).
    MemoryError
        If the parameters would not fit in the device's memory.
    """
    config = tl.layer_config(embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale,
                             forget_bias=forget_bias, dynamics=dynamics, flow=flow)
    tl.check_param_bytes(jnp, config, dtype)  # before any parameter is made
    random = [s for s in tl.param_specs(config) if s.init in ("uniform", "xavier_uniform")]
    keys = iter(jax.random.split(key, len(random)))

    def uniform(spec: tl.ParamSpec) -> jax.Array:
        return jax.random.uniform(next(keys), spec.shape, dtype, -spec.bound, spec.bound)

    return tl.init_params(jnp, config, uniform, dtype=dtype)


def conv_params(cell: Mapping[str, jax.Array]) -> ConvParams:
    """The ``"cell"`` group of a parameter pytree as :class:`tmcore.ConvParams`.

    Parameters
    ----------
    cell : dict of jax.Array
        ``params["cell"]``: ``depthwise_weight (n, 2C, 3)``, ``depthwise_bias
        (n, 2C)``, ``pointwise_weight (4C, 2C)``, ``pointwise_bias (4C,)``.

    Returns
    -------
    tmcore.ConvParams
        The same arrays in the order :func:`memory_scan` takes them.
    """
    return tl.cell_params({"cell": cell})


#: the checked configs of earlier calls (frozen ``LayerConfig`` objects), keyed by the type AND
#: value of every argument that decided them (2, 2.0 and True are three keys), at most
#: :data:`_CONFIG_CACHE_SIZE` of them (least recently used dropped first)
_CONFIGS: collections.OrderedDict = collections.OrderedDict()
_CONFIG_CACHE_SIZE = 256


def _typed(value: Any) -> Any:
    """``value`` as a hashable key that tells types apart (``2``, ``2.0``, ``True``,
    ``np.int64(2)`` differ); sequences element by element."""
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_typed(v) for v in value))
    hash(value)  # an unhashable argument: no key (the checks name it)
    return (type(value).__module__, type(value).__qualname__, value)


def _layer_config(params: Mapping[str, Any], x: Any, state: Any, **kwargs: Any
                  ) -> tl.LayerConfig:
    """:func:`_checked_config`, remembered by the parameters' shapes and dtypes, the state's
    grid and the keywords (by type and value): an eager decode loop checks its layer
    once, not per token, and a call differing only in an argument's type is checked
    afresh (:func:`tmcore.layer.layer_config` refuses ``2.0`` or ``True`` for an int)."""
    try:
        leaves = tuple((group, leaf, tuple(params[group][leaf].shape),
                        str(params[group][leaf].dtype)) for group, leaf in LAYER_KEYS)
        h = state[0] if isinstance(state, (tuple, list)) and len(state) == 2 else None
        grid = tuple(h.shape) if hasattr(h, "shape") else type(state).__name__
        key = (leaves, grid, tuple(sorted((k, _typed(v)) for k, v in kwargs.items())))
        config = _CONFIGS.get(key)
    except Exception:  # a malformed or unhashable argument: the checks below name it
        key = config = None
    if config is None:
        config = _checked_config(params, x, state, **kwargs)
        if key is not None:
            _CONFIGS[key] = config
            while len(_CONFIGS) > _CONFIG_CACHE_SIZE:
                _CONFIGS.popitem(last=False)
    else:
        _CONFIGS.move_to_end(key)
    if config.dynamics != "none":  # the warp_net group (not in the remembered key)
        tl.check_params(params, config)
    _check_option_groups(params, config)
    return config


def _check_option_groups(params: Mapping[str, Any], config: tl.LayerConfig) -> None:
    """Parameters trained with ``dynamics="warp"`` (``warp_net``) or ``flow=True``
    (``warp_flow``) applied without that option would silently run another model."""
    if tl.WARP_GROUP in params and config.dynamics != "warp":
        raise ValueError(f"params: hold the {tl.WARP_GROUP!r} group of a layer with "
                         f"dynamics='warp'; pass dynamics='warp' (got dynamics="
                         f"{config.dynamics!r}) or drop the group")
    if tl.FLOW_GROUP in params and not config.flow:
        raise ValueError(f"params: hold the {tl.FLOW_GROUP!r} group of a layer with "
                         f"flow=True; pass dynamics='warp', flow=True or drop the group")


def _check_no_widening(params: Mapping[str, Any], x: Any, state: Any) -> None:
    """``x`` and the state may be narrower than the parameters (bfloat16 tokens into a
    float32 layer compute in float32) but never wider: a float64 input into a float32
    layer would silently compute and return float64. Static (dtypes only)."""
    layer = jnp.result_type(*(params[group][leaf] for group, leaf in LAYER_KEYS))
    fields = [("x", x)]
    if isinstance(state, tl.StreamState):
        fields += [(f"state.{k}", getattr(state, k)) for k in ("h", "c", "pending", "read")]
    elif _is_pair(state):
        fields += [("state.h", state[0]), ("state.c", state[1])]
    for name, value in fields:
        dtype = getattr(value, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) \
                or not jnp.issubdtype(layer, jnp.floating):
            continue  # not floating: the shape and dtype checks name it
        if jnp.finfo(dtype).bits > jnp.finfo(layer).bits:
            raise TypeError(f"{name}: dtype {jnp.dtype(dtype).name} is wider than the "
                            f"layer's parameters ({jnp.dtype(layer).name}); cast it "
                            f"({name.split('.')[0]}.astype(jnp.{jnp.dtype(layer).name})) or "
                            f"the parameters (init(..., dtype=...))")


def _guard_count(state: tl.StreamState, length: int) -> tl.StreamState:
    """Jit-safe: a row whose ``count`` is outside ``[0, L)`` (a hostile or corrupted
    state; validate mode refuses it when concrete) restarts its unfinished chunk --
    ``count`` 0, ``pending`` and ``read`` zeroed, its ``h``, ``c`` kept -- so that no
    index ever reaches another row's data."""
    count = state.count
    bad = (count < 0) | (count >= length)
    return state._replace(
        count=jnp.where(bad, jnp.zeros_like(count), count),
        pending=jnp.where(bad[:, None, None], jnp.zeros_like(state.pending), state.pending),
        read=jnp.where(bad[:, None], jnp.zeros_like(state.read), state.read))


def _checked_config(params: Mapping[str, Any], x: Any, state: Any, *, chunk_size: Any,
                    memory_shape: Any, sigma_scale: Any, eps: Any, radius: Any,
                    checkpoint_every: Any, **options: Any) -> tl.LayerConfig:
    """The layer's config from its parameters (``d, C, n, L``) and the call's arguments;
    the grid from ``memory_shape``, else from the state."""
    d, channels, n, length = tl.sizes_from_params(params)
    tl.check_params(params, tl.LayerConfig(d, channels, (1,) * n, length))
    if chunk_size is not None and check_int("chunk_size", chunk_size, 1) != length:
        raise ValueError(f"chunk_size: {chunk_size} disagrees with write_proj.weight "
                         f"{tuple(params['write_proj']['weight'].shape)} (L = {length})")
    if memory_shape is not None:
        grid = tl.layer_config(d, channels, memory_shape, length).memory_shape
        if len(grid) != n:
            raise ValueError(f"memory_shape: expected n = {n} axes (from coord_net.weight), "
                             f"got {grid}")
    elif state is None:
        raise ValueError("memory_shape: required when no state is given (it cannot be "
                         "inferred from params)")
    else:
        h = state[0] if isinstance(state, (tuple, list)) and len(state) == 2 else None
        if not hasattr(h, "shape") or len(h.shape) != n + 2:
            tl.check_state(jnp, state, getattr(x, "shape", (0,))[0],
                           tl.LayerConfig(d, channels, (1,) * n, length))
            raise ValueError(f"state: expected (h, c) of shape (B, C, *S) with n = {n} "
                             f"spatial axes, got {getattr(h, 'shape', None)}")
        grid = tuple(int(s) for s in h.shape[2:])
        if min(grid) < 1:
            raise ValueError(f"state: expected h of shape (B, C, *S) with no zero-size axis, "
                             f"got {tuple(h.shape)}")
    return tl.layer_config(d, channels, grid, length, sigma_scale,
                           checkpoint_every=checkpoint_every, radius=radius, eps=eps,
                           **options)  # update / window / dynamics (experimental)


def _zero_state_like(x: jax.Array, config: tl.LayerConfig) -> MemoryState:
    """A zero state ``(B, C, *S)`` derived from ``x (B, N, d)``: it inherits ``x``'s batch
    sharding (explicit meshes) and varying axes (``shard_map``), which a fresh
    ``jnp.zeros`` would not have."""
    shape = config.state_shape(x.shape[0])
    zero = jnp.zeros_like(x[:, 0, 0]) if x.shape[1] else jnp.zeros(x.shape[:1], x.dtype)
    zeros = jnp.broadcast_to(jnp.reshape(zero, shape[:1] + (1,) * (len(shape) - 1)), shape)
    return MemoryState(zeros, zeros)


def _is_pair(state: Any) -> bool:
    return (isinstance(state, (tuple, list)) and len(state) == 2
            and all(hasattr(s, "shape") for s in state))


def reset_state(state: Any, reset: jax.Array) -> Any:
    """Zero the state of the sequences where ``reset`` is True (document boundaries).

    Parameters
    ----------
    state : MemoryState or sequence of MemoryState
        One ``(h, c)`` pair, each ``(B, C, *S)``, or a sequence of them (a causal
        stack's per-layer states).
    reset : jax.Array of bool, shape ``(B,)``
        True for the sequences whose state starts again from zeros.

    Returns
    -------
    MemoryState or tuple of MemoryState
        ``state`` with the flagged rows zeroed, in the same structure.

    Raises
    ------
    TypeError
        If ``reset`` is not a bool array (compare explicitly, e.g. ``mask > 0.5``).
    ValueError
        If ``reset`` does not have shape ``(B,)``.
    """
    if _is_pair(state):
        return MemoryState(*tl.reset_state(jnp, tuple(state), jnp.asarray(reset)))
    return tuple(reset_state(s, reset) for s in state)


def _compute_dtype(params: Mapping[str, Any], x: jax.Array, state: Any) -> Any:
    """The dtype the layer computes and keeps its state in: JAX's promotion of ``x``,
    the parameters and a given state (float32 params with a bfloat16 ``x`` -> float32)."""
    leaves = [params[group][leaf] for group, leaf in LAYER_KEYS]
    if state is not None:
        leaves += [state[0], state[1]]
    return jnp.result_type(x, *leaves)


def apply(
    params: Mapping[str, Any],
    x: jax.Array,  # [B, N, d]
    state: MemoryState | tuple[jax.Array, jax.Array] | None = None,
    *,
    chunk_size: int | None = None,
    memory_shape: Sequence[int] | None = None,
    sigma_scale: float = 1.0,
    reset: jax.Array | None = None,  # [B] bool
    eps: float = DEFAULT_EPS,
    radius: float | None = None,
    checkpoint_every: int = 1,
    layer: type[tl.Layer] = tl.Layer,
    stream: bool | None = None,
    doc_starts: Any = None,  # [B, N] bool
    valid: Any = None,  # [B, N] bool
    update: str = "dense",
    window: int | None = None,
    dynamics: str = "none",
    flow: bool = False,
) -> tuple[jax.Array, Any]:  # out [B, N, d], state
    """Run one Tensor Memory layer over ``x``; returns ``(out, state)``.

    Parameters
    ----------
    params : dict
        The parameter pytree from :func:`init` or :func:`params_from_state_dict`.
    x : jax.Array, shape ``(B, N, d)``
        The tokens; ``N`` need not be a multiple of the chunk size.
    state : StreamState, MemoryState, (h, c) or None, optional
        The state a previous call returned (``h``, ``c`` each ``(B, C, *S)``),
        or ``None`` for zeros.
    chunk_size : int, optional
        Checked against ``write_proj.weight (d, L*d)``, which fixes it.
    memory_shape : sequence of int, optional
        The grid shape ``S``; needed when ``state`` is ``None``.
    sigma_scale : float, default 1.0
        Multiplies the write spread.
    reset : jax.Array of bool, shape ``(B,)``, optional
        Those sequences start from the zero state.
    eps : float, default 1e-6
        As in :func:`tmcore.gaussian_splat`.
    radius : float or None, default None
        As in :func:`tmcore.gaussian_splat`.
    checkpoint_every : int, default 1
        The backward keeps the state entering every k-th chunk
        (``ceil(T / k)`` states) and recomputes the rest: memory ``O(T/k + k)``
        states for one extra forward pass; results do not depend on ``k``.
    layer : type, default :class:`tmcore.layer.Layer`
        A :class:`tmcore.layer.Layer` subclass overriding ``heads`` or
        ``read_out`` (a variant of the layer).
    stream : bool or None, default None
        ``True`` (the default; ``None`` means the same): return a
        :class:`StreamState` (``(h, c)`` at the last chunk boundary plus the
        unfinished chunk, its ``count`` an int32 array ``(B,)``), so that
        feeding a sequence back in pieces of ANY lengths, one token at a time
        included, equals one long call
        (:meth:`tmcore.layer.Layer.forward_stream`). The state is data: a
        streaming call works under ``jax.jit``, ``lax.scan``, ``fori_loop``,
        ``vmap`` and ``grad`` (a one-token step compiles once for every
        token); called eagerly it runs one compiled function per input
        structure and ``N``. ``False``: the non-streaming call, which pads
        the ragged last chunk with zeros and writes it into the state, and
        returns a :class:`MemoryState` ``(h, c)``; pieces fed back with it equal
        one call only when their lengths are multiples of the chunk size.
    doc_starts : jax.Array of bool, shape ``(B, N)``, optional
        True at each token that starts a
        document (packed documents, :func:`doc_starts_from_offsets`): the state
        and the unfinished chunk are dropped there and the chunk grid restarts,
        so each document's outputs equal running it alone. The grid is then
        planned on the host: ``doc_starts`` (and ``reset``, ``valid``, the
        state's ``count``) must be concrete; traced under ``jit`` it is a
        ``TypeError`` saying so.
    valid : jax.Array of bool, shape ``(B, N)``, optional
        False at tokens to skip (padding, left or
        right): they never enter the state nor the chunk grid and their outputs
        are zeros; each row streams its valid tokens only. Implies streaming.
    update : {"dense", "local"}, default "dense"
        Experimental (:func:`tmcore.layer.layer_config`,
        docs/guides/local-and-warp.md): ``"local"`` writes and updates only a
        window around each write.
    window : int or None, default None
        The window's cells per axis with ``update="local"``.
    dynamics : {"none", "warp"}, default "none"
        Experimental: ``"warp"`` resamples the state at displaced cell centres
        before each update (needs the ``warp_net`` group, :func:`init` with
        ``dynamics="warp"``).
    flow : bool, default False
        With ``dynamics="warp"``: a per-cell flow from a conv of ``h`` too
        (needs the ``warp_flow`` group, :func:`init` with ``flow=True``).

    Returns
    -------
    out : jax.Array, shape ``(B, N, d)``
        ``out_proj(read_t)`` on every token of chunk ``t``.
    state : StreamState or MemoryState
        The final state: a :class:`StreamState` (default) or, with
        ``stream=False``, a :class:`MemoryState`. Pass it to the next call to
        stream a long sequence; wrap it in :func:`detach_state` to truncate
        backprop. Streamed pieces equal one call to rounding (<= 1e-5 in
        float32).

    Raises
    ------
    KeyError
        If a parameter is missing.
    TypeError
        If ``x`` or a parameter is not floating, a mask is not bool, ``stream``
        is not a bool, or ``doc_starts`` is traced (it is planned on the host).
    ValueError
        If a parameter, ``x`` or the state is misshapen, ``memory_shape``,
        ``eps``, ``radius`` or ``sigma_scale`` is out of range, an
        ``_extra_state`` entry (the grid shape a PyTorch checkpoint stores)
        does not match the grid, ``stream=False`` meets a :class:`StreamState`,
        ``doc_starts`` or ``valid``, or (validate mode, :func:`tmcore.options`)
        a concrete ``x`` or state holds NaN or inf.

    Notes
    -----
    Every argument is checked statically (shapes, dtypes, Python scalars; fine
    under ``jit``; :mod:`tmcore.layer`), each error naming the argument.

    Mixed precision: the layer computes in JAX's promotion of ``x``, the
    parameters and the state (float32 parameters with a bfloat16 ``x``:
    float32); the output and the returned state have that dtype.
    """
    stream = True if stream is None else stream
    if not isinstance(stream, bool):
        raise TypeError(f"stream: expected True or False, got {stream!r}")
    if valid is not None and not stream:
        raise ValueError("valid: skipping tokens needs stream=True (the default)")
    if isinstance(state, tl.StreamState) and not stream:
        raise ValueError("state: a StreamState continues a stream; pass stream=True "
                         "(the default)")
    if doc_starts is not None and not stream:
        raise ValueError("doc_starts: packed documents need stream=True (the default)")
    pair = (state.h, state.c) if isinstance(state, tl.StreamState) else state
    config = _layer_config(params, x, pair, chunk_size=chunk_size,
                           memory_shape=memory_shape, sigma_scale=sigma_scale, eps=eps,
                           radius=radius, checkpoint_every=checkpoint_every,
                           update=update, window=window, dynamics=dynamics, flow=flow)
    tl.check_tokens(jnp, x, config)
    _check_no_widening(params, x, state)
    layer_sizes.check_forward(jnp, config, x)  # the state and the call fit, before allocating
    if stream:
        return _apply_stream(params, x, state, config, layer, reset, doc_starts, valid)
    batch, tokens, d = x.shape
    if state is None:
        state = _zero_state_like(x, config)
    state = MemoryState(*tl.check_state(jnp, state, batch, config))
    if EXTRA_STATE in params:
        error = tl.stored_grid_error(_stored(params[EXTRA_STATE]), config.memory_shape,
                                     f"params[{EXTRA_STATE!r}]")
        if error is not None:
            raise ValueError(error)
    if reset is not None:
        state = reset_state(state, reset)
    dtype = _compute_dtype(params, x, state)
    x = x.astype(dtype)
    state = MemoryState(state.h.astype(dtype), state.c.astype(dtype))
    _check_values_eagerly({"x": x, "state.h": state.h, "state.c": state.c})
    if batch == 0 or tokens == 0:  # nothing to scan; shapes as for any other input
        return jnp.zeros((batch, tokens, d), dtype), state
    theta, cell = _on_mesh_of(x, _cast_params(params, dtype))
    out, (h, c) = forward_mode_guard("apply", lambda: layer(config).forward(
        jnp, theta, x, tuple(state), scan=_layer_scan(config, cell, theta)))
    return out, MemoryState(h, c)


def _cast(value: Any, dtype: Any) -> Any:
    return value if getattr(value, "dtype", None) == dtype else value.astype(dtype)


def _cast_params(params: Mapping[str, Any], dtype: Any) -> tuple[dict, ConvParams]:
    """The head parameters ``{group: {leaf: array}}`` and the cell's :class:`ConvParams`
    in the compute ``dtype`` (leaves already in it are not copied)."""
    groups = tl.GROUPS + tuple(g for g in (tl.WARP_GROUP, tl.FLOW_GROUP) if g in params)
    theta = {group: {leaf: _cast(value, dtype) for leaf, value in params[group].items()}
             for group in groups if group != "cell"}
    return theta, ConvParams(*(_cast(a, dtype) for a in conv_params(params["cell"])))


def _on_mesh_of(x: Any, tree: Any) -> Any:
    """``tree``'s arrays replicated on ``x``'s mesh when that mesh has an ``Explicit``
    axis and an array has no mesh of its own; otherwise ``tree`` unchanged.

    Parameters made by :func:`init` are uncommitted: outside ``jax.set_mesh`` their
    type names no mesh. The heads and ``out_proj`` run once over all ``B*T`` chunk
    rows, so their weight gradients contract over ``x``'s batch axis, and on an
    explicit mesh JAX types that product by the weight's sharding -- with no mesh
    it refuses (``ShardingTypeError: Contracting dimensions are sharded``).
    Replicated on ``x``'s mesh, the weights say where the product goes (a sum over
    the batch, replicated), as under ``jax.set_mesh``. Values are unchanged.
    """
    mesh = jax.typeof(x).sharding.mesh
    if mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return tree  # no mesh, an Auto mesh (the partitioner decides), or shard_map
    concrete = not isinstance(x, jax.core.Tracer) and isinstance(
        getattr(x, "sharding", None), jax.sharding.NamedSharding)
    replicated = jax.sharding.NamedSharding(x.sharding.mesh if concrete else mesh,
                                            jax.sharding.PartitionSpec())

    def place(a: Any) -> Any:
        if not hasattr(a, "shape") or not jax.typeof(a).sharding.mesh.empty:
            return a
        if concrete and not isinstance(a, jax.core.Tracer):
            return jax.device_put(a, replicated)
        return jax.sharding.reshard(a, replicated)

    return jax.tree.map(place, tree)


def _layer_scan(config: tl.LayerConfig, cell: ConvParams, theta: Any = None) -> tl.Scan:
    """The layer's scan: its options' step (:func:`tmcore.scan.step_for`) in the one
    checkpointed ``lax.scan`` (:class:`tmcore.adapters._jax_scan.LayerScan`), with the
    ``warp_flow`` group of ``theta`` for ``flow=True``."""
    warp = config.dynamics == "warp"
    step = step_for(scan_options(config), warp)
    if warp:
        flow = tl.cell_params({"cell": theta[tl.FLOW_GROUP]}) if config.flow else None
        return _scan_mod.LayerScan(step, WarpParams(cell, flow), config.checkpoint_every)
    return _scan_mod.LayerScan(step, cell, config.checkpoint_every)


def _apply_stream(params: Mapping[str, Any], x: jax.Array, state: Any,
                  config: tl.LayerConfig, layer: type[tl.Layer], reset: Any,
                  doc_starts: Any, valid: Any = None) -> tuple[jax.Array, tl.StreamState]:
    """:func:`apply` with ``stream=True``: the shared layer's ``forward_stream`` with
    :func:`memory_scan` (compiled, custom VJP) as its scan, in one ``jax.jit`` keyed by
    the layer, its config and the options (eager calls then run one compiled function;
    under an outer trace it is inlined). With ``doc_starts`` the grid is planned on the
    host, so that call is not wrapped."""
    if EXTRA_STATE in params:
        error = tl.stored_grid_error(_stored(params[EXTRA_STATE]), config.memory_shape,
                                     f"params[{EXTRA_STATE!r}]")
        if error is not None:
            raise ValueError(error)
    if isinstance(state, tl.StreamState):
        state = tl.stream_state(jnp, state, x, config)  # checks; count as an int32 array
        state = _guard_count(state, config.chunk_size)  # under jit too: never another row
    dtype = _compute_dtype(params, x, None if state is None else (state[0], state[1]))
    x = _cast(x, dtype)
    if isinstance(state, tl.StreamState):
        state = state._replace(h=_cast(state.h, dtype), c=_cast(state.c, dtype),
                               pending=_cast(state.pending, dtype),
                               read=_cast(state.read, dtype))
        _check_values_eagerly({"state.h": state.h, "state.c": state.c,
                               "state.pending": state.pending, "state.read": state.read})
    elif state is not None:
        state = MemoryState(*(_cast(s, dtype) for s in tl.check_state(
            jnp, state, x.shape[0], config)))
        _check_values_eagerly({"state.h": state.h, "state.c": state.c})
    else:  # a pair: the count is known to be 0 (a chunk boundary), and x's sharding
        state = _zero_state_like(x, config)
    _check_values_eagerly({"x": x})
    theta, cell = _on_mesh_of(x, _cast_params(params, dtype))
    static = _StreamStatic(layer, config, _scan_mod.options_key())
    if doc_starts is not None:
        return forward_mode_guard("apply", lambda: _stream_call(
            static, theta, cell, x, state, reset, valid, doc_starts))
    function = _stream_function(static, tuple(x.shape), str(x.dtype))
    return forward_mode_guard("apply", lambda: function(theta, cell, x, state, reset, valid))


class _StreamStatic(NamedTuple):
    """What a compiled stream call depends on besides its arrays (hashable)."""

    layer: type
    config: tl.LayerConfig
    options: Any


def _stream_call(static: _StreamStatic, theta: Any, cell: ConvParams, x: jax.Array,
                 state: Any, reset: Any, valid: Any, doc_starts: Any = None
                 ) -> tuple[jax.Array, tl.StreamState]:
    return static.layer(static.config).forward_stream(
        jnp, theta, x, state, scan=_layer_scan(static.config, cell, theta), reset=reset,
        doc_starts=doc_starts, valid=valid)


#: The most compiled streaming functions an eager caller keeps (one per layer config,
#: options and piece shape ``(B, N, d)``): an eager loop over pieces of many lengths
#: would otherwise keep one compiled program per length without bound. The least
#: recently used is dropped (with its compiled program) and recompiled if it returns.
STREAM_CACHE_SIZE = 32

_STREAM_FUNCTIONS: collections.OrderedDict = collections.OrderedDict()


def _stream_function(static: _StreamStatic, shape: tuple[int, ...], dtype: str
                     ) -> Callable[..., Any]:
    """The jitted :func:`_stream_call` for one config and piece shape, from a bounded LRU
    (:data:`STREAM_CACHE_SIZE`); under an outer trace the call is inlined as before."""
    key = (static, shape, dtype)
    function = _STREAM_FUNCTIONS.get(key)
    if function is None:
        function = jax.jit(functools.partial(_stream_call, static))
        _STREAM_FUNCTIONS[key] = function
        while len(_STREAM_FUNCTIONS) > STREAM_CACHE_SIZE:
            _STREAM_FUNCTIONS.popitem(last=False)
    else:
        _STREAM_FUNCTIONS.move_to_end(key)
    return function


# --------------------------------------------------------------------------- residual, stack


def residual_init(
    key: jax.Array,
    embed_dim: int,
    memory_channels: int,
    memory_shape: Sequence[int],
    chunk_size: int,
    sigma_scale: float = 1.0,
    *,
    gate_init: float = 0.0,
    forget_bias: float = 0.0,
    dtype: Any = jnp.float32,
    dynamics: str = "none",
    flow: bool = False,
) -> dict:
    """Parameters of the gated residual ``x + sigmoid(gate) * memory(norm(x))``.

    The memory's parameters are :func:`init`'s with the same key and options, so
    with the same key they equal :class:`MemoryResidual`'s (``nnx.Rngs(seed)``'s
    first ``params`` key) for every option.

    Parameters
    ----------
    key : jax.Array
        A ``jax.random`` key.
    embed_dim : int
        The token width ``d``.
    memory_channels : int
        The grid channels ``C``.
    memory_shape : sequence of int
        The grid shape ``S`` (1 to 4 positive ints).
    chunk_size : int
        The tokens per chunk ``L``.
    sigma_scale : float, default 1.0
        Checked (> 0) and otherwise unused, as in :func:`init`.
    gate_init : float, default 0.0
        The gate's initial value: 0.0 (half open) and -2.0 (mostly closed) are
        the paper's two choices.
    forget_bias : float, default 0.0
        As in :func:`init`.
    dtype : dtype, default float32
        The parameters' dtype.
    dynamics : {"none", "warp"}, default "none"
        As in :func:`init`: ``"warp"`` adds the memory's ``warp_net`` group
        (``{"weight" (n, d), "bias" (n,)}``, zeros: no displacement at init);
        pass ``dynamics="warp"`` to :func:`residual_apply` too (experimental).
    flow : bool, default False
        As in :func:`init` (with ``dynamics="warp"``): adds the memory's
        ``warp_flow`` group (``depthwise_weight (n, C, 3)`` identity taps,
        ``depthwise_bias (n, C)``, ``pointwise_weight (n, C)``,
        ``pointwise_bias (n,)``, zeros). ``update`` / ``window`` add no
        parameter: they are :func:`residual_apply` keywords only.

    Returns
    -------
    dict
        ``{"norm": {"weight" (d,), "bias" (d,)}, "memory": init(...), "gate"
        (1,)}``; ``norm`` is a LayerNorm (ones, zeros, eps 1e-5 as in torch).

    Raises
    ------
    TypeError
        If a size is not an int, ``dynamics`` is not a string or ``flow`` not
        a bool (:func:`tmcore.layer.layer_config`; each error names the argument).
    ValueError
        If a size or ``sigma_scale`` is out of range, ``gate_init`` is not
        finite, ``dynamics`` is unknown or ``flow=True`` comes without
        ``dynamics="warp"``.
    """
    memory = init(key, embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale,
                  forget_bias=forget_bias, dtype=dtype, dynamics=dynamics, flow=flow)
    d = memory["out_proj"]["bias"].shape[0]
    return {
        "norm": {"weight": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)},
        "memory": memory,
        "gate": jnp.full(tl.GATE_SHAPE, check_finite("gate_init", gate_init), dtype),
    }


def _layer_norm(p: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + _LAYER_NORM_EPS) * p["weight"] + p["bias"]


def _gated(x: jax.Array, gate: jax.Array, out: jax.Array) -> jax.Array:
    return x + jax.nn.sigmoid(gate) * out


# one dispatch each when called eagerly (inlined under an outer trace)
_norm_jit = jax.jit(_layer_norm)
_gated_jit = jax.jit(_gated)


def residual_apply(
    params: Mapping[str, Any], x: jax.Array, state: Any = None, **kwargs: Any
) -> tuple[jax.Array, MemoryState]:
    """The gated residual ``x + sigmoid(gate) * apply(memory, layer_norm(x), state)``.

    Parameters
    ----------
    params : dict
        From :func:`residual_init` (or :func:`params_from_state_dict` of a
        torch ``MemoryResidual``); the gate may be ``(1,)`` or 0-dim.
    x : jax.Array, shape ``(B, N, d)``
        The tokens.
    state : StreamState, MemoryState or None, optional
        As in :func:`apply`.
    **kwargs
        :func:`apply`'s keywords (``memory_shape``, ``sigma_scale``, ``reset``,
        ``checkpoint_every``, ``stream``, ...), the layer options included:
        ``update`` / ``window`` and ``dynamics`` / ``flow`` (experimental; the
        last two need the groups :func:`residual_init` makes with the same
        options). They go to the memory's :func:`apply` unchanged, so the
        residual is differentiable and jittable with them as :func:`apply` is
        (its ``update`` / ``window`` / ``dynamics`` / ``flow`` static).

    Returns
    -------
    out : jax.Array, shape ``(B, N, d)``
        ``x`` plus the gated memory read.
    state : StreamState or MemoryState
        The memory's final state, as :func:`apply` returns it.

    Raises
    ------
    KeyError
        If ``params`` lacks ``norm``, ``memory`` or ``gate`` or a memory parameter
        (e.g. ``warp_net`` with ``dynamics="warp"``).
    TypeError, ValueError
        As :func:`apply` raises them (a bad option names it).
    """
    norm, gate = _on_mesh_of(x, (params["norm"], params["gate"]))
    out, state = apply(params["memory"], _norm_jit(norm, x), state, **kwargs)
    return _gated_jit(x, gate, out), state


def stack_apply(
    layers: Sequence[Mapping[str, Any]],
    x: jax.Array,  # [B, N, d]
    state: Any = None,
    *,
    mode: str,
    blocks: Sequence[Callable[[jax.Array], jax.Array]] | None = None,
    reset: jax.Array | None = None,
    **kwargs: Any,
) -> tuple[jax.Array, Any]:
    """A stack of gated memory residuals, optionally after per-layer blocks.

    Layer ``l`` computes ``x = blocks[l](x)`` (when given), then
    ``x = residual_apply(layers[l], x, ...)``. Repeat one parameter pytree in
    ``layers`` to share a memory between blocks.

    Parameters
    ----------
    layers : sequence of dict
        One :func:`residual_init` pytree per layer.
    x : jax.Array, shape ``(B, N, d)``
        The tokens.
    state : MemoryState, tuple of states or None, optional
        ``"threaded"``: one :class:`MemoryState`; ``"causal"``: a tuple of
        per-layer states (a single state is used for every layer); ``None``:
        zeros.
    mode : {"threaded", "causal"}
        ``"threaded"`` (the paper's): one state threaded through the layers --
        layer ``l`` starts from the state layer ``l - 1`` reached after the
        WHOLE segment, so every position sees later tokens of the segment. Not
        causal; right for bidirectional inputs (images, clip classification).
        ``"causal"``: every layer scans from its own state at the start of the
        segment, so a read at chunk ``t`` depends only on earlier chunks and
        chunk ``t``'s first token. Right for language modelling; streaming is
        exact (:mod:`tmcore.layer`).
    blocks : sequence of callable, optional
        ``blocks[l](x) -> x``, run before memory layer ``l``; one per layer.
    reset : jax.Array of bool, shape ``(B,)``, optional
        Zeroes the incoming state of the flagged sequences (every layer's).
    **kwargs
        :func:`apply`'s keywords (``memory_shape``, ``checkpoint_every``, ...).

    Returns
    -------
    out : jax.Array, shape ``(B, N, d)``
        The last layer's output.
    state : MemoryState or tuple
        ``"threaded"``: the last layer's :class:`MemoryState`; ``"causal"``: a
        tuple of per-layer states (:class:`StreamState` by default).

    Raises
    ------
    ValueError
        If ``mode`` is unknown, ``blocks`` has not one callable per layer,
        ``"threaded"`` is asked to stream (``stream``, ``doc_starts``,
        ``valid``), or the state has not one entry per layer; else as
        :func:`apply` raises.
    """
    tl.check_mode(mode)
    if mode == "threaded":
        if kwargs.get("stream") or kwargs.get("doc_starts") is not None \
                or kwargs.get("valid") is not None:
            raise ValueError("stream / doc_starts / valid: streaming across chunk "
                             "boundaries, packed documents and skipped tokens need "
                             "mode='causal'")
        kwargs["stream"] = False
    if blocks is not None and len(blocks) != len(layers):
        raise ValueError(f"blocks: expected {len(layers)} callables (one per layer), "
                         f"got {len(blocks)}")
    segment = tl.segment_states(mode, state, len(layers))
    finals: list[MemoryState] = []
    previous = None
    for index, params in enumerate(layers):
        x = x if blocks is None else blocks[index](x)
        start, resets = tl.start_state(mode, index, segment, previous)
        x, previous = residual_apply(params, x, start, reset=reset if resets else None,
                                     **kwargs)
        finals.append(previous)
    return x, tl.final_state(mode, finals)


# --------------------------------------------------------------------------- state dicts


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
        node = raw
        *path, leaf = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
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
        node, source = params, raw
        *path, leaf = name.split(".")
        for part in path:
            node, source = node.setdefault(part, {}), source[part]
        value = source[leaf]
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


# --------------------------------------------------------------------------- Flax NNX


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


def _options(module: TensorMemory) -> dict:
    """The experimental options of a :class:`TensorMemory` as :func:`apply`'s keywords
    (none on the default layer, so its call is unchanged)."""
    options = {"update": module.update, "window": module.window,
               "dynamics": module.dynamics, "flow": module.flow}
    return {k: v for k, v in options.items() if v != _DEFAULT_OPTIONS[k]}


_DEFAULT_OPTIONS = {"update": "dense", "window": None, "dynamics": "none", "flow": False}


def _without_extra_state(module: Any, params: Mapping[str, Any], path: str) -> dict:
    """``params`` less its ``_extra_state`` entries, each checked (when concrete) against
    the ``memory_shape`` of the submodule at its place."""
    out = {}
    for key, value in params.items():
        if key == EXTRA_STATE:
            grid = getattr(module, "memory_shape", None)
            error = None if grid is None else tl.stored_grid_error(_stored(value), grid,
                                                                   f"{path}{key}")
            if error is not None:
                raise ValueError(error)
        elif isinstance(value, Mapping):
            out[key] = _without_extra_state(getattr(module, str(key), None), value,
                                            f"{path}{key}.")
        else:
            out[key] = value
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
    ``valid``). Mixed precision as in :func:`apply` (float32 parameters with a
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
        self.memory_channels = config.memory_channels
        self.memory_shape = config.memory_shape
        self.chunk_size = config.chunk_size
        self.sigma_scale = config.sigma_scale
        self.eps = config.eps
        self.radius = config.radius
        self.checkpoint_every = config.checkpoint_every
        self.update = config.update
        self.window = config.window
        self.dynamics = config.dynamics
        self.flow = config.flow
        # ``(group, leaf)`` of every parameter (LAYER_KEYS, plus warp_net / warp_flow)
        self.param_keys = tuple((spec.group, spec.leaf) for spec in tl.param_specs(config))

    def init_state(self, batch: int, dtype: Any = jnp.float32) -> MemoryState:
        return init_state(batch, self.memory_channels, self.memory_shape, dtype)

    def __call__(self, x: jax.Array, state: Any = None, *, reset: jax.Array | None = None,
                 stream: bool | None = None, doc_starts: Any = None, valid: Any = None
                 ) -> tuple[jax.Array, Any]:
        return apply(_layer_params(self), x, state, chunk_size=self.chunk_size,
                     memory_shape=self.memory_shape, sigma_scale=self.sigma_scale,
                     reset=reset, eps=self.eps, radius=self.radius,
                     checkpoint_every=self.checkpoint_every, stream=stream,
                     doc_starts=doc_starts, valid=valid, **_options(self))


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
        self.norm = _to_variables({"weight": jnp.ones((embed_dim,), dtype),
                                   "bias": jnp.zeros((embed_dim,), dtype)})
        self.gate = nnx.Param(jnp.full(tl.GATE_SHAPE, check_finite("gate_init", gate_init),
                                       dtype))

    def __call__(self, x: jax.Array, state: Any = None, *, reset: jax.Array | None = None,
                 stream: bool | None = None, doc_starts: Any = None, valid: Any = None
                 ) -> tuple[jax.Array, Any]:
        m = self.memory
        params = {"norm": {"weight": _raw(self.norm["weight"]),
                           "bias": _raw(self.norm["bias"])},
                  "memory": _layer_params(m), "gate": _raw(self.gate)}
        return residual_apply(params, x, state, chunk_size=m.chunk_size,
                              memory_shape=m.memory_shape, sigma_scale=m.sigma_scale,
                              reset=reset, eps=m.eps, radius=m.radius,
                              checkpoint_every=m.checkpoint_every, stream=stream,
                              doc_starts=doc_starts, valid=valid, **_options(m))


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
