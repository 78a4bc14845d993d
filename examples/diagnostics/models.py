"""Backbones: a small causal pre-norm transformer, optionally carrying a memory.

Every model maps task features ``(B, N, F)`` to logits ``(B, N, n_out)``:
``Linear(F -> d)`` + learned positions, ``n_layers`` blocks, LayerNorm, head.
A block is ``x += attn(ln(x))``; ``x = x + sigmoid(gate) * memory(norm(x))``
when it carries a memory (Tensor Memory, attention slots or an LSTM/GRU, same
gated residual for all); ``x += mlp(ln(x))``.

Context (``ModelConfig.segment``): ``None`` puts the whole stream in one causal
attention window (the ``paper`` protocol). An int ``W`` processes the stream in
segments of ``W`` tokens (the ``streaming`` protocol), the way a long stream
is processed with bounded state: the stream is left-padded to a multiple of
``W`` (so the LAST segment ends with the stream, e.g. holds the queries),
positions are local to a segment, and what each block carries from one
segment to the next is its state:

- ``transformer``: nothing (attention within the segment only);
- ``sliding_window``: a KV cache; every token attends to the ``window`` most
  recent tokens (``ModelConfig.window``, default W), across the boundary;
- ``transformer_xl``: a cache of the last ``M`` hidden states of each layer
  (no gradient through it, as in Transformer-XL), ``M`` chosen so the cache
  holds as many numbers as Tensor Memory's state;
- memories (``memory_slots``, ``tensor_memory``, ``lstm_memory``,
  ``gru_memory``): their recurrent state, through ``memory(x, state) -> (out,
  state)``, the adapter's streaming contract.

``forward(features, reset=...)`` measures how much a model uses what it
carries: ``reset="segment"`` starts every segment from the initial state
(empty caches, zero memories); ``reset="token"`` (for one-window runs) gives
each token's memory call the initial state, so nothing written is ever read.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from examples.diagnostics.config import ModelConfig
from examples.diagnostics.memory import make_tensor_memory
from examples.diagnostics.recurrent import RecurrentMemory
from examples.diagnostics.slots import SlotMemory

__all__ = ["Backbone", "GatedResidual", "build_model", "count_params", "carried_numbers",
           "RESETS"]

#: ``Backbone.forward`` reset modes (see the module docstring).
RESETS = (None, "segment", "token")
ATTENTIONS = ("local", "sliding", "xl")


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

    def forward(self, x: torch.Tensor, state: object = None, reset_tokens: bool = False
                ) -> tuple[torch.Tensor, object]:
        """``x (B, N, d) -> (B, N, d)`` and the memory's state after ``x`` (``state=None``:
        the initial state). Recorded inputs of successive segments are concatenated.
        ``reset_tokens``: every token is its own stream from the initial state (nothing
        written is read back); the returned state is then ``None``."""
        normed = self.norm(x)
        if self.record_inputs:
            prev = self.last_input if state is not None else None
            self.last_input = normed.detach() if prev is None else torch.cat(
                [prev, normed.detach()], dim=1)
        if reset_tokens:
            B, N, d = normed.shape
            out, _ = self.memory(normed.reshape(B * N, 1, d), None)
            return x + torch.sigmoid(self.gate) * out.reshape(B, N, d), None
        out, state = self.memory(normed, state)
        return x + torch.sigmoid(self.gate) * out, state

    def gate_value(self) -> float:
        """``sigmoid(gate)``: how open the memory path is."""
        return float(torch.sigmoid(self.gate.detach()))


class Block(nn.Module):
    """Causal self-attention (local, sliding-window or XL-cached), optional gated memory,
    MLP; all pre-norm. The memory comes after the attention, or before it with
    ``ModelConfig.memory_first``. State: ``(memory state, attention cache)``."""

    def __init__(self, cfg: ModelConfig, d: int, memory: GatedResidual | None,
                 attention: str = "local") -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {ATTENTIONS}, got {attention!r}")
        self.n_heads = cfg.n_heads
        self.attention = attention
        self.window = cfg.window or cfg.segment
        self.cache_tokens = cfg.xl_cache_tokens()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * d, d))
        self.drop = nn.Dropout(cfg.dropout)
        self.memory = memory
        self.memory_first = cfg.memory_first

    def _attend(self, x: torch.Tensor, cache: torch.Tensor | tuple | None
                ) -> tuple[torch.Tensor, object]:
        """Attention of ``x (B, N, d)`` over the cache and its own causal prefix."""
        B, N, d = x.shape
        H = self.n_heads
        if self.attention == "xl":  # cache: earlier hidden states (B, M, d), no gradient
            ctx = x if cache is None else torch.cat([cache, x], dim=1)
            q = self.qkv(self.ln1(x))[..., :d]
            kv = self.qkv(self.ln1(ctx))[..., d:]
            k, v = kv.split(d, dim=-1)
            new_cache = ctx[:, -self.cache_tokens:].detach()
        else:
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            new_cache = None
            if self.attention == "sliding":  # cache: the window's keys and values
                if cache is not None:
                    k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
                new_cache = (k[:, -self.window:].detach(), v[:, -self.window:].detach())
        M = k.shape[1] - N  # cached positions before the segment

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(B, t.shape[1], H, d // H).transpose(1, 2)

        mask = None
        if M or self.attention == "sliding":
            query = torch.arange(N, device=x.device)[:, None] + M
            key = torch.arange(M + N, device=x.device)[None, :]
            mask = key <= query
            if self.attention == "sliding":
                mask = mask & (key > query - self.window)
        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask,
                                             is_causal=mask is None)
        return self.proj(out.transpose(1, 2).reshape(B, N, d)), new_cache

    def forward(self, x: torch.Tensor, state: tuple | None = None, reset_tokens: bool = False
                ) -> tuple[torch.Tensor, tuple]:
        """``x (B, N, d) -> (B, N, d)`` and the new ``(memory state, cache)``."""
        memory_state, cache = state if state is not None else (None, None)
        if self.memory is not None and self.memory_first:
            x, memory_state = self.memory(x, memory_state, reset_tokens)
        attn, cache = self._attend(x, cache)
        x = x + self.drop(attn)
        if self.memory is not None and not self.memory_first:
            x, memory_state = self.memory(x, memory_state, reset_tokens)
        return x + self.drop(self.mlp(self.ln2(x))), (memory_state, cache)


class Backbone(nn.Module):
    """``forward(features (B, N, F), reset=None) -> logits (B, N, n_out)``."""

    def __init__(self, in_features: int, n_out: int, cfg: ModelConfig,
                 memory_kind: str | None = None, variant: dict | None = None,
                 attention: str = "local") -> None:
        super().__init__()
        d = cfg.d_model
        self.segment = cfg.segment
        self.embed = nn.Linear(in_features, d)
        self.pos = nn.Parameter(torch.randn(cfg.segment or cfg.max_len, d) * 0.02)
        self.blocks = nn.ModuleList(
            Block(cfg, d, self._memory(cfg, memory_kind, variant or {})
                  if i in cfg.memory_layers else None, attention)
            for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_out)

    @staticmethod
    def _memory(cfg: ModelConfig, kind: str | None, variant: dict) -> GatedResidual | None:
        if kind is None:
            return None
        if kind == "slots":
            memory = SlotMemory(cfg.d_model, cfg.n_slots, cfg.chunk_size, cfg.forget_bias)
        elif kind == "tensor":
            memory = make_tensor_memory(cfg.d_model, cfg.memory_channels, cfg.memory_shape,
                                        cfg.chunk_size, cfg.sigma_scale, cfg.write_init,
                                        cfg.forget_bias, **variant)
        elif kind == "lstm":
            memory = RecurrentMemory(cfg.d_model, cfg.rnn_hidden_size(), "lstm", cfg.forget_bias)
        elif kind == "gru":  # GRU state is h alone: twice the LSTM's width for equal numbers
            memory = RecurrentMemory(cfg.d_model, 2 * cfg.rnn_hidden_size(), "gru",
                                     cfg.forget_bias)
        else:
            raise ValueError("memory kind: expected None, 'slots', 'tensor', 'lstm' or 'gru', "
                             f"got {kind!r}")
        return GatedResidual(memory, cfg.d_model, cfg.gate_init)

    def forward(self, features: torch.Tensor, reset: str | None = None) -> torch.Tensor:
        """``features (B, N, F)`` -> ``logits (B, N, n_out)``, segment by segment when
        ``segment`` is set (see the module docstring), else in one window. ``reset``: one
        of :data:`RESETS`."""
        if reset not in RESETS:
            raise ValueError(f"reset: expected one of {RESETS}, got {reset!r}")
        N = features.shape[1]
        W = self.segment or N
        pad = (-N) % W
        features = F.pad(features, (0, 0, pad, 0))  # left: the last segment ends the stream
        states: list[object] = [None] * len(self.blocks)
        logits = []
        for start in range(0, N + pad, W):
            if reset == "segment":
                states = [None] * len(self.blocks)
            x = self.embed(features[:, start:start + W]) + self.pos[:W]
            for i, block in enumerate(self.blocks):
                x, states[i] = block(x, states[i], reset == "token")
            logits.append(self.head(self.ln_f(x)))
        return torch.cat(logits, dim=1)[:, pad:]

    def memories(self) -> list[GatedResidual]:
        """The gated memory residuals, first block first."""
        return [b.memory for b in self.blocks if b.memory is not None]

    def gate_values(self) -> list[float]:
        """``sigmoid(gate)`` of every memory (empty without one)."""
        return [m.gate_value() for m in self.memories()]


def carried_numbers(model: Backbone) -> int:
    """Numbers one stream carries from a segment to the next (state or cache, all blocks)."""
    total = 0
    for block in model.blocks:
        d = block.qkv.in_features
        if block.attention == "xl":
            total += block.cache_tokens * d
        elif block.attention == "sliding":
            total += 2 * block.window * d
        if block.memory is not None:
            memory = block.memory.memory
            if isinstance(memory, RecurrentMemory):
                total += memory.state_numbers()
            elif isinstance(memory, SlotMemory):
                total += memory.init_slots.numel()
            else:
                cells = 1
                for size in memory.memory_shape:
                    cells *= size
                total += 2 * memory.memory_channels * cells
    return total


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
    """One of ``config.MODEL_KINDS`` / ``STREAMING_KINDS`` / ``gru_memory`` (or
    ``"tensor_memory"`` with ablation ``variant``s).

    ``transformer_wide`` is widened until it has at least as many parameters as
    the Tensor Memory model of the same config.
    """
    if kind == "transformer":
        return Backbone(in_features, n_out, cfg)
    if kind == "sliding_window":
        return Backbone(in_features, n_out, cfg, attention="sliding")
    if kind == "transformer_xl":
        return Backbone(in_features, n_out, cfg, attention="xl")
    if kind == "lstm_memory":
        return Backbone(in_features, n_out, cfg, "lstm")
    if kind == "gru_memory":
        return Backbone(in_features, n_out, cfg, "gru")
    if kind == "transformer_wide":
        target = count_params(Backbone(in_features, n_out, cfg, "tensor"))
        wide = replace(cfg, d_model=_matched_width(in_features, n_out, cfg, target))
        return Backbone(in_features, n_out, wide)
    if kind == "memory_slots":
        return Backbone(in_features, n_out, cfg, "slots")
    if kind == "tensor_memory":
        return Backbone(in_features, n_out, cfg, "tensor", variant)
    raise ValueError(f"model kind: unknown {kind!r}")
