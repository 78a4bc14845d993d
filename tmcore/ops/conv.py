"""Factorized convolution: per-axis depthwise 3-tap convs, then pointwise mixing."""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import (
    check_int,
    check_nonempty,
    check_rank,
    namespace_of,
    require_array,
)
from tmcore.types import ConvParams, device_of

__all__ = [
    "factorized_conv",
    "factorized_conv_vjp",
    "conv_params_from_pointwise",
    "xavier_uniform_bound",
]


def xavier_uniform_bound(c_in: int, c_out: int) -> float:
    """Give the half-width ``sqrt(6 / (c_in + c_out))`` of the Xavier-uniform range.

    Parameters
    ----------
    c_in, c_out : int
        The matrix's input and output channels, each >= 1.

    Returns
    -------
    float
        The bound: draw a ``(c_out, c_in)`` matrix uniformly in ``[-bound, bound]``.

    Raises
    ------
    TypeError
        If ``c_in`` or ``c_out`` is not an int.
    ValueError
        If ``c_in`` or ``c_out`` is < 1.
    """
    c_in, c_out = check_int("c_in", c_in, 1), check_int("c_out", c_out, 1)
    return math.sqrt(6.0 / (c_in + c_out))


def conv_params_from_pointwise(pointwise_weight: Any, ndim: int) -> ConvParams:
    """Build the layer's initial conv parameters around a given pointwise matrix.

    Identity depthwise taps and zero biases (docs/guides/conventions.md); draw
    ``pointwise_weight`` in ``+-xavier_uniform_bound(C_in, C_out)`` with your framework's RNG.

    Parameters
    ----------
    pointwise_weight : array, shape ``(C_out, C_in)``
        The channel mixing; the other fields get its namespace, dtype and device.
    ndim : int
        The number of spatial axes ``n``, 1 to 4.

    Returns
    -------
    ConvParams
        ``depthwise_weight (n, C_in, 3)``, ``depthwise_bias (n, C_in)``, ``pointwise_weight``
        itself and ``pointwise_bias (C_out,)``.

    Raises
    ------
    TypeError
        If ``pointwise_weight`` is not an array or ``ndim`` is not an int.
    ValueError
        If ``pointwise_weight`` is not 2-D or ``ndim`` is not 1 to 4.
    """
    xp = namespace_of(pointwise_weight=pointwise_weight)
    check_rank("pointwise_weight", pointwise_weight, 2, "(C_out, C_in)")
    ndim = check_int("ndim", ndim, 1, 4)
    c_out, c_in = pointwise_weight.shape
    kw: dict[str, Any] = {"dtype": pointwise_weight.dtype}
    if not array_api_compat.is_jax_array(pointwise_weight):
        # torch/CuPy need the input's device. JAX does not: an array created
        # with ``device=`` is committed to that one device, and jit with
        # batch-sharded inputs then rejects it ("incompatible devices"); an
        # uncommitted array follows whatever it is combined with.
        kw["device"] = device_of(pointwise_weight)
    centre = xp.asarray([0.0, 1.0, 0.0], **kw)
    taps = xp.broadcast_to(centre, (ndim, c_in, 3))
    return ConvParams(
        depthwise_weight=xp.asarray(taps, copy=True),
        depthwise_bias=xp.zeros((ndim, c_in), **kw),
        pointwise_weight=pointwise_weight,
        pointwise_bias=xp.zeros((c_out,), **kw),
    )


def neighbours(xp: Any, x: Any, axis: int) -> tuple[Any, Any]:
    """Zero-filled neighbours ``(prev, next)`` of ``x`` along ``axis``, ``prev[i] = x[i-1]``,
    ``next[i] = x[i+1]``: one padded copy, two slices."""
    size = x.shape[axis]
    edge = [slice(None)] * x.ndim
    edge[axis] = slice(0, 1)
    # The zero pad is made from a slice of x, not from xp.zeros: it then has x's
    # dtype, device and (under JAX explicit meshes) sharding, so the concat sees
    # operands with one sharding. ``zeros_like`` never reads x's values.
    pad = xp.zeros_like(x[tuple(edge)])
    padded = xp.concat([pad, x, pad], axis=axis)
    if array_api_compat.is_dask_array(padded):
        # The concat makes blocks of 1, S, 1 along ``axis`` and the shifted slices
        # cut them at 1 and S-1; combined with x, every conv refines the blocks
        # until each cell is one block (the task graph grows with T * cells).
        # One block along ``axis`` keeps x's chunking for the slices.
        padded = padded.rechunk({axis: -1})
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, size)
    prev = padded[tuple(index)]
    index[axis] = slice(2, size + 2)
    return prev, padded[tuple(index)]


