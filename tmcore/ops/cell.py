"""The ConvLSTM update of the memory grid, and its VJP."""

from __future__ import annotations

from typing import Any, NamedTuple

from tmcore.ops.common import sigmoid, sigmoid_grad_from_output, tanh_grad_from_output
from tmcore.ops.conv import as_conv_params, validate_conv_params
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import check_nonempty, check_rank, namespace_of, require_array
from tmcore.types import ConvParams

__all__ = ["convlstm_step", "convlstm_step_vjp", "CellCache", "gates_fwd", "gates_bwd",
           "gates_residuals", "cell_cache"]


class CellCache(NamedTuple):
    """What the backward of one step needs (recomputed, never stored across steps)."""

    conv_stages: Any  # the conv residuals of ops_for(xp).conv_fwd (generic: stage inputs)
    gate_residuals: Any  # the residuals of ops_for(xp).gates_fwd (generic: see gates_fwd)


def gates_fwd(xp: Any, z: Any, c: Any) -> tuple[Any, Any, Any]:
    """The LSTM update from ``z (B, 4C, *S)`` and ``c (B, C, *S)``: ``(h', c', residuals)``, the
    residuals ``(c, (i, f, o, g) activated, tanh(c'))`` (the generic Ops entry)."""
    channels = c.shape[1]
    i = sigmoid(xp, z[:, :channels, ...])
    f = sigmoid(xp, z[:, channels : 2 * channels, ...])
    o = sigmoid(xp, z[:, 2 * channels : 3 * channels, ...])
    g = xp.tanh(z[:, 3 * channels :, ...])
    c_new = f * c + i * g
    tanh_c_new = xp.tanh(c_new)
    return o * tanh_c_new, c_new, (c, (i, f, o, g), tanh_c_new)


