"""The JAX adapter's pure layer: :func:`init` / :func:`apply` over a parameter pytree that
carries its :class:`tmcore.layer.LayerConfig` (key ``"config"``, a static node), the states
(:class:`MemoryState`, :func:`init_state`, :func:`empty_stream_state`, :func:`reset_state`,
:func:`detach_state`), and the layer call as one jitted function per config and input
shape (a bounded LRU)."""

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
from tmcore.adapters.jax.checkpoints import CONFIG
from tmcore.layer.layer import Scan
from tmcore.layer.state import (
    check_forward,
    check_mask,
    check_state,
    check_stream_call,
    check_tokens,
    stream_state,
    where_rows,
)
from tmcore.runtime import validate
from tmcore.runtime.validate import check_int, check_values
from tmcore.scan.options import scan_options, step_for
from tmcore.types import ConvParams, WarpParams

__all__ = ["STREAM_CACHE_SIZE", "MemoryState", "StreamState", "apply", "conv_params",
           "detach_state", "doc_starts_from_offsets", "empty_stream_state", "init",
           "init_state", "reset_state"]

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


# The state between streamed calls (tmcore.layer.StreamState): (h, c) at the last chunk
# boundary plus the unfinished chunk's tokens, their count and its read. A plain comment,
# not a doc comment: the docs show the class (its page), not a constant of that name.
StreamState = tl.StreamState


def init(key: jax.Array, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
         chunk_size: int, sigma_scale: float = 1.0, *, dtype: Any = jnp.float32,
         **options: Any) -> dict:
    """Parameters of one Tensor Memory layer and its config, initialized like torch's.

    The plan is :func:`tmcore.layer.param_specs` (docs/LAYER.md); the random leaves are
    drawn from ``key`` in state-dict order. Arrays are made without a device
    (uncommitted), so ``jit`` places them next to sharded inputs.

    Parameters
    ----------
    key : jax.Array
        A ``jax.random`` key.
    embed_dim, memory_channels, memory_shape, chunk_size : int, int, sequence of int, int
        The sizes ``d``, ``C``, ``S`` (1 to 4 axes) and ``L``.
    sigma_scale : float, default 1.0
        Multiplies the write spread.
    dtype : dtype, default float32
        The parameters' dtype.
    **options
        The layer's other keywords (:func:`tmcore.layer.layer_config`:
        ``checkpoint_every``, ``radius``, ``eps``, ``forget_bias``, ``zero_init``,
        ``update``, ``window``, ``dynamics``, ``flow``).

    Returns
    -------
    dict
        ``{"write_proj": {"weight" (d, L*d), "bias" (d,)}, "content_net": {(C, d), (C,)},
        "sigma_net": {(1, d), (1,)}, "coord_net": {(n, d), (n,)}, "cell":
        {"depthwise_weight" (n, 2C, 3), "depthwise_bias" (n, 2C), "pointwise_weight"
        (4C, 2C), "pointwise_bias" (4C,)}, "out_proj": {(d, C), (d,)}}`` (plus
        ``warp_net`` / ``warp_flow`` with those options) and ``"config"``: the
        :class:`tmcore.layer.LayerConfig`, a static pytree node (``jax.grad`` and optax
        see the arrays only) that :func:`apply` runs.

    Raises
    ------
    TypeError, ValueError
        As :func:`tmcore.layer.layer_config` raises them (each error names the argument).
    MemoryError
        If the parameters would not fit in the device's memory.
    """
    config = tl.layer_config(embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale,
                             **options)
    tl.check_param_bytes(jnp, config, dtype)  # before any parameter is made
    random = [s for s in tl.param_specs(config) if s.init in ("uniform", "xavier_uniform")]
    keys = iter(jax.random.split(key, len(random)))

    def uniform(spec: tl.ParamSpec) -> jax.Array:
        return jax.random.uniform(next(keys), spec.shape, dtype, -spec.bound, spec.bound)

    return {**tl.init_params(jnp, config, uniform, dtype=dtype), CONFIG: config}


def config_of(params: Any) -> tl.LayerConfig:
    """The config a parameter pytree carries, once its parameters are checked against it.

    Parameters
    ----------
    params : dict
        A layer's parameter pytree (:func:`init`, :func:`params_from_state_dict`).

    Returns
    -------
    tmcore.layer.LayerConfig
        ``params["config"]``.

    Raises
    ------
    TypeError
        If ``params`` has no :class:`tmcore.layer.LayerConfig` under ``"config"``, or a
        parameter is not a floating array.
    KeyError, ValueError
        If a parameter is missing, has another shape than the config gives, or a group
        is not one of the config's.
    """
    config = params.get(CONFIG) if isinstance(params, Mapping) else None
    if not isinstance(config, tl.LayerConfig):
        raise TypeError(f"params: expected the parameter pytree init or "
                        f"params_from_state_dict makes, with its LayerConfig under "
                        f"{CONFIG!r}; got {type(params).__name__} with "
                        f"{type(config).__name__} there")
    tl.check_params(params, config)
    extra = sorted(set(params) - {CONFIG, *tl.param_groups(config)})
    if extra:
        raise ValueError(f"params: the groups {extra} are not parameters of its config "
                         f"(dynamics={config.dynamics!r}, flow={config.flow})")
    return config


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