def _channel_view(x: Any, ndim: int) -> tuple[int, ...]:
    return (1, x.shape[0]) + (1,) * ndim


def depthwise_axis(xp: Any, x: Any, taps: Any, bias: Any, axis: int) -> Any:
    """One depthwise 3-tap conv of ``x (B, C, *S)`` along spatial axis ``axis``."""
    n = x.ndim - 2
    dim = axis + 2
    view = _channel_view(bias, n)
    w_prev = xp.reshape(taps[:, 0], view)
    w_mid = xp.reshape(taps[:, 1], view)
    w_next = xp.reshape(taps[:, 2], view)
    prev, nxt = neighbours(xp, x, dim)
    return w_prev * prev + w_mid * x + w_next * nxt + xp.reshape(bias, view)


def conv_fwd(xp: Any, x: Any, params: ConvParams) -> tuple[Any, list[Any]]:
    """Forward without validation: ``z (B, C_out, *S)`` and the stage inputs ``[x, after axis 0,
    ..., after axis n-1]`` for the backward."""
    n = x.ndim - 2
    stages = [x]
    for axis in range(n):
        taps = params.depthwise_weight[axis, ...]
        bias = params.depthwise_bias[axis, ...]
        stages.append(depthwise_axis(xp, stages[-1], taps, bias, axis))
    y = stages[-1]
    batch = y.shape[0]
    y_flat = xp.reshape(y, (batch, y.shape[1], -1))
    z = xp.matmul(params.pointwise_weight, y_flat) + params.pointwise_bias[:, None]
    return xp.reshape(z, (batch, z.shape[1], *x.shape[2:])), stages


def conv_bwd(xp: Any, stages: list[Any], params: ConvParams, g: Any) -> tuple[Any, ConvParams]:
    """VJP given the stage inputs from :func:`conv_fwd` and ``g (B, C_out, *S)``."""
    n = len(stages) - 1
    y = stages[-1]
    batch, c_in = y.shape[:2]
    y_flat = xp.reshape(y, (batch, c_in, -1))
    g_flat = xp.reshape(g, (batch, g.shape[1], -1))
    d_pointwise = xp.sum(xp.matmul(g_flat, xp.matrix_transpose(y_flat)), axis=0)
    d_pointwise_bias = xp.sum(g_flat, axis=(0, 2))
    d_y = xp.reshape(
        xp.matmul(xp.matrix_transpose(params.pointwise_weight), g_flat), tuple(y.shape)
    )
    reduce_axes = (0,) + tuple(range(2, 2 + n))
    d_taps = [None] * n
    d_biases = [None] * n
    for axis in reversed(range(n)):
        x_in = stages[axis]
        dim = axis + 2
        taps = params.depthwise_weight[axis, ...]
        x_prev, x_next = neighbours(xp, x_in, dim)
        d_taps[axis] = xp.stack(
            [
                xp.sum(d_y * x_prev, axis=reduce_axes),
                xp.sum(d_y * x_in, axis=reduce_axes),
                xp.sum(d_y * x_next, axis=reduce_axes),
            ],
            axis=-1,
        )
        d_biases[axis] = xp.sum(d_y, axis=reduce_axes)
        view = _channel_view(taps[:, 0], n)
        g_prev, g_next = neighbours(xp, d_y, dim)
        d_y = (
            xp.reshape(taps[:, 0], view) * g_next
            + xp.reshape(taps[:, 1], view) * d_y
            + xp.reshape(taps[:, 2], view) * g_prev
        )
    d_params = ConvParams(
        depthwise_weight=xp.stack(d_taps, axis=0),
        depthwise_bias=xp.stack(d_biases, axis=0),
        pointwise_weight=d_pointwise,
        pointwise_bias=d_pointwise_bias,
    )
    return d_y, d_params


