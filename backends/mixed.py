"""The mixed-precision rule of the backends: float16 / bfloat16 inputs compute in float32, and
each result comes back in its primal's dtype (a gradient in its input's).
"""

from __future__ import annotations

from typing import Any

from tmcore.runtime.dispatch import Ops
from tmcore.types import ConvParams

__all__ = ["with_float32_compute"]


def _low(xp: Any) -> tuple[Any, ...]:
    return tuple(d for d in (getattr(xp, "float16", None), getattr(xp, "bfloat16", None)) if d)


def _any_low(xp: Any, *arrays: Any) -> bool:
    low = _low(xp)
    return any(a.dtype in low for a in arrays)


def _up(xp: Any, *arrays: Any) -> list[Any]:
    return [xp.astype(a, xp.float32) for a in arrays]


def with_float32_compute(ops: Ops) -> Ops:
    """``ops`` with half-precision inputs computed in float32; conv residuals become ``(x dtype or
    None, inner residuals)``."""

    def sample_fwd(xp, volume, coords):
        if not _any_low(xp, volume, coords):
            return ops.sample_fwd(xp, volume, coords)
        out = ops.sample_fwd(xp, *_up(xp, volume, coords))
        return xp.astype(out, xp.result_type(volume.dtype, coords.dtype))

    def sample_bwd(xp, volume, coords, g):
        if not _any_low(xp, volume, coords, g):
            return ops.sample_bwd(xp, volume, coords, g)
        d_volume, d_coords = ops.sample_bwd(xp, *_up(xp, volume, coords, g))
        return xp.astype(d_volume, volume.dtype), xp.astype(d_coords, coords.dtype)

    def splat_fwd(xp, content, mu, sigma, shape, eps, radius):
        if not _any_low(xp, content, mu, sigma):
            return ops.splat_fwd(xp, content, mu, sigma, shape, eps, radius)
        out = ops.splat_fwd(xp, *_up(xp, content, mu, sigma), shape, eps, radius)
        return xp.astype(out, xp.result_type(content.dtype, mu.dtype, sigma.dtype))

    def splat_bwd(xp, content, mu, sigma, shape, g, eps, radius):
        if not _any_low(xp, content, mu, sigma, g):
            return ops.splat_bwd(xp, content, mu, sigma, shape, g, eps, radius)
        content32, mu32, sigma32, g32 = _up(xp, content, mu, sigma, g)
        grads = ops.splat_bwd(xp, content32, mu32, sigma32, shape, g32, eps, radius)
        return tuple(xp.astype(d, p.dtype) for d, p in zip(grads, (content, mu, sigma),
                                                             strict=True))

    def conv_fwd(xp, x, params):
        params = ConvParams(*params)
        if not _any_low(xp, x, *params):
            z, residuals = ops.conv_fwd(xp, x, params)
            return z, (None, residuals)
        z, residuals = ops.conv_fwd(xp, *_up(xp, x), ConvParams(*_up(xp, *params)))
        out_dtype = xp.result_type(x.dtype, *(p.dtype for p in params))
        return xp.astype(z, out_dtype), (x.dtype, residuals)

    def conv_bwd(xp, residuals, params, g):
        x_dtype, inner = residuals
        params = ConvParams(*params)
        if x_dtype is None and not _any_low(xp, g, *params):
            return ops.conv_bwd(xp, inner, params, g)
        d_x, d_params = ops.conv_bwd(xp, inner, ConvParams(*_up(xp, *params)), *_up(xp, g))
        d_x = xp.astype(d_x, g.dtype if x_dtype is None else x_dtype)
        d_params = ConvParams(*(xp.astype(d, p.dtype) for d, p in zip(d_params, params,
                                                                      strict=True)))
        return d_x, d_params

    # the gates are elementwise on the conv's output: they run in its dtype unchanged
    return ops._replace(sample_fwd=sample_fwd, sample_bwd=sample_bwd, splat_fwd=splat_fwd,
                        splat_bwd=splat_bwd, conv_fwd=conv_fwd, conv_bwd=conv_bwd)