def gates_bwd(xp: Any, residuals: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
    """VJP of :func:`gates_fwd`: ``(d_z (B, 4C, *S), d_c (B, C, *S))``."""
    c, (i, f, o, g), tanh_c_new = residuals
    d_c_new = g_c + g_h * o * tanh_grad_from_output(tanh_c_new)
    d_z = xp.concat(
        [
            d_c_new * g * sigmoid_grad_from_output(i),
            d_c_new * c * sigmoid_grad_from_output(f),
            g_h * tanh_c_new * sigmoid_grad_from_output(o),
            d_c_new * i * tanh_grad_from_output(g),
        ],
        axis=1,
    )
    return d_z, d_c_new * f


def gates_residuals(xp: Any, z: Any, c: Any) -> Any:
    """The residuals of :func:`gates_fwd` alone (the generic Ops entry)."""
    return gates_fwd(xp, z, c)[2]


def cell_cache(xp: Any, x: Any, h: Any, c: Any, params: ConvParams) -> CellCache:
    """What :func:`cell_bwd` needs, recomputed from the step's inputs (without asking for
    ``h', c'``, which a backend may skip)."""
    ops = ops_for(xp)
    z, stages = ops.conv_fwd(xp, xp.concat([x, h], axis=1), params)
    return CellCache(stages, ops.gates_residuals(xp, z, c))


def cell_fwd(xp: Any, x: Any, h: Any, c: Any, params: ConvParams) -> tuple[Any, Any, CellCache]:
    """One ConvLSTM step without validation; returns ``(h', c', cache)``."""
    ops = ops_for(xp)
    z, stages = ops.conv_fwd(xp, xp.concat([x, h], axis=1), params)
    h_new, c_new, gate_residuals = ops.gates_fwd(xp, z, c)
    return h_new, c_new, CellCache(stages, gate_residuals)


def cell_bwd(
    xp: Any, cache: CellCache, params: ConvParams, g_h: Any, g_c: Any
) -> tuple[Any, Any, Any, ConvParams]:
    """VJP of one step given its cache; returns ``(d_x, d_h, d_c, d_params)``."""
    ops = ops_for(xp)
    d_z, d_c = ops.gates_bwd(xp, cache.gate_residuals, g_h, g_c)
    d_xh, d_params = ops.conv_bwd(xp, cache.conv_stages, params, d_z)
    channels = g_h.shape[1]
    return d_xh[:, :channels, ...], d_xh[:, channels:, ...], d_c, d_params


def validate_state(h: Any, c: Any, h_name: str = "h", c_name: str = "c") -> None:
    """Check ``h`` and ``c`` are ``(B, C, *S)`` with the same shape."""
    check_rank(h_name, h, (3, 4, 5, 6), "(B, C, *S) with 1 to 4 spatial axes")
    check_nonempty(h_name, h, "(B, C, *S)")
    if tuple(c.shape) != tuple(h.shape):
        raise ValueError(f"{c_name}: expected the shape of {h_name} {tuple(h.shape)}, "
                         f"got {tuple(c.shape)}")


def check_like_h(h: Any, **arrays: Any) -> None:
    """``ValueError`` naming the first of ``arrays`` (``None`` skipped) not shaped like ``h``."""
    for name, value in arrays.items():
        if value is not None and tuple(value.shape) != tuple(h.shape):
            raise ValueError(f"{name}: expected the shape of h (B, C, *S) = {tuple(h.shape)}, "
                             f"got {tuple(value.shape)}")


def _validate(x, h, c, params, g_h=None, g_c=None):
    params = as_conv_params(params)
    xp = namespace_of(x=x, h=h, c=c, g_h=g_h, g_c=g_c,
                      **{f"params.{k}": v for k, v in params._asdict().items()})
    validate_state(h, c)
    check_like_h(h, x=x, g_h=g_h, g_c=g_c)
    validate_gate_conv(params, h.ndim - 2, h.shape[1])
    return xp, params


def validate_gate_conv(params: ConvParams, ndim: int, channels: int) -> None:
    """Check the gate conv of ``channels`` state channels over ``ndim`` axes: ``C_in = 2C`` (the
    written volume and ``h``), ``C_out = 4C`` (the gates)."""
    validate_conv_params(params, ndim, 2 * channels)
    if params.pointwise_weight.shape[0] != 4 * channels:
        raise ValueError(f"params.pointwise_weight: expected shape (4C, 2C) = "
                         f"{(4 * channels, 2 * channels)}, "
                         f"got {tuple(params.pointwise_weight.shape)}")


def convlstm_step(x: Any, h: Any, c: Any, params: ConvParams) -> tuple[Any, Any]:
    """Update the state ``(h, c)`` by one ConvLSTM step on the written volume ``x``.

    ``z = factorized_conv(concat([x, h], channel axis), params)`` is split into the gates
    ``(i, f, o, g)``; ``c' = sigmoid(f) c + sigmoid(i) tanh(g)``, ``h' = sigmoid(o) tanh(c')``.

    Parameters
    ----------
    x, h, c : array, shape ``(B, C, *S)``
        The written volume (first in the concatenation), the hidden and the cell state.
    params : ConvParams
        The gate conv, ``C_in = 2C``, ``C_out = 4C``.

    Returns
    -------
    h_new, c_new : array, shape ``(B, C, *S)``
        The new state; ``|h_new| <= 1``.

    Raises
    ------
    TypeError
        If ``params`` is not a 4-tuple, an argument is not an array, or the arrays mix
        namespaces.
    ValueError
        If ``h`` does not have 1 to 4 spatial axes, ``x`` or ``c`` is not shaped like ``h``,
        a field of ``params`` does not fit ``C_in = 2C``, ``C_out = 4C``, the arrays lie on
        different devices, or (validate mode only) an array holds NaN or inf.
    """
    xp, params = _validate(x, h, c, params)
    h_new, c_new, _ = cell_fwd(xp, x, h, c, params)
    return h_new, c_new


def convlstm_step_vjp(
    x: Any, h: Any, c: Any, params: ConvParams, g_h: Any, g_c: Any
) -> tuple[Any, Any, Any, ConvParams]:
    """Give the gradients of :func:`convlstm_step` for the cotangents of ``h'`` and ``c'``.

    Parameters
    ----------
    x, h, c, params : array or ConvParams
        As in :func:`convlstm_step`.
    g_h, g_c : array, shape ``(B, C, *S)``
        The cotangents of the new state.

    Returns
    -------
    d_x, d_h, d_c : array, shape ``(B, C, *S)``
        The gradients for ``x``, ``h`` and ``c``.
    d_params : ConvParams
        The gradients for the conv's fields, shaped like them.

    Raises
    ------
    TypeError, ValueError
        As :func:`convlstm_step`; also if ``g_h`` or ``g_c`` is not an array shaped like ``h``.
    """
    require_array("g_h", g_h)
    require_array("g_c", g_c)
    xp, params = _validate(x, h, c, params, g_h, g_c)
    return cell_bwd(xp, cell_cache(xp, x, h, c, params), params, g_h, g_c)
