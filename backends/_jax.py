"""JAX fast paths: ``lax.conv_general_dilated`` for the depthwise taps (on accelerators),
fused C kernels through the XLA FFI (on the CPU).

:data:`CONV_KERNEL` ``"auto"`` uses the grouped conv when JAX's default
backend is not the CPU: XLA:CPU expands grouped convs and measured about 300x
slower there than the generic shifts.

On the CPU (default backend ``cpu``, float32 / float64) the depthwise passes
and the LSTM gates, forward and VJP, are the C kernels of the torch backend
(:mod:`tmcore.backends._native`), called as XLA custom calls
(``jax.ffi.ffi_call``, ``vmap_method="sequential"``); the pointwise product
stays a ``jnp.matmul``. The depthwise passes and the gates are
``jax.custom_vjp`` functions whose backward is the fused VJP, itself a
``custom_vjp`` differentiated through the generic math: ``jax.grad`` through
tmcore's public functions works to any order (reverse mode; forward mode,
``jax.jvp``, needs :data:`USE_NATIVE` off or ``TMCORE_NATIVE=0``). Measured at
the LM config: depthwise passes 1.0 -> 0.13 ms, a training step ~1.6x faster.

Imported only when JAX arrays reach tmcore. Everything is traceable under
``jax.jit`` (shapes and dtypes are the only Python-level branches; no host
syncs) and works with ``jax_enable_x64`` on or off. Each depthwise pass of
``x (B, C, *S)`` along axis ``a`` is one grouped 3-D conv
(``feature_group_count = C``) over the free reshape ``(B, C, pre, S_a, post)``;
its VJP is the same conv with flipped taps for the input and sliced products
for the taps (no conv weight-gradient kernel, deterministic). Convs run at
``Precision.HIGHEST`` so float32 matches the generic path on GPUs (no TF32).
float16 / bfloat16 inputs compute in float32 and return the input dtype.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tmcore._dispatch import Ops
from tmcore.cell import gates_fwd as generic_gates_fwd
from tmcore.conv import ConvParams, depthwise_axis

from . import _native
from ._mixed import with_float32_compute

__all__ = ["make_ops", "CONV_KERNEL", "USE_NATIVE"]

#: Use the fused C kernels (XLA FFI) on the CPU when they can be built.
USE_NATIVE = True

_DIMS = ("NCDHW", "OIDHW", "NCDHW")

#: ``"auto"`` (grouped conv unless JAX's default backend is the CPU), ``"lax"``, ``"generic"``.
CONV_KERNEL = "auto"


def _use_lax() -> bool:
    if CONV_KERNEL == "auto":
        return jax.default_backend() != "cpu"
    return CONV_KERNEL == "lax"


def _view(x: Any, axis: int) -> tuple[int, ...]:
    shape = tuple(x.shape[2:])
    return (x.shape[0], x.shape[1], math.prod(shape[:axis]), shape[axis],
            math.prod(shape[axis + 1 :]))


def _depthwise(x: Any, taps: Any, bias: Any | None, axis: int) -> Any:
    """Depthwise 3-tap cross-correlation of ``x (B,C,*S)`` along spatial ``axis``."""
    channels = x.shape[1]
    y = lax.conv_general_dilated(
        jnp.reshape(x, _view(x, axis)), jnp.reshape(taps, (channels, 1, 1, 3, 1)),
        window_strides=(1, 1, 1), padding=((0, 0), (1, 1), (0, 0)),
        dimension_numbers=_DIMS, feature_group_count=channels,
        precision=lax.Precision.HIGHEST,
    )
    if bias is not None:
        y = y + jnp.reshape(bias, (1, channels, 1, 1, 1))
    return jnp.reshape(y, x.shape)


def conv_fwd(xp: Any, x: Any, params: ConvParams):
    """Forward; residuals are the generic stage inputs ``[x, after axis 0, ...]``."""
    stages = [x]
    for axis in range(x.ndim - 2):
        stages.append(_depthwise(stages[-1], params.depthwise_weight[axis],
                                 params.depthwise_bias[axis], axis))
    y = stages[-1]
    batch = y.shape[0]
    z = jnp.matmul(params.pointwise_weight, jnp.reshape(y, (batch, y.shape[1], -1)),
                   precision=lax.Precision.HIGHEST)
    z = z + params.pointwise_bias[:, None]
    return jnp.reshape(z, (batch, z.shape[1], *x.shape[2:])), stages


def conv_bwd(xp: Any, stages: list[Any], params: ConvParams, g: Any):
    """VJP: flipped-tap grouped conv for the input, sliced products for the taps."""
    n = len(stages) - 1
    y = stages[-1]
    batch, c_in = y.shape[:2]
    y_flat = jnp.reshape(y, (batch, c_in, -1))
    g_flat = jnp.reshape(g, (batch, g.shape[1], -1))
    hi = lax.Precision.HIGHEST
    d_pointwise = jnp.einsum("bop,bip->oi", g_flat, y_flat, precision=hi)
    d_pointwise_bias = jnp.sum(g_flat, axis=(0, 2))
    d_y = jnp.reshape(jnp.matmul(params.pointwise_weight.T, g_flat, precision=hi), y.shape)
    d_taps, d_biases = [None] * n, [None] * n
    dims = (0, 2, 3, 4)
    for axis in reversed(range(n)):
        x5 = jnp.reshape(stages[axis], _view(y, axis))
        d5 = jnp.reshape(d_y, _view(y, axis))
        d_taps[axis] = jnp.stack([
            jnp.sum(d5[:, :, :, 1:] * x5[:, :, :, :-1], axis=dims),
            jnp.sum(d5 * x5, axis=dims),
            jnp.sum(d5[:, :, :, :-1] * x5[:, :, :, 1:], axis=dims),
        ], axis=-1)
        d_biases[axis] = jnp.sum(d5, axis=dims)
        d_y = _depthwise(d_y, params.depthwise_weight[axis][:, ::-1], None, axis)
    return d_y, ConvParams(jnp.stack(d_taps), jnp.stack(d_biases), d_pointwise,
                           d_pointwise_bias)


# ----------------------------------------------------------------------------- CPU kernels


class _NativeConvResiduals(NamedTuple):
    x: Any
    y: Any  # the depthwise output


class _NativeGateResiduals(NamedTuple):
    z: Any
    c: Any


def _native_suffix(*arrays: Any) -> str | None:
    """The kernels' dtype suffix when they may run on ``arrays`` (CPU default backend,
    one float32 / float64 dtype, the library built), else ``None``."""
    if not (USE_NATIVE and _native.enabled()) or jax.default_backend() != "cpu":
        return None
    dtype = arrays[0].dtype
    suffix = {jnp.dtype("float32"): "f32", jnp.dtype("float64"): "f64"}.get(jnp.dtype(dtype))
    if suffix is None or any(a.dtype != dtype for a in arrays):
        return None
    return suffix if _native.jax_library() is not None else None


def _ffi(kernel: str, like: Any, outputs: Any, *args: Any) -> Any:
    suffix = _native_suffix(like)
    return jax.ffi.ffi_call(f"tmcore_{kernel}_{suffix}", outputs,
                            vmap_method="sequential")(*args)


def _struct(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _generic_depthwise(x: Any, taps: Any, bias: Any) -> Any:
    for axis in range(x.ndim - 2):
        x = depthwise_axis(jnp, x, taps[axis], bias[axis], axis)
    return x


def _generic_depthwise_vjp(x: Any, taps: Any, bias: Any, g: Any) -> tuple[Any, Any, Any]:
    return jax.vjp(_generic_depthwise, x, taps, bias)[1](g)


def _generic_gates(z: Any, c: Any) -> tuple[Any, Any]:
    return generic_gates_fwd(jnp, z, c)[:2]


def _generic_gates_vjp(z: Any, c: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
    return jax.vjp(_generic_gates, z, c)[1]((g_h, g_c))


def _fused(generic: Any):
    """A ``custom_vjp`` function computed by the decorated kernel call, differentiated by
    differentiating ``generic`` (the same function in jnp): the fused VJPs below stay
    differentiable (second order goes through the generic math)."""
    def wrap(kernel):
        fn = jax.custom_vjp(kernel)
        fn.defvjp(lambda *args: (kernel(*args), args),
                  lambda args, cotangent: jax.vjp(generic, *args)[1](cotangent))
        return fn
    return wrap


@_fused(_generic_depthwise_vjp)
def _native_depthwise_vjp(x: Any, taps: Any, bias: Any, g: Any) -> tuple[Any, Any, Any]:
    """``(d_x, d_taps, d_bias)`` of :func:`_native_depthwise` for the cotangent ``g``."""
    return tuple(_ffi("dw_bwd", x, (_struct(x), _struct(taps), _struct(bias)), x, g, taps,
                      bias))


@jax.custom_vjp
def _native_depthwise(x: Any, taps: Any, bias: Any) -> Any:
    """All depthwise passes of ``x (B, C, *S)``, taps ``(n, C, 3)``, bias ``(n, C)``."""
    return _ffi("dw_fwd", x, _struct(x), x, taps, bias)


_native_depthwise.defvjp(lambda x, taps, bias: (_native_depthwise(x, taps, bias), (x, taps, bias)),
                         lambda args, g: _native_depthwise_vjp(*args, g))


@_fused(_generic_gates_vjp)
def _native_gates_vjp(z: Any, c: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
    """``(d_z, d_c)`` of :func:`_native_gates` (the gates recomputed from ``z``)."""
    return tuple(_ffi("gates_bwd", c, (_struct(z), _struct(c)), z, c, g_h, g_c))


@jax.custom_vjp
def _native_gates(z: Any, c: Any) -> tuple[Any, Any]:
    """``(h', c')`` from ``z (B, 4C, *S)`` and ``c (B, C, *S)``."""
    return tuple(_ffi("gates_fwd", c, (_struct(c), _struct(c)), z, c))


_native_gates.defvjp(lambda z, c: (_native_gates(z, c), (z, c)),
                     lambda args, g: _native_gates_vjp(*args, *g))


def _pointwise(y: Any, params: ConvParams) -> Any:
    batch = y.shape[0]
    z = jnp.matmul(params.pointwise_weight, jnp.reshape(y, (batch, y.shape[1], -1)),
                   precision=lax.Precision.HIGHEST)
    z = z + params.pointwise_bias[:, None]
    return jnp.reshape(z, (batch, z.shape[1], *y.shape[2:]))


def native_conv_fwd(xp: Any, x: Any, params: ConvParams):
    """Fused depthwise passes, then the pointwise ``matmul``."""
    y = _native_depthwise(x, params.depthwise_weight, params.depthwise_bias)
    return _pointwise(y, params), _NativeConvResiduals(x, y)


def native_conv_bwd(xp: Any, residuals: _NativeConvResiduals, params: ConvParams, g: Any):
    x, y = residuals
    batch, c_in = y.shape[:2]
    y_flat = jnp.reshape(y, (batch, c_in, -1))
    g_flat = jnp.reshape(g, (batch, g.shape[1], -1))
    hi = lax.Precision.HIGHEST
    d_pointwise = jnp.einsum("bop,bip->oi", g_flat, y_flat, precision=hi)
    d_y = jnp.reshape(jnp.matmul(params.pointwise_weight.T, g_flat, precision=hi), y.shape)
    d_x, d_taps, d_biases = _native_depthwise_vjp(x, params.depthwise_weight,
                                                  params.depthwise_bias, d_y)
    return d_x, ConvParams(d_taps, d_biases, d_pointwise, jnp.sum(g_flat, axis=(0, 2)))


def make_ops(generic: Ops) -> Ops:
    """The JAX table: lax conv (see :data:`CONV_KERNEL`), generic read and write, float32
    compute for halves."""

    def conv_fwd_auto(xp, x, params):
        if CONV_KERNEL == "auto" and _native_suffix(x, *params) is not None:
            return native_conv_fwd(xp, x, params)
        return (conv_fwd if _use_lax() else generic.conv_fwd)(xp, x, params)

    def conv_bwd_auto(xp, residuals, params, g):
        if isinstance(residuals, _NativeConvResiduals):
            return native_conv_bwd(xp, residuals, params, g)
        # both other conv_fwd variants return the generic stage list: either bwd consumes it
        return (conv_bwd if _use_lax() else generic.conv_bwd)(xp, residuals, params, g)

    def gates_fwd(xp, z, c):
        if _native_suffix(z, c) is not None:
            h_new, c_new = _native_gates(z, c)
            return h_new, c_new, _NativeGateResiduals(z, c)
        return generic.gates_fwd(xp, z, c)

    def gates_bwd(xp, residuals, g_h, g_c):
        if isinstance(residuals, _NativeGateResiduals):
            return _native_gates_vjp(*residuals, g_h, g_c)
        return generic.gates_bwd(xp, residuals, g_h, g_c)

    def gates_residuals(xp, z, c):
        if _native_suffix(z, c) is not None:
            return _NativeGateResiduals(z, c)
        return generic.gates_residuals(xp, z, c)

    fast = generic._replace(conv_fwd=conv_fwd_auto, conv_bwd=conv_bwd_auto, gates_fwd=gates_fwd,
                            gates_bwd=gates_bwd, gates_residuals=gates_residuals)
    return with_float32_compute(fast)
