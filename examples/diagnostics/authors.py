"""The authors' toy models, rebuilt for ``--authors-exact`` (protocol label ``paper-exact``).

The ``paper`` protocol runs the authors' tasks, sizes and optimiser in this suite's own
backbone (:mod:`examples.diagnostics.models`). This module is the other half: the
model the authors' public toy scripts build, so that every difference listed in the
README's audit ("Audit against the authors' scripts") that lives in the model can be
switched on at once. The data, the loss, the optimiser, the schedule and the
evaluation are the suite's (they already match the authors'; the audit says where not).

What differs from :class:`~examples.diagnostics.models.Backbone`:

- token embedding per task (:data:`EMBEDDINGS`): binding sums a type embedding, a
  linear map of the key and a value embedding (``nn.Embedding``, entries ~ N(0, 1))
  and adds **no positional information at all**; map building is a linear map plus
  learned positions that start at zero; occlusion a linear map of each 4 x 4 patch plus
  a within-frame and a per-frame position, both starting at zero;
- blocks: ``nn.MultiheadAttention`` (dropout on the attention weights, xavier init),
  dropout on the attention residual and inside the MLP (after the GELU and after the
  second linear), the causal mask as a bool matrix;
- ``transformer_wide``: MLP ratio 4.5 (not width-matched to Tensor Memory);
- ``memory_slots``: 8 global slots, read by every token through cross-attention
  after each block and then rewritten by attention over **all** tokens of the layer
  (no mask: a token of the next layer reads slots written from later tokens);
- ``tensor_memory``: ONE layer shared by every block (same weights), after the block's
  MLP, each block with its own LayerNorm, gate (logit 0) and dropout on the read; the
  state is threaded from the end of one block's pass to the start of the next
  (``threaded=True``, the authors'); ``threaded=False`` starts every block from the
  initial state (causal, the ``tensor_memory (causal)`` row);
- read-out: per token, except occlusion, whose answer is read from the mean of the
  final frame's tokens (placed at the last position, where the mask is).

Every model maps ``features (B, N, F) -> logits (B, N, n_out)`` and offers the suite's
hooks (``blocks``, ``memories()``, ``gate_values()``, ``reset="token"``,
:meth:`AuthorsModel.carried_numbers`).
"""

from __future__ import annotations

import torch
from torch import nn

from examples.diagnostics.config import ModelConfig
from examples.diagnostics.memory import make_tensor_memory
from examples.diagnostics.tasks import CoordinateBinding, MapBuilding, NoHarm, Task
from examples.diagnostics.tasks.occlusion import OcclusionFinalFrame

__all__ = ["AuthorsModel", "build_authors_model", "EMBEDDINGS", "KINDS", "WIDE_MLP_RATIO"]

#: the rows the authors' scripts offer (their ``base``, ``base_wide``, ``slots``, ``tensor``)
KINDS = ("transformer", "transformer_wide", "memory_slots", "tensor_memory")
#: the authors' wide baseline: the same width, MLP ratio 4.5 instead of 4
WIDE_MLP_RATIO = 4.5
#: token embeddings: ``binding`` (type + key + value, no positions), ``linear_pos`` (a linear
#: map + learned positions from zero), ``patches`` (occlusion: + within-frame and frame
#: positions), ``tokens`` (no-harm: an embedding of the one-hot token + positions)
EMBEDDINGS = ("binding", "linear_pos", "patches", "tokens")


