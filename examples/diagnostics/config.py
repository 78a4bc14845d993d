"""Configuration: model and training sizes, and the CPU / ``--full`` / tiny scales."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["ModelConfig", "TrainConfig", "MODEL_KINDS", "STREAMING_KINDS", "MEMORY_KINDS",
           "scaled"]

#: The backbones the old-style tasks compare, at equal depth and width (the wide one is
#: parameter-matched to the Tensor Memory model instead); also the paper protocol's rows.
MODEL_KINDS = ("transformer", "transformer_wide", "memory_slots", "tensor_memory")
#: The streaming protocol's rows: every baseline can carry something across segments
#: except the plain one (see models.py for each one's state size).
STREAMING_KINDS = ("transformer", "sliding_window", "transformer_xl", "lstm_memory",
                   "memory_slots", "tensor_memory")
#: Rows whose memory has a retention ("forget") bias to tune; the others tune lr only.
MEMORY_KINDS = ("lstm_memory", "gru_memory", "memory_slots", "tensor_memory")


@dataclass(frozen=True)
class ModelConfig:
    """Backbone and memory sizes (shared by every model of a run)."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    max_len: int = 128
    #: attention window: ``None`` = the whole stream in one window ("--context full");
    #: an int W = segments of W tokens, recurrent memory state carried across them
    segment: int | None = 8
    memory_layers: tuple[int, ...] = (0,)  # blocks that carry a memory (slots or TM)
    memory_channels: int = 8
    memory_shape: tuple[int, int, int] = (6, 6, 6)
    chunk_size: int = 1
    sigma_scale: float = 0.5  # write spread at init ~0.66 (cell spacing: 0.67 at 4^3, 0.4 at 6^3)
    write_init: str = "first_token"  # see memory.init_write_proj; "default": the layer's own
    forget_bias: float = 3.0  # ConvLSTM forget-gate bias at init (memory.init_forget_bias)
    gate_init: float = 0.0  # sigmoid(0) = 0.5: the memory starts half open
    n_slots: int = 16
    #: recurrent-memory baseline (``lstm_memory`` / ``gru_memory``) hidden size; ``None``:
    #: the size whose state holds as many numbers as Tensor Memory's ``(h, c)``
    rnn_hidden: int | None = None
    #: Transformer-XL cache length in tokens per layer; ``None``: as many numbers as Tensor
    #: Memory's state (``2 C prod(S) / (d * n_layers)``)
    cache_tokens: int | None = None
    #: sliding-window attention: each token sees this many tokens back (``None``: the segment)
    window: int | None = None
    dropout: float = 0.0
    #: the memory residual before the block's attention (True), or after it; before, the
    #: memory reads and writes the token embeddings themselves (see the README's findings)
    memory_first: bool = True

    def state_numbers(self) -> int:
        """Numbers in one Tensor Memory layer's state ``(h, c)``: ``2 C prod(S)``."""
        cells = 1
        for size in self.memory_shape:
            cells *= size
        return 2 * self.memory_channels * cells

    def rnn_hidden_size(self) -> int:
        """The LSTM/GRU baseline's hidden size: its ``(h, c)`` holds ``state_numbers()``."""
        return self.rnn_hidden or self.state_numbers() // 2

    def xl_cache_tokens(self) -> int:
        """Transformer-XL cache length: ``d`` numbers per token and layer, as many numbers in
        all as Tensor Memory's state (at least 1)."""
        if self.cache_tokens is not None:
            return self.cache_tokens
        return max(1, self.state_numbers() // (self.d_model * self.n_layers))


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer and schedule of the shared training loop (AdamW, warmup + cosine)."""

    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    memory_lr_scale: float = 1.0  # learning rate of the memory layers (TM and slots) = lr * this
    weight_decay: float = 0.01
    warmup: int = 30
    grad_clip: float = 1.0
    eval_examples: int = 256
    log_every: int = 10
    seeds: tuple[int, ...] = (0,)
    schedule: str = "cosine"  # "cosine" (warmup + cosine to 0.1 lr) or "constant" (the paper's)
    extra: dict = field(default_factory=dict)  # task-specific knobs


def scaled(train: TrainConfig, model: ModelConfig, scale: str) -> tuple[TrainConfig, ModelConfig]:
    """Apply a named scale: ``"cpu"`` (as given), ``"full"`` (paper-scale, for a GPU), ``"tiny"``
    (smoke tests: a handful of steps on minute inputs)."""
    if scale == "cpu":
        return train, model
    if scale == "full":
        return (replace(train, steps=train.steps * 10, batch_size=64, eval_examples=2048,
                        warmup=200, log_every=50, seeds=(0, 1, 2)),
                replace(model, d_model=128, n_layers=4, memory_channels=32,
                        memory_layers=(0, 2), max_len=512))
    if scale == "tiny":
        return (replace(train, steps=8, batch_size=4, eval_examples=8, warmup=2, log_every=2,
                        seeds=(0,)),
                replace(model, d_model=16, n_layers=1, n_heads=2, memory_channels=2,
                        memory_shape=tuple(min(s, 4) for s in model.memory_shape), n_slots=4,
                        segment=model.segment and min(model.segment, 4)))
    raise ValueError(f"scale: expected 'cpu', 'full' or 'tiny', got {scale!r}")
