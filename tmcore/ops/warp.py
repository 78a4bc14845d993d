"""Warped dynamics: resample the state at displaced cell centres, and the VJP.

``h_w(p) = h(p + d(p))``, read like :func:`tmcore.trilinear_sample`, with ``d`` a shift
``(B, n)`` plus an optional per-cell flow ``(B, n, *S)``. The definition, the costs and the
two VJPs for the state under a flow (a scatter-add where the Ops table has ``scatter_add``,
else dense products over tiles of cells, ``O(B K P^2)``): docs/guides/local-and-warp.md
("Warped dynamics").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from tmcore.ops.addressing import axis_of_component
from tmcore.ops.cell import check_like_h, validate_state
from tmcore.ops.common import grid_size, index_dtype, outer_product, to_index
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import check_dim, check_rank, namespace_of, require_array
from tmcore.types import device_of

__all__ = ["warp_state", "warp_state_vjp", "warp_fwd", "warp_bwd", "WarpResiduals"]

#: Beyond this (normalized units) every displaced centre is past the border.
_MAX_DISPLACEMENT = 2.0

#: Entries of one dense tile ``(B, cells in the tile, P)`` in the flow VJP.
_TILE_ENTRIES = 1 << 21


class WarpResiduals(NamedTuple):
    """What :func:`warp_bwd` needs: ``volume (B, K, *S)`` and the per-axis interpolation."""

    volume: Any
    stages: Any  # shift: the volume before each axis' resampling; flow: None
    axes: Any  # per axis (weights, slopes): shift (B, S_a, S_a) each; flow (lower, frac,
    #            inside * half) each (B, *S)
    has_flow: bool


def _positions(xp: Any, disp: Any, index: Any, size: int):
    """Voxel positions ``index + disp (S - 1) / 2`` and their interpolation ``(lower, frac,
    d position / d disp)`` with the conventions of trilinear sampling."""
    half = (size - 1) / 2.0
    u = index + xp.clip(disp, -_MAX_DISPLACEMENT, _MAX_DISPLACEMENT) * half
    clamped = xp.clip(u, 0.0, float(size - 1))
    lower = xp.floor(clamped)
    # u * 0: NaN for a NaN displacement (so its gradient is NaN too), else 0
    inside = xp.astype((u > 0.0) & (u < float(size - 1)), disp.dtype) + u * 0.0
    return lower, clamped - lower, inside * half


def _shift_matrices(xp: Any, disp: Any, size: int) -> tuple[Any, Any]:
    """``(M, D)``, each ``(B, S, S)``: ``M[b, i, j]`` the weight of cell ``j`` for output cell
    ``i``, ``D`` its derivative by the displacement ``disp (B,)``."""
    device = device_of(disp)
    index = xp.arange(size, dtype=disp.dtype, device=device)
    lower, frac, slope = _positions(xp, disp[:, None], index[None, :], size)  # (B, S)
    is_lower = xp.astype(index[None, None, :] == lower[..., None], disp.dtype)
    is_upper = xp.astype(index[None, None, :] == (lower + 1.0)[..., None], disp.dtype)
    weights = is_lower * (1.0 - frac[..., None]) + is_upper * frac[..., None]
    return weights, (is_upper - is_lower) * slope[..., None]


def _apply(xp: Any, volume: Any, matrix: Any, axis: int, transpose: bool = False) -> Any:
    """Contract spatial ``axis`` of ``volume (B, K, *S)`` with ``matrix (B, S_a, S_a)``, ``out[i] =
    sum_j M[i, j] v[j]`` (``transpose``: ``out[j] = sum_i M[i, j] v[i]``)."""
    n = volume.ndim - 2
    dim = axis + 2
    order = [d for d in range(volume.ndim) if d != dim] + [dim]
    moved = xp.permute_dims(volume, tuple(order))
    m = matrix if transpose else xp.matrix_transpose(matrix)
    m = xp.reshape(m, (m.shape[0], *([1] * (n - 1)), *m.shape[1:]))
    out = xp.matmul(moved, m)
    inverse = [0] * volume.ndim
    for position, d in enumerate(order):
        inverse[d] = position
    return xp.permute_dims(out, tuple(inverse))


def _cell_index(xp: Any, shape: tuple[int, ...], axis: int, dtype: Any, device: Any) -> Any:
    """The index along ``axis`` of every cell, shaped to broadcast with ``(B, *S)``."""
    view = [1] * (len(shape) + 1)
    view[axis + 1] = shape[axis]
    return xp.reshape(xp.arange(shape[axis], dtype=dtype, device=device), tuple(view))


def _displacement(xp: Any, shift: Any, flow: Any, component: int, n: int) -> Any:
    """Component ``component`` of the displacement, ``(B, *S)``."""
    return xp.reshape(shift[:, component], (shift.shape[0], *([1] * n))) + flow[:, component, ...]


def _corner_indices(xp: Any, volume: Any, axes: list[tuple[Any, Any, Any]]):
    """Per corner ``c`` in ``{0, 1}^n``: ``(bits, flat index (B * K * P,))`` of every cell's corner
    ``lower + c`` in ``volume (B, K, *S)``."""
    batch, channels = volume.shape[:2]
    shape = tuple(volume.shape[2:])
    n = len(shape)
    cells = grid_size(shape)
    dtype = index_dtype(xp, device_of(volume))
    device = device_of(volume)
    lows = [to_index(xp, lower, dtype) for lower, _, _ in axes]
    highs = [xp.minimum(low + 1, xp.full_like(low, shape[a] - 1)) for a, low in enumerate(lows)]
    strides = [grid_size(shape[a + 1:]) for a in range(n)]
    rows = xp.reshape(xp.arange(batch * channels, dtype=dtype, device=device) * cells,
                      (batch, channels, *([1] * n)))
    for corner in range(1 << n):
        bits = [(corner >> (n - 1 - a)) & 1 for a in range(n)]
        cell = None
        for a in range(n):
            term = (highs[a] if bits[a] else lows[a]) * strides[a]
            cell = term if cell is None else cell + term
        yield bits, xp.reshape(rows + cell[:, None, ...], (-1,))


def _corner_gathers(xp: Any, volume: Any, axes: list[tuple[Any, Any, Any]],
                    corners: Iterable[tuple[list[int], Any]] | None = None):
    """Per corner: ``(bits, values (B, K, *S))`` of the volume at every cell's corner
    (``corners``: the :func:`_corner_indices`, if made)."""
    if corners is None:
        corners = _corner_indices(xp, volume, axes)
    flat = xp.reshape(volume, (-1,))
    return [(bits, xp.reshape(xp.take(flat, index), volume.shape)) for bits, index in corners]


def _corner_weight(axes: list[tuple[Any, Any, Any]], bits: list[int],
                   skip: int | None = None) -> Any:
    """``prod_a w_a`` over the axes (but ``skip``), ``(B, *S)``; ``1`` when nothing is left."""
    weight = None
    for a, (_, frac, _) in enumerate(axes):
        if a == skip:
            continue
        w = frac if bits[a] else 1.0 - frac
        weight = w if weight is None else weight * w
    return 1.0 if weight is None else weight


def warp_fwd(xp: Any, volume: Any, shift: Any, flow: Any = None) -> tuple[Any, WarpResiduals]:
    """``(warped (B, K, *S), residuals)`` of ``volume (B, K, *S)``; no validation."""
    shape = tuple(volume.shape[2:])
    n = len(shape)
    if flow is None:
        stages, axes = [volume], []
        for axis in range(n):
            weights, slopes = _shift_matrices(xp, shift[:, axis_of_component(axis, n)],
                                              shape[axis])
            axes.append((weights, slopes))
            stages.append(_apply(xp, stages[-1], weights, axis))
        return stages[-1], WarpResiduals(volume, stages, axes, False)
    device = device_of(volume)
    axes = []
    for axis in range(n):
        disp = _displacement(xp, shift, flow, axis_of_component(axis, n), n)
        axes.append(_positions(xp, disp, _cell_index(xp, shape, axis, volume.dtype, device),
                               shape[axis]))
    out = None
    for bits, values in _corner_gathers(xp, volume, axes):
        term = _corner_weight(axes, bits)[:, None, ...] * values
        out = term if out is None else out + term
    return out, WarpResiduals(volume, None, axes, True)


def _flow_volume_grad(xp: Any, residuals: WarpResiduals, g: Any) -> Any:
    """``d volume`` of the flow warp without a scatter-add: dense products of one-hot
    interpolation rows over tiles of output cells, ``O(B K P^2)``."""
    volume = residuals.volume
    batch, channels = volume.shape[:2]
    shape = tuple(volume.shape[2:])
    cells = grid_size(shape)
    device = device_of(volume)
    g_flat = xp.reshape(g, (batch, channels, cells))
    lowers = [xp.reshape(xp.broadcast_to(lower, (batch, *shape)), (batch, cells))
              for lower, _, _ in residuals.axes]
    fracs = [xp.reshape(xp.broadcast_to(frac, (batch, *shape)), (batch, cells))
             for _, frac, _ in residuals.axes]
    tile = max(1, _TILE_ENTRIES // max(1, batch * cells))
    total = None
    for first in range(0, cells, tile):
        last = min(first + tile, cells)
        rows = []
        for a, size in enumerate(shape):
            index = xp.arange(size, dtype=volume.dtype, device=device)[None, None, :]
            lower = lowers[a][:, first:last, None]
            frac = fracs[a][:, first:last, None]
            rows.append(xp.astype(index == lower, volume.dtype) * (1.0 - frac)
                        + xp.astype(index == lower + 1.0, volume.dtype) * frac)
        part = xp.matmul(g_flat[:, :, first:last], outer_product(xp, rows))
        total = part if total is None else total + part
    return xp.reshape(total, volume.shape)


def _flow_volume_scatter(xp: Any, residuals: WarpResiduals, g: Any,
                         corners: list[tuple[list[int], Any]], scatter_add: Any) -> Any:
    """``d volume`` of the flow warp as the transpose of the corner gather: ``weight * g``
    scatter-added into each corner's cells, ``O(2^n B K P)``."""
    volume = residuals.volume
    batch = volume.shape[0]
    n = volume.ndim - 2
    total = xp.zeros((grid_size(tuple(volume.shape)),), dtype=g.dtype,
                     device=device_of(g))
    for bits, index in corners:
        values = _corner_weight(residuals.axes, bits)[:, None, ...] * g
        total = scatter_add(xp, total, index, xp.reshape(values, (-1,)))
    total = xp.reshape(total, volume.shape)
    # A NaN displacement makes its batch element's gradient NaN, as the dense
    # contraction does (its NaN weight meets every cell there); no host sync.
    bad = None
    for _, frac, _ in residuals.axes:
        bad = xp.isnan(frac) if bad is None else bad | xp.isnan(frac)
    bad = xp.any(xp.reshape(xp.broadcast_to(bad, (batch, *volume.shape[2:])), (batch, -1)),
                 axis=1)
    return xp.where(xp.reshape(bad, (batch, *([1] * (n + 1)))), xp.nan, total)