def _causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """``(n, n)`` bool, True above the diagonal: the positions a query may NOT attend to."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


class _Memory(nn.Module):
    """One block's memory residual: ``x + sigmoid(gate) * dropout(read(norm(x)))``.

    ``shared`` is the (tensor memory or slot) module every block uses; it is registered
    in each block, and ``Module.parameters()`` lists it once.
    """

    def __init__(self, shared: nn.Module, d: int, dropout: float) -> None:
        super().__init__()
        self.memory = shared
        self.norm = nn.LayerNorm(d)
        self.gate = nn.Parameter(torch.zeros(1))
        self.drop = nn.Dropout(dropout)

    def gate_value(self) -> float:
        return float(torch.sigmoid(self.gate.detach()))


class _Block(nn.Module):
    """Pre-norm: ``x += drop(attn(ln(x)))``, ``x += mlp(ln(x))`` (dropout inside the MLP)."""

    def __init__(self, d: int, heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        hidden = int(d * mlp_ratio)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, d), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)
        self.attention = "local"  # the suite's hooks: attention within the window only
        self.memory: _Memory | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + self.drop(a)
        return x + self.mlp(self.ln2(x))


class _Slots(nn.Module):
    """The authors' slot module: per block, a read (tokens attend to the slots) and an
    update (the slots attend to every token of the block's output, unmasked)."""

    def __init__(self, d: int, heads: int, n_slots: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.init_slots = nn.Parameter(torch.randn(1, n_slots, d) * 0.02)

        def attn() -> nn.MultiheadAttention:
            return nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)

        def norms() -> nn.ModuleList:
            return nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))

        self.read = nn.ModuleList(attn() for _ in range(layers))
        self.write = nn.ModuleList(attn() for _ in range(layers))
        self.ln_read_q, self.ln_read_kv = norms(), norms()
        self.ln_write_q, self.ln_write_kv = norms(), norms()
        self.drop = nn.Dropout(dropout)

    def step(self, i: int, x: torch.Tensor, slots: torch.Tensor, update: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``i``: ``x (B, N, d)`` reads ``slots (B, K, d)``, then (``update``) the
        slots are rewritten from all of ``x``. Returns ``(x, slots)``."""
        kv = self.ln_read_kv[i](slots)
        r, _ = self.read[i](self.ln_read_q[i](x), kv, kv, need_weights=False)
        x = x + self.drop(r)
        if update:
            kv = self.ln_write_kv[i](x)
            u, _ = self.write[i](self.ln_write_q[i](slots), kv, kv, need_weights=False)
            slots = slots + self.drop(u)
        return x, slots


class _Embedding(nn.Module):
    """The authors' token embedding of one task, from this suite's feature layout."""

    def __init__(self, kind: str, in_features: int, d: int, max_len: int, n_values: int = 0,
                 tokens_per_frame: int = 0, frames: int = 0) -> None:
        super().__init__()
        if kind not in EMBEDDINGS:
            raise ValueError(f"embedding: expected one of {EMBEDDINGS}, got {kind!r}")
        self.kind = kind
        if kind == "binding":  # features [is_write, is_query, key (3), one_hot(value) (V)]
            self.type_emb = nn.Embedding(2, d)
            self.coord = nn.Linear(3, d)
            self.value_emb = nn.Embedding(n_values, d)
        elif kind == "tokens":  # features one_hot(token)
            self.tok = nn.Embedding(in_features, d)
            self.pos = nn.Parameter(torch.zeros(max_len, d))
        else:
            self.proj = nn.Linear(in_features, d)
            if kind == "linear_pos":
                self.pos = nn.Parameter(torch.zeros(max_len, d))
            else:  # patches
                self.tokens_per_frame = tokens_per_frame
                self.tok_pos = nn.Parameter(torch.zeros(tokens_per_frame, d))
                self.frame_pos = nn.Parameter(torch.zeros(frames, 1, d))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``features (B, N, F)`` -> ``(B, N, d)``."""
        B, N, _ = features.shape
        if self.kind == "binding":
            kind = features[..., 1].long()  # 0 write, 1 query
            values = features[..., 5:] @ self.value_emb.weight  # zeros at the queries
            return self.type_emb(kind) + self.coord(features[..., 2:5]) + values
        if self.kind == "tokens":
            return features @ self.tok.weight + self.pos[:N]
        x = self.proj(features)
        if self.kind == "linear_pos":
            return x + self.pos[:N]
        P = self.tokens_per_frame
        x = x.reshape(B, N // P, P, -1) + self.tok_pos + self.frame_pos[: N // P]
        return x.reshape(B, N, -1)


class AuthorsModel(nn.Module):
    """``forward(features (B, N, F), reset=None) -> logits (B, N, n_out)``.

    ``kind``: one of :data:`KINDS`; ``embedding``: one of :data:`EMBEDDINGS`;
    ``readout_mean``: read the answer at the last position from the mean of the last
    ``readout_mean`` tokens (occlusion: the final frame), 0 = per token;
    ``threaded``: Tensor Memory's state flows from one block's pass to the next.
    ``reset="token"``: nothing written to a memory is ever read (each token's Tensor
    Memory call starts from the initial state; the slots are never rewritten).
    """

    def __init__(self, kind: str, embedding: _Embedding, n_out: int, cfg: ModelConfig,
                 readout_mean: int = 0, threaded: bool = True) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        d, p = cfg.d_model, cfg.dropout
        self.kind, self.readout_mean, self.threaded = kind, readout_mean, threaded
        self.embed = embedding
        ratio = WIDE_MLP_RATIO if kind == "transformer_wide" else float(cfg.mlp_ratio)
        self.blocks = nn.ModuleList(_Block(d, cfg.n_heads, ratio, p)
                                    for _ in range(cfg.n_layers))
        self.shared: nn.Module | None = None
        if kind == "memory_slots":
            self.shared = _Slots(d, cfg.n_heads, cfg.n_slots, cfg.n_layers, p)
        elif kind == "tensor_memory":  # the layer's own init: forget bias 0, sigma scale 1
            self.shared = make_tensor_memory(d, cfg.memory_channels, cfg.memory_shape,
                                             cfg.chunk_size, 1.0, "default", 0.0)
        if self.shared is not None:
            for block in self.blocks:
                block.memory = _Memory(self.shared, d, p)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_out)

    def forward(self, features: torch.Tensor, reset: str | None = None) -> torch.Tensor:
        if reset not in (None, "token"):
            raise ValueError(f"reset: expected None or 'token' (one window), got {reset!r}")
        x = self.embed(features)
        B, N, d = x.shape
        mask = _causal_mask(N, x.device)
        slots = self.shared.init_slots.expand(B, -1, -1) if self.kind == "memory_slots" \
            else None
        state = None
        for i, block in enumerate(self.blocks):
            x = block(x, mask)
            if self.kind == "memory_slots":
                x, slots = self.shared.step(i, x, slots, update=reset != "token")
            elif self.kind == "tensor_memory":
                mem = block.memory
                normed = mem.norm(x)
                if reset == "token":
                    out, _ = self.shared(normed.reshape(B * N, 1, d), None)
                    out = out.reshape(B, N, d)
                else:
                    out, new_state = self.shared(normed, state if self.threaded else None)
                    state = new_state
                x = x + torch.sigmoid(mem.gate) * mem.drop(out)
        h = self.ln_f(x)
        logits = self.head(h)
        if self.readout_mean:
            last = self.head(h[:, -self.readout_mean:].mean(dim=1))
            logits = torch.cat([logits[:, :-1], last[:, None]], dim=1)
        return logits

    def memories(self) -> list[_Memory]:
        """The per-block memory residuals (each holds the shared module as ``.memory``)."""
        return [b.memory for b in self.blocks if b.memory is not None]

    def gate_values(self) -> list[float]:
        return [m.gate_value() for m in self.memories()]

    def carried_numbers(self) -> int:
        """Numbers the memory holds (one shared state): ``2 C prod(S)`` for Tensor Memory,
        ``K d`` for the slots, 0 without a memory."""
        if self.kind == "tensor_memory":
            cells = 1
            for size in self.shared.memory_shape:
                cells *= size
            return 2 * self.shared.memory_channels * cells
        if self.kind == "memory_slots":
            return self.shared.init_slots[0].numel()
        return 0


def build_authors_model(kind: str, task: Task, cfg: ModelConfig, threaded: bool = True
                        ) -> AuthorsModel:
    """The authors' model of ``kind`` for ``task`` (its embedding and read-out chosen by
    the task's type). ``cfg.segment`` must be ``None`` (one window)."""
    if cfg.segment is not None:
        raise ValueError(f"cfg.segment: the authors' models see one window (None), got "
                         f"{cfg.segment}")
    F, d = task.in_features, cfg.d_model
    readout = 0
    if isinstance(task, CoordinateBinding):
        embedding = _Embedding("binding", F, d, cfg.max_len, n_values=task.n_values)
    elif isinstance(task, OcclusionFinalFrame):
        embedding = _Embedding("patches", F, d, cfg.max_len,
                               tokens_per_frame=task.tokens_per_frame, frames=task.frames)
        readout = task.tokens_per_frame
    elif isinstance(task, NoHarm):
        embedding = _Embedding("tokens", F, d, cfg.max_len)
    elif isinstance(task, MapBuilding):
        embedding = _Embedding("linear_pos", F, d, cfg.max_len)
    else:
        raise ValueError(f"task: no authors' model for {type(task).__name__}")
    return AuthorsModel(kind, embedding, task.n_classes, cfg, readout, threaded)
