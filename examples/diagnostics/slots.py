"""Learnable memory slots read and written by attention: the slot-memory baseline.

Same interface and causality as Tensor Memory: tokens are grouped in chunks;
chunk ``t`` READS the slots as they were before its write (query = the chunk's
first token, attention over the K slots), then WRITES. State: ``slots (B, K, d)``,
starting from learned initial slots. Size never grows with sequence length.

The write is competitive, as in slot attention: each token of the chunk
spreads one unit of write mass over the K slots (softmax over the SLOTS, not
over the chunk's tokens), slot ``k`` moves towards the mass-weighted mean of
the values it received by ``min(mass_k, 1) * gate_k``. An earlier version took
the softmax over the chunk's tokens, which at chunk size 1 is a softmax over
one token: every slot received the identical update, so the slots could not
specialise (the write had no addressing at all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SlotMemory"]


class SlotMemory(nn.Module):
    """``forward(x (B, N, d), state (B, K, d) | None) -> (out (B, N, d), state)``."""

    def __init__(self, embed_dim: int, n_slots: int, chunk_size: int,
                 retain_bias: float = 0.0) -> None:
        super().__init__()
        d = embed_dim
        self.chunk_size = chunk_size
        self.init_slots = nn.Parameter(torch.randn(n_slots, d) * d**-0.5)
        self.read_q, self.read_k, self.read_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.write_q, self.write_k, self.write_v = (nn.Linear(d, d), nn.Linear(d, d),
                                                    nn.Linear(d, d))
        self.update_gate = nn.Linear(2 * d, d)
        # a negative gate bias starts the slots keeping their content (the retention knob the
        # tuning grid searches, like the other memories' forget bias)
        nn.init.constant_(self.update_gate.bias, -float(retain_bias))
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
            # write: each token spreads unit mass over the slots (softmax over K), each slot
            # takes the mass-weighted mean of its values, scaled by its mass (<= 1) and gate
            logits = torch.einsum("bkd,bld->bkl", self.write_q(slots), keys[:, t]) * d**-0.5
            assign = logits.softmax(dim=1)  # (B, K, L): over slots
            mass = assign.sum(-1, keepdim=True)  # (B, K, 1)
            update = torch.einsum("bkl,bld->bkd", assign, values[:, t]) / mass.clamp_min(1e-6)
            gate = torch.sigmoid(self.update_gate(torch.cat([slots, update], dim=-1)))
            step = mass.clamp(max=1.0) * gate
            slots = (1 - step) * slots + step * torch.tanh(update)
        out = self.out_proj(torch.stack(reads, dim=1))
        return out.repeat_interleave(L, dim=1)[:, :N], slots
