"""The JAX adapter's primitives: :func:`trilinear_sample`, :func:`gaussian_splat` and
:func:`memory_scan` on ``jax.Array`` s, each checked (shapes, dtypes, and in validate mode
the values of concrete arrays) and then run as tmcore's ``custom_vjp`` of
:mod:`tmcore.adapters.jax.bridge` (forward mode refused with a clear ``TypeError``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tmcore.adapters.jax import bridge as _scan_mod
from tmcore.adapters.jax.bridge import forward_mode_guard
from tmcore.ops.sample import validate_sample_inputs
from tmcore.ops.splat import DEFAULT_EPS, validate_splat_inputs
from tmcore.runtime.validate import check_values
from tmcore.scan.dense import DenseStep, validate_scan_inputs
from tmcore.types import ConvParams, StepInputs

__all__ = ["gaussian_splat", "memory_scan", "trilinear_sample"]


def trilinear_sample(
    volume: jax.Array,  # [B, C, *S]
    coords: jax.Array,  # [B, Q, n]
) -> jax.Array:  # [B, Q, C]
    """:func:`tmcore.trilinear_sample` with tmcore's VJP registered with JAX.

    Works under ``jit``, ``vmap``, ``grad`` and ``shard_map``; forward mode
    (``jvp``) is refused with a ``TypeError`` saying what to use instead.

    Parameters
    ----------
    volume : jax.Array, shape ``(B, C, *S)``
        The grid to read, with 1 to 4 spatial axes ``S``.
    coords : jax.Array, shape ``(B, Q, n)``
        ``Q`` query positions per batch element in ``[-1, 1]``;
        ``coords[..., k]`` addresses spatial axis ``n - 1 - k``.

    Returns
    -------
    jax.Array, shape ``(B, Q, C)``
        The n-linear interpolation of ``volume`` at ``coords`` (border padding).

    Raises
    ------
    TypeError
        If an argument is not an array or not real floating, or under forward
        mode differentiation.
    ValueError
        If the shapes do not match the layouts above, or (validate mode, concrete
        arrays) an array holds NaN or inf.
    """
    volume, coords = jnp.asarray(volume), jnp.asarray(coords)
    validate_sample_inputs(volume, coords)
    check_values(jnp, {"volume": volume, "coords": coords})
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

    Parameters
    ----------
    content : jax.Array, shape ``(B, K, C)``
        ``K`` content vectors per batch element.
    mu : jax.Array, shape ``(B, K, n)``
        Their normalized centres in ``[-1, 1]`` (``mu[..., k]`` addresses
        spatial axis ``n - 1 - k``).
    sigma : jax.Array, shape ``(B, K)``
        Their spreads in normalized units, > 0.
    shape : sequence of int
        The grid shape ``S`` (``n = len(S)``, 1 to 4 axes); static.
    eps : float, default 1e-6
        Added to ``2 sigma^2`` in the Gaussian's denominator; static.
    radius : float or None, default None
        Truncation radius in units of sigma (``None``: the whole grid); static.

    Returns
    -------
    jax.Array, shape ``(B, C, *shape)``
        The written volume, ``sum_k content[b, k] * w_bk(p)`` at every cell ``p``.

    Raises
    ------
    TypeError
        If an array argument is not an array or not real floating, or under
        forward mode differentiation.
    ValueError
        If the shapes do not match the layouts above, ``eps`` or ``radius`` is
        out of range, or (validate mode, concrete arrays) a value is not finite
        or a sigma is not > 0.
    """
    content, mu, sigma = map(jnp.asarray, (content, mu, sigma))
    _, dims = validate_splat_inputs(content, mu, sigma, shape, radius=radius, eps=eps)
    check_values(jnp, {"content": content, "mu": mu, "sigma": sigma})
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
    ``tmcore.scan.step_bwd``; the gradients do not depend on ``k``. Mixed
    floating dtypes are promoted to a common one (JAX's rules).

    Parameters
    ----------
    h0 : jax.Array, shape ``(B, C, *S)``
        The initial hidden state, with 1 to 4 spatial axes.
    c0 : jax.Array, shape ``(B, C, *S)``
        The initial cell state.
    read_coords : jax.Array, shape ``(B, T, n)``
        The normalized read position of each step.
    write_coords : jax.Array, shape ``(B, T, n)``
        The normalized write centre of each step.
    write_sigma : jax.Array, shape ``(B, T)``
        The write spread of each step, > 0.
    write_content : jax.Array, shape ``(B, T, C)``
        The content vector each step writes.
    params : tmcore.ConvParams
        The ConvLSTM's gate conv (``C_in = 2C``, ``C_out = 4C``; :func:`conv_params`).
    eps : float, default 1e-6
        As in :func:`gaussian_splat`.
    radius : float or None, default None
        As in :func:`gaussian_splat`.
    checkpoint_every : int, default 1
        ``k``: the backward stores every ``k``-th state and recomputes the rest.

    Returns
    -------
    reads : jax.Array, shape ``(B, T, C)``
        What each step read (before its write).
    h_T : jax.Array, shape ``(B, C, *S)``
        The final hidden state.
    c_T : jax.Array, shape ``(B, C, *S)``
        The final cell state.

    Raises
    ------
    TypeError
        If an argument is not an array, the arrays are not floating,
        ``params`` is not a 4-tuple or ``checkpoint_every`` is not an int, or
        under forward mode differentiation.
    ValueError
        If a shape does not match the layouts above, ``T`` is 0,
        ``checkpoint_every < 1``, ``eps`` or ``radius`` is out of range, or
        (validate mode, concrete arrays) a value is not finite.
    """
    arrays = [jnp.asarray(a) for a in (h0, c0, read_coords, write_coords, write_sigma,
                                       write_content, *params)]
    dtype = _promote("memory_scan", arrays)
    h0, c0, read_coords, write_coords, write_sigma, write_content, *cell = (
        a.astype(dtype) for a in arrays)
    _, params = validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma,
                                     write_content, ConvParams(*cell), checkpoint_every, radius,
                                     eps=eps)
    check_values(jnp, {"h0": h0, "c0": c0, "read_coords": read_coords,
                           "write_coords": write_coords, "write_sigma": write_sigma,
                           "write_content": write_content})
    static = _scan_mod.ScanStatic(DenseStep(float(eps), _static_radius(radius)),
                                  int(checkpoint_every), _scan_mod.options_key())
    xs = StepInputs(*map(_time_major, (read_coords, write_coords, write_sigma, write_content)))
    reads, h, c = forward_mode_guard(
        "memory_scan", lambda: _scan_mod.checkpoint_scan(static, params, xs, h0, c0))
    return _batch_major(reads), h, c