def empty_stream_state(config_or_params: Any, batch: int, *, dtype: Any = None
                       ) -> tl.StreamState:
    """Make an empty :class:`StreamState` (zeros, ``count`` 0) for ``batch`` rows.

    It is what :func:`apply` returns the state as, so it is a ``lax.scan`` /
    ``fori_loop`` carry whose type is the same in and out
    (``lax.scan(step, empty_stream_state(params, B), xs)``).

    Parameters
    ----------
    config_or_params : tmcore.layer.LayerConfig or dict
        The layer's config, or its parameter pytree (:func:`init`).
    batch : int
        ``B`` (>= 0).
    dtype : dtype, optional
        The floating fields' dtype (real floating); default the parameters' (float32
        for a config).

    Returns
    -------
    StreamState
        ``h``, ``c`` ``(B, C, *S)``, ``pending`` ``(B, L, d)``, ``read`` ``(B, C)`` of
        zeros and ``count`` int32 zeros ``(B,)``.

    Raises
    ------
    TypeError
        If ``batch`` is not an int, ``dtype`` not a real floating dtype, or
        ``config_or_params`` neither a config nor a parameter pytree.
    ValueError, MemoryError
        If the state would not fit int64 or the device (naming ``batch``); nothing is
        allocated first.
    """
    if isinstance(config_or_params, tl.LayerConfig):
        config = config_or_params
        dtype = jnp.float32 if dtype is None else dtype
    else:
        config = config_of(config_or_params)
        if dtype is None:
            dtype = _layer_dtype(config_or_params, config)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype: expected a real floating dtype, got {jnp.dtype(dtype).name}")
    batch = check_int("batch", batch, 0)
    shape = config.state_shape(batch)
    count = validate.check_count("batch", shape, "(B, C, *S)", "the state h (and c)")
    rest = batch * (config.chunk_size * config.embed_dim + config.memory_channels)
    validate.check_bytes("batch", (2 * count + rest) * jnp.dtype(dtype).itemsize + 4 * batch,
                      f"an empty stream state of {batch} rows (h and c {shape})", jnp)
    tokens = jnp.zeros((batch, 0, config.embed_dim), dtype)  # fixes B, dtype, device
    return stream_state(jnp, None, tokens, config)[0]


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
    if isinstance(state, (tuple, list)) and len(state) == 2 \
            and all(hasattr(s, "shape") for s in state):
        reset = jnp.asarray(reset)
        check_mask(jnp, reset, "reset", (state[0].shape[0],))
        return MemoryState(*(where_rows(jnp, ~reset, v, jnp.zeros_like(v)) for v in state))
    return tuple(reset_state(s, reset) for s in state)


