"""Warped memory dynamics: resample the state at displaced cell centres, and the VJP.

Before a step's update the state is moved: ``h_w(p) = h(p + d(p))`` and likewise ``c``,
read by n-linear interpolation with border padding, exactly the semantics of
:func:`tmcore.trilinear_sample` (the voxel position is clamped to ``[0, S_a - 1]``;
the displacement gradient is zero at and beyond the border and right-sided at cell
centres). The displacement is in normalized units, component ``k`` addressing spatial
axis ``n - 1 - k`` like every coordinate:

- ``shift (B, n)``: one displacement per batch element (a global shift per chunk);
- ``flow (B, n, *S)`` (optional): a per-cell displacement added to the shift.

Positions are computed in voxel units (``u = i + d (S_a - 1) / 2``), so a zero
displacement returns the state exactly, bit for bit (weight 1 on the cell itself).
Displacements beyond ``+-2`` (the whole grid) are clipped to it, which changes no value.

Cost: a shift alone is separable, one ``(S_a, S_a)`` interpolation matrix per axis and
batch element: ``O(B K P sum(S_a))`` forward and VJP (``P`` cells, ``K`` channels), on
every namespace. With a flow the forward gathers the ``2^n`` corners of every cell
(``O(2^n B K P)``, ``take``), and the VJP w.r.t. the displacement is ``O(2^n B K P)``
too. The VJP w.r.t. the state is the transpose of that gather, a scatter-add of
``weight * g`` into the ``2^n`` corner cells:

- where the dispatch table has one (:class:`tmcore.runtime.dispatch.Ops` ``scatter_add``):
  ``O(2^n B K P)``. PyTorch: ``index_add_`` (on CUDA, under the default
  ``deterministic=True``, the sorted ``index_put_(accumulate=True)``); JAX:
  ``.at[].add`` on the CPU, and off it only with ``deterministic=False`` (XLA's GPU
  scatter adds atomically);
- elsewhere (NumPy, array-api-strict, any other namespace, JAX on an accelerator by
  default, and ``tmcore.options(generic=True)``): the array API has no scatter-add, so
  the generic path computes it as dense products over tiles of cells, ``O(B K P^2)``.

Both agree to rounding (float64: within 1e-12, tested), NaN displacements included
(the batch element's state gradient is NaN on both).
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
    """What :func:`warp_bwd` needs: the input ``volume (B, K, *S)``, the displacement and
    the per-axis interpolation (shift: matrices; flow: per-cell positions)."""

    volume: Any
    stages: Any  # shift: the volume before each axis' resampling; flow: None
    axes: Any  # per axis (weights, slopes): shift (B, S_a, S_a) each; flow (lower, frac,
    #            inside * half) each (B, *S)
    has_flow: bool


def _positions(xp: Any, disp: Any, index: Any, size: int):
    """Voxel positions ``index + disp (S - 1) / 2`` (broadcast) and their interpolation:
    ``(lower, frac, d position / d disp)`` with the conventions of trilinear sampling."""
    half = (size - 1) / 2.0
    u = index + xp.clip(disp, -_MAX_DISPLACEMENT, _MAX_DISPLACEMENT) * half
    clamped = xp.clip(u, 0.0, float(size - 1))
    lower = xp.floor(clamped)
    # u * 0: NaN for a NaN displacement (so its gradient is NaN too), else 0
    inside = xp.astype((u > 0.0) & (u < float(size - 1)), disp.dtype) + u * 0.0
    return lower, clamped - lower, inside * half


def _shift_matrices(xp: Any, disp: Any, size: int) -> tuple[Any, Any]:
    """``(M, D)`` of shape ``(B, S, S)``: ``M[b, i, j]`` is the weight of cell ``j`` for
    output cell ``i``; ``D`` its derivative w.r.t. the displacement component ``disp (B,)``."""
    device = device_of(disp)
    index = xp.arange(size, dtype=disp.dtype, device=device)
    lower, frac, slope = _positions(xp, disp[:, None], index[None, :], size)  # (B, S)
    is_lower = xp.astype(index[None, None, :] == lower[..., None], disp.dtype)
    is_upper = xp.astype(index[None, None, :] == (lower + 1.0)[..., None], disp.dtype)
    weights = is_lower * (1.0 - frac[..., None]) + is_upper * frac[..., None]
    return weights, (is_upper - is_lower) * slope[..., None]


def _apply(xp: Any, volume: Any, matrix: Any, axis: int, transpose: bool = False) -> Any:
    """Contract spatial ``axis`` of ``volume (B, K, *S)`` with ``matrix (B, S_a, S_a)``:
    ``out[.., i, ..] = sum_j M[i, j] v[.., j, ..]``; with ``transpose``,
    ``out[.., j, ..] = sum_i M[i, j] v[.., i, ..]``."""
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
    """Yield per corner ``c`` in ``{0, 1}^n``: ``(bits, index (B * K * P,))``, the flat index
    into ``volume (B, K, *S)`` of the corner ``lower + c`` of every cell's position
    (C order over ``(B, K, *S)``)."""
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
    """Per corner ``c`` in ``{0, 1}^n``: ``(bits, values (B, K, *S))``, ``values`` the
    volume at the corner ``lower + c`` of every cell's position (``corners``: the
    :func:`_corner_indices` of the same volume and axes, if already made)."""
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
    """Resample ``volume (B, K, *S)`` at the displaced centres; no validation.

    Returns ``(warped (B, K, *S), residuals)``.
    """
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
    """``d volume`` of the flow warp on the generic path (no scatter-add): the transpose of
    the corner gather, as dense products of one-hot interpolation rows over tiles of
    output cells, ``O(B K P^2)``."""
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
    """``d volume`` of the flow warp as what it is, the transpose of the corner gather:
    per corner, ``weight * g`` scatter-added into the corner cells (``O(2^n B K P)``;
    ``scatter_add`` is the namespace's, :class:`tmcore.runtime.dispatch.Ops`)."""
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
    """VJP of :func:`warp_fwd` for ``g (B, K, *S)``: ``(d_volume, d_shift (B, n), d_flow)``
    (``d_flow (B, n, *S)``, or ``None`` without a flow).

    With a flow, ``d_volume`` is the namespace's scatter-add (``O(2^n B K P)``) where
    ``ops_for(xp).scatter_add`` exists, else the generic tile contraction
    (``O(B K P^2)``); see the module notes."""
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

    ``h_w(p) = h(p + d(p))`` and likewise ``c``, read n-linearly with border
    padding (the semantics of :func:`tmcore.trilinear_sample`).

    Parameters
    ----------
    h, c : array, shape ``(B, C, *S)``
        The state, with 1 to 4 spatial axes.
    shift : array, shape ``(B, n)``
        One displacement per batch element, in normalized units; component
        ``k`` moves along spatial axis ``n - 1 - k`` (coordinate order).
    flow : array, shape ``(B, n, *S)``, optional
        A per-cell displacement added to ``shift``.

    Returns
    -------
    h_w, c_w : array, shape ``(B, C, *S)``
        The warped state; exactly ``(h, c)`` for a zero displacement.

    Raises
    ------
    TypeError
        If an argument is not an array, the arrays mix namespaces, or a dtype
        is not real floating.
    ValueError
        If ``h`` and ``c`` differ in shape or do not have 1 to 4 spatial axes,
        ``shift`` is not ``(B, n)`` or ``flow`` not ``(B, n, *S)``, the arrays
        lie on different devices, or (validate mode only) an array holds NaN
        or inf.
    """
    xp = _validate(h, c, shift, flow)
    channels = h.shape[1]
    out, _ = warp_fwd(xp, xp.concat([h, c], axis=1), shift, flow)
    return out[:, :channels, ...], out[:, channels:, ...]


def warp_state_vjp(h: Any, c: Any, shift: Any, flow: Any, g_h: Any,
                   g_c: Any) -> tuple[Any, Any, Any, Any]:
    """VJP of :func:`warp_state` for ``g_h, g_c (B, C, *S)`` (``flow`` may be ``None``).

    Parameters
    ----------
    h, c, shift, flow : array or None
        The arguments of :func:`warp_state` (``(B, C, *S)`` twice, ``(B, n)``,
        ``(B, n, *S)`` or ``None``).
    g_h, g_c : array, shape ``(B, C, *S)``
        The cotangents of the warped state.

    Returns
    -------
    d_h, d_c : array, shape ``(B, C, *S)``
        The gradients for the state.
    d_shift : array, shape ``(B, n)``
        The gradient for ``shift``.
    d_flow : array, shape ``(B, n, *S)``, or None
        The gradient for ``flow`` (``None`` without a flow).

    Raises
    ------
    TypeError, ValueError
        As :func:`warp_state`, for the cotangents too (both must be arrays
        shaped like ``h``).
    """
    require_array("g_h", g_h)
    require_array("g_c", g_c)
    xp = _validate(h, c, shift, flow, g_h, g_c)
    channels = h.shape[1]
    _, residuals = warp_fwd(xp, xp.concat([h, c], axis=1), shift, flow)
    d_volume, d_shift, d_flow = warp_bwd(xp, residuals, xp.concat([g_h, g_c], axis=1))
    return d_volume[:, :channels, ...], d_volume[:, channels:, ...], d_shift, d_flow
