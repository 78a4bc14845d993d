"""Tensor Memory with ablation switches (examples only), built on tmcore's one layer.

:class:`VariantTensorMemory` is ``tmcore.adapters.torch.TensorMemory`` (same
parameters, names, checks, chunking, reset and streaming) with three switches
the adapter does not offer. Nothing of the layer is copied here: a switch
either replaces :meth:`tmcore.layer.Layer.heads` (a subclass of the adapter's
layer) or the ``scan`` callable the layer runs.

- ``write="hard"``: the content goes to the single nearest cell (a one-hot
  volume: no spread, no gradient to the write coordinate or the spread)
  instead of a Gaussian splat. The scan is then a plain loop over chunks of
  tmcore's public primitives (:func:`_stepwise_scan`).
- ``tied=False``: a separate write coordinate head ``write_coord_net``
  (``Linear(d, n)``, an extra parameter group); ``coord_net`` still gives the
  read coordinates.
- ``conv="pointwise"``: no depthwise taps, only the pointwise gate mixing: the
  scan gets identity taps and a zero depthwise bias (constants) in place of
  ``cell.depthwise_*``, which then receive no gradient.

With the default switches the module is the adapter's layer (its scan, its
state dict); ``tests/examples/test_diagnostics_smoke.py`` checks that. The adapter's
layer options (``update="local"`` with ``window``, ``dynamics="warp"``) pass
through: the scan is then the adapter's options scan
(``tmcore.adapters.torch.option_scan``) over the switched gate
parameters (the Gaussian write only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tmcore
from tmcore.adapters.torch import (
    TensorMemory,
    gaussian_splat,
    memory_scan,
    option_scan,
    trilinear_sample,
)
from tmcore.scan.options import scan_options
from tmcore.types import ConvParams, StepInputs

__all__ = ["VariantTensorMemory"]

WRITES = ("gaussian", "hard")
CONVS = ("factorized", "pointwise")

#: ``write(inputs_t, shape) -> written (B, C, *S)`` for one step's :class:`StepInputs`
Write = Callable[[StepInputs, Sequence[int]], Tensor]


def hard_write(inputs: StepInputs, shape: Sequence[int]) -> Tensor:
    """The content ``(B, C)`` placed in the one cell nearest to ``write_coords (B, n)``.

    Coordinate component ``k`` addresses spatial axis ``n - 1 - k`` (tmcore's
    convention, see ``tmcore.gaussian_splat``). The coordinate is rounded, so it
    gets no gradient; ``write_sigma`` is unused.
    """
    coords, content = inputs.write_coords, inputs.write_content
    n, batch = len(shape), coords.shape[0]
    voxel = torch.round(tmcore.normalized_to_voxel(coords.detach(), shape))  # (B, n)
    weight = torch.ones(batch, dtype=content.dtype, device=content.device)
    for axis, size in enumerate(shape):
        index = voxel[:, n - 1 - axis].clamp(0, size - 1).long()
        one_hot = F.one_hot(index, size).to(content.dtype)  # (B, S_axis)
        weight = weight[..., None] * one_hot.reshape(batch, *(1,) * axis, size)
    return content.reshape(*content.shape, *(1,) * n) * weight[:, None]


def gaussian_write(eps: float, radius: float | None) -> Write:
    """The layer's own Gaussian write (the torch adapter's differentiable splat)."""

    def write(inputs: StepInputs, shape: Sequence[int]) -> Tensor:
        return gaussian_splat(inputs.write_content[:, None], inputs.write_coords[:, None],
                              inputs.write_sigma[:, None], shape, eps=eps, radius=radius)

    return write


def _stepwise_scan(h: Tensor, c: Tensor, inputs: StepInputs, params: ConvParams,
                   write: Write, reset: Tensor | None = None, active: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``tmcore.memory_scan``'s recurrence as a plain loop with a pluggable ``write``.

    Per step: read ``h`` at ``read_coords[:, t]`` (before the write), ``write``
    the step's volume, one ConvLSTM update, under the scan's row masks ``reset, active``
    (``(B, T)``, :func:`tmcore.memory_scan`). ``inputs`` holds ``(B, T, ...)``
    arrays; returns ``(reads (B, T, C), h_T, c_T)``. Torch autograd
    differentiates it (the cell runs tmcore's generic array-API path on torch
    tensors), keeping every step's graph: meant for the small ablation runs.
    """
    shape = tuple(h.shape[2:])
    reads = []
    rows = (-1,) + (1,) * (h.ndim - 1)
    for t in range(inputs.read_coords.shape[1]):
        step = StepInputs(*(v[:, t] for v in inputs))
        if reset is not None:
            h, c = (torch.where(reset[:, t].reshape(rows), torch.zeros_like(v), v)
                    for v in (h, c))
        reads.append(trilinear_sample(h, step.read_coords[:, None])[:, 0])
        written = write(step, shape)
        with tmcore.options(generic=True):
            new_h, new_c = tmcore.convlstm_step(written, h, c, params)
        if active is None:
            h, c = new_h, new_c
        else:
            keep = active[:, t].reshape(rows)
            h, c = torch.where(keep, new_h, h), torch.where(keep, new_c, c)
    return torch.stack(reads, dim=1), h, c