def warp_bwd(xp: Any, residuals: WarpResiduals, g: Any) -> tuple[Any, Any, Any]:
    """VJP of :func:`warp_fwd` for ``g (B, K, *S)``: ``(d_volume, d_shift (B, n), d_flow (B, n, *S)
    or None)``."""
    volume = residuals.volume
    shape = tuple(volume.shape[2:])
    n = len(shape)
    spatial = tuple(range(1, 1 + n))
    d_disp: list[Any] = [None] * n
    if not residuals.has_flow:
        for axis in reversed(range(n)):
            weights, slopes = residuals.axes[axis]
            moved = _apply(xp, residuals.stages[axis], slopes, axis)
            d_disp[axis_of_component(axis, n)] = xp.sum(g * moved, axis=(1, *range(2, 2 + n)))
            g = _apply(xp, g, weights, axis, transpose=True)
        return g, xp.stack(d_disp, axis=1), None
    indices = list(_corner_indices(xp, volume, residuals.axes))
    corners = _corner_gathers(xp, volume, residuals.axes, indices)
    for axis in range(n):
        d_u = None
        for bits, values in corners:
            weight = _corner_weight(residuals.axes, bits, skip=axis)
            dot = xp.sum(g * values, axis=1)  # (B, *S)
            term = weight * dot if bits[axis] else -(weight * dot)
            d_u = term if d_u is None else d_u + term
        d_disp[axis_of_component(axis, n)] = d_u * residuals.axes[axis][2]
    d_flow = xp.stack(d_disp, axis=1)
    d_shift = xp.stack([xp.sum(d, axis=spatial) for d in d_disp], axis=1)
    scatter_add = ops_for(xp).scatter_add
    if scatter_add is None:
        return _flow_volume_grad(xp, residuals, g), d_shift, d_flow
    return _flow_volume_scatter(xp, residuals, g, indices, scatter_add), d_shift, d_flow


