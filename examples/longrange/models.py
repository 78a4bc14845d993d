"""The rows: one tiny Mistral-style causal LM (``transformers.MistralForCausalLM`` built from a
config, random init) per row, differing only in how far back it can get information.

- ``window``: sliding-window attention (the config's ``sliding_window = W``: each token
  attends to itself and the ``W - 1`` tokens before it).
- ``tensor_memory``: ``window`` + ``tmcore.adapters.hf.attach_memory`` (a gated Tensor
  Memory after every block, ``causal`` mode, ``zero_init=True``); with
  ``ModelConfig.placement = "before"`` the same gated memory sits before each block's
  attention instead (:class:`BeforeAttention`: it reads and adds to the block's input).
- ``lstm`` / ``delta``: ``window`` + an LSTM memory / a gated delta-rule memory after every
  block, attached the same way (:mod:`examples.longrange.baselines`).
- ``xl``: ``window`` + a Transformer-XL-style cache (Dai et al. 2019) of ``M`` more tokens:
  each token also attends to the keys/values of the ``M`` tokens just before its window,
  with no gradient through them (Transformer-XL's stop-gradient memory, with a segment of
  one token). Its forward is an uncached one (training and evaluation); at evaluation it is
  exactly a sliding window of ``W + M``.
- ``full``: full causal attention over the whole document (the upper bound).

Equal state (:func:`state_sizes`): every carried state holds about ``2 * C * prod(S)``
numbers per layer, Tensor Memory's ``(h, c)``: the LSTM's hidden size is half that, the
delta rule's ``heads * dk * dv`` equals it, and the XL cache holds ``M`` tokens of keys and
values, ``M * 2 * d`` numbers. Every windowed row also keeps the window's own KV cache
when it streams (``(W - 1) * 2 * d`` numbers per layer), the same for all of them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from examples.longrange.baselines import Attached, GatedDeltaMemory, LSTMMemory, attach_recurrent

__all__ = ["ROWS", "LABELS", "MEMORY_ROWS", "ModelConfig", "Built", "BeforeAttention", "build",
           "state_sizes", "XL_ATTENTION"]

ROWS = ("window", "tensor_memory", "lstm", "delta", "xl", "full")
MEMORY_ROWS = ("tensor_memory", "lstm", "delta")
LABELS = {"window": "window only", "tensor_memory": "window + Tensor Memory",
          "lstm": "window + LSTM memory", "delta": "window + gated delta-rule memory",
          "xl": "window + Transformer-XL cache", "full": "full attention"}
XL_ATTENTION = "longrange_xl"


@dataclass(frozen=True)
class ModelConfig:
    """What every row shares, and each memory's size (:func:`state_sizes` derives the
    baselines' sizes from Tensor Memory's)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 128
    window: int = 16
    memory_channels: int = 4
    memory_shape: tuple[int, ...] = (4, 4, 4)
    chunk_size: int = 1
    sigma_scale: float = 1.0
    placement: str = "after"  # Tensor Memory after each block, or "before" its attention
    write_init: str = "default"  # "identity": write_proj starts as the identity (L = 1)
    addressing: str = "learned"  # "oracle": a diagnosis, see OracleAddress
    input_bias: float = 0.0  # Tensor Memory's ConvLSTM input-gate bias at init
    delta_heads: int = 2
    max_positions: int = 32768

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def state_sizes(config: ModelConfig) -> dict[str, Any]:
    """The equal-state sizes: Tensor Memory's numbers per layer ``2 C prod(S)`` and each
    baseline's size and numbers per layer (``numbers``: what each row carries beyond the
    window, per layer and sequence)."""
    tm = 2 * config.memory_channels * math.prod(config.memory_shape)
    head = int(round(math.sqrt(tm / config.delta_heads)))
    xl = max(1, round(tm / (2 * config.hidden)))
    return {
        "tensor_memory": {"channels": config.memory_channels,
                          "shape": list(config.memory_shape), "numbers": tm},
        "lstm": {"hidden": tm // 2, "numbers": 2 * (tm // 2)},
        "delta": {"heads": config.delta_heads, "key_dim": head, "value_dim": head,
                  "numbers": config.delta_heads * head * head},
        "xl": {"tokens": xl, "numbers": xl * 2 * config.hidden},
        "window": {"numbers": 0}, "full": {"numbers": 0},
        "window_kv_cache": (config.window - 1) * 2 * config.hidden,
    }


# --------------------------------------------------------------------------- XL attention


def xl_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Tensor | None, scaling: float, dropout: float = 0.0,
                 **kwargs: Any) -> tuple[Tensor, Tensor]:
    """Attention over the window (``config.sliding_window`` keys, with gradient) and the
    ``config.longrange_xl_cache`` keys before it (keys and values detached).

    ``query, key, value (B, heads, N, hd)`` of an uncached forward (``N`` queries over the
    same ``N`` keys; ``attention_mask`` must be ``None``: no padding). Returns ``(B, N,
    heads, hd)`` and the weights, as transformers' attention functions do.
    """
    if query.shape[2] != key.shape[2] or attention_mask is not None:
        raise NotImplementedError("the XL row runs uncached, unpadded forwards only")
    window = module.config.sliding_window
    cache = module.config.longrange_xl_cache
    n = query.shape[2]
    index = torch.arange(n, device=query.device)
    back = index[:, None] - index[None, :]                       # query i, key j: i - j
    recent = (back >= 0) & (back < window)
    old = (back >= window) & (back < window + cache)
    scores = torch.where(recent, query @ key.transpose(2, 3),
                         query @ key.detach().transpose(2, 3)) * scaling
    scores = scores.masked_fill(~(recent | old), float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = (weights * recent) @ value + (weights * old) @ value.detach()
    return out.transpose(1, 2).contiguous(), weights


def _register_xl() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(XL_ATTENTION, xl_attention)


# --------------------------------------------------------------------------- placement


class BeforeAttention:
    """A gated Tensor Memory before each decoder block's attention: a forward pre-hook
    replaces the block's input ``x (B, N, d)`` by ``x + sigmoid(gate) * memory(norm(x))``
    (a :class:`tmcore.adapters.torch.MemoryResidual`, submodule ``block.tensor_memory``), so
    the read enters the block's attention and MLP. Uncached forwards only (each call starts
    from zeros: training and evaluation); :meth:`start_documents` marks the next call's
    state resets (``causal`` mode, as :meth:`tmcore.adapters.torch.MemoryHandle.start_documents`).
    """

    def __init__(self, model: nn.Module, memories: list[nn.Module]):
        self.memories = memories
        self._starts: Tensor | None = None
        self._calls = 0
        for block, memory in zip(model.model.layers, memories, strict=True):
            block.add_module("tensor_memory", memory)
            block.register_forward_pre_hook(self._hook, with_kwargs=True)

    def start_documents(self, starts: Tensor) -> None:
        self._starts, self._calls = starts, 0

    def _hook(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise NotImplementedError("placement 'before': uncached forwards only")
        x = args[0] if args else kwargs["hidden_states"]
        y, _ = block.tensor_memory(x, doc_starts=self._starts)
        self._calls += 1
        if self._calls == len(self.memories):  # the masks are the call's, every layer's
            self._starts, self._calls = None, 0
        return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": y})


class OracleAddress:
    """A diagnosis, not a recipe: every tagged position (a fact, a question) writes and
    reads at a fixed cell of its token (its key), the other positions where the memory's
    heads say. Key ``k`` (token ``key0 + k``) gets the ``k``-th cell of a farthest-point
    order of the grid's cells (16 keys on 4x4x4: cells at least 1.4 cells apart), so
    what the memory then recalls is what it can store and read once the addressing is
    right. Chunks of one token; the heads of each memory's layer are wrapped (an instance
    attribute over :meth:`tmcore.layer.Layer.heads`).
    """

    def __init__(self, memories: list[nn.Module], shape: tuple[int, ...]):
        axes = [torch.linspace(-1, 1, size) for size in reversed(shape)]  # x = last axis
        centres = torch.cartesian_prod(*axes).reshape(-1, len(shape))
        order = [0]
        far = (centres - centres[0]).norm(dim=-1)
        for _ in range(len(centres) - 1):
            order.append(int(far.argmax()))
            far = torch.minimum(far, (centres - centres[order[-1]]).norm(dim=-1))
        self.cells = centres[order]
        self._coords: Tensor | None = None
        for residual in memories:
            layer = residual.memory.layer
            if residual.memory.chunk_size != 1:
                raise ValueError("addressing: the oracle needs chunks of one token")
            layer.heads = functools.partial(self._heads, layer.heads)

    @contextmanager
    def given(self, tokens: Tensor, tags: Tensor) -> Iterator[None]:
        """The coordinates of this call's tagged positions (``tags != PAD``)."""
        from examples.longrange.task import PAD, Vocab

        cell = self.cells[(tokens - Vocab().key0) % len(self.cells)]        # (B, N, n)
        self._coords = torch.where((tags != PAD)[..., None], cell, torch.nan)
        try:
            yield
        finally:
            self._coords = None

    def _heads(self, heads: Any, xp: Any, params: Any, chunks: Tensor) -> Any:
        inputs = heads(xp, params, chunks)
        fixed = self._coords
        if fixed is None:
            return inputs
        if chunks.shape[:2] != fixed.shape[:2]:
            raise ValueError("addressing: the oracle needs one chunk per position")
        known = ~fixed.isnan()
        return inputs._replace(read_coords=torch.where(known, fixed, inputs.read_coords),
                               write_coords=torch.where(known, fixed, inputs.write_coords))


def _identity_write(memories: list[nn.Module]) -> None:
    """``write_proj`` (``(d, L d)``) starts as the identity on the chunk's first token, so a
    token's write address starts as its read address (``L = 1``: the same function)."""
    with torch.no_grad():
        for residual in memories:
            proj = residual.memory.write_proj
            d = proj.weight.shape[0]
            proj.weight.zero_()
            proj.weight[:, :d] = torch.eye(d)
            proj.bias.zero_()


# --------------------------------------------------------------------------- rows


@dataclass
class Built:
    """A row's model and what its evaluation needs.

    ``forward(tokens (B, N)) -> logits (B, N, V)``; ``forward(tokens, reset_every=W)``
    evaluates with the carried state reset every ``W`` tokens (memories: their state
    restarts from zeros at positions ``0, W, 2W, ...``; ``xl``: no cache, the window
    alone); ``resettable`` says whether the row carries anything to reset.
    """

    row: str
    model: nn.Module
    handle: Any = None
    numbers: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    oracle: OracleAddress | None = None

    @property
    def resettable(self) -> bool:
        return self.row in (*MEMORY_ROWS, "xl")

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def memory_parameters(self) -> list[nn.Parameter]:
        """The memories' parameters (norm, memory, read-out, gate); empty without one."""
        if self.row not in MEMORY_ROWS:
            return []
        return [p for m in self.handle.memories for p in m.parameters()]

    @contextmanager
    def _reset(self, every: int | None, batch: int, tokens: int) -> Iterator[None]:
        if every is None:
            yield
            return
        if self.row == "tensor_memory":
            starts = torch.zeros(batch, tokens, dtype=torch.bool)
            starts[:, ::every] = True
            getattr(self.handle, "handle", self.handle).start_documents(starts)
            yield
        elif self.row in ("lstm", "delta"):
            self.handle.reset_every = every
            try:
                yield
            finally:
                self.handle.reset_every = None
        elif self.row == "xl":
            config = self.model.config
            saved, config.longrange_xl_cache = config.longrange_xl_cache, 0
            try:
                yield
            finally:
                config.longrange_xl_cache = saved
        else:
            raise ValueError(f"{self.row}: carries nothing to reset")

    def embed(self, tokens: Tensor, tags: Tensor | None = None) -> Tensor:
        """``tokens (B, N)`` (+ ``tags (B, N)``) -> the input embeddings ``(B, N, d)``: the
        sum of both ids' rows of the model's embedding table (``PAD``'s row is zero)."""
        table = self.model.get_input_embeddings()
        return table(tokens) if tags is None else table(tokens) + table(tags)

    def forward(self, tokens: Tensor, tags: Tensor | None = None,
                reset_every: int | None = None) -> Tensor:
        """Logits ``(B, N, V)`` of an uncached forward over ``tokens`` (+ ``tags``)."""
        with self._reset(reset_every, tokens.shape[0], tokens.shape[1]):
            if self.oracle is None or tags is None:
                return self.model(inputs_embeds=self.embed(tokens, tags), use_cache=False).logits
            with self.oracle.given(tokens, tags):
                return self.model(inputs_embeds=self.embed(tokens, tags), use_cache=False).logits


def mistral(config: ModelConfig, vocab_size: int, window: int | None,
            attention: str = "sdpa") -> Any:
    """A randomly initialized ``MistralForCausalLM`` (tied embeddings, RoPE)."""
    from transformers import MistralConfig, MistralForCausalLM

    hf_config = MistralConfig(
        vocab_size=vocab_size, hidden_size=config.hidden, intermediate_size=config.intermediate,
        num_hidden_layers=config.layers, num_attention_heads=config.heads,
        num_key_value_heads=config.heads, head_dim=config.hidden // config.heads,
        max_position_embeddings=config.max_positions, sliding_window=window,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        attn_implementation=attention)
    return MistralForCausalLM(hf_config)


def build(row: str, config: ModelConfig, vocab_size: int, seed: int,
          retention: float = 0.0) -> Built:
    """Row ``row``'s model, its weights drawn from ``seed``; ``retention`` is the memory's
    forget-gate bias (Tensor Memory's ConvLSTM ``forget_bias``, the LSTM's, the delta rule's
    decay bias), unused by rows without a memory."""
    from tmcore.adapters import hf

    if row not in ROWS:
        raise ValueError(f"row: expected one of {ROWS}, got {row!r}")
    sizes = state_sizes(config)
    torch.manual_seed(seed)
    if row == "full":
        return Built(row, mistral(config, vocab_size, None))
    if row == "xl":
        _register_xl()
        model = mistral(config, vocab_size, config.window, XL_ATTENTION)
        model.config.longrange_xl_cache = sizes["xl"]["tokens"]
        return Built(row, model, numbers=sizes["xl"]["numbers"], info=sizes["xl"])
    model = mistral(config, vocab_size, config.window)
    if row == "window":
        return Built(row, model)
    if row == "tensor_memory":
        kw = {"memory_channels": config.memory_channels, "memory_shape": config.memory_shape,
              "chunk_size": config.chunk_size, "sigma_scale": config.sigma_scale,
              "forget_bias": retention, "zero_init": True}
        if config.placement == "after":
            handle: Any = hf.attach_memory(model, gate_init=0.0, **kw)
        elif config.placement == "before":
            from tmcore.adapters.torch import MemoryResidual, TensorMemory

            handle = BeforeAttention(model, [
                MemoryResidual(TensorMemory(config.hidden, **kw), gate_init=0.0)
                for _ in range(config.layers)])
        else:
            raise ValueError(f"placement: expected 'after' or 'before', got {config.placement!r}")
        if config.input_bias:  # the pointwise bias's input-gate quarter (gates i, f, o, g)
            with torch.no_grad():
                for residual in handle.memories:
                    residual.memory.cell.pointwise_bias[:config.memory_channels] = \
                        config.input_bias
        if config.write_init == "identity":
            _identity_write(handle.memories)
        elif config.write_init != "default":
            raise ValueError(f"write_init: expected 'default' or 'identity', "
                             f"got {config.write_init!r}")
        oracle = None
        if config.addressing == "oracle":
            oracle = OracleAddress(handle.memories, config.memory_shape)
        elif config.addressing != "learned":
            raise ValueError(f"addressing: expected 'learned' or 'oracle', "
                             f"got {config.addressing!r}")
        return Built(row, model, handle, sizes[row]["numbers"], sizes[row], oracle)
    if row == "lstm":
        attached: Attached = attach_recurrent(
            model, lambda d: LSTMMemory(d, sizes["lstm"]["hidden"], forget_bias=retention))
    else:
        s = sizes["delta"]
        attached = attach_recurrent(
            model, lambda d: GatedDeltaMemory(d, s["heads"], s["key_dim"], s["value_dim"],
                                              forget_bias=retention))
    assert attached.state_numbers() == sizes[row]["numbers"]
    return Built(row, model, attached, sizes[row]["numbers"], sizes[row])