def apply(
    params: Mapping[str, Any],
    x: jax.Array,  # [B, N, d]
    state: Any = None,
    *,
    reset: jax.Array | None = None,  # [B] bool
    stream: bool = True,
    doc_starts: Any = None,  # [B, N] bool
    valid: Any = None,  # [B, N] bool
    max_documents: int | None = None,
    layer: type[tl.Layer] = tl.Layer,
) -> tuple[jax.Array, Any]:  # out [B, N, d], state
    """Run one Tensor Memory layer over ``x``; returns ``(out, state)``.

    The layer is the one ``params["config"]`` describes (:func:`init`). Every argument
    is checked before anything runs (shapes, dtypes, Python scalars: fine under
    ``jit``), each error naming the argument; the call then runs as one compiled
    function (jitted per input structure, at most :data:`STREAM_CACHE_SIZE` kept for
    eager calls; under an outer trace it is inlined).

    Parameters
    ----------
    params : dict
        The parameter pytree from :func:`init` or :func:`params_from_state_dict`.
    x : jax.Array, shape ``(B, N, d)``
        The tokens; ``N`` need not be a multiple of the chunk size.
    state : StreamState, MemoryState, (h, c) or None, optional
        The state a previous call returned (``h``, ``c`` each ``(B, C, *S)`` with
        the config's grid), or ``None`` for zeros.
    reset : jax.Array of bool, shape ``(B,)``, optional
        Those sequences start from the zero state.
    stream : bool, default True
        Return a :class:`StreamState` (``(h, c)`` at the last chunk boundary plus
        the unfinished chunk, its ``count`` an int32 array ``(B,)``), so that pieces
        of ANY lengths fed back with it equal one long call
        (:meth:`tmcore.layer.Layer.forward_stream`, docs/guides/jax-generation.md);
        it is data, so a streaming call works under ``jit``, ``lax.scan``, ``vmap``
        and ``grad``. ``False``: the ragged last chunk is zero-padded and written,
        and the state is a :class:`MemoryState`.
    doc_starts : jax.Array of bool, shape ``(B, N)``, optional
        True at each token that starts a document (packed documents,
        :func:`doc_starts_from_offsets`): the state and the unfinished chunk are
        dropped there, so each document's outputs equal running it alone. Read on
        the host unless ``max_documents`` is given.
    valid : jax.Array of bool, shape ``(B, N)``, optional
        False at tokens to skip (padding): they never enter the state nor the chunk
        grid and their outputs are zeros.
    max_documents : int, optional
        ``D``, a static bound on the document starts of any row in this call; the
        packed grid is then planned with arrays, so the masks may be traced
        (:meth:`tmcore.layer.Layer.forward_stream` says what happens past it).
    layer : type, default :class:`tmcore.layer.Layer`
        A :class:`tmcore.layer.Layer` subclass overriding ``heads`` or
        ``read_out`` (a variant of the layer).

    Returns
    -------
    out : jax.Array, shape ``(B, N, d)``
        ``out_proj(read_t)`` on every token of chunk ``t``.
    state : StreamState or MemoryState
        The final state; wrap it in :func:`detach_state` to truncate backprop.

    Raises
    ------
    KeyError
        If a parameter is missing.
    TypeError
        If ``params`` carries no config, ``x`` or a parameter is not floating, ``x``
        or the state is wider than the parameters, a mask is not bool, ``stream`` is
        not a bool, or ``doc_starts`` is traced without ``max_documents``.
    ValueError
        If a parameter, ``x`` or the state is misshapen (a state of another grid than
        the config's included), ``stream=False`` meets a :class:`StreamState`,
        ``doc_starts`` or ``valid``, ``max_documents`` is below 1 or exceeded by a
        concrete ``doc_starts``, or (validate mode, :func:`tmcore.options`) a
        concrete ``x`` or state holds NaN or inf.

    Notes
    -----
    Mixed precision: the layer computes in JAX's promotion of ``x``, the
    parameters and the state (float32 parameters with a bfloat16 ``x``:
    float32); the output and the returned state have that dtype.
    """
    return _run(params, x, state, None, reset=reset, stream=stream, doc_starts=doc_starts,
                valid=valid, max_documents=max_documents, layer=layer)


def _run(params: Mapping[str, Any], x: Any, state: Any, residual: Any, *, reset: Any = None,
         stream: bool = True, doc_starts: Any = None, valid: Any = None,
         max_documents: int | None = None, layer: type[tl.Layer] = tl.Layer
         ) -> tuple[jax.Array, Any]:
    """:func:`apply`, or with ``residual = (norm, gate)`` the gated residual around it
    (:func:`tmcore.adapters.jax.residual_apply`): checks, then one compiled call."""
    config = config_of(params)
    stream = check_stream_call(stream, state, doc_starts, valid)
    documents = None if max_documents is None else check_int("max_documents", max_documents, 1)
    documents = None if doc_starts is None else documents  # (one function whatever it is)
    check_tokens(jnp, x, config)
    if isinstance(state, tl.StreamState):
        state = stream_state(jnp, state, x, config)[0]  # checked; count an int32 array
    elif state is not None:
        state = MemoryState(*check_state(jnp, state, x.shape[0], config))
    dtype = _compute_dtype(params, config, x, state)
    # the state and the call fit, in the dtype the call computes in, before allocating
    check_forward(jnp, config, x, dtype)
    x = _cast(x, dtype)
    if state is not None:
        state = state._replace(**{k: _cast(getattr(state, k), dtype)
                                  for k in _FLOAT_FIELDS if k in state._fields})
    check_values(jnp, {"x": x, **({} if state is None else {
        f"state.{k}": getattr(state, k) for k in _FLOAT_FIELDS if k in state._fields})})
    theta, cell, residual = _on_mesh_of(x, (*_cast_params(params, config, dtype), residual))
    static = _Static(layer, config, _scan_mod.options_key(), stream, documents)
    if doc_starts is not None:  # (not wrapped: concrete masks are read by the layer)
        return forward_mode_guard("apply", lambda: _call(
            static, theta, cell, x, state, reset, valid, residual, doc_starts))
    function = _compiled(static, tuple(x.shape), str(x.dtype))
    return forward_mode_guard("apply", lambda: function(theta, cell, x, state, reset, valid,
                                                        residual))


def _cast(value: Any, dtype: Any) -> Any:
    return value if getattr(value, "dtype", None) == dtype else value.astype(dtype)


