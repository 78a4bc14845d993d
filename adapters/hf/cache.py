"""The memory state follows the generation, the way the KV cache does
(docs/guides/huggingface.md): :class:`HFMemory`, the forward hooks of the blocks' owner
that take each call's state from its cache (or start fresh) and store the state the call
reaches on the cache; the cache methods whose rows the state follows; the padding mask
read as the tokens that enter the state; the decoding modes it cannot follow, refused."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from tmcore.adapters.hf.blocks import (
    CONFIG_KEY,
    parameter_names,
    transformers_module,
    unmark_config,
)
from tmcore.adapters.torch import MemoryHandle, StreamState, detach_state
from tmcore.adapters.torch import attach as _torch_attach
from tmcore.adapters.torch import tuners as _tuners

__all__ = ["PEFT_EXCLUDE", "HFMemory"]

_CACHE_ATTR = "_tmcore_memory"
_CACHE_NAMES = ("cache", "past_key_values")


class _Entry:
    """What a cache object carries for the memory: the owner, the cache length the
    state belongs to (``None``: bound by a compiled forward, not recorded), the per-layer
    states (a class: ``torch.compile`` builds it without a graph break)."""

    def __init__(self, owner: int, length: int | None, state: list[Any]):
        self.owner, self.length, self.state = owner, length, state


class _CacheMethod:
    """An instance attribute that wraps a ``Cache`` method so the memory state stored on
    the cache follows it (picklable and deep-copyable with the cache)."""

    def __init__(self, cache: Any, name: str):
        self.cache, self.name = cache, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache, name = self.cache, self.name
        entry = cache.__dict__.get(_CACHE_ATTR)
        value = args[0] if args else next(iter(kwargs.values()), 0)  # its one argument
        if name == "crop" and entry is not None:
            before = cache.get_seq_length()
            if before > 0 and (value < 0 or 0 < value < before):
                raise RuntimeError(f"tmcore.adapters.hf: cache.crop({value}) would remove "
                                   f"tokens: {_REFUSED['_get_candidate_generator']}")
        result = getattr(type(cache), name)(cache, *args, **kwargs)
        if entry is not None and name == "reset":
            cache.__dict__.pop(_CACHE_ATTR, None)
        elif entry is not None and name in _ROW_METHODS:  # indices, a bool mask or repeats
            if name == "batch_repeat_interleave":
                index = torch.arange(entry.state[0].h.shape[0]).repeat_interleave(int(value))
            else:
                index = torch.as_tensor(value)
                index = index.nonzero().reshape(-1) if index.dtype == torch.bool else index
            # a StreamState per layer, every field (count included) with the batch axis first
            entry.state = [StreamState(*(t.index_select(0, index.to(t.device)) for t in s))
                           for s in entry.state]
        return result


#: The cache methods that pick the rows the cache keeps (the state's rows follow).
_ROW_METHODS = ("reorder_cache", "batch_select_indices", "batch_repeat_interleave")
_FOLLOWED = (*_ROW_METHODS, "crop", "reset")


# --------------------------------------------------------------------------- the handle


class HFMemory:
    """The memories attached to a Hugging Face model (:func:`attach_memory`'s result).

    ``memories`` / ``parameters()`` as :class:`tmcore.adapters.torch.MemoryHandle`'s;
    ``spec`` the stored configuration (``model.config.tensor_memory``);
    :meth:`state_of` the per-layer state a cache carries; :meth:`remove` undoes the
    attach exactly. Made by :func:`attach_memory` and :func:`from_pretrained`, not
    by hand.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model the memories are attached to.
    path : str
        The dotted path of its blocks (:func:`find_blocks`).
    owner : torch.nn.Module
        The module owning the blocks; its forward hooks carry the memory state.
    handle : tmcore.adapters.torch.MemoryHandle
        The attached memories (one per block).
    spec : dict
        The memory configuration stored in ``model.config.tensor_memory``.
    """

    def __init__(self, model: nn.Module, path: str, owner: nn.Module, handle: MemoryHandle,
                 spec: dict[str, Any]):
        self.model, self.path, self.owner, self.handle, self.spec = model, path, owner, handle, spec
        self.streaming = bool(spec["streaming"])
        self._train_state: list[Any] | None = None
        self._names = parameter_names(owner)
        self._hooks = [
            owner.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            owner.register_forward_hook(self._after, with_kwargs=True),
        ]
        for method in _REFUSED:
            if hasattr(model, method):
                model.__dict__[method] = partial(_refuse, method)

    def __repr__(self) -> str:
        return (f"HFMemory(blocks={self.path!r}, layers={len(self.handle.memories)}, "
                f"attached={self.attached})")

    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    @property
    def memories(self) -> list[nn.Module]:
        return self.handle.memories

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.handle.parameters()

    def state_of(self, cache: Any) -> list[Any] | None:
        """The per-layer memory state a generation cache carries.

        Parameters
        ----------
        cache : transformers.Cache or None
            The ``past_key_values`` of a forward or ``generate`` call.

        Returns
        -------
        list or None
            One state per memory layer (:class:`tmcore.adapters.torch.StreamState`),
            or ``None`` when the cache carries none (a fresh start).
        """
        return getattr(getattr(cache, "__dict__", {}).get(_CACHE_ATTR), "state", None)

    def reset_state(self) -> None:
        """Forget the streaming-training state (``streaming=True``).

        The next uncached training forward starts fresh (a document boundary).
        """
        self._train_state = None

    def remove(self) -> None:
        """Remove the memories, the hooks and ``model.config.tensor_memory``."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for method in _REFUSED:
            if getattr(self.model.__dict__.get(method), "func", None) is _refuse:
                del self.model.__dict__[method]
        self.handle.remove()
        self._train_state = None
        if getattr(self.model, "_tmcore_hf_memory", None) is self:
            del self.model._tmcore_hf_memory
        self.model.config.__dict__.pop(CONFIG_KEY, None)
        unmark_config(self.model.config)  # model_type included

    # ----------------------------------------------------------------- per call

    def _arg(self, args: tuple, kwargs: dict, *names: str) -> tuple[str, Any]:
        """The first of the forward's arguments ``names`` that is given (not None), and its
        name."""
        for name in names:
            index = self._names.get(name, len(args))
            value = kwargs.get(name, args[index] if index < len(args) else None)
            if value is not None:
                return name, value
        return names[0], None

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        compiling = torch.compiler.is_compiling()
        if torch.is_grad_enabled() and not compiling:  # training (decoding: no_grad)
            _check_adapted_linears(self.handle.memories)
        name, cache = self._arg(args, kwargs, *_CACHE_NAMES)
        _, tokens = self._arg(args, kwargs, "input_ids", "inputs_embeds")
        if not isinstance(tokens, Tensor) or tokens.dim() < 2:
            raise ValueError("input_ids: expected input_ids (B, N) or inputs_embeds (B, N, d)")
        batch, count = int(tokens.shape[0]), int(tokens.shape[1])
        start, past = None, 0
        if cache is None:
            if self.streaming and module.training and self._train_state is not None:
                rows = int(self._train_state[0].h.shape[0])
                if rows != batch:
                    raise ValueError(
                        f"input_ids: streaming training continues the previous batch of "
                        f"{rows} rows, got {batch} rows; drop the last incomplete batch "
                        f"(dataloader_drop_last=True) or call memory.reset_state() first")
                start = self._train_state
        else:
            start, past = self._cache_start(name, cache, compiling)
        self.handle.set_state(start)  # a detached training state, a cache's (no grad) or None
        self.handle.set_valid(_valid_mask(self._arg(args, kwargs, "attention_mask")[1], batch,
                                          count, compiling, past))

    def _cache_start(self, name: str, cache: Any, compiling: bool
                     ) -> tuple[list[Any] | None, int]:
        """The state a cached call starts from, and the cache length (0 while compiling)."""
        if type(cache).__name__ == "PagedAttentionCache":
            raise NotImplementedError(f"{name}: {_REFUSED['init_continuous_batching']}")
        if not isinstance(cache, transformers_module().Cache):
            raise TypeError(f"{name}: tmcore's memory follows a transformers Cache object "
                            f"(DynamicCache, StaticCache, ...); got {type(cache).__name__} "
                            f"(legacy tuple caches cannot carry the memory state)")
        past = cache.get_seq_length()
        entry = cache.__dict__.get(_CACHE_ATTR)
        if compiling:
            return getattr(entry, "state", None), 0
        if past == 0:
            cache.__dict__.pop(_CACHE_ATTR, None)
            return None, 0
        if entry is None or entry.owner != id(self):
            raise RuntimeError(f"{name}: this cache holds {past} tokens but no Tensor Memory "
                               f"state of this model: it was filled before the memory was "
                               f"attached, by another model, or with virtual tokens the memory "
                               f"never read (PEFT prefix tuning is not supported with memory; "
                               f"LoRA and prompt tuning are); start from an empty cache")
        if entry.length is not None and entry.length != past:
            raise RuntimeError(f"{name}: the cache now holds {past} tokens, its memory state "
                               f"belongs to {entry.length}; the cache was changed in a way "
                               f"the memory cannot follow")
        return entry.state, past

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        states = self.handle.state
        self.handle.reset_state()  # the next call starts from what its pre-hook sets
        _, passed = self._arg(args, kwargs, *_CACHE_NAMES)
        cache = passed if passed is not None else _cache_in(output)
        if torch.is_grad_enabled():  # a cache never keeps the graph alive (no_grad: none)
            states = [detach_state(s) for s in states]
        if isinstance(cache, transformers_module().Cache):
            self._bind(cache, states)
        if self.streaming and module.training and passed is None:
            # no cache came in (one the forward made for itself, use_cache=True by
            # default, does not count): streaming training carries the state on
            self._train_state = states

    def _bind(self, cache: Any, states: list[Any]) -> None:
        # a compiled forward cannot read the length without a graph break (a static
        # cache counts it on the device): None, the next eager call takes the state as is
        length = None if torch.compiler.is_compiling() else cache.get_seq_length()
        cache.__dict__[_CACHE_ATTR] = _Entry(id(self), length, list(states))
        for name in _FOLLOWED:
            current = cache.__dict__.get(name)
            if not isinstance(current, _CacheMethod) and hasattr(type(cache), name):
                cache.__dict__[name] = _CacheMethod(cache, name)


#: The PEFT ``exclude_modules`` that keeps LoRA (and other tuners) off the memory's own
#: layers, e.g. ``LoraConfig(target_modules="all-linear", exclude_modules=PEFT_EXCLUDE)``:
#: to train the memory in full next to the base model's adapters. Without it, LoRA on the
#: memory's linear layers works too (their deltas are folded into the weights the memory
#: reads, :func:`tmcore.adapters.torch.tuners.effective_weight`).
PEFT_EXCLUDE = rf".*\.{_torch_attach.ATTRIBUTE}\..*"


def _check_adapted_linears(memories: list[nn.Module]) -> None:
    """Check the PEFT tuners on the memory's layers (``target_modules="all-linear"``) before
    a training forward, naming each layer in full: a tuner the memory cannot fold into its
    weights is refused, a skipped LoRA dropout warned about
    (:func:`tmcore.adapters.torch.tuners.check_tuned`)."""
    layers = {f"{_torch_attach.ATTRIBUTE}.{name} (block {index})": sub
              for index, residual in enumerate(memories) for name, sub in residual.named_modules()}
    skipped = [name for name, sub in layers.items() if _tuners.check_tuned(sub, name, warn=False)]
    if skipped:  # one warning for all the memory's layers
        _tuners.warn_dropout(skipped)


#: Decoding modes the memory state cannot follow, refused when they start (before any
#: token): the model method each starts with, and why.
_REFUSED = {
    "_get_candidate_generator": (
        "assisted and prompt-lookup decoding (assistant_model=, prompt_lookup_num_tokens=, "
        "assistant_early_exit=) are not supported with Tensor Memory: they feed candidate "
        "tokens and crop the rejected ones from the cache, and the memory state cannot be "
        "rolled back; use greedy, sampling or beam search"),
    "init_continuous_batching": (
        "continuous batching (generate_batch, init_continuous_batching, paged caches) is "
        "not supported with Tensor Memory: a paged cache packs the requests into one "
        "sequence and carries no per-request memory state; use generate with a batch "
        "(left padding)"),
}


def _refuse(name: str, *args: Any, **kwargs: Any) -> Any:
    """Shadows (as a picklable ``partial``) a model method of :data:`_REFUSED`."""
    raise NotImplementedError(f"tmcore.adapters.hf: {_REFUSED[name]}")


def _cache_in(output: Any) -> Any:
    """The cache a base model's output holds (a ``ModelOutput`` field or a tuple entry;
    read by value, not by name: an old field name may be a deprecated alias)."""
    values = output.values() if isinstance(output, dict) else output  # a ModelOutput or a tuple
    cache_class = transformers_module().Cache
    return next((v for v in values if isinstance(v, cache_class)), None)


def _valid_mask(mask: Any, batch: int, tokens: int, compiling: bool, past: int = 0
                ) -> Tensor | None:
    """The new tokens' bool ``(B, N)`` validity, ``None`` when there is no mask or no padding.

    ``mask`` is ``attention_mask (B, past + N)`` of 0/1 ints or bools, or a prepared 4-D mask
    ``(B, H, N, K)`` (``generate`` passes one with static caches; bool True or additive 0 =
    may attend), or a mapping of those per attention kind (models mixing sliding and full
    attention; the full-attention one is read). A real token attends to itself and a padding
    token's row is masked out, so new token ``j`` is valid where its key ``past + j`` is
    allowed in its row."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention", next((m for m in mask.values() if m is not None),
                                               None))
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask: expected a tensor of shape (B, past + N) of 0/1 "
                        f"ints or bools, got {type(mask).__name__}")
    if mask.dim() == 4:
        if tokens == 1:  # a decoding step: generated tokens are real (the 2-D mask gets a 1)
            return None
        if mask.shape[0] != batch or mask.shape[2] != tokens or mask.shape[3] < past + tokens:
            raise ValueError(f"attention_mask: a 4-D mask must be (B, heads, N, keys) with "
                             f"B = {batch}, N = {tokens}, keys >= {past + tokens}, "
                             f"got {tuple(mask.shape)}")
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        valid = allowed.diagonal(past, 1, 2)  # (B, N): token j's row at its key past + j
        return valid if compiling or not bool(valid.all()) else None
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"attention_mask: expected 0/1 ints or bools of shape (B, past + N), "
                        f"got dtype {mask.dtype} (tmcore reads which tokens are padding; "
                        f"convert with mask.long())")
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < tokens:
        raise ValueError(f"attention_mask: expected shape (B, past + N) with B = {batch}, "
                         f"N = {tokens} (a 2-D padding mask, or a prepared 4-D mask "
                         f"(B, heads, N, keys)), got {tuple(mask.shape)}")
    valid = mask[:, mask.shape[1] - tokens:]
    if not compiling and bool((valid == 1).all()):  # no padding (every decoding step): one
        return None                                # test instead of the range check's five
    if valid.dtype != torch.bool and not compiling and bool(((valid != 0) & (valid != 1)).any()):
        raise ValueError("attention_mask: expected only 0 and 1 (1 = a real token)")
    return valid != 0
