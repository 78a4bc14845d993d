"""The layer's heads and read-out, and the chunking of tokens.

:func:`heads` maps chunks ``(..., L, d)`` to the scan's :class:`tmcore.StepInputs`
(one fused product for the three ``d``-vector heads); :func:`read_out` maps reads
``(..., C)`` to ``(..., d)``; :func:`chunk` / :func:`unchunk` turn tokens ``(B, N, d)``
into chunks ``(B, T, L, d)`` (a ragged last chunk zero-padded on the right) and
per-chunk rows ``(B, T, d)`` back into tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tmcore.layer.config import LayerConfig
from tmcore.layer.params import WARP_GROUP, Params
from tmcore.ops.addressing import MIN_SIGMA
from tmcore.ops.common import softplus
from tmcore.types import StepInputs, WarpInputs

__all__ = ["Linear", "chunk", "heads", "linear", "num_chunks", "read_coords", "read_out", "split",
           "unchunk"]


def linear(xp: Any, p: Mapping[str, Any], x: Any) -> Any:
    """``x @ weight.T + bias``, a linear map in torch's layout.

    Parameters
    ----------
    xp : namespace
        The array namespace of the arrays.
    p : dict of array
        ``{"weight": (out, in), "bias": (out,)}``.
    x : array, shape ``(..., in)``
        The inputs.

    Returns
    -------
    array, shape ``(..., out)``
        The mapped inputs.
    """
    return xp.matmul(x, xp.matrix_transpose(p["weight"])) + p["bias"]


Linear = Callable[[Any, Mapping[str, Any], Any], Any]


def split(xp: Any, x: Any, sizes: Sequence[int]) -> tuple[Any, ...]:
    """Cut an array along its last axis into consecutive pieces.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``x``.
    x : array, shape ``(..., sum(sizes))``
        The array to cut.
    sizes : sequence of int
        The width of each piece, in order.

    Returns
    -------
    tuple of array
        One slice ``(..., size)`` per entry of ``sizes`` (an adapter may pass one
        op that makes all of them instead, e.g. ``torch.split``).
    """
    pieces, start = [], 0
    for size in sizes:
        pieces.append(x[..., start:start + size])
        start += size
    return tuple(pieces)


def heads(xp: Any, params: Params, chunk: Any, config: LayerConfig, *,
          linear: Linear = linear, softplus: Callable[[Any, Any], Any] = softplus,
          split: Callable[[Any, Any, Sequence[int]], tuple[Any, ...]] = split,
          flat_rows: bool = False) -> StepInputs:
    """The layer's linear heads: chunks of tokens to the scan's step inputs.

    ``...`` is ``(B,)`` for one chunk or ``(B, T)`` for all of them; the layer
    calls it once on all ``(B, T)`` chunks, so the number of operations does not
    grow with the sequence. (Streamed pieces then equal one call to rounding,
    not bit for bit: a matmul over ``B*T`` rows may block its sums differently
    from one over fewer rows.)

    The three heads that read a ``d``-vector (``coord_net``, tied between the read
    query and the write summary, ``content_net`` and ``sigma_net``) run as ONE
    matrix product: their weights stacked ``(n + C + 1, d)``, applied to the
    stacked rows ``[first token, summary]`` ``(..., 2, d)`` (the content and sigma
    columns of the first-token row are not used). The math is the per-head one;
    the fusion saves the dispatches (kernel launches on a GPU) of four products.

    ``linear(xp, p, x)`` computes every linear map (default :func:`linear`; an
    adapter may pass its framework's fused kernel, e.g. torch's ``F.linear``,
    which also follows autocast); ``softplus(xp, x)`` likewise (default the
    overflow-free :func:`tmcore.ops.common.softplus`).

    Parameters
    ----------
    xp : namespace
        The array namespace of the arrays.
    params : dict of dict of array
        The layer's parameter pytree ``{group: {leaf: array}}`` (the heads read
        ``write_proj``, ``coord_net``, ``content_net``, ``sigma_net`` and, with
        ``dynamics="warp"``, ``warp_net``).
    chunk : array, shape ``(..., L, d)``
        One chunk per batch element ``(B, L, d)``, or all of them ``(B, T, L, d)``.
    config : LayerConfig
        The layer's sizes, ``sigma_scale`` and ``dynamics``.
    linear : callable, default :func:`linear`
        ``linear(xp, p, x)``, every linear map.
    softplus : callable, default :func:`tmcore.ops.common.softplus`
        ``softplus(xp, x)``, the sigma head's softplus.
    split : callable, default :func:`split`
        ``split(xp, x, sizes)``, the cut of the fused product's output
        ``(..., 2 (n + C + 1))`` into the four heads' outputs (one op instead of
        one slice per head: the backward then has one op for them, too).
    flat_rows : bool, default False
        Give the products 2-D operands (one row per chunk, ``M = prod(...)``)
        instead of ``(..., L*d)`` and ``(..., 2, d)`` ones: the same products
        where the framework's linear map flattens the leading axes itself (torch's
        ``F.linear``), without a reshape around each. Off by default: XLA sums the
        bias gradients over the leading axes in another order when they are
        flattened (equal to rounding, not bit for bit).

    Returns
    -------
    StepInputs
        ``read_coords (..., n)`` and ``write_coords (..., n)`` in ``(-1, 1)``,
        ``write_sigma (...)`` > 0 and ``write_content (..., C)``; with
        ``dynamics="warp"`` a :class:`tmcore.scan.warped.WarpInputs`, which adds
        the warp's ``shift (..., n)``.
    """
    lead = tuple(chunk.shape[:-2])
    length, d = chunk.shape[-2:]
    n = config.ndim
    c = config.memory_channels
    k = n + c + 1
    fused = {key: xp.concat([params[g][key] for g in ("coord_net", "content_net", "sigma_net")],
                            axis=0) for key in ("weight", "bias")}
    # the rows [first token, summary] of every chunk go through one product; its output
    # is cut into the four heads' outputs by one split (same values, fewer dispatches)
    if flat_rows:  # 2-D operands, one row per chunk: no reshape around each product
        rows = math.prod(lead)
        flat = xp.reshape(chunk, (rows, length * d))                    # (M, L*d)
        summary = linear(xp, params["write_proj"], flat)                # (M, d)
        pairs = xp.reshape(xp.stack([flat[:, :d], summary], axis=1), (2 * rows, d))
    else:
        summary = linear(xp, params["write_proj"], xp.reshape(chunk, (*lead, length * d)))
        pairs = xp.stack([chunk[..., 0, :], summary], axis=-2)          # (..., 2, d)
    out = xp.reshape(linear(xp, fused, pairs), (*lead, 2 * k))          # (..., 2 (n + C + 1))
    # the first k + n columns: the read coordinates, the first-token row's unused content
    # and sigma columns (their tanh is never used: a zero gradient), the write coordinates
    coords, content, sigma = split(xp, out, (k + n, c, 1))
    read_coords, _, write_coords = split(xp, xp.tanh(coords), (n, k - n, n))
    sigma = softplus(xp, xp.reshape(sigma, lead)) + MIN_SIGMA
    if config.sigma_scale != 1.0:  # (a product by 1.0 is exact: skipped, same bits)
        sigma = sigma * config.sigma_scale
    inputs = StepInputs(read_coords=read_coords, write_coords=write_coords,
                        write_sigma=sigma, write_content=content)
    if config.dynamics == "warp":  # + the shift (..., n) from the summary (tmcore.scan.warped)
        shift = linear(xp, params[WARP_GROUP], summary)                 # (M or ..., n)
        return WarpInputs(*inputs, shift=xp.reshape(shift, (*lead, n)))
    return inputs


def read_coords(xp: Any, params: Params, first: Any, *, linear: Linear = linear) -> Any:
    """The read coordinates of chunks from their first tokens alone (``coord_net``).

    :func:`heads`' ``read_coords`` without the write heads and the summary product (a
    decode step that starts a chunk reads before the chunk's other tokens exist).

    Parameters
    ----------
    xp : namespace
        The array namespace of the arrays.
    params : dict of dict of array
        The layer's parameter pytree (its ``coord_net`` group is read).
    first : array, shape ``(..., d)``
        Each chunk's first token.
    linear : callable, default :func:`linear`
        ``linear(xp, p, x)``, the linear map.

    Returns
    -------
    array, shape ``(..., n)``
        ``tanh(coord_net(first))`` in ``(-1, 1)``: :func:`heads`' ``read_coords`` to
        rounding (one product of ``n`` outputs instead of a row of the fused one).
    """
    return xp.tanh(linear(xp, params["coord_net"], first))


def read_out(xp: Any, params: Params, reads: Any, *, linear: Linear = linear) -> Any:
    """The read-out: ``out_proj`` on the reads.

    Parameters
    ----------
    xp : namespace
        The array namespace of the arrays.
    params : dict of dict of array
        The layer's parameter pytree (its ``out_proj`` group is read).
    reads : array, shape ``(..., C)``
        What the scan read, e.g. ``(B, T, C)``.
    linear : callable, default :func:`linear`
        ``linear(xp, p, x)``, the linear map.

    Returns
    -------
    array, shape ``(..., d)``
        The layer's output per read.
    """
    return linear(xp, params["out_proj"], reads)


# --------------------------------------------------------------------------- chunking


def num_chunks(tokens: int, chunk_size: int) -> int:
    """The number of chunks of a sequence, ``T = ceil(N / L)``.

    Parameters
    ----------
    tokens : int
        ``N``, the sequence length.
    chunk_size : int
        ``L``, the tokens per chunk.

    Returns
    -------
    int
        ``T``; a ragged last chunk counts.
    """
    return -(-tokens // chunk_size)


def chunk(xp: Any, x: Any, chunk_size: int) -> Any:
    """Split tokens into chunks of ``L``.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``x``.
    x : array, shape ``(B, N, d)``
        The tokens.
    chunk_size : int
        ``L``, the tokens per chunk.

    Returns
    -------
    array, shape ``(B, T, L, d)``
        ``T = ceil(N / L)`` chunks, the last one zero-padded on the right.
    """
    batch, tokens, d = x.shape
    steps = num_chunks(tokens, chunk_size)
    pad = steps * chunk_size - tokens
    if pad:
        # zeros like x (dtype, device, sharding) without asking for a device, which
        # torch.compile would trace through array_api_compat's type checks
        zeros = xp.broadcast_to(xp.zeros_like(x[:, :1, :]), (batch, pad, d))
        x = xp.concat([x, zeros], axis=1)
    return xp.reshape(x, (batch, -1, chunk_size, d))  # (-1: no symbolic ceil under compile)


def unchunk(xp: Any, per_chunk: Any, tokens: int, chunk_size: int) -> Any:
    """Spread one row per chunk back over the chunk's tokens.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``per_chunk``.
    per_chunk : array, shape ``(B, T, d)``
        One row per chunk.
    tokens : int
        ``N``, the number of real tokens (at most ``T * L``).
    chunk_size : int
        ``L``, the tokens per chunk.

    Returns
    -------
    array, shape ``(B, N, d)``
        Chunk ``t``'s row on each of its tokens, trimmed to the first ``N``.
    """
    batch, steps, d = per_chunk.shape
    out = xp.broadcast_to(per_chunk[:, :, None, :], (batch, steps, chunk_size, d))
    out = xp.reshape(out, (batch, steps * chunk_size, d))
    return out if tokens == steps * chunk_size else out[:, :tokens, :]
