"""Backbones: a small causal pre-norm transformer, optionally carrying a memory.

Every model maps task features ``(B, N, F)`` to logits ``(B, N, n_out)``:
``Linear(F -> d)`` + learned positions, ``n_layers`` blocks, LayerNorm, head.
A block is ``x += attn(ln(x))``; ``x = x + sigmoid(gate) * memory(norm(x))``
when it carries a memory (Tensor Memory or attention slots, same gated
residual for both); ``x += mlp(ln(x))``.

Context (``ModelConfig.segment``): ``None`` puts the whole stream in one causal
attention window (the "full" setting). An int ``W`` processes the stream in
segments of ``W`` tokens, the way a long stream is processed with a bounded
KV cache: the stream is left-padded to a multiple of ``W`` (so the LAST
segment ends with the stream, e.g. holds the queries), attention and positions
are local to a segment, and each memory layer's recurrent state (Tensor
Memory's ``(h, c)``, the slots) is carried from one segment to the next
through ``memory(x, state) -> (out, state)``, the streaming contract of the
adapter. A plain transformer therefore sees only its own segment.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from examples.diagnostics.config import ModelConfig
from examples.diagnostics.memory import make_tensor_memory
from examples.diagnostics.slots import SlotMemory

__all__ = ["Backbone", "GatedResidual", "build_model", "count_params"]


class GatedResidual(nn.Module):
    """``x + sigmoid(gate) * memory(LayerNorm(x))``; the memory is causal, state-in/state-out.

    ``record_inputs = True`` keeps the last normalized input in ``last_input``
    (``(B, N, d)``) for the memory-state picture.
    """

    def __init__(self, memory: nn.Module, embed_dim: int, gate_init: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embed_dim)
        self.memory = memory
        self.gate = nn.Parameter(torch.tensor(float(gate_init)))
        self.record_inputs = False
        self.last_input: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, state: object = None) -> tuple[torch.Tensor, object]:
        """``x (B, N, d) -> (B, N, d)`` and the memory's state after ``x`` (``state=None``:
        the initial state). Recorded inputs of successive segments are concatenated."""
        normed = self.norm(x)
        if self.record_inputs:
            prev = self.last_input if state is not None else None
            self.last_input = normed.detach() if prev is None else torch.cat(
                [prev, normed.detach()], dim=1)
        out, state = self.memory(normed, state)
        return x + torch.sigmoid(self.gate) * out, state

    def gate_value(self) -> float:
        """``sigmoid(gate)``: how open the memory path is."""
        return float(torch.sigmoid(self.gate.detach()))


class Block(nn.Module):
    """Causal self-attention, optional gated memory, MLP; all pre-norm. The memory comes
    after the attention, or before it with ``ModelConfig.memory_first``."""

    def __init__(self, cfg: ModelConfig, d: int, memory: GatedResidual | None) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * d, d))
        self.memory = memory
        self.memory_first = cfg.memory_first

    def forward(self, x: torch.Tensor, state: object = None) -> tuple[torch.Tensor, object]:
        """``x (B, N, d) -> (B, N, d)``, and the memory's new state (``None`` without one)."""
        B, N, d = x.shape
        if self.memory is not None and self.memory_first:
            x, state = self.memory(x, state)
        q, k, v = self.qkv(self.ln1(x)).reshape(B, N, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, N, d/h)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, N, d))
        if self.memory is not None and not self.memory_first:
            x, state = self.memory(x, state)
        return x + self.mlp(self.ln2(x)), state


class Backbone(nn.Module):
    """``forward(features (B, N, F)) -> logits (B, N, n_out)``."""

    def __init__(self, in_features: int, n_out: int, cfg: ModelConfig,
                 memory_kind: str | None = None, variant: dict | None = None) -> None:
        super().__init__()
        d = cfg.d_model
        self.segment = cfg.segment
        self.embed = nn.Linear(in_features, d)
        self.pos = nn.Parameter(torch.randn(cfg.segment or cfg.max_len, d) * 0.02)
        self.blocks = nn.ModuleList(
            Block(cfg, d, self._memory(cfg, memory_kind, variant or {})
                  if i in cfg.memory_layers else None)
            for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_out)

    @staticmethod
    def _memory(cfg: ModelConfig, kind: str | None, variant: dict) -> GatedResidual | None:
        if kind is None:
            return None
        if kind == "slots":
            memory = SlotMemory(cfg.d_model, cfg.n_slots, cfg.chunk_size)
        elif kind == "tensor":
            memory = make_tensor_memory(cfg.d_model, cfg.memory_channels, cfg.memory_shape,
                                        cfg.chunk_size, cfg.sigma_scale, cfg.write_init,
                                        cfg.forget_bias, **variant)
        else:
            raise ValueError(f"memory kind: expected None, 'slots' or 'tensor', got {kind!r}")
        return GatedResidual(memory, cfg.d_model, cfg.gate_init)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``features (B, N, F)`` -> ``logits (B, N, n_out)``, segment by segment when
        ``segment`` is set (see the module docstring), else in one window."""
        N = features.shape[1]
        W = self.segment or N
        pad = (-N) % W
        features = F.pad(features, (0, 0, pad, 0))  # left: the last segment ends the stream
        states: list[object] = [None] * len(self.blocks)
        logits = []
        for start in range(0, N + pad, W):
            x = self.embed(features[:, start:start + W]) + self.pos[:W]
            for i, block in enumerate(self.blocks):
                x, states[i] = block(x, states[i])
            logits.append(self.head(self.ln_f(x)))
        return torch.cat(logits, dim=1)[:, pad:]

    def memories(self) -> list[GatedResidual]:
        """The gated memory residuals, first block first."""
        return [b.memory for b in self.blocks if b.memory is not None]

    def gate_values(self) -> list[float]:
        """``sigmoid(gate)`` of every memory (empty for a plain transformer)."""
        return [m.gate_value() for m in self.memories()]


def count_params(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _matched_width(in_features: int, n_out: int, cfg: ModelConfig, target: int) -> int:
    """Smallest multiple of ``n_heads`` whose plain transformer has >= ``target`` parameters."""
    d = cfg.d_model
    while count_params(Backbone(in_features, n_out, replace(cfg, d_model=d))) < target:
        d += cfg.n_heads
    return d


def build_model(kind: str, in_features: int, n_out: int, cfg: ModelConfig,
                variant: dict | None = None) -> Backbone:
    """One of ``config.MODEL_KINDS`` (or ``"tensor_memory"`` with ablation ``variant``s).

    ``transformer_wide`` is widened until it has at least as many parameters as
    the Tensor Memory model of the same config.
    """
    if kind == "transformer":
        return Backbone(in_features, n_out, cfg)
    if kind == "transformer_wide":
        target = count_params(Backbone(in_features, n_out, cfg, "tensor"))
        wide = replace(cfg, d_model=_matched_width(in_features, n_out, cfg, target))
        return Backbone(in_features, n_out, wide)
    if kind == "memory_slots":
        return Backbone(in_features, n_out, cfg, "slots")
    if kind == "tensor_memory":
        return Backbone(in_features, n_out, cfg, "tensor", variant)
    raise ValueError(f"model kind: unknown {kind!r}")
