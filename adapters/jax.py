"""JAX adapter: tmcore's hand-written VJPs as ``jax.custom_vjp``, a pure layer, a Flax module.

Three levels, each a thin layer over the one below:

1. **Primitives** -- :func:`trilinear_sample`, :func:`gaussian_splat` and
   :func:`memory_scan` are ``jax.custom_vjp`` functions whose forward and
   backward are tmcore's own (``tmcore.*`` and ``tmcore.*_vjp``; the scan runs
   ``tmcore.scan.step_fwd`` under ``lax.scan`` and its backward runs
   ``tmcore.scan.step_bwd`` under a reverse ``lax.scan``, keeping only the
   per-step input states). They are defined once, at import; static settings
   (grid shape, ``eps``, ``radius``) travel as ``nondiff_argnums``. They work
   under ``jit``, ``vmap`` and ``grad``. Second order: reverse-over-reverse
   (``grad(grad(f))``) works, JAX differentiating the backward rules;
   forward mode (``jvp``, ``jacfwd``, ``hessian``) is not available for
   ``custom_vjp`` functions.
2. **Pure layer** -- :func:`init` / :func:`apply` over a nested-dict parameter
   pytree whose keys and layouts equal the PyTorch adapter's state dict
   (``weight`` is ``(out, in)``), the gated residual :func:`residual_init` /
   :func:`residual_apply`, the multi-layer :func:`stack_apply` (modes
   ``"threaded"`` and ``"causal"``), streaming (state in, state out,
   :func:`detach_state`, a per-sequence ``reset`` mask), and
   :func:`params_from_state_dict` / :func:`state_dict_from_params`.
3. **Flax NNX** -- :class:`TensorMemory` and :class:`GatedMemoryResidual`
   hold the same pytree as ``nnx.Param`` leaves; :func:`params_from_module` /
   :func:`load_params` convert.

Layer math per chunk ``t`` of ``L = chunk_size`` tokens (DESIGN.md): read
coordinate ``tanh(coord_net(first token))``; ``summary = write_proj(concat of
the chunk's tokens, position-major)``; write coordinate ``tanh(coord_net(summary))``
(the coordinate head is tied); ``content = content_net(summary)``; ``sigma =
(softplus(sigma_net(summary)) + 1e-4) * sigma_scale``; the read of chunk ``t``
sees the state before chunk ``t``'s write; ``out_proj(read_t)`` is broadcast to
every token of chunk ``t``; a ragged last chunk is zero-padded on the right
and the output trimmed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import tmcore
from tmcore._validate import (
    check_eps,
    check_finite,
    check_grid_shape,
    check_int,
    check_positive_scalar,
    check_radius,
    check_values,
    validation_enabled,
)
from tmcore.conv import ConvParams
from tmcore.sampling import _validate as sample_validate
from tmcore.scan import StepInputs, validate_scan_inputs
from tmcore.splat import DEFAULT_EPS
from tmcore.splat import _validate as splat_validate

from . import _jax_scan as _scan_mod
from ._jax_scan import forward_mode_guard

__all__ = [
    "MODES",
    "MemoryState",
    "GatedMemoryResidual",
    "TensorMemory",
    "apply",
    "conv_params",
    "detach_state",
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

#: Multi-layer modes of :func:`stack_apply`.
MODES = ("threaded", "causal")

#: Parameter names of one memory layer, ``(group, leaf)``, torch state-dict order.
LAYER_KEYS = (
    ("write_proj", "weight"), ("write_proj", "bias"),
    ("content_net", "weight"), ("content_net", "bias"),
    ("sigma_net", "weight"), ("sigma_net", "bias"),
    ("coord_net", "weight"), ("coord_net", "bias"),
    ("cell", "depthwise_weight"), ("cell", "depthwise_bias"),
    ("cell", "pointwise_weight"), ("cell", "pointwise_bias"),
    ("out_proj", "weight"), ("out_proj", "bias"),
)

_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default

#: State-dict key (last part) under which the PyTorch adapter stores the grid shape.
EXTRA_STATE = "_extra_state"


# --------------------------------------------------------------------------- argument checks
# Static checks only (Python values, shapes and dtypes), so they also hold under ``jit``.


def _check_sigma_scale(sigma_scale: Any) -> float:
    check_positive_scalar("sigma_scale", sigma_scale)
    return float(sigma_scale)


def _concrete(value: Any) -> np.ndarray | None:
    """``value`` as a NumPy array, or ``None`` when it is not concrete (a tracer)."""
    try:
        return np.asarray(value)
    except Exception:  # a tracer under jit / vmap / grad
        return None


def _stored_grid_error(value: Any, memory_shape: tuple[int, ...], where: str) -> str | None:
    """Why a stored grid shape (the PyTorch adapter's ``_extra_state``) does not match."""
    saved = _concrete(value)
    if saved is None:
        return None
    if saved.ndim != 1 or not np.issubdtype(saved.dtype, np.integer):
        return f"memory_shape: {where} should hold the grid shape (1-D ints), got {saved!r}"
    if tuple(int(s) for s in saved) != tuple(memory_shape):
        return (f"memory_shape: {tuple(memory_shape)} disagrees with the grid "
                f"{tuple(int(s) for s in saved)} stored in {where}")
    return None


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

    Arguments are checked like :func:`tmcore.trilinear_sample` (validate mode
    included, for concrete arrays).
    """
    volume, coords = jnp.asarray(volume), jnp.asarray(coords)
    sample_validate(volume, coords)
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

    ``shape``, ``eps`` and ``radius`` are static (Python values, not traced).
    Arguments are checked like :func:`tmcore.gaussian_splat` (in validate mode
    also finite values and ``sigma > 0``, for concrete arrays).
    """
    content, mu, sigma = map(jnp.asarray, (content, mu, sigma))
    _, dims = splat_validate(content, mu, sigma, shape, radius=radius, eps=eps)
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
    ``tmcore.scan.step_bwd``; the gradients do not depend on ``k``. ``params``
    is a :class:`tmcore.ConvParams` (``C_in = 2C``, ``C_out = 4C``). Mixed
    floating dtypes are promoted to a common one (JAX's rules).
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
    static = _scan_mod.ScanStatic(_scan_mod.identity_prepare, _scan_mod.identity_finish,
                                  float(eps), _static_radius(radius), int(checkpoint_every),
                                  _scan_mod.options_key())
    xs = StepInputs(*map(_time_major, (read_coords, write_coords, write_sigma, write_content)))
    reads, h, c = forward_mode_guard(
        "memory_scan", lambda: _scan_mod.checkpoint_scan(static, (), params, xs, h0, c0))
    return _batch_major(reads), h, c


# --------------------------------------------------------------------------- pure layer


class MemoryState(NamedTuple):
    """The recurrent state ``(h, c)``, each ``(B, C, *S)`` (a pytree)."""

    h: jax.Array
    c: jax.Array


def init_state(batch: int, memory_channels: int, memory_shape: Sequence[int],
               dtype: Any = jnp.float32) -> MemoryState:
    """Zero state ``(h, c)`` of shape ``(batch, memory_channels, *memory_shape)``."""
    shape = (int(batch), int(memory_channels), *(int(s) for s in memory_shape))
    return MemoryState(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def detach_state(state: Any) -> Any:
    """``lax.stop_gradient`` on every leaf: cut backprop between streamed segments."""
    return jax.tree.map(lax.stop_gradient, state)


def _linear_init(key: jax.Array, out_features: int, in_features: int, dtype: Any) -> dict:
    """``torch.nn.Linear``'s default: weight and bias uniform in ``+-1/sqrt(in_features)``."""
    bound = 1.0 / math.sqrt(in_features)
    k_w, k_b = jax.random.split(key)
    return {
        "weight": jax.random.uniform(k_w, (out_features, in_features), dtype, -bound, bound),
        "bias": jax.random.uniform(k_b, (out_features,), dtype, -bound, bound),
    }


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
) -> dict:
    """Parameters of one Tensor Memory layer, initialized like the PyTorch adapter.

    Linear layers as ``torch.nn.Linear`` (uniform ``+-1/sqrt(fan_in)``),
    ``sigma_net.bias = 1.0``; the cell's depthwise taps identity, its
    pointwise matrix Xavier-uniform, its biases zero except the forget-gate
    quarter of the pointwise bias, ``forget_bias`` (as the PyTorch
    ``TensorMemory(forget_bias=...)``).

    Parameters
    ----------
    key : a ``jax.random`` key.
    embed_dim : token width ``d``.
    memory_channels : grid channels ``C``.
    memory_shape : grid shape ``S`` (1 to 4 positive ints; ``n = len(S)``).
    chunk_size : tokens per chunk ``L``.
    sigma_scale : not a parameter; accepted for signature parity with the
        PyTorch constructor and checked (> 0). Pass it to :func:`apply`.
    forget_bias : initial bias of the ConvLSTM forget gate (default 0; e.g. 3
        starts the memory keeping 95 % of its state per chunk).
    dtype : parameter dtype.

    Sizes must be ints (a float is a ``TypeError``, never truncated); a size
    < 1 is a ``ValueError``.

    Returns
    -------
    ``{"write_proj": {"weight" (d, L*d), "bias" (d,)}, "content_net": {(C, d), (C,)},
    "sigma_net": {(1, d), (1,)}, "coord_net": {(n, d), (n,)}, "cell":
    {"depthwise_weight" (n, 2C, 3), "depthwise_bias" (n, 2C), "pointwise_weight"
    (4C, 2C), "pointwise_bias" (4C,)}, "out_proj": {(d, C), (d,)}}``.
    """
    d = check_int("embed_dim", embed_dim, 1)
    channels = check_int("memory_channels", memory_channels, 1)
    length = check_int("chunk_size", chunk_size, 1)
    dims = check_grid_shape("memory_shape", memory_shape)
    _check_sigma_scale(sigma_scale)
    forget_bias = check_finite("forget_bias", forget_bias)
    n = len(dims)
    keys = jax.random.split(key, 6)
    bound = tmcore.xavier_uniform_bound(2 * channels, 4 * channels)
    pointwise = jax.random.uniform(keys[4], (4 * channels, 2 * channels), dtype, -bound, bound)
    sigma_net = _linear_init(keys[2], 1, d, dtype)
    sigma_net["bias"] = jnp.ones((1,), dtype)
    return {
        "write_proj": _linear_init(keys[0], d, length * d, dtype),
        "content_net": _linear_init(keys[1], channels, d, dtype),
        "sigma_net": sigma_net,
        "coord_net": _linear_init(keys[3], n, d, dtype),
        "cell": _with_forget_bias(_cell_init(pointwise, n), channels, forget_bias),
        "out_proj": _linear_init(keys[5], d, channels, dtype),
    }


def _cell_init(pointwise: jax.Array, n: int) -> dict:
    """:func:`tmcore.conv_params_from_pointwise` as JAX arrays without a device.

    The generic function places its leaves on the pointwise matrix's device,
    which commits them to that device; uncommitted leaves (made by ``jnp``
    without ``device=``) let ``jit`` place them with the batch-sharded inputs.
    """
    plan = tmcore.conv_params_from_pointwise(np.zeros(pointwise.shape, pointwise.dtype), n)
    return {**{name: jnp.asarray(value) for name, value in plan._asdict().items()},
            "pointwise_weight": pointwise}


def _with_forget_bias(cell: dict, channels: int, forget_bias: float) -> dict:
    bias = cell["pointwise_bias"]
    return {**cell, "pointwise_bias": bias.at[channels : 2 * channels].set(forget_bias)}


def conv_params(cell: Mapping[str, jax.Array]) -> ConvParams:
    """The ``"cell"`` group of a parameter pytree as :class:`tmcore.ConvParams`."""
    return ConvParams(**{field: cell[field] for field in ConvParams._fields})


def _linear(p: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    """``torch.nn.functional.linear``: ``x @ weight.T + bias``."""
    return x @ p["weight"].T + p["bias"]


class _LayerShape(NamedTuple):
    d: int  # embed_dim, from out_proj.weight (d, C)
    length: int  # chunk_size L, from write_proj.weight (d, L*d)
    channels: int  # C, from out_proj.weight (d, C)
    n: int  # spatial axes, from coord_net.weight (n, d)


def _check_params(params: Mapping[str, Any]) -> _LayerShape:
    """Every parameter present and shaped consistently; ``KeyError`` / ``ValueError``
    naming the leaf. Returns the sizes the parameters fix."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a nested dict from init or params_from_state_dict, "
                        f"got {type(params).__name__}")
    for group, leaf in LAYER_KEYS:
        if not isinstance(params.get(group), Mapping) or leaf not in params[group]:
            raise KeyError(f"params: missing {group}.{leaf} (expected a pytree from init or "
                           f"params_from_state_dict)")

    def shape(group: str, leaf: str) -> tuple[int, ...]:
        return tuple(jnp.shape(params[group][leaf]))

    for group, leaf, rank in (("out_proj", "weight", 2), ("write_proj", "weight", 2),
                              ("coord_net", "weight", 2)):
        if len(shape(group, leaf)) != rank:
            raise ValueError(f"params.{group}.{leaf}: expected a matrix (out, in), "
                             f"got shape {shape(group, leaf)}")
    d, channels = shape("out_proj", "weight")
    n = shape("coord_net", "weight")[0]
    in_features = shape("write_proj", "weight")[1]
    length = in_features // d if d else 0
    if d < 1 or channels < 1 or length < 1 or length * d != in_features:
        raise ValueError(f"params.write_proj.weight: expected shape (d, L*d) with d = {d} "
                         f"(from out_proj.weight), got {shape('write_proj', 'weight')}")
    if not 1 <= n <= 4:
        raise ValueError(f"params.coord_net.weight: expected shape (n, d) with n = 1 to 4 "
                         f"spatial axes, got {shape('coord_net', 'weight')}")
    expected = {
        ("write_proj", "weight"): ((d, length * d), "(d, L*d)"),
        ("write_proj", "bias"): ((d,), "(d,)"),
        ("content_net", "weight"): ((channels, d), "(C, d)"),
        ("content_net", "bias"): ((channels,), "(C,)"),
        ("sigma_net", "weight"): ((1, d), "(1, d)"),
        ("sigma_net", "bias"): ((1,), "(1,)"),
        ("coord_net", "weight"): ((n, d), "(n, d)"),
        ("coord_net", "bias"): ((n,), "(n,)"),
        ("cell", "depthwise_weight"): ((n, 2 * channels, 3), "(n, 2C, 3)"),
        ("cell", "depthwise_bias"): ((n, 2 * channels), "(n, 2C)"),
        ("cell", "pointwise_weight"): ((4 * channels, 2 * channels), "(4C, 2C)"),
        ("cell", "pointwise_bias"): ((4 * channels,), "(4C,)"),
        ("out_proj", "weight"): ((d, channels), "(d, C)"),
        ("out_proj", "bias"): ((d,), "(d,)"),
    }
    for (group, leaf), (want, layout) in expected.items():
        if shape(group, leaf) != want:
            raise ValueError(f"params.{group}.{leaf}: expected shape {layout} = {want} "
                             f"(d = {d}, C = {channels} from out_proj.weight, n = {n} from "
                             f"coord_net.weight, L = {length}), got {shape(group, leaf)}")
    return _LayerShape(d, length, channels, n)


def _layer_config(params: Mapping[str, Any], x: jax.Array, chunk_size: int | None) -> _LayerShape:
    config = _check_params(params)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x: expected an array of shape (B, N, d), got {type(x).__name__}")
    if x.ndim != 3:
        raise ValueError(f"x: expected shape (B, N, d) (3 dims), got {tuple(x.shape)}")
    d = config.d
    if x.shape[-1] != d:
        raise ValueError(f"x: expected shape (B, N, d) with d = {d} (from out_proj.weight), "
                         f"got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x: expected a floating dtype, got {x.dtype}")
    if x.shape[1] < 1:
        raise ValueError(f"x: expected at least one token, got shape {tuple(x.shape)}")
    if chunk_size is not None and check_int("chunk_size", chunk_size, 1) != config.length:
        raise ValueError(f"chunk_size: {chunk_size} disagrees with write_proj.weight "
                         f"{tuple(jnp.shape(params['write_proj']['weight']))} "
                         f"(L = {config.length})")
    return config


def _zero_state_like(x: jax.Array, channels: int, memory_shape: tuple[int, ...]) -> MemoryState:
    """A zero state ``(B, C, *S)`` derived from ``x (B, N, d)``: it inherits ``x``'s batch
    sharding (explicit meshes) and varying axes (``shard_map``), which a fresh
    ``jnp.zeros`` would not have."""
    zero = jnp.zeros_like(x[:, 0, 0])  # (B,), sharded and varying like x's batch
    shape = (x.shape[0], channels, *memory_shape)
    zeros = jnp.broadcast_to(jnp.reshape(zero, (x.shape[0],) + (1,) * (len(shape) - 1)), shape)
    return MemoryState(zeros, zeros)


def _start_state(params, config: _LayerShape, x, state, memory_shape, reset) -> MemoryState:
    channels, n = config.channels, config.n
    if memory_shape is not None:
        memory_shape = check_grid_shape("memory_shape", memory_shape)
        if len(memory_shape) != n:
            raise ValueError(f"memory_shape: expected n = {n} axes (from coord_net.weight), "
                             f"got {memory_shape}")
    if state is None:
        if memory_shape is None:
            raise ValueError("memory_shape: required when no state is given (it cannot be "
                             "inferred from params)")
        state = _zero_state_like(x, channels, memory_shape)
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise ValueError(f"state: expected a pair (h, c) or None, got {type(state).__name__}")
    state = MemoryState(*state)
    for name, value in (("state.h", state.h), ("state.c", state.c)):
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{name}: expected an array of shape (B, C, *S), "
                            f"got {type(value).__name__}")
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(f"{name}: expected a floating dtype, got {value.dtype}")
    expected = (x.shape[0], channels)
    if tuple(state.h.shape[:2]) != expected or state.h.ndim != n + 2:
        raise ValueError(f"state.h: expected shape (B, C, *S) with B, C = {expected} and "
                         f"n = {n} spatial axes, got {tuple(state.h.shape)}")
    if tuple(state.c.shape) != tuple(state.h.shape):
        raise ValueError(f"state.c: expected the shape of state.h {tuple(state.h.shape)}, "
                         f"got {tuple(state.c.shape)}")
    grid = tuple(state.h.shape[2:])
    if min(grid) < 1:
        raise ValueError(f"state.h: expected shape (B, C, *S) with no zero-size axis, "
                         f"got {tuple(state.h.shape)}")
    if memory_shape is not None and grid != memory_shape:
        raise ValueError(f"memory_shape: {memory_shape} disagrees with the state's {grid}")
    if EXTRA_STATE in params:
        error = _stored_grid_error(params[EXTRA_STATE], grid, f"params[{EXTRA_STATE!r}]")
        if error is not None:
            raise ValueError(error)
    if reset is not None:
        state = reset_state(state, reset)
    return state


def reset_state(state: Any, reset: jax.Array) -> Any:
    """Zero the state of the sequences where ``reset (B,)`` is true (document boundaries)."""
    reset = jnp.asarray(reset, bool)

    def zero(leaf):
        if reset.shape != leaf.shape[:1]:
            raise ValueError(f"reset: expected shape (B,) = {leaf.shape[:1]}, "
                             f"got {reset.shape}")
        mask = jnp.reshape(reset, reset.shape + (1,) * (leaf.ndim - 1))
        return jnp.where(mask, jnp.zeros_like(leaf), leaf)

    return jax.tree.map(zero, state)


_HEADS = ("write_proj", "content_net", "sigma_net", "coord_net", "out_proj")


class _Heads(NamedTuple):
    """``prepare`` of the layer's scan: one chunk ``[B, L, d]`` -> its :class:`StepInputs`
    through the linear heads (hashable by value: it keys the compiled scan)."""

    sigma_scale: float

    def __call__(self, heads: Mapping[str, Any], chunk: jax.Array) -> StepInputs:
        batch, length, d = chunk.shape
        summary = _linear(heads["write_proj"], jnp.reshape(chunk, (batch, length * d)))
        return StepInputs(
            read_coords=tmcore.squash_coords(_linear(heads["coord_net"], chunk[:, 0, :])),
            write_coords=tmcore.squash_coords(_linear(heads["coord_net"], summary)),
            write_sigma=tmcore.sigma_from_logit(_linear(heads["sigma_net"], summary)[:, 0],
                                                self.sigma_scale),
            write_content=_linear(heads["content_net"], summary),
        )


def _out_proj(heads: Mapping[str, Any], read: jax.Array) -> jax.Array:
    """``finish`` of the layer's scan: ``out_proj(read (B, C)) -> (B, d)``."""
    return _linear(heads["out_proj"], read)


_HEADS = ("write_proj", "content_net", "sigma_net", "coord_net", "out_proj")


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
) -> tuple[jax.Array, MemoryState]:  # out [B, N, d], state
    """Run one Tensor Memory layer over ``x``; returns ``(out, state)``.

    Parameters
    ----------
    params : pytree from :func:`init` or :func:`params_from_state_dict`.
    x : ``(B, N, d)`` tokens; ``N`` need not be a multiple of the chunk size.
    state : ``(h, c)`` from a previous call (streaming), or ``None`` for zeros.
    chunk_size : checked against ``write_proj.weight (d, L*d)``, which fixes it.
    memory_shape : grid shape; needed when ``state`` is ``None``.
    sigma_scale : multiplies the write spread.
    reset : optional ``(B,)`` bool; those sequences start from the zero state.
    eps, radius : as in :func:`tmcore.gaussian_splat`.
    checkpoint_every : the backward keeps the state entering every k-th chunk
        (``ceil(T / k)`` states) and recomputes the rest: memory ``O(T/k + k)``
        states for one extra forward pass; results do not depend on ``k``.

    Every argument is checked statically (shapes, dtypes, Python scalars; fine
    under ``jit``): a missing parameter is a ``KeyError``, a misshapen one, a
    bad ``memory_shape`` / ``eps`` / ``radius`` / ``sigma_scale`` or state a
    ``ValueError``, a non-floating ``x`` a ``TypeError``, each naming the
    argument. An ``_extra_state`` entry (the grid shape a PyTorch checkpoint
    stores) must match the grid when it is concrete. In validate mode
    (:func:`tmcore.options`) concrete ``x`` and state must also be finite.

    Mixed precision: the layer computes in JAX's promotion of ``x``, the
    parameters and the state (float32 parameters with a bfloat16 ``x``:
    float32); the output and the returned state have that dtype.

    Returns
    -------
    ``out (B, N, d)`` -- ``out_proj(read_t)`` on every token of chunk ``t`` --
    and the final :class:`MemoryState`. Pass the state to the next call to
    stream a long sequence; wrap it in :func:`detach_state` to truncate
    backprop. Pieces whose lengths are multiples of the chunk size give the
    same result as one call.
    """
    config = _layer_config(params, x, chunk_size)
    state = _start_state(params, config, x, state, memory_shape, reset)
    static = _scan_mod.ScanStatic(_Heads(_check_sigma_scale(sigma_scale)), _out_proj,
                                  check_eps(eps), check_radius(radius),
                                  check_int("checkpoint_every", checkpoint_every, 1),
                                  _scan_mod.options_key())
    dtype = _compute_dtype(params, x, state)
    x = x.astype(dtype)
    state = MemoryState(state.h.astype(dtype), state.c.astype(dtype))
    _check_values_eagerly({"x": x, "state.h": state.h, "state.c": state.c})
    length = config.length
    batch, tokens, d = x.shape
    if batch == 0:  # nothing to scan; shapes as for any other batch
        return jnp.zeros((0, tokens, d), dtype), state
    steps = -(-tokens // length)
    padded = jnp.pad(x, ((0, 0), (0, steps * length - tokens), (0, 0)))
    chunks = jnp.moveaxis(jnp.reshape(padded, (batch, steps, length, d)), 1, 0)  # [T, B, L, d]
    heads = {name: jax.tree.map(lambda a: a.astype(dtype), dict(params[name]))
             for name in _HEADS}
    cell = ConvParams(*(a.astype(dtype) for a in conv_params(params["cell"])))
    per_chunk, h, c = forward_mode_guard("apply", lambda: _scan_mod.checkpoint_scan(
        static, heads, cell, chunks, state.h, state.c))  # per_chunk [T, B, d]
    out = jnp.broadcast_to(per_chunk[:, :, None, :], (steps, batch, length, d))
    out = jnp.reshape(jnp.moveaxis(out, 0, 1), (batch, steps * length, d))
    return out[:, :tokens, :], MemoryState(h, c)


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
) -> dict:
    """Parameters of ``x + sigmoid(gate) * memory(norm(x))``.

    ``{"norm": {"weight" (d,), "bias" (d,)}, "memory": init(...), "gate" ()}``;
    ``norm`` is a LayerNorm (ones, zeros, eps 1e-5 as in torch); ``gate_init``
    0.0 (half open) and -2.0 (mostly closed) are the paper's two choices.
    """
    d = int(embed_dim)
    return {
        "norm": {"weight": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)},
        "memory": init(key, embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale,
                       forget_bias=forget_bias, dtype=dtype),
        "gate": jnp.asarray(gate_init, dtype),
    }


def _layer_norm(p: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + _LAYER_NORM_EPS) * p["weight"] + p["bias"]


def residual_apply(
    params: Mapping[str, Any], x: jax.Array, state: Any = None, **kwargs: Any
) -> tuple[jax.Array, MemoryState]:
    """``x + sigmoid(gate) * apply(memory, layer_norm(x), state)``; returns ``(out, state)``.

    ``kwargs`` are :func:`apply`'s keywords (``memory_shape``, ``sigma_scale``,
    ``reset``, ...).
    """
    out, state = apply(params["memory"], _layer_norm(params["norm"], x), state, **kwargs)
    return x + jax.nn.sigmoid(params["gate"]) * out, state


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

    Modes
    -----
    ``"threaded"`` (the paper's): one state threaded through the layers --
        layer ``l`` starts from the state layer ``l - 1`` reached after the
        WHOLE segment, so every position sees later tokens of the segment. Not
        causal; right for bidirectional inputs (images, clip classification).
        ``state`` is one :class:`MemoryState`.
    ``"causal"``: every layer scans from its own state at the start of the
        segment, so a read at chunk ``t`` depends only on earlier chunks and
        chunk ``t``'s first token. Right for language modelling. ``state`` is
        a tuple of per-layer states (a single state is used for every layer),
        and a tuple is returned, so streaming is exact.

    ``reset`` zeroes the incoming state of the flagged sequences (every layer's).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if blocks is not None and len(blocks) != len(layers):
        raise ValueError(f"blocks: expected {len(layers)} callables (one per layer), "
                         f"got {len(blocks)}")
    if state is not None and reset is not None:
        state = reset_state(state, reset)
    if mode == "threaded":
        if state is not None:
            state = MemoryState(*state)
        for index, layer in enumerate(layers):
            x = x if blocks is None else blocks[index](x)
            x, state = residual_apply(layer, x, state, **kwargs)
        return x, state
    if state is None or hasattr(state[0], "shape"):  # one (h, c) for every layer
        states = [state] * len(layers)
    else:
        states = list(state)
        if len(states) != len(layers):
            raise ValueError(f"state: expected {len(layers)} per-layer states in causal mode, "
                             f"got {len(states)}")
    finals = []
    for index, layer in enumerate(layers):
        x = x if blocks is None else blocks[index](x)
        x, final = residual_apply(layer, x, states[index], **kwargs)
        finals.append(final)
    return x, tuple(finals)


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


def params_from_state_dict(
    sd: Mapping[str, Any], prefix: str | None = None, *, dtype: Any = None
) -> dict:
    """Parameter pytree from a (PyTorch adapter) state dict of NumPy arrays.

    Dotted names become nested dicts: ``"write_proj.weight"`` ->
    ``params["write_proj"]["weight"]``, ``"memory.cell.pointwise_bias"`` ->
    ``params["memory"]["cell"]["pointwise_bias"]``. Only keys starting with
    ``prefix`` are taken, with it removed; ``prefix=None`` infers it from the
    single key ending in ``write_proj.weight`` (a memory layer, or a gated
    residual whose memory is ``memory``). Layouts are unchanged (torch's).
    Arrays become ``jnp`` arrays of their own dtype (float64 needs x64
    enabled) or of ``dtype``. An ``_extra_state`` entry (the grid shape the
    PyTorch adapter stores) is kept as an int array; :func:`apply` checks it
    against the grid, :func:`state_dict_from_params` writes it back.
    """
    keys = [str(k) for k in sd]
    prefix = _find_prefix(keys) if prefix is None else prefix
    params: dict = {}
    for key in keys:
        if not key.startswith(prefix):
            continue
        node = params
        *path, leaf = key[len(prefix):].split(".")
        for part in path:
            node = node.setdefault(part, {})
        value = np.asarray(sd[key])
        if leaf == EXTRA_STATE:  # the grid shape a PyTorch checkpoint stores: kept as ints
            node[leaf] = jnp.asarray(value)
        else:
            node[leaf] = jnp.asarray(value, dtype=dtype if dtype is not None else value.dtype)
    if not params:
        raise ValueError(f"sd: no key starts with prefix {prefix!r}")
    layer = params.get("memory", params)
    for group, leaf in LAYER_KEYS:
        if group not in layer or leaf not in layer[group]:
            raise KeyError(f"sd: missing {prefix}{'memory.' if layer is not params else ''}"
                           f"{group}.{leaf}")
    return params


def state_dict_from_params(params: Mapping[str, Any], prefix: str = "") -> dict:
    """Inverse of :func:`params_from_state_dict`: flat ``{dotted name: np.ndarray}``."""
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
    """The pure parameter pytree of a :class:`TensorMemory` or :class:`GatedMemoryResidual`."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _without_extra_state(module: Any, params: Mapping[str, Any], path: str) -> dict:
    """``params`` less its ``_extra_state`` entries, each checked (when concrete) against
    the ``memory_shape`` of the submodule at its place."""
    out = {}
    for key, value in params.items():
        if key == EXTRA_STATE:
            grid = getattr(module, "memory_shape", None)
            error = None if grid is None else _stored_grid_error(value, grid, f"{path}{key}")
            if error is not None:
                raise ValueError(error)
        elif isinstance(value, Mapping):
            out[key] = _without_extra_state(getattr(module, str(key), None), value,
                                            f"{path}{key}.")
        else:
            out[key] = value
    return out


def _shape_mismatches(expected: Mapping[str, Any], given: Any, path: str) -> list[str]:
    """Every leaf of ``given`` missing, unknown, or of another shape than in ``expected``."""
    if not isinstance(given, Mapping):
        return [f"{path[:-1]}: expected a dict of parameters, got {type(given).__name__}"]
    problems = [f"{path}{k}: missing" for k in expected if k not in given]
    problems += [f"{path}{k}: unknown to this module" for k in given if k not in expected]
    for key, want in expected.items():
        if key not in given:
            continue
        got = given[key]
        if isinstance(want, Mapping):
            problems += _shape_mismatches(want, got, f"{path}{key}.")
        elif isinstance(got, Mapping):
            problems.append(f"{path}{key}: expected an array of shape "
                            f"{tuple(jnp.shape(want))}, got a dict")
        elif tuple(jnp.shape(got)) != tuple(jnp.shape(want)):
            problems.append(f"{path}{key}: expected shape {tuple(jnp.shape(want))}, "
                            f"got {tuple(jnp.shape(got))}")
    return problems


def load_params(module: nnx.Module, params: Mapping[str, Any]) -> None:
    """Overwrite ``module``'s parameters in place with a pure pytree of the same structure.

    Raises ``ValueError`` naming the leaf when ``params`` misses one of the
    module's parameters, has one it does not, or has one of another shape (then
    nothing is changed). ``_extra_state`` entries (the grid shape of a PyTorch
    checkpoint, see :func:`params_from_state_dict`) are checked against the
    module's ``memory_shape`` and not loaded.
    """
    state = nnx.state(module, nnx.Param)
    params = _without_extra_state(module, params, "")
    problems = _shape_mismatches(nnx.to_pure_dict(state), params, "")
    if problems:
        raise ValueError("params: not a pytree of this module's parameters (nothing loaded): "
                         + "; ".join(problems))
    nnx.replace_by_pure_dict(state, params)
    nnx.update(module, state)


class TensorMemory(nnx.Module):
    """Flax NNX Tensor Memory layer; ``__call__(x, state=None, *, reset=None) -> (out, state)``.

    Its ``nnx.Param`` leaves carry the names of :func:`init`'s pytree
    (``module.write_proj["weight"]``, ``module.cell["pointwise_weight"]``, ...);
    :func:`params_from_module` and :func:`load_params` convert.
    """

    def __init__(self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
                 chunk_size: int, sigma_scale: float = 1.0, *, rngs: nnx.Rngs,
                 dtype: Any = jnp.float32, eps: float = DEFAULT_EPS,
                 radius: float | None = None, forget_bias: float = 0.0,
                 checkpoint_every: int = 1) -> None:
        params = init(rngs.params(), embed_dim, memory_channels, memory_shape, chunk_size,
                      sigma_scale, forget_bias=forget_bias, dtype=dtype)
        for name, group in params.items():
            setattr(self, name, _to_variables(group))
        self.memory_channels = int(memory_channels)
        self.memory_shape = tuple(int(s) for s in memory_shape)
        self.chunk_size = int(chunk_size)
        self.sigma_scale = float(sigma_scale)
        self.eps = float(eps)
        self.radius = _static_radius(radius)
        self.checkpoint_every = check_int("checkpoint_every", checkpoint_every, 1)

    def init_state(self, batch: int, dtype: Any = jnp.float32) -> MemoryState:
        return init_state(batch, self.memory_channels, self.memory_shape, dtype)

    def __call__(self, x: jax.Array, state: Any = None, *,
                 reset: jax.Array | None = None) -> tuple[jax.Array, MemoryState]:
        return apply(params_from_module(self), x, state, chunk_size=self.chunk_size,
                     memory_shape=self.memory_shape, sigma_scale=self.sigma_scale,
                     reset=reset, eps=self.eps, radius=self.radius,
                     checkpoint_every=self.checkpoint_every)


class GatedMemoryResidual(nnx.Module):
    """Flax NNX ``x + sigmoid(gate) * memory(norm(x))`` (:func:`residual_apply`)."""

    def __init__(self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
                 chunk_size: int, sigma_scale: float = 1.0, *, gate_init: float = 0.0,
                 rngs: nnx.Rngs, dtype: Any = jnp.float32, eps: float = DEFAULT_EPS,
                 radius: float | None = None, forget_bias: float = 0.0,
                 checkpoint_every: int = 1) -> None:
        self.memory = TensorMemory(embed_dim, memory_channels, memory_shape, chunk_size,
                                   sigma_scale, rngs=rngs, dtype=dtype, eps=eps, radius=radius,
                                   forget_bias=forget_bias, checkpoint_every=checkpoint_every)
        self.norm = _to_variables({"weight": jnp.ones((embed_dim,), dtype),
                                   "bias": jnp.zeros((embed_dim,), dtype)})
        self.gate = nnx.Param(jnp.asarray(gate_init, dtype))

    def __call__(self, x: jax.Array, state: Any = None, *,
                 reset: jax.Array | None = None) -> tuple[jax.Array, MemoryState]:
        m = self.memory
        return residual_apply(params_from_module(self), x, state, chunk_size=m.chunk_size,
                              memory_shape=m.memory_shape, sigma_scale=m.sigma_scale,
                              reset=reset, eps=m.eps, radius=m.radius,
                              checkpoint_every=m.checkpoint_every)
