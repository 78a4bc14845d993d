"""Learnable memory slots read and written by attention: the slot-memory baseline.

Same interface and causality as Tensor Memory: tokens are grouped in chunks;
chunk ``t`` READS the slots as they were before its write (query = the chunk's
first token, attention over the K slots), then WRITES (every slot attends to
the chunk's tokens and takes a gated update). State: ``slots (B, K, d)``,
starting from learned initial slots. Size never grows with sequence length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SlotMemory"]


class SlotMemory(nn.Module):
    """``forward(x (B, N, d), state (B, K, d) | None) -> (out (B, N, d), state)``."""

    def __init__(self, embed_dim: int, n_slots: int, chunk_size: int) -> None:
        super().__init__()
        d = embed_dim
        self.chunk_size = chunk_size
        self.init_slots = nn.Parameter(torch.randn(n_slots, d) * d**-0.5)
        self.read_q, self.read_k, self.read_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.write_q, self.write_k, self.write_v = (nn.Linear(d, d), nn.Linear(d, d),
                                                    nn.Linear(d, d))
        self.update_gate = nn.Linear(2 * d, d)
        self.out_proj = nn.Linear(d, d)

    def init_state(self, batch: int, device=None, dtype=None) -> torch.Tensor:
        """The learned initial slots, ``(batch, K, d)``."""
        return self.init_slots.to(device=device, dtype=dtype).expand(batch, -1, -1)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (B, N, d)`` -> ``out (B, N, d)`` (the chunk's read on each of its tokens)."""
        B, N, d = x.shape
        L = self.chunk_size
        T = -(-N // L)
        x = F.pad(x, (0, 0, 0, T * L - N))
        chunks = x.reshape(B, T, L, d)
        slots = state if state is not None else self.init_state(B, x.device, x.dtype)
        queries = self.read_q(chunks[:, :, 0])  # (B, T, d)
        keys, values = self.write_k(chunks), self.write_v(chunks)  # (B, T, L, d)
        reads = []
        for t in range(T):
            # read (before this chunk's write): one query over K slots
            scores = torch.einsum("bd,bkd->bk", queries[:, t], self.read_k(slots)) * d**-0.5
            reads.append(torch.einsum("bk,bkd->bd", scores.softmax(-1), self.read_v(slots)))
            # write: each slot attends over the chunk's tokens, then a gated update
            attn = torch.einsum("bkd,bld->bkl", self.write_q(slots), keys[:, t]) * d**-0.5
            update = torch.einsum("bkl,bld->bkd", attn.softmax(-1), values[:, t])
            gate = torch.sigmoid(self.update_gate(torch.cat([slots, update], dim=-1)))
            slots = (1 - gate) * slots + gate * torch.tanh(update)
        out = self.out_proj(torch.stack(reads, dim=1))
        return out.repeat_interleave(L, dim=1)[:, :N], slots
