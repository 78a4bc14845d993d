"""An LSTM / GRU memory baseline with the memory interface of Tensor Memory.

``forward(x (B, N, d), state) -> (out (B, N, d), state)``: a single-layer
LSTM (state ``(h, c)``, each ``(1, B, H)``) or GRU (state ``h``) runs over the
tokens, and ``out_proj(h_t)`` is the memory's output at token ``t``. The
hidden size ``H`` is chosen by the caller so that the state holds as many
numbers as Tensor Memory's ``(h, c)`` (``ModelConfig.rnn_hidden_size``), and
the LSTM's forget-gate bias starts at the same value as Tensor Memory's
ConvLSTM forget bias (``forget_bias``), so both memories start remembering
alike. For the GRU, whose update gate ``z`` keeps the old state, the same
value goes to the ``z`` bias.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RecurrentMemory"]


class RecurrentMemory(nn.Module):
    """``kind``: ``"lstm"`` or ``"gru"``; ``hidden``: state width; ``forget_bias``: see above."""

    def __init__(self, embed_dim: int, hidden: int, kind: str = "lstm",
                 forget_bias: float = 0.0) -> None:
        super().__init__()
        if kind not in ("lstm", "gru"):
            raise ValueError(f"kind: expected 'lstm' or 'gru', got {kind!r}")
        if hidden < 1:
            raise ValueError(f"hidden: expected a positive size, got {hidden}")
        self.kind = kind
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = cls(embed_dim, hidden, batch_first=True)
        self.out_proj = nn.Linear(hidden, embed_dim)
        with torch.no_grad():
            # gate order: LSTM i, f, g, o; GRU r, z, n. One bias carries the value, the
            # other (bias_hh) its share 0, so the gate starts at sigmoid(forget_bias).
            index = 1
            self.rnn.bias_ih_l0[index * hidden:(index + 1) * hidden] = forget_bias
            self.rnn.bias_hh_l0[index * hidden:(index + 1) * hidden] = 0.0

    def state_numbers(self, batch: int = 1) -> int:
        """Numbers in the state of ``batch`` streams."""
        per = self.rnn.hidden_size * (2 if self.kind == "lstm" else 1)
        return batch * per

    def forward(self, x: torch.Tensor, state: object = None) -> tuple[torch.Tensor, object]:
        """``x (B, N, d)`` -> ``out (B, N, d)`` and the state after the last token."""
        outputs, state = self.rnn(x, state)
        return self.out_proj(outputs), state