def as_conv_params(params: Any, name: str = "params") -> ConvParams:
    """``params`` as :class:`ConvParams`; ``TypeError`` unless it is a 4-tuple (or list)."""
    if not isinstance(params, (tuple, list)) or len(params) != 4:
        given = type(params).__name__
        if isinstance(params, (tuple, list)):
            given = f"a {given} of {len(params)} entries"
        raise TypeError(f"{name}: expected ConvParams(depthwise_weight, depthwise_bias, "
                        f"pointwise_weight, pointwise_bias), got {given}")
    return ConvParams(*params)


def validate_conv_params(params: ConvParams, ndim: int, c_in: int, name: str = "params") -> None:
    """Check the four fields' shapes against ``ndim`` spatial axes and ``c_in`` channels."""
    params = as_conv_params(params, name)
    c_out = params.pointwise_weight.shape[0] if params.pointwise_weight.ndim == 2 else -1
    expected = {
        "depthwise_weight": (ndim, c_in, 3),
        "depthwise_bias": (ndim, c_in),
        "pointwise_weight": (c_out, c_in),
        "pointwise_bias": (c_out,),
    }
    for field, shape in expected.items():
        got = tuple(getattr(params, field).shape)
        if got != shape:
            raise ValueError(f"{name}.{field}: expected shape {shape}, got {got}")


def _validate(x: Any, params: ConvParams, g: Any = None) -> Any:
    params = as_conv_params(params)
    xp = namespace_of(x=x, g=g, **{f"params.{k}": v for k, v in params._asdict().items()})
    check_rank("x", x, (3, 4, 5, 6), "(B, C_in, *S) with 1 to 4 spatial axes")
    check_nonempty("x", x, "(B, C_in, *S)")
    validate_conv_params(params, x.ndim - 2, x.shape[1])
    for field, value in params._asdict().items():  # name the argument, not a kernel's error
        if value.dtype != x.dtype:
            raise TypeError(f"params.{field}: expected x's dtype {x.dtype}, got {value.dtype}")
    if g is not None:
        expected = (x.shape[0], params.pointwise_weight.shape[0], *x.shape[2:])
        if tuple(g.shape) != expected:
            raise ValueError(f"g: expected shape (B, C_out, *S) = {expected}, got {tuple(g.shape)}")
    return xp


def factorized_conv(x: Any, params: ConvParams) -> Any:
    """Apply the factorized conv: a depthwise 3-tap pass per axis, then pointwise mixing.

    Per spatial axis ``a``, first axis first, ``y[i] = w[a, c, 0] x[i-1] + w[a, c, 1] x[i] +
    w[a, c, 2] x[i+1] + b[a, c]`` with zero padding; then ``z = pointwise_weight @ y +
    pointwise_bias`` over channels.

    Parameters
    ----------
    x : array, shape ``(B, C_in, *S)``
        The input, with 1 to 4 spatial axes.
    params : ConvParams
        The fields as :func:`conv_params_from_pointwise` makes them, of ``x``'s dtype.

    Returns
    -------
    array, shape ``(B, C_out, *S)``
        The convolved input.

    Raises
    ------
    TypeError
        If ``params`` is not a 4-tuple, an argument is not an array, the arrays mix
        namespaces, or a field's dtype differs from ``x``'s.
    ValueError
        If ``x`` does not have 1 to 4 spatial axes or has a zero-size axis, a field of
        ``params`` has the wrong shape, the arrays lie on different devices, or (validate
        mode only) an array holds NaN or inf.
    """
    xp = _validate(x, params)
    return ops_for(xp).conv_fwd(xp, x, ConvParams(*params))[0]


def factorized_conv_vjp(x: Any, params: ConvParams, g: Any) -> tuple[Any, ConvParams]:
    """Give the gradients of :func:`factorized_conv` for the cotangent ``g``.

    Parameters
    ----------
    x, params : array, ConvParams
        As in :func:`factorized_conv`.
    g : array, shape ``(B, C_out, *S)``
        The cotangent of the output.

    Returns
    -------
    d_x : array, shape ``(B, C_in, *S)``
        The gradient for ``x``.
    d_params : ConvParams
        The gradients for the four fields, shaped like them.

    Raises
    ------
    TypeError, ValueError
        As :func:`factorized_conv`; also if ``g`` is not an array of shape ``(B, C_out, *S)``.
    """
    require_array("g", g)
    xp = _validate(x, params, g)
    params = ConvParams(*params)
    ops = ops_for(xp)
    _, residuals = ops.conv_fwd(xp, x, params)
    return ops.conv_bwd(xp, residuals, params, g)
