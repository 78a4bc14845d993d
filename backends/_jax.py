"""JAX fast path: ``lax.conv_general_dilated`` for the depthwise taps (on accelerators).

:data:`CONV_KERNEL` ``"auto"`` uses the grouped conv when JAX's default
backend is not the CPU: XLA:CPU expands grouped convs and measured about 300x
slower there than the generic shifts, which XLA fuses well, so on CPU the
generic path runs.

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
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tmcore._dispatch import Ops
from tmcore.conv import ConvParams

from ._mixed import with_float32_compute

__all__ = ["make_ops", "CONV_KERNEL"]

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


def make_ops(generic: Ops) -> Ops:
    """The JAX table: lax conv (see :data:`CONV_KERNEL`), generic read and write, float32
    compute for halves."""

    def conv_fwd_auto(xp, x, params):
        return (conv_fwd if _use_lax() else generic.conv_fwd)(xp, x, params)

    def conv_bwd_auto(xp, residuals, params, g):
        # both conv_fwd variants return the generic stage list, so either bwd consumes it
        return (conv_bwd if _use_lax() else generic.conv_bwd)(xp, residuals, params, g)

    fast = generic._replace(conv_fwd=conv_fwd_auto, conv_bwd=conv_bwd_auto)
    return with_float32_compute(fast)
