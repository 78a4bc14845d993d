"""Local updates (``update="local"``): a step's write and ConvLSTM update touch only a window
of ``w`` cells per axis around the write.

The definition and the two paths, ``method="masked"`` (the dense definition) and ``"fast"``
(the window plus its 1-cell halo gathered as a box, updated, written back; no arithmetic
depends on the grid): docs/guides/local-and-warp.md ("Local updates"). :func:`local_update`
is one step; the scan and its undo log are :mod:`tmcore.scan.local`'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import array_api_compat

from tmcore.ops.addressing import axis_of_component
from tmcore.ops.cell import (
    cell_bwd,
    cell_cache,
    cell_fwd,
    check_like_h,
    validate_gate_conv,
    validate_state,
)
from tmcore.ops.common import box_index, gather_box, index_dtype, outer_product, set_box, to_index
from tmcore.ops.conv import as_conv_params
from tmcore.ops.splat import DEFAULT_EPS, gaussian_profiles, splat_rows, splat_rows_vjp
from tmcore.runtime.validate import (
    check_dim,
    check_eps,
    check_int,
    check_positive,
    check_radius,
    check_rank,
    namespace_of,
    require_array,
)
from tmcore.types import ConvParams, device_of

__all__ = ["METHODS", "Window", "Write", "local_update", "local_update_vjp", "window_geometry",
           "window_mask"]

#: The two paths of every local function (see the module docstring).
METHODS = ("fast", "masked")


class Write(NamedTuple):
    """One step's write: ``write_coords (B, n)``, ``write_sigma (B,)``, ``write_content (B, C)``
    (a :class:`tmcore.StepInputs` serves too)."""

    write_coords: Any
    write_sigma: Any
    write_content: Any


class Window(NamedTuple):
    """Where a step's window and its box lie: ``start``, ``box_start`` ``(B, n)`` integer starts;
    per axis ``size = min(w, S_a)`` and ``box = min(w + 2, S_a)`` (window and halo, in the grid)."""

    start: Any
    size: tuple[int, ...]
    box_start: Any
    box: tuple[int, ...]


def _per_axis(xp: Any, values: list[float], like: Any) -> Any:
    """A ``(n,)`` array of ``values`` in ``like``'s dtype and device (uncommitted in JAX)."""
    kw: dict[str, Any] = {"dtype": like.dtype}
    if not array_api_compat.is_jax_array(like):
        kw["device"] = device_of(like)
    return xp.asarray(values, **kw)