def _validate(h, c, shift, flow, g_h=None, g_c=None):
    xp = namespace_of(h=h, c=c, shift=shift, flow=flow, g_h=g_h, g_c=g_c) if flow is not None \
        else namespace_of(h=h, c=c, shift=shift, g_h=g_h, g_c=g_c)
    validate_state(h, c)
    batch = h.shape[0]
    n = h.ndim - 2
    check_rank("shift", shift, 2, "(B, n)")
    check_dim("shift", shift, 0, batch, "(B, n)", "B = h.shape[0]")
    check_dim("shift", shift, 1, n, "(B, n)", "n = number of spatial axes of h")
    if flow is not None and tuple(flow.shape) != (batch, n, *h.shape[2:]):
        raise ValueError(f"flow: expected shape (B, n, *S) = {(batch, n, *h.shape[2:])}, "
                         f"got {tuple(flow.shape)}")
    check_like_h(h, g_h=g_h, g_c=g_c)
    return xp


def warp_state(h: Any, c: Any, shift: Any, flow: Any = None) -> tuple[Any, Any]:
    """Resample the state at the cell centres plus a displacement.

    ``h_w(p) = h(p + d(p))`` and likewise ``c``, read like :func:`tmcore.trilinear_sample`.

    Parameters
    ----------
    h, c : array, shape ``(B, C, *S)``
        The state, with 1 to 4 spatial axes.
    shift : array, shape ``(B, n)``
        One displacement per batch element, in normalized units; component ``k`` moves along
        spatial axis ``n - 1 - k``.
    flow : array, shape ``(B, n, *S)``, optional
        A per-cell displacement added to ``shift``.

    Returns
    -------
    h_w, c_w : array, shape ``(B, C, *S)``
        The warped state; exactly ``(h, c)`` for a zero displacement.

    Raises
    ------
    TypeError
        If an argument is not a real floating array, or the arrays mix namespaces.
    ValueError
        If ``h`` and ``c`` differ in shape or do not have 1 to 4 spatial axes, ``shift`` is
        not ``(B, n)`` or ``flow`` not ``(B, n, *S)``, the arrays lie on different devices,
        or (validate mode only) an array holds NaN or inf.
    """
    xp = _validate(h, c, shift, flow)
    channels = h.shape[1]
    out, _ = warp_fwd(xp, xp.concat([h, c], axis=1), shift, flow)
    return out[:, :channels, ...], out[:, channels:, ...]


