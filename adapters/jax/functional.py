"""The JAX adapter's pure layer: :func:`init` / :func:`apply` over a parameter pytree,
the states (:class:`MemoryState`, :func:`init_state`, :func:`empty_stream_state`,
:func:`reset_state`, :func:`detach_state`), the checked-config cache, and streaming
(``Layer.forward_stream`` in one bounded LRU of jitted functions)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tmcore import layer as tl
from tmcore.adapters.jax import bridge as _scan_mod
from tmcore.adapters.jax.bridge import forward_mode_guard
from tmcore.adapters.jax.checkpoints import EXTRA_STATE, _check_stored
from tmcore.layer.layer import Scan
from tmcore.layer.state import (
    check_forward,
    check_mask,
    check_state,
    check_tokens,
    stream_state,
    where_rows,
)
from tmcore.ops.splat import DEFAULT_EPS
from tmcore.runtime.validate import check_int, check_values
from tmcore.scan.options import scan_options, step_for
from tmcore.types import ConvParams, WarpParams

__all__ = ["LAYER_KEYS", "STREAM_CACHE_SIZE", "MemoryState", "StreamState", "apply",
           "conv_params", "detach_state", "doc_starts_from_offsets", "empty_stream_state",
           "init", "init_state", "reset_state"]

#: Parameter names of one memory layer, ``(group, leaf)``, torch state-dict order.
LAYER_KEYS = tuple((spec.group, spec.leaf)
                   for spec in tl.param_specs(tl.LayerConfig(1, 1, (1,), 1)))
#: the floating fields of a :class:`StreamState` (``count`` is an integer array)
_FLOAT_FIELDS = ("h", "c", "pending", "read")


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
    return stream_state(jnp, None, tokens, config)[0]


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
            return s._replace(**{k: lax.stop_gradient(getattr(s, k)) for k in _FLOAT_FIELDS})
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


def _remember(cache: collections.OrderedDict, key: Any, value: Any, size: int) -> None:
    """Put ``value`` in the LRU ``cache``, dropping the least recently used beyond ``size``."""
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)


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
            _remember(_CONFIGS, key, config, _CONFIG_CACHE_SIZE)
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
        fields += [(f"state.{k}", getattr(state, k)) for k in _FLOAT_FIELDS]
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
            check_state(jnp, state, getattr(x, "shape", (0,))[0],
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
        reset = jnp.asarray(reset)
        check_mask(jnp, reset, "reset", (state[0].shape[0],))
        return MemoryState(*(where_rows(jnp, ~reset, v, jnp.zeros_like(v)) for v in state))
    return tuple(reset_state(s, reset) for s in state)


def _compute_dtype(params: Mapping[str, Any], x: jax.Array, state: Any) -> Any:
    """The dtype the layer computes and keeps its state in: JAX's promotion of ``x``,
    the parameters and a given state (float32 params with a bfloat16 ``x`` -> float32)."""
    leaves = [params[group][leaf] for group, leaf in LAYER_KEYS]
    if state is not None:
        leaves += [state[0], state[1]]
    return jnp.result_type(x, *leaves)


def _call_dtype(params: Mapping[str, Any], x: jax.Array, state: Any) -> Any:
    """:func:`_compute_dtype` before the state is checked, from the fields that are
    floating arrays (the state's check names any other): the dtype the call's working
    set is sized in (bfloat16 tokens into a float32 layer compute in float32)."""
    pair = (state.h, state.c) if isinstance(state, tl.StreamState) else state
    fields = [value.dtype for value in (pair if _is_pair(pair) else ())
              if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)]
    return jnp.result_type(x, *(params[group][leaf] for group, leaf in LAYER_KEYS), *fields)


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
    max_documents: int | None = None,
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
        so each document's outputs equal running it alone. Without
        ``max_documents`` the grid is planned on the host: ``doc_starts`` (and
        ``reset``, ``valid``, the state's ``count``) must be concrete; traced
        under ``jit`` it is a ``TypeError`` saying to pass ``max_documents``.
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
    max_documents : int, optional
        ``D``, a static Python int bounding the documents that start in this
        call: at least each row's True entries of ``doc_starts`` (plus one for
        a ``reset`` row whose ``doc_starts`` is False at token 0). The
        document a row continues (a :class:`StreamState`'s unfinished chunk
        and the tokens up to the row's first start) needs no room in ``D``:
        the grid's size counts it. The chunk
        grid is then computed by array operations, so ``doc_starts``,
        ``reset``, ``valid`` and the state may be traced (``jax.jit``,
        ``jax.grad``; a jitted training step takes ``doc_starts`` as an
        argument): every row runs ``T = ceil((L - 1 + N) / L) + min(D, N)``
        chunks in ONE ``lax.scan`` (its own chunks -- the continued
        unfinished one, then each document's -- then inactive padding
        chunks), whose per-step masks zero a row's state where its document
        starts and freeze it after its last complete chunk; it compiles
        once per ``(B, N, D)``. Results equal the host-planned call's (to
        rounding). A row with more than ``D`` starts: concrete masks raise
        ``ValueError``; traced ones cannot be checked and that row's starts
        after its ``D``-th (a start on a padded token counted at the next
        valid one) are ignored, its later documents continuing the state of
        the one before (wrong outputs and state for that row from there).
        Compute scales with ``T``: pick ``D`` near the data's real bound.
        Ignored without ``doc_starts``.

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
        is not a bool, ``max_documents`` is not an int, or ``doc_starts`` is
        traced without ``max_documents`` (it is then planned on the host).
    ValueError
        If a parameter, ``x`` or the state is misshapen, ``memory_shape``,
        ``eps``, ``radius`` or ``sigma_scale`` is out of range, an
        ``_extra_state`` entry (the grid shape a PyTorch checkpoint stores)
        does not match the grid, ``stream=False`` meets a :class:`StreamState`,
        ``doc_starts`` or ``valid``, ``max_documents`` is below 1 or a concrete
        ``doc_starts`` has a row with more starts than it, or (validate mode,
        :func:`tmcore.options`) a concrete ``x`` or state holds NaN or inf.

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
    documents = None if max_documents is None else check_int("max_documents", max_documents, 1)
    pair = (state.h, state.c) if isinstance(state, tl.StreamState) else state
    config = _layer_config(params, x, pair, chunk_size=chunk_size,
                           memory_shape=memory_shape, sigma_scale=sigma_scale, eps=eps,
                           radius=radius, checkpoint_every=checkpoint_every,
                           update=update, window=window, dynamics=dynamics, flow=flow)
    # x and the state are checked here, once: the layer's call below is told so (checked=)
    check_tokens(jnp, x, config)
    _check_no_widening(params, x, state)
    # the state and the call fit, in the dtype the call computes in, before allocating
    check_forward(jnp, config, x, _call_dtype(params, x, state))
    if stream:
        return _apply_stream(params, x, state, config, layer, reset, doc_starts, valid,
                             documents)
    batch, tokens, d = x.shape
    if state is None:
        state = _zero_state_like(x, config)  # made to fit: nothing to check
    else:
        state = MemoryState(*check_state(jnp, state, batch, config))
    if EXTRA_STATE in params:
        _check_stored(params[EXTRA_STATE], config.memory_shape, f"params[{EXTRA_STATE!r}]")
    if reset is not None:
        state = reset_state(state, reset)
    dtype = _compute_dtype(params, x, state)
    x = x.astype(dtype)
    state = MemoryState(state.h.astype(dtype), state.c.astype(dtype))
    check_values(jnp, {"x": x, "state.h": state.h, "state.c": state.c})
    if batch == 0 or tokens == 0:  # nothing to scan; shapes as for any other input
        return jnp.zeros((batch, tokens, d), dtype), state
    theta, cell = _on_mesh_of(x, _cast_params(params, dtype))
    out, (h, c) = forward_mode_guard("apply", lambda: layer(config).forward(
        jnp, theta, x, tuple(state), scan=_layer_scan(config, cell, theta), checked=True))
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


def _layer_scan(config: tl.LayerConfig, cell: ConvParams, theta: Any = None) -> Scan:
    """The layer's scan: its options' step (:func:`tmcore.scan.step_for`) in the one
    checkpointed ``lax.scan`` (:class:`tmcore.adapters.jax.bridge.LayerScan`), with the
    ``warp_flow`` group of ``theta`` for ``flow=True``."""
    warp = config.dynamics == "warp"
    step = step_for(scan_options(config), warp)
    if warp:
        flow = tl.cell_params({"cell": theta[tl.FLOW_GROUP]}) if config.flow else None
        return _scan_mod.LayerScan(step, WarpParams(cell, flow), config.checkpoint_every)
    return _scan_mod.LayerScan(step, cell, config.checkpoint_every)


def _apply_stream(params: Mapping[str, Any], x: jax.Array, state: Any,
                  config: tl.LayerConfig, layer: type[tl.Layer], reset: Any,
                  doc_starts: Any, valid: Any = None, documents: int | None = None
                  ) -> tuple[jax.Array, tl.StreamState]:
    """:func:`apply` with ``stream=True``: the shared layer's ``forward_stream`` with
    :func:`memory_scan` (compiled, custom VJP) as its scan, in one ``jax.jit`` keyed by
    the layer, its config and the options (eager calls then run one compiled function;
    under an outer trace it is inlined). With ``doc_starts`` the call is not wrapped:
    the layer reads concrete masks (to plan the grid on the host or, with ``documents``
    (``max_documents``), to check the bound before planning it with arrays)."""
    if EXTRA_STATE in params:
        _check_stored(params[EXTRA_STATE], config.memory_shape, f"params[{EXTRA_STATE!r}]")
    if isinstance(state, tl.StreamState):
        state = stream_state(jnp, state, x, config)[0]  # checks; count an int32 array
        state = _guard_count(state, config.chunk_size)  # under jit too: never another row
    dtype = _compute_dtype(params, x, None if state is None else (state[0], state[1]))
    x = _cast(x, dtype)
    if isinstance(state, tl.StreamState):
        state = state._replace(**{k: _cast(getattr(state, k), dtype) for k in _FLOAT_FIELDS})
        check_values(jnp, {f"state.{k}": getattr(state, k) for k in _FLOAT_FIELDS})
    elif state is not None:
        state = MemoryState(*(_cast(s, dtype) for s in check_state(
            jnp, state, x.shape[0], config)))
        check_values(jnp, {"state.h": state.h, "state.c": state.c})
    else:  # a pair: the count is known to be 0 (a chunk boundary), and x's sharding
        state = _zero_state_like(x, config)
    check_values(jnp, {"x": x})
    theta, cell = _on_mesh_of(x, _cast_params(params, dtype))
    if doc_starts is None:
        documents = None  # (one compiled function whatever the bound)
    static = _StreamStatic(layer, config, _scan_mod.options_key(), documents)
    if doc_starts is not None:  # (not wrapped: concrete masks are read by the layer)
        return forward_mode_guard("apply", lambda: _stream_call(
            static, theta, cell, x, state, reset, valid, doc_starts))
    function = _stream_function(static, tuple(x.shape), str(x.dtype))
    return forward_mode_guard("apply", lambda: function(theta, cell, x, state, reset, valid))


class _StreamStatic(NamedTuple):
    """What a compiled stream call depends on besides its arrays (hashable)."""

    layer: type
    config: tl.LayerConfig
    options: Any
    documents: int | None = None  # max_documents: packed documents planned with arrays


def _stream_call(static: _StreamStatic, theta: Any, cell: ConvParams, x: jax.Array,
                 state: Any, reset: Any, valid: Any, doc_starts: Any = None
                 ) -> tuple[jax.Array, tl.StreamState]:
    # x and state were checked by apply (a StreamState by tl.stream_state): not again
    return static.layer(static.config).forward_stream(
        jnp, theta, x, state, scan=_layer_scan(static.config, cell, theta), reset=reset,
        doc_starts=doc_starts, valid=valid, checked=True, max_documents=static.documents)


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
        _remember(_STREAM_FUNCTIONS, key, function, STREAM_CACHE_SIZE)
    else:
        _STREAM_FUNCTIONS.move_to_end(key)
    return function

