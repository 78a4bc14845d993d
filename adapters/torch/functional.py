"""The torch adapter's functional ops: tmcore's primitives and scans on tensors, with
autograd (each a custom op of :mod:`tmcore.adapters.torch.bridge`), and the packing mask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tmcore import layer as tl
from tmcore.adapters.torch import bridge
from tmcore.ops.conv import as_conv_params
from tmcore.ops.sample import validate_sample_inputs
from tmcore.ops.splat import DEFAULT_EPS, validate_splat_inputs
from tmcore.types import ConvParams, StepInputs

__all__ = ["doc_starts_from_offsets", "gaussian_splat", "memory_scan", "option_scan",
           "trilinear_sample"]

_XP = bridge.XP


def trilinear_sample(volume: Tensor, coords: Tensor) -> Tensor:
    """Sample a volume at coordinates, with autograd (tmcore.trilinear_sample).

    Same checks (and validate mode), dispatch and float16 / bfloat16 rule as
    :func:`tmcore.trilinear_sample`; the gradient is its hand-written VJP.

    Parameters
    ----------
    volume : Tensor, shape ``(B, C, *S)``
        The volume, ``n = len(S)`` spatial axes (1 to 4).
    coords : Tensor, shape ``(B, Q, n)``
        Coordinates in ``[-1, 1]``, ``coords[..., k]`` addressing spatial axis
        ``n - 1 - k`` (``grid_sample``'s order); clamped to the border.

    Returns
    -------
    Tensor, shape ``(B, Q, C)``
        The n-linear interpolation of ``volume`` at each coordinate.

    Raises
    ------
    TypeError
        If an argument is not a floating tensor.
    ValueError
        If the shapes do not fit, or (validate mode) a value is not finite.
    """
    validated = not torch.compiler.is_compiling()  # (Dynamo cannot trace the validator)
    if validated:
        validate_sample_inputs(volume, coords)
    return bridge.call(bridge.TrilinearSampleFunction, bridge.trilinear_sample_op,
                       volume, coords, validated=validated)


def gaussian_splat(
    content: Tensor, mu: Tensor, sigma: Tensor, shape: Sequence[int], *,
    eps: float = DEFAULT_EPS, radius: float | None = None,
) -> Tensor:
    """Write contents as Gaussians into a volume, with autograd (tmcore.gaussian_splat).

    Same checks (and validate mode), dispatch and float16 / bfloat16 rule as
    :func:`tmcore.gaussian_splat`; the gradient is its hand-written VJP.

    Parameters
    ----------
    content : Tensor, shape ``(B, K, C)``
        What each of the ``K`` writes adds.
    mu : Tensor, shape ``(B, K, n)``
        The writes' centres in ``[-1, 1]`` (``grid_sample``'s axis order).
    sigma : Tensor, shape ``(B, K)``
        The writes' spreads (> 0, normalized units).
    shape : sequence of int
        The grid ``S`` (``n`` = its length, 1 to 4).
    eps : float, default 1e-6
        Added to ``2 sigma^2`` in the exponent's denominator (>= 0).
    radius : float or None, default None
        Truncate each write at ``radius * sigma`` (None: dense).

    Returns
    -------
    Tensor, shape ``(B, C, *shape)``
        ``sum_k content[b, k] * exp(-|p - mu_bk|^2 / (2 sigma_bk^2 + eps))`` at every
        cell centre ``p``.

    Raises
    ------
    TypeError
        If an argument is not a floating tensor, or ``shape`` not ints.
    ValueError
        If the shapes do not fit, ``radius`` or ``eps`` is out of range, or
        (validate mode) a value is not finite or ``sigma <= 0``.
    """
    validated = not torch.compiler.is_compiling()  # (Dynamo cannot trace the validator)
    dims = validate_splat_inputs(content, mu, sigma, shape, radius=radius, eps=eps)[1] \
        if validated else tuple(shape)
    return bridge.call(bridge.GaussianSplatFunction, bridge.gaussian_splat_op,
                       content, mu, sigma, list(dims), float(eps),
                       None if radius is None else float(radius), validated=validated)


def memory_scan(
    h0: Tensor, c0: Tensor, read_coords: Tensor, write_coords: Tensor, write_sigma: Tensor,
    write_content: Tensor, params: ConvParams, *, eps: float = DEFAULT_EPS,
    radius: float | None = None, checkpoint_every: int = 1, reset: Tensor | None = None,
    active: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the chunk recurrence (read, write, update) with autograd (tmcore.memory_scan).

    The gradient is tmcore's hand-written scan VJP. ``checkpoint_every = k``
    keeps ``ceil(T / k)`` states for the backward; when no gradient is needed
    (``no_grad``, or no input requires grad) only the initial state is kept, so
    inference memory does not grow with ``T``. The arguments are checked by
    :func:`tmcore.scan.validate_scan_inputs` (once: the op does not check them
    again); under ``torch.compile`` the same shape checks run once, at trace
    time, in the op's fake implementation (values of fake tensors are never read).

    Parameters
    ----------
    h0 : Tensor, shape ``(B, C, *S)``
        The hidden state entering the first step.
    c0 : Tensor, shape ``(B, C, *S)``
        The cell state entering the first step.
    read_coords : Tensor, shape ``(B, T, n)``
        Each step's read position, ``[-1, 1]``.
    write_coords : Tensor, shape ``(B, T, n)``
        Each step's write centre.
    write_sigma : Tensor, shape ``(B, T)``
        Each step's write spread (> 0).
    write_content : Tensor, shape ``(B, T, C)``
        Each step's written content.
    params : ConvParams
        The gate conv's tensors (:meth:`ConvLSTMCell.params`).
    eps : float, default 1e-6
        As in :func:`gaussian_splat`.
    radius : float or None, default None
        As in :func:`gaussian_splat`.
    checkpoint_every : int, default 1
        Keep every ``k``-th state for the backward and recompute the rest.
    reset, active : Tensor, shape ``(B, T)``, bool, optional
        The per-step row masks (:func:`tmcore.memory_scan`).

    Returns
    -------
    reads : Tensor, shape ``(B, T, C)``
        Step ``t``'s read, of the state before its write.
    h : Tensor, shape ``(B, C, *S)``
        The final hidden state.
    c : Tensor, shape ``(B, C, *S)``
        The final cell state.

    Raises
    ------
    TypeError
        If an argument is not a tensor of a floating dtype, or ``params`` is
        not a 4-tuple (each error names the argument).
    ValueError
        If the shapes do not fit, a size option is out of range, or (validate
        mode) a value is not finite or ``write_sigma <= 0``.
    """
    return bridge.dense_scan(h0, c0, StepInputs(read_coords, write_coords, write_sigma,
                                                write_content), as_conv_params(params),
                             eps=eps, radius=radius, checkpoint_every=checkpoint_every,
                             reset=reset, active=active)


#: The layer's scan with its options beyond the paper (``update="local"``,
#: ``dynamics="warp"``), with autograd (:func:`tmcore.adapters.bridge.option_scan`).
option_scan = bridge.option_scan


def doc_starts_from_offsets(offsets: Sequence[Any], tokens: int, *, device: Any = None
                            ) -> Tensor:
    """Turn ``cu_seqlens``-style document offsets into a per-token document-start mask.

    Parameters
    ----------
    offsets : sequence of int, or sequence of sequences of int
        For one row, the increasing start offsets of its documents (e.g. ``[0, 5,
        12]``, optionally ending with ``tokens``); or one such list per row.
    tokens : int
        ``N``, the tokens per row.
    device : torch.device, str or None, optional
        Where the mask is made.

    Returns
    -------
    Tensor, shape ``(B, tokens)``, bool
        True at each document start: :meth:`TensorMemory.forward`'s
        ``doc_starts`` (:func:`tmcore.layer.doc_starts_from_offsets`).

    Raises
    ------
    ValueError
        If the offsets of a row are not increasing or not in ``[0, tokens]``.
    """
    return tl.doc_starts_from_offsets(_XP, offsets, tokens, device=device)
