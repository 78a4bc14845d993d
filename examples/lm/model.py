"""TinyLM: a byte-level causal LM whose blocks carry attention, an MLP and Tensor Memory.

Decoding keeps a per-layer cache: the attention's keys and values (all of them, or the
last ``window - 1`` with a sliding window) and the memory's
:class:`tmcore.layer.StreamState` (fixed size: ``(h, c)``, the unfinished chunk's
tokens and its read). Because the memory streams exactly (any split of the sequence
equals one call), ``model(prompt)`` followed by one ``model(token, cache)`` per new
token gives the logits of one teacher-forced call over the whole text.

Shapes: ``tokens (B, N)`` int64 bytes; ``logits (B, N, 256)``; ``d`` = width.
There is no positional embedding (causal attention infers order; NoPE), so the
model has no context limit of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tmcore.adapters.torch import MemoryResidual, TensorMemory

VOCAB = 256


@dataclass(frozen=True)
class LMConfig:
    """The model's sizes. ``memory=False`` drops the memories (the baseline);
    ``window`` (``None``: full attention) limits each query to its last ``window``
    positions, itself included."""

    width: int = 64
    layers: int = 2
    heads: int = 4
    window: int | None = None
    memory: bool = True
    memory_channels: int = 8
    memory_shape: tuple[int, ...] = (4, 4, 4)
    chunk_size: int = 16
    forget_bias: float = 3.0


@dataclass
class LayerCache:
    """One block's decoding cache: keys/values ``(B, H, K, d/H)`` starting at absolute
    position ``start``, and the memory's stream state (``None`` before the first call)."""

    k: Tensor | None = None
    v: Tensor | None = None
    start: int = 0
    memory: Any = None

    def nbytes(self) -> int:
        """Bytes held between calls (keys, values, memory state tensors)."""
        tensors = [t for t in (self.k, self.v) if t is not None]
        if self.memory is not None:
            tensors += [self.memory.h, self.memory.c, self.memory.pending, self.memory.read]
        return sum(t.numel() * t.element_size() for t in tensors)


class CausalAttention(nn.Module):
    """Multi-head causal self-attention with a KV cache (and an optional sliding window)."""

    def __init__(self, width: int, heads: int, window: int | None):
        super().__init__()
        if width % heads:
            raise ValueError(f"width: expected a multiple of heads = {heads}, got {width}")
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def split_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, n, width)`` -> ``q, k, v``, each ``(B, H, n, width // H)``."""
        batch, n, width = x.shape
        q, k, v = self.qkv(x).view(batch, n, 3, self.heads, width // self.heads) \
            .permute(2, 0, 3, 1, 4)
        return q, k, v

    def merge_heads(self, out: Tensor) -> Tensor:
        """``out (B, H, n, dh)`` -> the output projection of ``(B, n, H * dh)``."""
        batch, heads, n, dh = out.shape
        return self.proj(out.transpose(1, 2).reshape(batch, n, heads * dh))

    def forward(self, x: Tensor, cache: LayerCache) -> Tensor:
        n = x.shape[1]
        q, k, v = self.split_heads(x)
        past = 0 if cache.k is None else cache.k.shape[2]
        if cache.k is not None:
            k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        first = cache.start + past                                    # absolute position of x[0]
        query_pos = torch.arange(first, first + n, device=x.device)[:, None]
        key_pos = torch.arange(cache.start, cache.start + k.shape[2], device=x.device)[None, :]
        allowed = key_pos <= query_pos
        if self.window is not None:
            allowed = allowed & (query_pos - key_pos < self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        if self.window is not None:  # later queries never look further back than this
            keep = self.window - 1
            drop = max(k.shape[2] - keep, 0)
            k, v, cache.start = k[:, :, drop:], v[:, :, drop:], cache.start + drop
        cache.k, cache.v = k, v
        return self.merge_heads(out)


class Block(nn.Module):
    """``x + attn(norm(x))``, ``x + mlp(norm(x))``, then the gated memory (if any)."""

    def __init__(self, config: LMConfig):
        super().__init__()
        w = config.width
        self.norm1, self.norm2 = nn.LayerNorm(w), nn.LayerNorm(w)
        self.attn = CausalAttention(w, config.heads, config.window)
        self.mlp = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w))
        self.memory = (MemoryResidual(TensorMemory(
            w, config.memory_channels, config.memory_shape, config.chunk_size,
            forget_bias=config.forget_bias), gate_init=-2.0) if config.memory else None)

    def forward(self, x: Tensor, cache: LayerCache) -> Tensor:
        x = x + self.attn(self.norm1(x), cache)
        x = x + self.mlp(self.norm2(x))
        if self.memory is not None:
            # stream=True: the state carries the unfinished chunk, so calls of any
            # lengths (a prompt, then one token at a time) equal one long call
            x, cache.memory = self.memory(x, cache.memory, stream=True)
        return x


class TinyLM(nn.Module):
    """Byte-level causal LM: ``model(tokens, cache) -> (logits, cache)``."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.width)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.layers)])
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, VOCAB)

    def new_cache(self) -> list[LayerCache]:
        return [LayerCache() for _ in self.blocks]

    def forward(self, tokens: Tensor, cache: list[LayerCache] | None = None
                ) -> tuple[Tensor, list[LayerCache]]:
        """``tokens (B, n)`` -> ``(logits (B, n, 256), cache)``; ``cache=None`` starts a
        new text (the returned cache continues it)."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens: expected int64 of shape (B, n), got "
                             f"{tokens.dtype} {tuple(tokens.shape)}")
        cache = self.new_cache() if cache is None else cache
        x = self.embed(tokens)
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            x = block(x, layer_cache)
        return self.head(self.norm(x)), cache


def cache_bytes(cache: list[LayerCache]) -> int:
    """Bytes the decoding cache holds (all layers)."""
    return sum(c.nbytes() for c in cache)


@torch.no_grad()
def generate(model: TinyLM, prompt: Tensor, steps: int, *, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Prefill ``prompt (B, n)`` in one call, then decode ``steps`` tokens one at a time
    (greedy at ``temperature = 0``, else sampled). Returns ``(tokens (B, steps),
    logits (B, steps, 256))``: the logits each new token was drawn from."""
    logits, cache = model(prompt)
    out, seen = [], []
    for _ in range(steps):
        last = logits[:, -1, :]
        seen.append(last)
        if temperature > 0:
            probs = torch.softmax(last / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
        else:
            token = last.argmax(dim=-1, keepdim=True)
        out.append(token)
        logits, cache = model(token, cache)
    return torch.cat(out, dim=1), torch.stack(seen, dim=1)