def _layer_dtype(params: Mapping[str, Any], config: tl.LayerConfig) -> Any:
    return jnp.result_type(*(params[s.group][s.leaf] for s in tl.param_specs(config)))


def _compute_dtype(params: Mapping[str, Any], config: tl.LayerConfig, x: Any, state: Any
                   ) -> Any:
    """The dtype the layer computes and keeps its state in: JAX's promotion of ``x``,
    the parameters and a given (checked) state. ``x`` and the state may be narrower
    than the parameters (bfloat16 tokens into a float32 layer compute in float32) but
    never wider: a float64 input into a float32 layer would silently compute and
    return float64."""
    layer = _layer_dtype(params, config)
    fields = [("x", x)] + ([] if state is None else [
        (f"state.{k}", getattr(state, k)) for k in _FLOAT_FIELDS if k in state._fields])
    for name, value in fields:
        if jnp.issubdtype(layer, jnp.floating) \
                and jnp.finfo(value.dtype).bits > jnp.finfo(layer).bits:
            raise TypeError(f"{name}: dtype {jnp.dtype(value.dtype).name} is wider than the "
                            f"layer's parameters ({jnp.dtype(layer).name}); cast it "
                            f"({name.split('.')[0]}.astype(jnp.{jnp.dtype(layer).name})) or "
                            f"the parameters (init(..., dtype=...))")
    return jnp.result_type(layer, *(value for _, value in fields))


def _cast_params(params: Mapping[str, Any], config: tl.LayerConfig, dtype: Any
                 ) -> tuple[dict, ConvParams]:
    """The head parameters ``{group: {leaf: array}}`` and the cell's :class:`ConvParams`
    in the compute ``dtype`` (leaves already in it are not copied)."""
    theta = {group: {leaf: _cast(value, dtype) for leaf, value in params[group].items()}
             for group in tl.param_groups(config) if group != "cell"}
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


class _Static(NamedTuple):
    """What a compiled call depends on besides its arrays (hashable)."""

    layer: type
    config: tl.LayerConfig
    options: Any
    stream: bool
    documents: int | None  # max_documents: packed documents planned with arrays


_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default


def _call(static: _Static, theta: Any, cell: ConvParams, x: jax.Array, state: Any,
          reset: Any, valid: Any, residual: Any, doc_starts: Any = None) -> tuple[Any, Any]:
    """The layer call on checked inputs (``state`` ``None`` or checked): the zero state is
    made from ``x`` (it inherits ``x``'s batch sharding and ``shard_map`` axes), and
    ``residual = (norm, gate)`` wraps the call in ``x + sigmoid(gate) * layer(norm(x))``."""
    config = static.config
    inner = x
    if residual is not None:  # torch.nn.LayerNorm over d
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        inner = (x - mean) * lax.rsqrt(var + _LAYER_NORM_EPS) * residual[0]["weight"] \
            + residual[0]["bias"]
    if state is None:
        shape = config.state_shape(x.shape[0])
        zero = jnp.zeros_like(inner[:, 0, 0]) if x.shape[1] else jnp.zeros(x.shape[:1], x.dtype)
        state = MemoryState(*(jnp.broadcast_to(jnp.reshape(zero, shape[:1] + (1,) * (
            len(shape) - 1)), shape),) * 2)
    layer, scan = static.layer(config), _layer_scan(config, cell, theta)
    if static.stream:
        out, state = layer.forward_stream(
            jnp, theta, inner, state, scan=scan, reset=reset, doc_starts=doc_starts,
            valid=valid, checked=True, max_documents=static.documents)
    else:
        out, pair = layer.forward(jnp, theta, inner, tuple(state), scan=scan, reset=reset,
                                  checked=True)
        state = MemoryState(*pair)
    return (out if residual is None else x + jax.nn.sigmoid(residual[1]) * out), state


#: The most compiled layer calls an eager caller keeps (one per layer config, options and
#: input shape ``(B, N, d)``): an eager loop over pieces of many lengths would otherwise
#: keep one compiled program per length without bound. The least recently used is
#: dropped (with its compiled program and JAX's traces of it) and recompiled if it
#: returns.
STREAM_CACHE_SIZE = 32

_COMPILED: collections.OrderedDict = collections.OrderedDict()


def _compiled(static: _Static, shape: tuple[int, ...], dtype: str) -> Callable[..., Any]:
    """The jitted :func:`_call` for one config and input shape, from a bounded LRU
    (:data:`STREAM_CACHE_SIZE`)."""
    key = (static, shape, dtype)
    function = _COMPILED.get(key)
    if function is not None:
        _COMPILED.move_to_end(key)
        return function
    function = _COMPILED[key] = jax.jit(functools.partial(_call, static))
    while len(_COMPILED) > STREAM_CACHE_SIZE:
        _COMPILED.popitem(last=False)[1].clear_cache()
    return function
