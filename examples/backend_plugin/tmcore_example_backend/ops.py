"""The read and its VJP by gathering the ``2**n`` corners of each query (the generic path
contracts the volume with dense per-axis weights); everything else is tmcore's generic
table. float16 is computed in float32; :data:`CALLS` counts the calls of each entry.
"""

import collections
import itertools

import numpy as np

from tmcore import Options
from tmcore.backends import Ops

__all__ = ["CALLS", "make_ops"]

CALLS: collections.Counter = collections.Counter()


def _axes(coords, shape, dtype):
    """Per spatial axis: lower corner index, upper one, upper weight and ``du/dx``."""
    n = len(shape)
    axes = []
    for a, size in enumerate(shape):
        u = (coords[..., n - 1 - a].astype(dtype) + 1) / 2 * (size - 1)
        # border padding: no coordinate gradient on or beyond the border (as grid_sample)
        slope = np.where((u > 0) & (u < size - 1), (size - 1) / 2, 0).astype(dtype)
        u = np.clip(u, 0, size - 1)
        lower = np.minimum(np.floor(u), max(size - 2, 0)).astype(np.intp)
        axes.append((lower, np.minimum(lower + 1, size - 1), u - lower, slope))
    return axes


def _corners(volume, coords):
    """The compute dtype, the cells ``(B, *S, C)``, the axes, and per corner of the
    ``2**n``: its bits, gather index and per-axis weight factors."""
    dtype = np.float64 if np.float64 in (volume.dtype, coords.dtype) else np.float32
    axes = _axes(coords, volume.shape[2:], dtype)
    batch = np.arange(volume.shape[0])[:, None]
    corners = []
    for bits in itertools.product((0, 1), repeat=len(axes)):
        picked = list(zip(axes, bits, strict=True))
        index = (batch, *(upper if bit else lower for (lower, upper, _, _), bit in picked))
        corners.append((bits, index, [t if bit else 1 - t for (_, _, t, _), bit in picked]))
    return dtype, np.moveaxis(volume.astype(dtype), 1, -1), axes, corners


def sample_fwd(xp, volume, coords):
    """``volume (B, C, *S)``, ``coords (B, Q, n)`` -> ``(B, Q, C)``."""
    CALLS["sample_fwd"] += 1
    dtype, cells, _, corners = _corners(volume, coords)
    out = np.zeros((*coords.shape[:2], cells.shape[-1]), dtype=dtype)
    for _, index, factors in corners:
        out += np.prod(factors, axis=0)[..., None] * cells[index]
    return out.astype(np.result_type(volume.dtype, coords.dtype))


def sample_bwd(xp, volume, coords, g):
    """-> ``(d_volume (B, C, *S), d_coords (B, Q, n))``."""
    CALLS["sample_bwd"] += 1
    dtype, cells, axes, corners = _corners(volume, coords)
    g = g.astype(dtype)
    d_cells = np.zeros_like(cells)
    d_u = np.zeros((len(axes), *coords.shape[:2]), dtype=dtype)
    for bits, index, factors in corners:
        np.add.at(d_cells, index, np.prod(factors, axis=0)[..., None] * g)
        value = np.sum(cells[index] * g, axis=-1)
        for a, bit in enumerate(bits):
            others = np.prod(factors[:a] + factors[a + 1:], axis=0)
            d_u[a] += (1 if bit else -1) * others * value
    n = len(axes)
    d_coords = np.stack([d_u[n - 1 - k] * axes[n - 1 - k][3] for k in range(n)], axis=-1)
    return np.moveaxis(d_cells, -1, 1).astype(volume.dtype), d_coords.astype(coords.dtype)


def make_ops(generic: Ops, options: Options) -> Ops:
    """The NumPy table: this module's read and its VJP, and the generic write's VJP
    through :func:`splat_bwd`; the rest is ``generic``'s."""

    def splat_bwd(xp, content, mu, sigma, shape, g, eps, radius):
        CALLS["splat_bwd"] += 1
        d_content, d_mu, d_sigma = generic.splat_bwd(xp, content, mu, sigma, shape, g, eps,
                                                     radius)
        return d_content, d_mu, d_sigma

    return generic._replace(sample_fwd=sample_fwd, sample_bwd=sample_bwd, splat_bwd=splat_bwd)
