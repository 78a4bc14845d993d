"""The LM comparison's models: TinyLM variants at equal depth and width.

Every model is a :class:`~examples.lm.model.TinyLM` (byte embedding, pre-norm blocks of
attention + MLP, no positional embedding) and differs only in its token mixing:

* ``full``: causal softmax attention over the whole context.
* ``window``: sliding-window causal attention (each query sees its last ``window`` tokens).
* ``xl``: Transformer-XL-style segment recurrence: the context is cut into segments of
  ``segment`` tokens; each segment attends causally to itself and to the previous
  segment's cached keys/values, which are detached (stop-gradient).
* ``linear``: ELU+1 linear attention, causal (chunked prefix sums).
* ``window+memory`` / ``full+memory``: that attention plus a gated Tensor Memory in
  ``causal`` mode in every block (TinyLM's ``memory=True``).

``CompareLM(kind, config)(tokens (B, N)) -> logits (B, N, 256)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.lm.model import CausalAttention, LayerCache, LMConfig, TinyLM

__all__ = ["MODELS", "LABELS", "ModelSizes", "CompareLM", "LinearAttention",
           "linear_attention"]

MODELS = ("full", "window", "xl", "linear", "window+memory", "full+memory")
LABELS = {"full": "full attention", "window": "sliding window",
          "xl": "Transformer-XL recurrence", "linear": "linear attention (ELU+1)",
          "window+memory": "sliding window + Tensor Memory",
          "full+memory": "full attention + Tensor Memory"}


@dataclass(frozen=True)
class ModelSizes:
    """What all models share (``window`` for the windowed ones, ``segment`` for ``xl``,
    the memory fields for the ``+memory`` ones)."""

    width: int = 64
    layers: int = 2
    heads: int = 4
    window: int = 64
    segment: int = 64
    memory_channels: int = 8
    memory_shape: tuple[int, ...] = (4, 4, 4)
    chunk_size: int = 16
    linear_chunk: int = 64


def _before(x: Tensor) -> Tensor:
    """Exclusive prefix sum over dim 2 (a shifted cumsum, not ``cumsum - x``: that would
    let a chunk's own rounding leak into what earlier positions see)."""
    return torch.cumsum(F.pad(x, (0, 0) * (x.dim() - 3) + (1, 0))[:, :, :-1], dim=2)


def linear_attention(q: Tensor, k: Tensor, v: Tensor, chunk: int, eps: float = 1e-6
                     ) -> Tensor:
    """Causal ELU+1 linear attention. ``q, k, v (B, H, N, d)`` -> ``(B, H, N, d)``:
    ``out_i = phi(q_i) . sum_{j<=i} phi(k_j) v_j^T / (phi(q_i) . sum_{j<=i} phi(k_j))``.
    Chunked (quadratic inside a chunk, prefix sums of ``(d, d)`` states between chunks)
    so memory is ``O(N d^2 / chunk)`` rather than ``O(N d^2)``."""
    b, h, n, d = q.shape
    q, k = F.elu(q) + 1, F.elu(k) + 1
    pad = -n % chunk
    if pad:  # padded keys are zero, so they add nothing; padded queries are dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    t = q.shape[2] // chunk
    qc, kc, vc = (x.reshape(b, h, t, chunk, -1) for x in (q, k, v))
    chunk_kv = torch.einsum("bhtcd,bhtce->bhtde", kc, vc)
    prev_kv, prev_k = _before(chunk_kv), _before(kc.sum(3))     # chunks before this one
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    scores = torch.einsum("bhtcd,bhtsd->bhtcs", qc, kc).masked_fill(~tril, 0.0)
    num = scores @ vc + torch.einsum("bhtcd,bhtde->bhtce", qc, prev_kv)
    den = scores.sum(-1) + torch.einsum("bhtcd,bhtd->bhtc", qc, prev_k)
    out = num / (den[..., None] + eps)
    return out.reshape(b, h, t * chunk, d)[:, :, :n]


class LinearAttention(CausalAttention):
    """Multi-head causal ELU+1 linear attention (the projections of ``CausalAttention``);
    whole sequences only (the comparison trains and scores teacher-forced)."""

    def __init__(self, width: int, heads: int, chunk: int):
        super().__init__(width, heads, window=None)
        self.chunk = chunk

    def forward(self, x: Tensor, cache: LayerCache) -> Tensor:
        q, k, v = self.split_heads(x)
        return self.merge_heads(linear_attention(q, k, v, self.chunk))


class CompareLM(nn.Module):
    """One of :data:`MODELS` at the given sizes: ``forward(tokens (B, N)) -> (B, N, 256)``."""

    def __init__(self, kind: str, sizes: ModelSizes):
        super().__init__()
        if kind not in MODELS:
            raise ValueError(f"kind: expected one of {MODELS}, got {kind!r}")
        self.kind, self.sizes = kind, sizes
        window = sizes.window if kind.startswith("window") else None
        self.lm = TinyLM(LMConfig(
            width=sizes.width, layers=sizes.layers, heads=sizes.heads, window=window,
            memory=kind.endswith("+memory"), memory_channels=sizes.memory_channels,
            memory_shape=tuple(sizes.memory_shape), chunk_size=sizes.chunk_size))
        if kind == "linear":
            for block in self.lm.blocks:
                block.attn = LinearAttention(sizes.width, sizes.heads, sizes.linear_chunk)

    def forward(self, tokens: Tensor) -> Tensor:
        if self.kind != "xl":
            return self.lm(tokens)[0]
        seg = self.sizes.segment
        cache, outs = self.lm.new_cache(), []
        for i in range(0, tokens.shape[1], seg):
            logits, cache = self.lm(tokens[:, i:i + seg], cache)
            outs.append(logits)
            for c in cache:  # keep the last segment's keys/values, without their gradient
                drop = max(c.k.shape[2] - seg, 0)
                c.k, c.v = c.k[:, :, drop:].detach(), c.v[:, :, drop:].detach()
                c.start += drop
        return torch.cat(outs, dim=1)