class _UntiedLayer(TensorMemory.layer_class):
    """The adapter's layer with the write coordinates from ``params["write_coord_net"]``."""

    def heads(self, xp: Any, params: Any, chunk: Tensor) -> StepInputs:
        tied = super().heads(xp, params, chunk)
        # the same heads with the write head in coord_net's place; only their
        # write_coords are kept (the rest is recomputed: cheap, and nothing copied)
        untied = super().heads(xp, {**params, "coord_net": params["write_coord_net"]}, chunk)
        return tied._replace(write_coords=untied.write_coords)


class VariantTensorMemory(TensorMemory):
    """Tensor Memory with ablation switches; ``forward(x (B, N, d), state) -> (out, state)``.

    Parameters
    ----------
    embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale, and the
        keyword arguments of ``tmcore.adapters.torch.TensorMemory``
        (``checkpoint_every``, ``radius``, ``eps``, ``forget_bias``, ``update``,
        ``window``, ``dynamics``, ``device``, ``dtype``).
    write : ``"gaussian"`` (default) or ``"hard"`` (nearest cell, one-hot).
    tied : one shared coordinate head for reads and writes (default) or two
        (``False``: adds ``write_coord_net``).
    conv : ``"factorized"`` (default) or ``"pointwise"`` (depthwise taps off).
    """

    def __init__(
        self, embed_dim: int, memory_channels: int, memory_shape: Sequence[int],
        chunk_size: int, sigma_scale: float = 1.0, *, write: str = "gaussian",
        tied: bool = True, conv: str = "factorized", **kwargs: Any,
    ) -> None:
        if write not in WRITES:
            raise ValueError(f"write: expected one of {WRITES}, got {write!r}")
        if conv not in CONVS:
            raise ValueError(f"conv: expected one of {CONVS}, got {conv!r}")
        if not isinstance(tied, bool):
            raise TypeError(f"tied: expected a bool, got {type(tied).__name__}")
        if write == "hard" and (kwargs.get("update", "dense") != "dense"
                                or kwargs.get("dynamics", "none") != "none"):
            raise ValueError("write='hard' runs its own stepwise scan, which has no local "
                             "update nor warp: use update='dense', dynamics='none' with it")
        super().__init__(embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale,
                         **kwargs)
        self.write_mode, self.tied, self.conv_mode = write, tied, conv
        if not tied:
            self.layer = _UntiedLayer(self.config)
            ref = self.coord_net.weight
            # nn.Linear's default init: the plan's init of coord_net (uniform, 1/sqrt(d))
            self.write_coord_net = nn.Linear(self.embed_dim, self.config.ndim,
                                             device=ref.device, dtype=ref.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, write={self.write_mode!r}, tied={self.tied}, "
                f"conv={self.conv_mode!r}")

    def params(self) -> dict[str, dict[str, Tensor]]:
        """The adapter's pytree, plus ``write_coord_net`` when the heads are untied."""
        params = super().params()
        if not self.tied:
            params["write_coord_net"] = dict(self.write_coord_net.named_parameters())
        return params

    def _cell_params(self) -> ConvParams:
        """The gate parameters the scan uses (``conv="pointwise"``: identity taps, zero
        depthwise bias, as constants, so the depthwise chain is the identity)."""
        params = self.cell.params()
        if self.conv_mode == "factorized":
            return params
        taps = torch.zeros_like(params.depthwise_weight)  # (n, 2C, 3), no grad
        taps[..., 1] = 1.0
        return params._replace(depthwise_weight=taps,
                               depthwise_bias=torch.zeros_like(params.depthwise_bias))

    def _scan(self, h0: Tensor, c0: Tensor, inputs: Any, *, reset: Tensor | None = None,
              active: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        config, params = self.config, self._cell_params()
        masks = {"reset": reset, "active": active}
        if config.update != "dense" or config.dynamics != "none":  # the layer options' scan
            return option_scan(scan_options(config), h0, c0, inputs, params, **masks)
        if self.write_mode == "gaussian":  # the adapter's scan (hand-written VJP)
            return memory_scan(h0, c0, *inputs, params, eps=config.eps, radius=config.radius,
                               checkpoint_every=config.checkpoint_every, **masks)
        return _stepwise_scan(h0, c0, StepInputs(*inputs), params, hard_write, **masks)