def warp_state_vjp(h: Any, c: Any, shift: Any, flow: Any, g_h: Any,
                   g_c: Any) -> tuple[Any, Any, Any, Any]:
    """Give the gradients of :func:`warp_state` for ``g_h, g_c``.

    Parameters
    ----------
    h, c, shift, flow : array or None
        As in :func:`warp_state` (``flow`` may be None).
    g_h, g_c : array, shape ``(B, C, *S)``
        The cotangents of the warped state.

    Returns
    -------
    d_h, d_c : array, shape ``(B, C, *S)``
        The gradients for the state.
    d_shift : array, shape ``(B, n)``
        The gradient for ``shift``.
    d_flow : array, shape ``(B, n, *S)``, or None
        The gradient for ``flow`` (None without a flow).

    Raises
    ------
    TypeError, ValueError
        As :func:`warp_state`; also if ``g_h`` or ``g_c`` is not an array shaped like ``h``.
    """
    require_array("g_h", g_h)
    require_array("g_c", g_c)
    xp = _validate(h, c, shift, flow, g_h, g_c)
    channels = h.shape[1]
    _, residuals = warp_fwd(xp, xp.concat([h, c], axis=1), shift, flow)
    d_volume, d_shift, d_flow = warp_bwd(xp, residuals, xp.concat([g_h, g_c], axis=1))
    return d_volume[:, :channels, ...], d_volume[:, channels:, ...], d_shift, d_flow
