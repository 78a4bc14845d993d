"""Recurrent memories that are not Tensor Memory, attached to a Hugging Face model's blocks the
way ``tmcore.adapters.hf.attach_memory`` attaches it.

Each decoder block gets a :class:`Residual` (``block.longrange_memory``) and a forward hook
that replaces the block's output ``x (B, N, d)`` by ``x + sigmoid(gate) * mem(norm(x))``:
a LayerNorm, the memory, a read-out that starts at zero (so the model is unchanged at step
0, like ``zero_init=True``) and a gate logit that starts at 0, as Tensor Memory's
``MemoryResidual``. The state follows the generation cache as Tensor Memory's does
(:class:`Attached`): an uncached call or an empty cache starts from zeros, a cached call
continues the state the previous call with that cache reached, so feeding a stream in
pieces equals one call.

The memories (``forward(x (B, N, d), state) -> (out (B, N, d), state)``):

- :class:`LSTMMemory`: a single-layer LSTM (Hochreiter & Schmidhuber 1997, ``torch.nn.LSTM``)
  over the tokens; state ``(h, c)`` of ``2 H`` numbers per sequence.
- :class:`GatedDeltaMemory`: the delta rule of DeltaNet (Schlag et al. 2021; Yang et al.
  2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length") with
  the scalar decay gate of Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025, "Gated Delta
  Networks"), run token by token; state ``S`` of ``heads * dk * dv`` numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LSTMMemory", "GatedDeltaMemory", "Residual", "Attached", "attach_recurrent",
           "ATTRIBUTE"]

#: The submodule each block gets.
ATTRIBUTE = "longrange_memory"


class LSTMMemory(nn.Module):
    """An LSTM over the tokens, read out by a linear map of its hidden state.

    ``hidden`` is chosen by the caller so that ``(h, c)`` holds as many numbers as Tensor
    Memory's ``(h, c)`` (``2 * hidden = 2 * C * prod(S)``); the forget-gate bias starts at
    ``forget_bias`` (the same knob as Tensor Memory's ConvLSTM ``forget_bias``).
    """

    def __init__(self, embed_dim: int, hidden: int, forget_bias: float = 0.0):
        super().__init__()
        self.rnn = nn.LSTM(embed_dim, hidden, batch_first=True)
        self.out_proj = nn.Linear(hidden, embed_dim)
        with torch.no_grad():  # gate order i, f, g, o: the forget gate starts at sigmoid(b)
            self.rnn.bias_ih_l0[hidden:2 * hidden] = forget_bias
            self.rnn.bias_hh_l0[hidden:2 * hidden] = 0.0

    def state_numbers(self) -> int:
        """Numbers in the state of one sequence: ``2 * hidden``."""
        return 2 * self.rnn.hidden_size

    def forward(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        """``x (B, N, d)``, state ``(h, c)`` each ``(1, B, H)`` or ``None`` -> ``out (B, N, d)``
        and the state after the last token."""
        hidden, state = self.rnn(x, state)
        return self.out_proj(hidden), state


class GatedDeltaMemory(nn.Module):
    """A gated delta-rule fast-weight memory, token by token, ``heads`` heads.

    Per head, with ``k_t, q_t`` L2-normalized (``dk``), ``v_t`` (``dv``), the write strength
    ``beta_t = sigmoid(w_beta . x_t)`` and the decay ``alpha_t = sigmoid(w_alpha . x_t +
    b)`` (``b`` = ``forget_bias``, the retention knob)::

        S_t = alpha_t * (S_{t-1} - beta_t (S_{t-1} k_t) k_t^T) + beta_t v_t k_t^T
        o_t = S_t q_t

    ``S`` is ``(B, heads, dv, dk)``. As in DeltaNet, the write replaces what ``S`` held
    under ``k_t`` (``S k_t``) by ``v_t`` in proportion ``beta_t``; Gated DeltaNet's gate
    ``alpha_t`` decays the whole state. Left out from the published layers: their short
    causal convolutions, output norm and output gate, and the chunkwise-parallel training
    form (this loop computes the same recurrence, slower).
    """

    def __init__(self, embed_dim: int, heads: int, key_dim: int, value_dim: int,
                 forget_bias: float = 0.0):
        super().__init__()
        self.heads, self.key_dim, self.value_dim = heads, key_dim, value_dim
        self.q_proj = nn.Linear(embed_dim, heads * key_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, heads * key_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, heads * value_dim, bias=False)
        self.beta_proj = nn.Linear(embed_dim, heads)
        self.alpha_proj = nn.Linear(embed_dim, heads)
        self.out_proj = nn.Linear(heads * value_dim, embed_dim)
        with torch.no_grad():
            self.alpha_proj.bias.fill_(forget_bias)

    def state_numbers(self) -> int:
        """Numbers in the state of one sequence: ``heads * key_dim * value_dim``."""
        return self.heads * self.key_dim * self.value_dim

    def forward(self, x: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``x (B, N, d)``, ``S (B, heads, dv, dk)`` or ``None`` -> ``out (B, N, d)``, ``S``."""
        b, n, _ = x.shape
        h, dk, dv = self.heads, self.key_dim, self.value_dim
        q = F.normalize(self.q_proj(x).view(b, n, h, dk), dim=-1)
        k = F.normalize(self.k_proj(x).view(b, n, h, dk), dim=-1)
        v = self.v_proj(x).view(b, n, h, dv)
        beta = torch.sigmoid(self.beta_proj(x))[..., None]      # (B, N, h, 1)
        alpha = torch.sigmoid(self.alpha_proj(x))[..., None, None]  # (B, N, h, 1, 1)
        s = x.new_zeros(b, h, dv, dk) if state is None else state
        outs = []
        for t in range(n):
            kt = k[:, t][:, :, None, :]                          # (B, h, 1, dk)
            old = torch.einsum("bhvk,bhk->bhv", s, k[:, t])      # what S holds under k_t
            s = alpha[:, t] * (s - (beta[:, t] * old)[..., None] * kt) \
                + (beta[:, t] * v[:, t])[..., None] * kt
            outs.append(torch.einsum("bhvk,bhk->bhv", s, q[:, t]))
        out = torch.stack(outs, 1).reshape(b, n, h * dv) if n else x.new_zeros(b, 0, h * dv)
        return self.out_proj(out), s


class Residual(nn.Module):
    """``x + sigmoid(gate) * memory(norm(x))`` with the read-out ``memory.out_proj`` at zero
    at first (Tensor Memory's ``MemoryResidual`` with ``zero_init=True``)."""

    def __init__(self, memory: nn.Module, embed_dim: int, gate_init: float = 0.0):
        super().__init__()
        self.memory = memory
        self.norm = nn.LayerNorm(embed_dim)
        self.gate = nn.Parameter(torch.tensor(float(gate_init)))
        with torch.no_grad():
            memory.out_proj.weight.zero_()
            memory.out_proj.bias.zero_()

    def forward(self, x: Tensor, state: Any = None, resets: list[int] | None = None
                ) -> tuple[Tensor, Any]:
        """``x (B, N, d)`` -> ``(B, N, d)`` and the memory state; ``resets``: positions
        (in this call) where the state restarts from zeros."""
        y = self.norm(x)
        cuts = sorted(p for p in set(resets or ()) if 0 <= p < x.shape[1])
        bounds = [0, *[p for p in cuts if p > 0], x.shape[1]]
        if cuts and cuts[0] == 0:
            state = None
        outs = []
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            if start > 0:
                state = None
            out, state = self.memory(y[:, start:stop], state)
            outs.append(out)
        return x + torch.sigmoid(self.gate) * torch.cat(outs, 1), state


class _BlockHook:
    def __init__(self, owner: Attached, layer: int):
        self.owner, self.layer = owner, layer

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        x = output[0] if isinstance(output, tuple) else output
        y = self.owner._run(self.layer, module, x)
        return (y, *output[1:]) if isinstance(output, tuple) else y


class Attached:
    """The memories attached to a model's blocks (:func:`attach_recurrent`'s result).

    ``reset_every``: when set, every call restarts every layer's state at the positions
    ``0, reset_every, 2 reset_every, ...`` of the stream (counted from the stream's start,
    across cached calls): the "state reset" evaluation. ``remove()`` undoes the attach.
    """

    def __init__(self, model: nn.Module, memories: list[Residual]):
        self.model = model
        self.blocks = list(model.model.layers)
        self.reset_every: int | None = None
        self._start: list[Any] | None = None
        self._current: list[Any] = []
        self._offset = 0
        self._hooks = []
        for block, memory in zip(self.blocks, memories, strict=True):
            block.add_module(ATTRIBUTE, memory)
        self._hooks = [b.register_forward_hook(_BlockHook(self, i), prepend=True)
                       for i, b in enumerate(self.blocks)]
        self._hooks.append(model.model.register_forward_pre_hook(self._before, with_kwargs=True))
        self._hooks.append(model.model.register_forward_hook(self._after, with_kwargs=True))

    @property
    def memories(self) -> list[Residual]:
        return [getattr(b, ATTRIBUTE) for b in self.blocks]

    def state_numbers(self) -> int:
        """Numbers one layer carries per sequence."""
        return self.memories[0].memory.state_numbers()

    @staticmethod
    def _cache(kwargs: dict) -> Any:
        return kwargs.get("cache", kwargs.get("past_key_values"))

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = self._cache(kwargs)
        past = 0 if cache is None else cache.get_seq_length()
        if past == 0:
            self._start, self._offset = None, 0
        elif getattr(cache, "_longrange_state", None) is None \
                or cache._longrange_state[0] != past:
            raise RuntimeError("cache: it holds tokens but not this memory's state for them")
        else:
            self._offset, self._start = cache._longrange_state
        self._current = []

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        cache = self._cache(kwargs) or getattr(output, "cache", None)
        if cache is not None and self._current:
            cache._longrange_state = (cache.get_seq_length(), list(self._current))
        self._start, self._current = None, []

    def _resets(self, tokens: int) -> list[int] | None:
        if not self.reset_every:
            return None
        first = -self._offset % self.reset_every
        return list(range(first, tokens, self.reset_every))

    def _run(self, layer: int, module: nn.Module, x: Tensor) -> Tensor:
        memory = getattr(module, ATTRIBUTE)
        start = None if self._start is None else self._start[layer]
        y, state = memory(x, start, self._resets(x.shape[1]))
        self._current.append(state)
        return y

    def remove(self) -> None:
        """Remove the hooks and the memory submodules."""
        for hook in self._hooks:
            hook.remove()
        for block in self.blocks:
            if ATTRIBUTE in block._modules:
                delattr(block, ATTRIBUTE)
        self._hooks = []


def attach_recurrent(model: nn.Module, make: Callable[[int], nn.Module],
                     gate_init: float = 0.0) -> Attached:
    """Attach ``Residual(make(d))`` after every decoder block of a Hugging Face causal LM
    (``model.model.layers``: Llama, Mistral, Qwen2, ...); ``d`` is ``config.hidden_size``."""
    d = model.config.hidden_size
    return Attached(model, [Residual(make(d), d, gate_init) for _ in model.model.layers])
