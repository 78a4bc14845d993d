"""The torch adapter's functional ops: tmcore's primitives and scans on tensors, with
autograd (custom ops of :mod:`tmcore.adapters.torch.bridge`), and the packing mask."""

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
    """Sample a volume at coordinates, with autograd (:func:`tmcore.trilinear_sample`).

    The core function's checks, dispatch and float16 rule; its VJP is the gradient.

    Parameters
    ----------
    volume, coords : Tensor, shapes ``(B, C, *S)``, ``(B, Q, n)``
        As in :func:`tmcore.trilinear_sample`.

    Returns
    -------
    Tensor, shape ``(B, Q, C)``
        The n-linear interpolation of ``volume`` at each coordinate.

    Raises
    ------
    TypeError, ValueError
        As :func:`tmcore.trilinear_sample`.
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
    """Write contents as Gaussians into a volume, with autograd (:func:`tmcore.gaussian_splat`).

    The core function's checks, dispatch and float16 rule; its VJP is the gradient.

    Parameters
    ----------
    content, mu, sigma : Tensor, shapes ``(B, K, C)``, ``(B, K, n)``, ``(B, K)``
        As in :func:`tmcore.gaussian_splat`.
    shape : sequence of int
        The grid ``S``.
    eps, radius : float, float or None
        As in :func:`tmcore.gaussian_splat` (defaults 1e-6, None).

    Returns
    -------
    Tensor, shape ``(B, C, *shape)``
        The sum of the weighted contents at every cell centre.

    Raises
    ------
    TypeError, ValueError
        As :func:`tmcore.gaussian_splat`.
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
    """Run the chunk recurrence (read, write, update) with autograd (:func:`tmcore.memory_scan`).

    The gradient is tmcore's scan VJP, keeping ``ceil(T / k)`` states (only the initial one
    when no gradient is needed). The arguments are checked once, eagerly, or under
    ``torch.compile`` at trace time in the op's fake implementation.

    Parameters
    ----------
    h0, c0 : Tensor, shape ``(B, C, *S)``
        The initial state.
    read_coords, write_coords : Tensor, shape ``(B, T, n)``
        Each step's read position and write centre.
    write_sigma, write_content : Tensor, shapes ``(B, T)``, ``(B, T, C)``
        Each step's write spread and content.
    params : ConvParams
        The gate conv's tensors (:meth:`ConvLSTMCell.params`).
    eps, radius : float, float or None
        As in :func:`tmcore.memory_scan`.
    checkpoint_every : int, default 1
        ``k``: the backward keeps every ``k``-th state and recomputes the rest.
    reset, active : Tensor, shape ``(B, T)``, bool, optional
        The per-step row masks of :func:`tmcore.memory_scan`.

    Returns
    -------
    reads : Tensor, shape ``(B, T, C)``
        What each step read, before its write.
    h, c : Tensor, shape ``(B, C, *S)``
        The final state.

    Raises
    ------
    TypeError, ValueError
        As :func:`tmcore.memory_scan`.
    """
    return bridge.dense_scan(h0, c0, StepInputs(read_coords, write_coords, write_sigma,
                                                write_content), as_conv_params(params),
                             eps=eps, radius=radius, checkpoint_every=checkpoint_every,
                             reset=reset, active=active)


#: The layer's scan with its options beyond the paper, with autograd.
option_scan = bridge.option_scan


def doc_starts_from_offsets(offsets: Sequence[Any], tokens: int, *, device: Any = None
                            ) -> Tensor:
    """Turn ``cu_seqlens``-style document offsets into a per-token document-start mask.

    Parameters
    ----------
    offsets, tokens : sequence, int
        As in :func:`tmcore.layer.doc_starts_from_offsets`.
    device : torch.device, str or None, optional
        Where the mask is made.

    Returns
    -------
    Tensor, shape ``(B, tokens)``, bool
        :meth:`TensorMemory.forward`'s ``doc_starts``.

    Raises
    ------
    ValueError
        If the offsets of a row are not increasing or not in ``[0, tokens]``.
    """
    return tl.doc_starts_from_offsets(_XP, offsets, tokens, device=device)
