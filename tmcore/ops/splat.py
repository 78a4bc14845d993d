"""Gaussian splatting (the write), and its VJP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tmcore.ops.addressing import axis_of_component
from tmcore.ops.common import grid_size, outer_product
from tmcore.runtime import validate
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.validate import (
    check_dim,
    check_eps,
    check_grid_shape,
    check_nonempty,
    check_positive,
    check_radius,
    check_rank,
    namespace_of,
    require_array,
)
from tmcore.types import device_of

__all__ = ["gaussian_splat", "gaussian_splat_vjp", "gaussian_profiles", "DEFAULT_EPS",
           "validate_splat_inputs"]

DEFAULT_EPS = 1e-6


def gaussian_profiles(
    xp: Any, mu: Any, sigma: Any, shape: tuple[int, ...], eps: float, radius: float | None
) -> tuple[list[Any], list[Any], Any]:
    """Per-axis profiles of writes at ``mu (B, K, n)`` with ``sigma (B, K)``: ``(profiles, offsets
    p_a - mu_a, denom)``, n ``(B, K, S_a)`` arrays each (spatial-axis order, profiles truncated
    by ``radius``) and ``denom = 2 sigma^2 + eps`` of shape ``(B, K, 1)``."""
    n = len(shape)
    device = device_of(mu)
    denom = (2.0 * sigma * sigma + eps)[..., None]
    # denom = 0 (sigma = 0 with eps = 0, or 2 sigma^2 underflowing): the limit, a
    # weight of 1 on a centre the write hits exactly and 0 elsewhere, not 0/0 = NaN.
    # With eps > 0, denom >= eps > 0 and the plain formula serves (no extra passes).
    degenerate = denom == 0.0 if eps <= 0.0 else None
    if degenerate is not None:
        safe_denom = xp.where(degenerate, xp.ones_like(denom), denom)
    profiles, offsets = [], []
    for axis in range(n):
        centres = xp.linspace(-1.0, 1.0, shape[axis], dtype=mu.dtype, device=device)
        offset = centres - mu[..., axis_of_component(axis, n), None]
        square = offset * offset
        if degenerate is None:
            profile = xp.exp(-square / denom)
        else:
            exponent = square / safe_denom
            limit = xp.where(square > 0.0, xp.full_like(square, xp.inf), square)  # NaN stays
            profile = xp.exp(-xp.where(degenerate, limit, exponent))
        if radius is not None:
            inside = xp.abs(offset) <= radius * sigma[..., None]
            profile = xp.where(inside, profile, profile * 0.0)  # 0, but NaN stays NaN
        profiles.append(profile)
        offsets.append(offset)
    return profiles, offsets, denom


def splat_fwd(
    xp: Any, content: Any, mu: Any, sigma: Any, shape: tuple[int, ...], eps: float,
    radius: float | None,
) -> Any:
    """``(B, K, C), (B, K, n), (B, K) -> (B, C, *shape)`` without validation."""
    profiles, _, _ = gaussian_profiles(xp, mu, sigma, shape, eps, radius)
    dense = outer_product(xp, profiles)  # (B, K, P)
    if content.shape[1] == 1:  # one write: an outer product (the same single rounding as
        # the K = 1 matmul, which some BLAS run many times slower)
        volume = content[:, 0, :, None] * dense
    else:
        volume = xp.matmul(xp.matrix_transpose(content), dense)  # (B, C, P)
    return xp.reshape(volume, (content.shape[0], content.shape[2], *shape))


def splat_bwd(
    xp: Any, content: Any, mu: Any, sigma: Any, shape: tuple[int, ...], g: Any, eps: float,
    radius: float | None,
) -> tuple[Any, Any, Any]:
    """VJP of :func:`splat_fwd` for ``g (B, C, *shape)``; no validation."""
    n = len(shape)
    profiles, offsets, denom = gaussian_profiles(xp, mu, sigma, shape, eps, radius)
    dense = outer_product(xp, profiles)  # (B, K, P)
    g_flat = xp.reshape(g, (g.shape[0], g.shape[1], grid_size(shape)))  # (B, C, P)
    d_content = xp.matmul(dense, xp.matrix_transpose(g_flat))  # (B, K, C)
    # sensitivity of the loss to each cell's weight, times the weight: (B, K, *S)
    weighted = xp.reshape(xp.matmul(content, g_flat) * dense, (*dense.shape[:2], *shape))
    spatial_axes = tuple(range(2, 2 + n))
    d_mu_parts = [None] * n
    moment2 = None
    for axis in range(n):
        view = [1] * n
        view[axis] = shape[axis]
        offset = xp.reshape(offsets[axis], (*dense.shape[:2], *view))
        # d w / d mu_a = w * 2 (p_a - mu_a) / denom
        d_mu_parts[axis_of_component(axis, n)] = xp.sum(weighted * offset, axis=spatial_axes)
        # w (p_a - mu_a)^2 is 0 wherever the profile is 0, also when the square overflows
        # (a write far outside, e.g. at 1e30 in float32: 0 * inf would be NaN)
        square = offsets[axis] * offsets[axis]
        square = xp.where(profiles[axis] == 0.0, xp.zeros_like(square), square)
        term = xp.sum(weighted * xp.reshape(square, offset.shape), axis=spatial_axes)
        moment2 = term if moment2 is None else moment2 + term
    # denom = 0: the weight is a step in mu and sigma (flat on either side); its
    # gradient is taken as 0 rather than 0 * inf
    if eps > 0.0:  # denom >= eps > 0
        d_mu = xp.stack(d_mu_parts, axis=-1) * (2.0 / denom)
        # d w / d sigma = w * ||p - mu||^2 * 4 sigma / denom^2
        d_sigma = moment2 * (4.0 * sigma / (denom[..., 0] * denom[..., 0]))
        return d_content, d_mu, d_sigma
    degenerate = denom == 0.0
    safe_denom = xp.where(degenerate, xp.ones_like(denom), denom)
    zero = xp.zeros_like(denom)
    d_mu = xp.stack(d_mu_parts, axis=-1) * xp.where(degenerate, zero, 2.0 / safe_denom)
    scale = xp.where(degenerate, zero, 4.0 * sigma[..., None] / (safe_denom * safe_denom))
    d_sigma = moment2 * scale[..., 0]
    return d_content, d_mu, d_sigma


def splat_rows(xp: Any, write: Any, shape: tuple[int, ...], eps: float,
               radius: float | None) -> Any:
    """One write per row through ``ops_for(xp)``: ``write_coords (M, n)``, ``write_sigma (M,)``,
    ``write_content (M, C)`` (a :class:`tmcore.StepInputs` serves) -> ``(M, C, *shape)``."""
    return ops_for(xp).splat_fwd(xp, write.write_content[:, None, :],
                                 write.write_coords[:, None, :], write.write_sigma[:, None],
                                 shape, eps, radius)


def splat_rows_vjp(xp: Any, write: Any, shape: tuple[int, ...], g: Any, eps: float,
                   radius: float | None) -> tuple[Any, Any, Any]:
    """VJP of :func:`splat_rows` for ``g (M, C, *shape)``: ``(d_mu (M, n), d_sigma (M,), d_content
    (M, C))``."""
    d_content, d_mu, d_sigma = ops_for(xp).splat_bwd(
        xp, write.write_content[:, None, :], write.write_coords[:, None, :],
        write.write_sigma[:, None], shape, g, eps, radius)
    return d_mu[:, 0, :], d_sigma[:, 0], d_content[:, 0, :]


def validate_splat_inputs(content, mu, sigma, shape, g=None, radius=None, eps=DEFAULT_EPS):
    """The checks of :func:`gaussian_splat` and its VJP (the torch op's too): ``(namespace,
    shape as a tuple)``."""
    dims = check_grid_shape("shape", shape)
    xp = namespace_of(content=content, mu=mu, sigma=sigma, g=g)
    check_rank("content", content, 3, "(B, K, C)")
    check_nonempty("content", content, "(B, K, C)", axes=(0, 2))
    batch, writes, channels = content.shape
    check_rank("mu", mu, 3, "(B, K, n)")
    if tuple(mu.shape) != (batch, writes, len(dims)):
        raise ValueError(
            f"mu: expected shape (B, K, n) = {(batch, writes, len(dims))} "
            f"(B, K from content, n = len(shape)), got {tuple(mu.shape)}"
        )
    check_rank("sigma", sigma, 2, "(B, K)")
    check_dim("sigma", sigma, 0, batch, "(B, K)", "B = content.shape[0]")
    check_dim("sigma", sigma, 1, writes, "(B, K)", "K = content.shape[1]")
    if g is not None and tuple(g.shape) != (batch, channels, *dims):
        raise ValueError(
            f"g: expected shape (B, C, *shape) = {(batch, channels, *dims)}, got {tuple(g.shape)}"
        )
    check_radius(radius)
    check_eps(eps)
    validate.check_array(xp, "shape", (batch, channels, *dims), "(B, C, *shape)", "the volume",
                       content)
    check_positive(xp, "sigma", sigma)
    return xp, dims




def gaussian_splat(
    content: Any, mu: Any, sigma: Any, shape: Sequence[int], *, eps: float = DEFAULT_EPS,
    radius: float | None = None,
) -> Any:
    """Write ``K`` content vectors as isotropic Gaussian volumes and sum them.

    ``volume[b, :, p] = sum_k content[b, k, :] * w_bk(p)`` with the unnormalized weight
    ``w_bk(p) = exp(-||p - mu_bk||^2 / (2 sigma_bk^2 + eps))`` over the normalized cell centres
    ``p``: a product of one 1-D profile per axis, so the write is a dense contraction.

    Parameters
    ----------
    content : array, shape ``(B, K, C)``
        The vectors to write.
    mu : array, shape ``(B, K, n)``
        The normalized centres; ``mu[..., k]`` addresses spatial axis ``n - 1 - k``.
    sigma : array, shape ``(B, K)``
        The spreads, in normalized units, > 0. Checked in validate mode only (a host sync);
        otherwise ``sigma = 0`` gives a one-hot-like weight limited by ``eps`` (with
        ``eps = 0`` its limit, docs/guides/errors-and-cache.md) and a negative sigma acts
        like ``|sigma|`` except under ``radius``.
    shape : sequence of int
        The spatial grid shape ``S``, 1 to 4 positive ints.
    eps : float, default 1e-6
        Added to ``2 sigma^2``; finite and >= 0.
    radius : float or None, default None
        Truncation in units of sigma: each axis profile is 0 where ``|p_a - mu_a| > radius *
        sigma`` (a box, so the weight stays separable; the mask is constant in the gradient).

    Returns
    -------
    array, shape ``(B, C, *shape)``
        The written volume, in the inputs' namespace, device and dtype.

    Raises
    ------
    TypeError
        If an argument is not a real floating array, the arrays mix namespaces, or ``shape``
        is not a sequence of ints.
    ValueError
        If a shape does not match the layouts above, ``shape`` has no or more than 4 axes or
        a size < 1, ``eps`` is negative or not finite, ``radius`` is not None or > 0, or
        (validate mode only) an array holds NaN or inf or a sigma is not > 0.

    Examples
    --------
    One write at the centre of a 1-D grid of five cells:

    >>> import numpy as np
    >>> import tmcore
    >>> content, mu, sigma = np.ones((1, 1, 1)), np.zeros((1, 1, 1)), np.full((1, 1), 0.5)
    >>> volume = tmcore.gaussian_splat(content, mu, sigma, (5,))      # (B, C, 5)
    >>> np.round(volume[0, 0], 3)                                     # exp(-p^2 / 0.5)
    array([0.135, 0.607, 1.   , 0.607, 0.135])
    """
    xp, dims = validate_splat_inputs(content, mu, sigma, shape, radius=radius, eps=eps)
    return ops_for(xp).splat_fwd(xp, content, mu, sigma, dims, eps, radius)


def gaussian_splat_vjp(
    content: Any, mu: Any, sigma: Any, shape: Sequence[int], g: Any, *,
    eps: float = DEFAULT_EPS, radius: float | None = None,
) -> tuple[Any, Any, Any]:
    """Give the gradients of :func:`gaussian_splat` for the cotangent ``g``.

    Parameters
    ----------
    content, mu, sigma, shape : array or sequence of int
        As in :func:`gaussian_splat`.
    g : array, shape ``(B, C, *shape)``
        The cotangent of the written volume.
    eps, radius : float, float or None
        As in :func:`gaussian_splat`.

    Returns
    -------
    d_content : array, shape ``(B, K, C)``
        The gradient for ``content``.
    d_mu : array, shape ``(B, K, n)``
        The gradient for ``mu``.
    d_sigma : array, shape ``(B, K)``
        The gradient for ``sigma``.

    Raises
    ------
    TypeError, ValueError
        As :func:`gaussian_splat`; also if ``g`` is not an array of shape ``(B, C, *shape)``.
    """
    require_array("g", g)
    xp, dims = validate_splat_inputs(content, mu, sigma, shape, g=g, radius=radius, eps=eps)
    return ops_for(xp).splat_bwd(xp, content, mu, sigma, dims, g, eps, radius)
