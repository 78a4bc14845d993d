"""Transformer backbones over a grid of patch tokens, at equal depth and width.

Every variant is the same stack of pre-norm ``nn.TransformerEncoderLayer`` blocks
with learned position embeddings; they differ in one thing each:

- ``base``: full attention between all tokens;
- ``local``: each token attends only to tokens within ``window`` grid steps
  (Chebyshev distance) of it;
- ``registers``: ``registers`` extra learned tokens join the sequence and are
  dropped at the output;
- ``memory``: a gated Tensor Memory after every block
  (:func:`tmcore.adapters.torch.attach_memory`), its voxel grid the token grid
  (``memory_shape = grid``) and one chunk per slice along the grid's first
  axis (a row of patches in an image, one frame's patches in a clip), in the
  ``threaded`` multi-layer mode. ``threaded`` lets every position see later
  tokens, which is wrong for a language model but legitimate here: an image
  or a whole clip is given at once, and full attention sees everything anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["BackboneConfig", "Backbone", "local_mask", "KINDS"]

KINDS = ("base", "local", "registers", "memory")


@dataclass(frozen=True)
class BackboneConfig:
    """Sizes shared by every variant (``grid``: the token grid, e.g. ``(8, 8)`` patches or
    ``(frames, rows, cols)``)."""

    grid: tuple[int, ...]
    width: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: int = 2
    registers: int = 4
    window: int = 2
    memory_channels: int = 16
    forget_bias: float = 3.0
    gate_init: float = 0.0
    #: ``memory``: the layer options beyond the paper, as ``(name, value)`` pairs of
    #: ``TensorMemory`` arguments (``update``, ``window``, ``dynamics``); none by default
    memory_options: tuple[tuple[str, object], ...] = ()

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)


def local_mask(grid: Sequence[int], window: int) -> Tensor:
    """``(N, N)`` bool mask, True where attention is NOT allowed: tokens more than
    ``window`` steps apart along any grid axis."""
    axes = torch.meshgrid(*[torch.arange(n) for n in grid], indexing="ij")
    coords = torch.stack([a.reshape(-1) for a in axes], dim=-1)  # (N, ndim)
    distance = (coords[:, None, :] - coords[None, :, :]).abs().amax(dim=-1)
    return distance > window


class Backbone(nn.Module):
    """``forward(tokens (B, N, width)) -> (B, N, width)``; ``kind`` is one of :data:`KINDS`."""

    def __init__(self, kind: str, config: BackboneConfig):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        self.kind, self.config = kind, config
        d = config.width
        self.pos = nn.Parameter(torch.randn(1, config.tokens, d) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, config.heads, config.mlp_ratio * d, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(config.depth))
        self.norm = nn.LayerNorm(d)
        self.registers = (nn.Parameter(torch.randn(1, config.registers, d) * 0.02)
                          if kind == "registers" else None)
        self.register_buffer("mask", local_mask(config.grid, config.window)
                             if kind == "local" else None, persistent=False)
        self.handle = None
        if kind == "memory":
            from tmcore.adapters.torch import attach_memory

            # the memories become submodules of the blocks (block.tensor_memory)
            self.handle = attach_memory(
                self.blocks, "threaded", gate_init=config.gate_init, embed_dim=d,
                memory_channels=config.memory_channels, memory_shape=tuple(config.grid),
                chunk_size=math.prod(config.grid[1:]), forget_bias=config.forget_bias,
                **dict(config.memory_options))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[1:] != (self.config.tokens, self.config.width):
            raise ValueError(f"x: expected (B, {self.config.tokens}, {self.config.width}), "
                             f"got {tuple(x.shape)}")
        x = x + self.pos
        if self.registers is not None:
            x = torch.cat([x, self.registers.expand(x.shape[0], -1, -1)], dim=1)
        for block in self.blocks:
            x = block(x, src_mask=self.mask)
        return self.norm(x[:, :self.config.tokens])

    def gates(self) -> list[float]:
        """``sigmoid(gate)`` of each block's memory (empty without memory)."""
        if self.handle is None:
            return []
        return [float(torch.sigmoid(m.gate.detach()).item()) for m in self.handle.memories]