def window_sizes(shape: tuple[int, ...], window: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The :class:`Window`'s ``size`` and ``box`` per axis of ``shape``."""
    return tuple(min(window, s) for s in shape), tuple(min(window + 2, s) for s in shape)


def window_geometry(xp: Any, coords: Any, shape: tuple[int, ...], window: int) -> Window:
    """The :class:`Window` of writes at ``coords (B, n)`` (a NaN coordinate puts it at 0)."""
    dtype = index_dtype(xp, device_of(coords))
    sizes, boxes = window_sizes(shape, window)
    u = (xp.flip(coords, axis=1) + 1.0) * _per_axis(xp, [(s - 1) / 2.0 for s in shape], coords)
    u = xp.clip(u, 0.0, _per_axis(xp, [float(s - 1) for s in shape], coords))
    start = xp.clip(xp.round(u) - _per_axis(xp, [float(w // 2) for w in sizes], coords), 0.0,
                    _per_axis(xp, [float(s - w) for s, w in zip(shape, sizes, strict=True)],
                              coords))
    box_start = xp.clip(start - 1.0, 0.0,
                        _per_axis(xp, [float(s - b) for s, b in zip(shape, boxes, strict=True)],
                                  coords))
    return Window(to_index(xp, start, dtype), sizes, to_index(xp, box_start, dtype), boxes)


def _axis_masks(xp: Any, first: Any, size: tuple[int, ...], extent: tuple[int, ...]) -> list[Any]:
    """Per axis ``(B, extent_a)`` bool: ``first[:, a] <= j < first[:, a] + size_a``."""
    device = device_of(first)
    masks = []
    for axis, length in enumerate(extent):
        j = xp.arange(length, dtype=first.dtype, device=device)[None, :]
        lo = first[:, axis : axis + 1]
        masks.append((j >= lo) & (j < lo + size[axis]))
    return masks


def combine(xp: Any, masks: list[Any]) -> Any:
    """Per-axis masks ``(B, L_a)`` -> their box ``(B, 1, *L)``."""
    n = len(masks)
    out = None
    for axis, m in enumerate(masks):
        view = [1] * n
        view[axis] = m.shape[1]
        m = xp.reshape(m, (m.shape[0], 1, *view))
        out = m if out is None else out & m
    return out


def window_mask(xp: Any, geometry: Window, shape: tuple[int, ...]) -> Any:
    """The window as a ``(B, 1, *S)`` bool mask of the grid."""
    return combine(xp, _axis_masks(xp, geometry.start, geometry.size, shape))


def box_window_masks(xp: Any, geometry: Window) -> list[Any]:
    """Per axis ``(B, box_a)``: which box cells are in the window."""
    return _axis_masks(xp, geometry.start - geometry.box_start, geometry.size, geometry.box)


def _take_rows(xp: Any, rows: Any, columns: list[int], firsts: list[Any],
               lengths: tuple[int, ...]) -> Any:
    """Pieces of ``rows (B, L)`` in one ``take``: piece ``k`` is
    ``rows[b, columns[k] + firsts[k][b] + j]`` for ``j < lengths[k]``; ``(B, sum(lengths))``."""
    batch, extent = rows.shape
    dtype = firsts[0].dtype
    device = device_of(firsts[0])
    pieces = [xp.reshape(first, (batch, 1)) + (xp.arange(length, dtype=dtype, device=device)
                                                 + column)[None, :]
              for column, first, length in zip(columns, firsts, lengths, strict=True)]
    base = xp.arange(batch, dtype=dtype, device=device)[:, None] * extent
    index = xp.reshape(xp.concat(pieces, axis=1) + base, (-1,))
    return xp.reshape(xp.take(xp.reshape(rows, (-1,)), index), (batch, sum(lengths)))


def _zero(xp: Any, x: Any) -> Any:
    return xp.zeros_like(x)


# ----------------------------------------------------------------------------- the box write


class BoxWrite(NamedTuple):
    """The splat restricted to the window, on the box: what its VJP needs too."""

    dense: Any  # (B, 1, prod(box)) window-masked outer product of the profiles
    profiles: list[Any]  # per axis (B, 1, box_a), window-masked
    offsets: list[Any]  # per axis (B, 1, box_a): p_a - mu_a
    denom: Any  # (B, 1, 1)


def box_write(xp: Any, write: Any, geometry: Window, shape: tuple[int, ...],
               eps: float, radius: float | None, masks: list[Any]) -> tuple[Any, BoxWrite]:
    """The written box ``(B, C, *box)``: the splat's own 1-D profiles cut to the box and masked to
    the window (``masks``: :func:`box_window_masks`)."""
    batch = write.write_content.shape[0]
    mu = write.write_coords[:, None, :]
    profiles, offsets, denom = gaussian_profiles(xp, mu, write.write_sigma[:, None], shape,
                                                 eps, radius)
    n = len(shape)
    rows = xp.concat([p[:, 0, :] for p in profiles] + [o[:, 0, :] for o in offsets], axis=1)
    columns, firsts, at = [], [], 0
    for _ in range(2):  # the profiles, then the offsets
        for axis in range(n):
            columns.append(at)
            firsts.append(geometry.box_start[:, axis])
            at += shape[axis]
    cut = _take_rows(xp, rows, columns, firsts, geometry.box * 2)
    box_profiles, box_offsets, at = [], [], 0
    for axis, length in enumerate(geometry.box):
        profile = cut[:, at : at + length]
        box_profiles.append(xp.where(masks[axis], profile, _zero(xp, profile))[:, None, :])
        start = sum(geometry.box) + at
        box_offsets.append(cut[:, start : start + length][:, None, :])
        at += length
    dense = outer_product(xp, box_profiles)  # (B, 1, prod(box))
    volume = write.write_content[:, :, None] * dense
    box = xp.reshape(volume, (batch, volume.shape[1], *geometry.box))
    return box, BoxWrite(dense, box_profiles, box_offsets, denom)


def box_write_bwd(xp: Any, write: Any, parts: BoxWrite, g: Any,
                   sigma: Any) -> tuple[Any, Any, Any]:
    """VJP of :func:`box_write` for ``g (B, C, *box)``: ``(d_content (B, C), d_mu (B, n), d_sigma
    (B,))``."""
    dense, profiles, offsets, denom = parts
    batch, channels = g.shape[:2]
    box = tuple(g.shape[2:])
    n = len(box)
    g_flat = xp.reshape(g, (batch, channels, dense.shape[2]))
    d_content = xp.matmul(dense, xp.matrix_transpose(g_flat))[:, 0, :]
    weighted = xp.reshape(xp.matmul(write.write_content[:, None, :], g_flat) * dense,
                          (batch, 1, *box))
    spatial = tuple(range(2, 2 + n))
    parts_mu: list[Any] = [None] * n
    moment2 = None
    for axis in range(n):
        view = [1] * n
        view[axis] = box[axis]
        offset = xp.reshape(offsets[axis], (batch, 1, *view))
        parts_mu[axis_of_component(axis, n)] = xp.sum(weighted * offset, axis=spatial)
        square = offsets[axis] * offsets[axis]
        square = xp.where(profiles[axis] == 0.0, _zero(xp, square), square)
        term = xp.sum(weighted * xp.reshape(square, offset.shape), axis=spatial)
        moment2 = term if moment2 is None else moment2 + term
    d_mu = xp.stack(parts_mu, axis=-1)  # (B, 1, n)
    denom2 = denom[..., 0]  # (B, 1)
    degenerate = denom == 0.0
    safe = xp.where(degenerate, xp.ones_like(denom), denom)
    d_mu = d_mu * xp.where(degenerate, _zero(xp, denom), 2.0 / safe)
    safe2 = safe[..., 0]
    scale = xp.where(denom2 == 0.0, _zero(xp, denom2), 4.0 * sigma[:, None] / (safe2 * safe2))
    return d_content, d_mu[:, 0, :], (moment2 * scale)[:, 0]


def window_write(xp: Any, write: Any, geometry: Window, shape: tuple[int, ...], eps: float,
                 radius: float | None) -> tuple[Any, Any, BoxWrite]:
    """The fast path's write: ``(box (B, C, *box), the window's cells in it (B, 1, *box), what
    box_write_bwd needs)``."""
    masks = box_window_masks(xp, geometry)
    volume, parts = box_write(xp, write, geometry, shape, eps, radius, masks)
    return volume, combine(xp, masks), parts


# ----------------------------------------------------------------------------- one step


def owned(xp: Any, x: Any) -> Any:
    """A copy the caller may update in place (JAX updates are functional: no copy)."""
    if array_api_compat.is_jax_namespace(xp):
        return x
    if array_api_compat.is_torch_array(x):  # (torch.asarray(copy=True) warns about grad)
        return x.clone()
    return xp.asarray(x, copy=True)


def box_update(xp: Any, params: ConvParams, h_box: Any, c_box: Any, volume: Any,
               inside: Any) -> tuple[Any, Any]:
    """The ConvLSTM on a box ``(B, C, *box)`` written with ``volume``, kept at the window's cells
    ``inside (B, 1, *box)``; on the whole grid, the masked path's update (the definition)."""
    h_new, c_new, _ = cell_fwd(xp, volume, h_box, c_box, params)
    return xp.where(inside, h_new, h_box), xp.where(inside, c_new, c_box)


def box_update_vjp(xp: Any, params: ConvParams, h_box: Any, c_box: Any, volume: Any,
                   inside: Any, g_h_box: Any, g_c_box: Any):
    """VJP of :func:`box_update`: ``(d_h box, d_c box, d_volume, d_params)``."""
    zero = _zero(xp, g_h_box)
    cache = cell_cache(xp, volume, h_box, c_box, params)
    d_x, d_h, d_c, d_params = cell_bwd(xp, cache, params, xp.where(inside, g_h_box, zero),
                                       xp.where(inside, g_c_box, zero))
    return (xp.where(inside, zero, g_h_box) + d_h, xp.where(inside, zero, g_c_box) + d_c, d_x,
            d_params)


def update_in_box(xp: Any, params: ConvParams, h: Any, c: Any, geometry: Window, index: Any,
                  volume: Any, inside: Any) -> tuple[Any, Any, Any, Any]:
    """:func:`box_update` on the box of ``h, c (B, C, *S)``, written back in place (pass arrays
    nothing else reads): ``(h', c', h box, c box)``, the boxes as they were before."""
    h_box = gather_box(xp, h, geometry.box_start, geometry.box, index)
    c_box = gather_box(xp, c, geometry.box_start, geometry.box, index)
    h_new, c_new = box_update(xp, params, h_box, c_box, volume, inside)
    return (set_box(xp, h, geometry.box_start, h_new, index),
            set_box(xp, c, geometry.box_start, c_new, index), h_box, c_box)


def update_in_box_vjp(xp: Any, params: ConvParams, g_h: Any, g_c: Any, geometry: Window,
                      index: Any, h_box: Any, c_box: Any, volume: Any, inside: Any):
    """VJP of :func:`update_in_box` from the boxes before the update; ``g_h, g_c (B, C, *S)``
    updated in place: ``(d_h, d_c, d_volume, d_params)``."""
    g_h_box = gather_box(xp, g_h, geometry.box_start, geometry.box, index)
    g_c_box = gather_box(xp, g_c, geometry.box_start, geometry.box, index)
    d_h_box, d_c_box, d_volume, d_params = box_update_vjp(xp, params, h_box, c_box, volume,
                                                          inside, g_h_box, g_c_box)
    return (set_box(xp, g_h, geometry.box_start, d_h_box, index),
            set_box(xp, g_c, geometry.box_start, d_c_box, index), d_volume, d_params)


def state_update_vjp(xp: Any, params: ConvParams, h: Any, c: Any, g_h: Any, g_c: Any,
                     geometry: Window, index: Any, volume: Any, inside: Any):
    """:func:`update_in_box_vjp` from the state ``h, c`` before the update, on copies of
    ``g_h, g_c``."""
    return update_in_box_vjp(xp, params, owned(xp, g_h), owned(xp, g_c), geometry, index,
                             gather_box(xp, h, geometry.box_start, geometry.box, index),
                             gather_box(xp, c, geometry.box_start, geometry.box, index),
                             volume, inside)


def masked_update_vjp(xp: Any, params: ConvParams, h: Any, c: Any, written: Any, mask: Any,
                      g_h: Any, g_c: Any):
    """VJP of the masked path's update: ``(d_h, d_c, d_written (zero outside), d_params)``."""
    d_h, d_c, d_x, d_params = box_update_vjp(xp, params, h, c, written, mask, g_h, g_c)
    return d_h, d_c, xp.where(mask, d_x, _zero(xp, d_x)), d_params


def masked_write(xp: Any, write: Any, shape: tuple[int, ...], window: int, eps: float,
                 radius: float | None) -> tuple[Any, Any]:
    """``(written (B, C, *S), mask (B, 1, *S))``: the splat cut to the window (for a cotangent zero
    outside the window, its VJP is :func:`splat_rows_vjp`)."""
    mask = window_mask(xp, window_geometry(xp, write.write_coords, shape, window), shape)
    splat = splat_rows(xp, write, shape, eps, radius)
    return xp.where(mask, splat, _zero(xp, splat)), mask


# ----------------------------------------------------------------------------- validation


def check_method(method: Any) -> str:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    return method


def _validate_step(h, c, write_coords, write_sigma, write_content, params, window, eps, radius,
                   method, g_h=None, g_c=None):
    params = as_conv_params(params)
    xp = namespace_of(h=h, c=c, write_coords=write_coords, write_sigma=write_sigma,
                      write_content=write_content, g_h=g_h, g_c=g_c,
                      **{f"params.{k}": v for k, v in params._asdict().items()})
    validate_state(h, c)
    batch, channels = h.shape[:2]
    n = h.ndim - 2
    check_rank("write_coords", write_coords, 2, "(B, n)")
    check_dim("write_coords", write_coords, 0, batch, "(B, n)", "B = h.shape[0]")
    check_dim("write_coords", write_coords, 1, n, "(B, n)", "n = number of spatial axes of h")
    check_rank("write_sigma", write_sigma, 1, "(B,)")
    check_dim("write_sigma", write_sigma, 0, batch, "(B,)", "B = h.shape[0]")
    check_rank("write_content", write_content, 2, "(B, C)")
    check_dim("write_content", write_content, 0, batch, "(B, C)", "B = h.shape[0]")
    check_dim("write_content", write_content, 1, channels, "(B, C)", "C = h.shape[1]")
    check_like_h(h, g_h=g_h, g_c=g_c)
    validate_gate_conv(params, n, channels)
    check_int("window", window, 1)
    check_radius(radius)
    check_eps(eps)
    check_method(method)
    check_positive(xp, "write_sigma", write_sigma)
    return xp, params


# ----------------------------------------------------------------------------- public step


def local_update(h: Any, c: Any, write_coords: Any, write_sigma: Any, write_content: Any,
                 params: ConvParams, *, window: int, eps: float = DEFAULT_EPS,
                 radius: float | None = None, method: str = "fast") -> tuple[Any, Any]:
    """Run one write and ConvLSTM update confined to a window around the write.

    Parameters
    ----------
    h, c : array, shape ``(B, C, *S)``
        The state, with 1 to 4 spatial axes.
    write_coords : array, shape ``(B, n)``
        The normalized write centre.
    write_sigma : array, shape ``(B,)``
        The write spread (> 0).
    write_content : array, shape ``(B, C)``
        The content vector.
    params : ConvParams
        The gate conv, ``C_in = 2C``, ``C_out = 4C``.
    window : int
        Cells per axis, ``w >= 1`` (``min(w, S_a)`` on each axis).
    eps, radius : float, float or None
        As in :func:`tmcore.gaussian_splat`.
    method : {"fast", "masked"}, default "fast"
        The box path or the dense definition (:mod:`tmcore.ops.window`), equal to rounding.

    Returns
    -------
    h_new, c_new : array, shape ``(B, C, *S)``
        The updated state, equal to ``h, c`` bit for bit outside the window.

    Raises
    ------
    TypeError
        If an argument is not an array (or ``params`` not four arrays), the arrays mix
        namespaces, a dtype is not real floating, or ``window`` is not an int.
    ValueError
        If a shape does not match ``h``'s ``B``, ``C`` and ``n``, ``window`` is < 1, ``eps``
        or ``radius`` is out of range, ``method`` is unknown, or (validate mode only) an array
        holds NaN or inf or ``write_sigma`` <= 0.
    """
    xp, params = _validate_step(h, c, write_coords, write_sigma, write_content, params,
                                window, eps, radius, method)
    write = Write(write_coords, write_sigma, write_content)
    shape = tuple(h.shape[2:])
    if method == "masked":
        written, mask = masked_write(xp, write, shape, window, eps, radius)
        return box_update(xp, params, h, c, written, mask)
    geometry = window_geometry(xp, write_coords, shape, window)
    index = box_index(xp, geometry.box_start, geometry.box, h.shape[0], h.shape[1], shape)
    volume, inside, _ = window_write(xp, write, geometry, shape, eps, radius)
    h_new, c_new, _, _ = update_in_box(xp, params, owned(xp, h), owned(xp, c), geometry, index,
                                       volume, inside)
    return h_new, c_new


def local_update_vjp(h: Any, c: Any, write_coords: Any, write_sigma: Any, write_content: Any,
                     params: ConvParams, g_h: Any, g_c: Any, *, window: int,
                     eps: float = DEFAULT_EPS, radius: float | None = None,
                     method: str = "fast") -> tuple[Any, Any, Any, Any, Any, ConvParams]:
    """Give the gradients of :func:`local_update` for ``g_h, g_c``.

    Outside the window ``d_h = g_h`` and ``d_c = g_c``, except on the 1-cell halo the gates read.

    Parameters
    ----------
    h, c, write_coords, write_sigma, write_content, params : array or ConvParams
        As in :func:`local_update`.
    g_h, g_c : array, shape ``(B, C, *S)``
        The cotangents of the updated state.
    window, eps, radius, method : see local_update
        The options of the forward step.

    Returns
    -------
    tuple
        ``(d_h, d_c, d_write_coords (B, n), d_write_sigma (B,), d_write_content (B, C),
        d_params)``, each shaped like its input.

    Raises
    ------
    TypeError, ValueError
        As :func:`local_update`; also if ``g_h`` or ``g_c`` is not an array shaped like ``h``.
    """
    require_array("g_h", g_h)
    require_array("g_c", g_c)
    xp, params = _validate_step(h, c, write_coords, write_sigma, write_content, params,
                                window, eps, radius, method, g_h, g_c)
    write = Write(write_coords, write_sigma, write_content)
    shape = tuple(h.shape[2:])
    if method == "masked":
        written, mask = masked_write(xp, write, shape, window, eps, radius)
        d_h, d_c, d_x, d_params = masked_update_vjp(xp, params, h, c, written, mask, g_h, g_c)
        return (d_h, d_c, *splat_rows_vjp(xp, write, shape, d_x, eps, radius), d_params)
    geometry = window_geometry(xp, write_coords, shape, window)
    index = box_index(xp, geometry.box_start, geometry.box, h.shape[0], h.shape[1], shape)
    volume, inside, parts = window_write(xp, write, geometry, shape, eps, radius)
    d_h, d_c, d_x, d_params = state_update_vjp(xp, params, h, c, g_h, g_c, geometry, index,
                                               volume, inside)
    d_content, d_mu, d_sigma = box_write_bwd(xp, write, parts, d_x, write_sigma)
    return d_h, d_c, d_mu, d_sigma, d_content, d_params


# ----------------------------------------------------------------------------- local read


def corners(xp: Any, coords: Any, shape: tuple[int, ...]):
    """The ``2^n`` cells a read at ``coords (B, n)`` uses, as a box: ``(start (B, n), size, weights,
    slopes)``, per axis ``(B, 1, size_a)``, with :func:`tmcore.ops.sample.tent_profiles`'s
    conventions."""
    dtype = index_dtype(xp, device_of(coords))
    half = _per_axis(xp, [(s - 1) / 2.0 for s in shape], coords)
    top = _per_axis(xp, [float(s - 1) for s in shape], coords)
    u = (xp.clip(xp.flip(coords, axis=1), -1.0, 1.0) + 1.0) * half  # spatial-axis order
    clamped = xp.clip(u, 0.0, top)
    # u * 0: NaN for a NaN coordinate (so its gradient is NaN too), else 0
    inside = xp.astype((u > 0.0) & (u < top), coords.dtype) + u * 0.0
    lower = xp.clip(xp.floor(clamped), 0.0,
                    _per_axis(xp, [float(max(s - 2, 0)) for s in shape], coords))
    frac = clamped - lower  # 0 on a 1-cell axis (its one weight is 1 - 0)
    step = inside * half
    weights = xp.stack([1.0 - frac, frac], axis=-1)  # (B, n, 2)
    slopes = xp.stack([-step, step], axis=-1)
    sizes = tuple(1 if s == 1 else 2 for s in shape)
    return (to_index(xp, lower, dtype), sizes,
            [weights[:, a : a + 1, :k] for a, k in enumerate(sizes)],
            [slopes[:, a : a + 1, :k] for a, k in enumerate(sizes)])


def read_corners(xp: Any, h: Any, coords: Any):
    """``(read (B, C), corner box (B, C, *size), start, size, weights, slopes)``."""
    start, size, weights, slopes = corners(xp, coords, tuple(h.shape[2:]))
    box = gather_box(xp, h, start, size)
    dense = outer_product(xp, weights)  # (B, 1, 2^n)
    flat = xp.reshape(box, (box.shape[0], box.shape[1], dense.shape[2]))
    return xp.matmul(dense, xp.matrix_transpose(flat))[:, 0, :], box, start, size, weights, slopes


def read_corners_bwd(xp: Any, box: Any, weights: list[Any], slopes: list[Any],
                  g: Any) -> tuple[Any, Any]:
    """VJP of the corner read: ``(d_box (B, C, *size), d_coords (B, n))``."""
    n = len(weights)
    batch, channels = box.shape[:2]
    dense = outer_product(xp, weights)
    flat = xp.reshape(box, (batch, channels, dense.shape[2]))
    d_box = xp.reshape(xp.matmul(g[:, :, None], dense), box.shape)
    g_dot = xp.matmul(g[:, None, :], flat)  # (B, 1, 2^n)
    parts: list[Any] = [None] * n
    for axis in range(n):
        slope = outer_product(xp, weights, replace={axis: slopes[axis]})
        parts[axis_of_component(axis, n)] = xp.sum(g_dot * slope, axis=-1)[:, 0]
    return d_box, xp.stack(parts, axis=-1)
