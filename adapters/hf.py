"""Hugging Face ``transformers`` integration: Tensor Memory in a causal LM with one call.

::

    from transformers import AutoModelForCausalLM
    from tmcore.adapters import hf

    model = AutoModelForCausalLM.from_pretrained("path/to/model")
    memory = hf.attach_memory(model, memory_channels=16, memory_shape=(4, 4, 4),
                              chunk_size=32)          # zero_init=True: unchanged at step 0
    ...                                               # train (Trainer works), generate
    model.save_pretrained("out")                      # the memory config is in config.json
    model = hf.from_pretrained("out")                 # the model with its memory, bit-identical
    hf.detach_memory(model)                           # the model exactly as before

:func:`attach_memory` finds the decoder blocks of a ``PreTrainedModel``
(``model.layers``, ``transformer.h``, ... of its base model; or the dotted path
given as ``blocks=``) and adds a gated :class:`~tmcore.adapters.torch.MemoryResidual`
after each (``causal`` mode of :func:`tmcore.adapters.torch.attach_memory`: a
read at chunk ``t`` sees only tokens before chunk ``t`` and the chunk's first
token).

The memory state belongs to the generation, the way the KV cache does:

- a call with an empty cache (a new ``generate``, a first forward) or with no
  cache (``use_cache=False``, training) starts from a fresh state; the state a
  cached call reaches is stored ON the cache object, so the next call with that
  cache continues it, and two ``generate`` calls in a row (of any batch sizes)
  are independent;
- beam search reorders it with the cache (``Cache.reorder_cache``, also
  ``batch_select_indices`` / ``batch_repeat_interleave``); a cache ``crop`` that
  removes tokens is refused with a ``RuntimeError``: the memory state cannot be
  rolled back; assisted / prompt-lookup decoding and continuous batching
  (``generate_batch``, paged caches) are refused when they start;
- ``attention_mask`` (left or right padding, ``(B, past + N)`` of 0/1 ints or
  bools) decides which tokens enter the state: padding never enters it nor
  shifts the chunk grid, so every row equals that row run alone;
- training forwards never carry a state across batches, unless
  ``streaming=True`` asks for streaming training (truncated backprop: each
  forward in training mode given no cache continues, detached, from the previous
  one, also when it makes a cache for itself with ``use_cache=True``;
  :meth:`HFMemory.reset_state` at document boundaries);
- the state stored on a cache is detached from the autograd graph.

The memory configuration (every hyper-parameter, the blocks' path) is stored in
``model.config.tensor_memory``, so ``save_pretrained`` writes it to
``config.json`` and :func:`from_pretrained` rebuilds the model with its memory
and loads its weights, checking each stored value. The config is saved with
``model_type = "tensor_memory"`` (and ``base_model_type``), registered with
``AutoConfig`` / ``AutoModelForCausalLM`` (and ``AutoModel`` and the
sequence-classification, token-classification and question-answering Auto classes, each
for its own head) on
import (:func:`register_auto_classes`), so a plain ``AutoModelForCausalLM.from_pretrained``
or ``pipeline`` loads the model with its memory too.

Also: activation checkpointing (``activation_checkpointing_enable()``, formerly
``gradient_checkpointing_enable()``) recomputes the memory inside a
checkpoint (exact gradients); ``torch.compile(model, fullgraph=True)`` traces
through the memory, cached or not, with or without a padding mask; ``output_hidden_states``
includes the memory's contribution; DDP, FSDP1 (flat parameters) and FSDP2 wrap the
model.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tmcore import layer as tl
from tmcore.adapters.torch import MemoryHandle, StreamState, detach_state
from tmcore.adapters.torch import attach as _torch_attach
from tmcore.adapters.torch import attach_memory as _attach_blocks
from tmcore.adapters.torch import tuners as _tuners

__all__ = ["CONFIG_KEY", "MODEL_TYPE", "PEFT_EXCLUDE", "HFMemory", "attach_memory", "detach_memory",
           "find_blocks", "from_pretrained", "memory_of", "register_auto_classes"]

#: Key of the memory configuration in ``model.config`` (and so in ``config.json``).
CONFIG_KEY = "tensor_memory"
#: Version of the stored configuration's layout.
FORMAT = 1
#: Where decoder blocks live, relative to the model (first match wins).
BLOCK_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers",
               "transformer.layers", "transformer.blocks", "model.language_model.layers",
               "layers", "h", "decoder.layers", "blocks")
_NORMS = ("layernorm", "identity")
_CACHE_ATTR = "_tmcore_memory"
_CACHE_NAMES = ("cache", "past_key_values")
#: What the names of the memory's weights (and only theirs) hold in a model's state dict.
_MARKER = f".{_torch_attach.ATTRIBUTE}."
#: The layer's experimental options (docs/guides/local-and-warp.md) and their defaults: a
#: configuration saved before they existed lacks them and loads as the default layer.
_OPTION_DEFAULTS = {"update": "dense", "window": None, "dynamics": "none", "flow": False}
_LAYER_KEYS = ("embed_dim", "memory_channels", "memory_shape", "chunk_size", "sigma_scale",
               "checkpoint_every", "radius", "eps", "forget_bias", "zero_init",
               *_OPTION_DEFAULTS)
_SPEC_KEYS = ("format", "blocks", "num_blocks", "mode", "gate_init", "norm", "streaming",
              *_LAYER_KEYS)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - the tests skip without it
        raise ImportError("tmcore.adapters.hf needs transformers: pip install 'tmcore[hf]'"
                          ) from error
    return transformers


# --------------------------------------------------------------------------- blocks


def _resolve(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, nn.Module,
                                                                         nn.ModuleList]:
    """The decoder blocks of a Hugging Face model: where they are, who owns them, the list.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only model (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...).
    blocks : str or None, default None
        The dotted path of its ``nn.ModuleList`` of blocks (e.g. ``"model.layers"``);
        ``None``: the first of :data:`BLOCK_PATHS` that is a non-empty one, of
        ``config.num_hidden_layers`` blocks when the config says.

    Returns
    -------
    path : str
        The dotted path of the blocks.
    owner : torch.nn.Module
        The module that owns the list (the base model, whose forward receives the
        cache and the attention mask).
    blocks : torch.nn.ModuleList
        The blocks.

    Raises
    ------
    TypeError
        If ``model`` is not a ``PreTrainedModel`` or ``blocks`` is not a str.
    ValueError
        Naming ``model`` / ``blocks``: an encoder-decoder model, a path that is
        not a non-empty ``nn.ModuleList``, or no blocks found.
    """
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model: expected a transformers PreTrainedModel, "
                        f"got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"model: {type(model).__name__} is an encoder-decoder; "
                         f"tmcore.adapters.hf supports decoder-only (causal LM) models")
    if blocks is not None:
        if not isinstance(blocks, str):
            raise TypeError(f"blocks: expected a dotted path such as 'model.layers', "
                            f"got {type(blocks).__name__}")
        found = _resolve(model, blocks)
        if not isinstance(found, nn.ModuleList) or len(found) == 0:
            raise ValueError(f"blocks: {blocks!r} is not a non-empty nn.ModuleList of "
                             f"{type(model).__name__} (got {type(found).__name__})")
        candidates = [blocks]
    else:
        layers = getattr(_text_config(model), "num_hidden_layers", None)
        lists = {p: _resolve(model, p) for p in BLOCK_PATHS}
        candidates = [p for p, found in lists.items()
                      if isinstance(found, nn.ModuleList) and len(found) > 0
                      and (layers is None or len(found) == layers)]
        if not candidates:
            raise ValueError(f"model: could not find the decoder blocks of "
                             f"{type(model).__name__} (tried {', '.join(BLOCK_PATHS)}); "
                             f"pass blocks='dotted.path.to.the.ModuleList'")
    path = candidates[0]
    owner_path, _, _ = path.rpartition(".")
    owner = model if not owner_path else _resolve(model, owner_path)
    return path, owner, _resolve(model, path)


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _config_width(model: nn.Module) -> int | None:
    size = getattr(_text_config(model), "hidden_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _check_fits(model: nn.Module, path: str, owner: nn.Module, embed_dim: int,
                where: str = "embed_dim") -> None:
    """Refuse, before anything is attached, what would only fail at the first forward: a
    token width other than the blocks' (the hidden size), or blocks whose owner is not
    called with the tokens (an encoder's inner stack such as BERT's ``encoder.layer``,
    whose owner receives hidden states and an extended mask)."""
    width = _config_width(model)
    if width is not None and embed_dim != width:
        raise ValueError(f"{where}: the memory reads and writes the blocks' outputs of the "
                         f"model's hidden size {width} (config.hidden_size), got {embed_dim}; "
                         f"leave embed_dim unset or pass {width}")
    names = _parameter_names(owner)
    if "input_ids" not in names and "inputs_embeds" not in names:
        raise ValueError(
            f"blocks: {path!r} is owned by {type(owner).__name__}, whose forward is not "
            f"called with input_ids or inputs_embeds (an encoder's inner stack?); "
            f"tmcore.adapters.hf attaches to the blocks of a decoder's base model, whose "
            f"forward receives the tokens, the cache and the padding mask (model.layers, "
            f"transformer.h, ...). For other stacks use tmcore.adapters.torch.attach_memory")


# --------------------------------------------------------------------------- state per cache


class _Entry:
    """What a cache object carries for the memory: the owner, the cache length the
    state belongs to (``None``: bound by a compiled forward, not recorded), the per-layer
    states."""

    def __init__(self, owner: int, length: int | None, state: list[Any]):
        self.owner, self.length, self.state = owner, length, state


def _index_state(state: Any, index: Tensor) -> Any:
    """One layer's state with its batch axis gathered by ``index (B',)`` (every field,
    ``count`` included: a tuple of ints or an integer array)."""
    def take(t: Tensor) -> Tensor:
        return t.index_select(0, index.to(t.device))

    if isinstance(state, StreamState):
        count = state.count
        if isinstance(count, Tensor):
            count = take(count)
        elif hasattr(count, "shape") and not isinstance(count, tuple):  # a NumPy array
            count = count[index.cpu().numpy()]
        else:
            count = tuple(count[i] for i in index.tolist())
        return StreamState(take(state.h), take(state.c), take(state.pending), count,
                           take(state.read))
    return tuple(take(t) for t in state)


class _CacheMethod:
    """An instance attribute that wraps a ``Cache`` method so the memory state stored on
    the cache follows it (picklable and deep-copyable with the cache)."""

    def __init__(self, cache: Any, name: str):
        self.cache, self.name = cache, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache, name = self.cache, self.name
        entry = cache.__dict__.get(_CACHE_ATTR)
        if name == "crop" and entry is not None:
            before = cache.get_seq_length()
            amount = args[0] if args else kwargs.get("tokens_to_remove", kwargs.get(
                "max_length", 0))
            removes = amount < 0 or (amount > 0 and amount < before)
            if removes and before > 0:
                raise RuntimeError(
                    f"tmcore.adapters.hf: cache.crop({amount}) would remove tokens, but the "
                    f"Tensor Memory state cannot be rolled back (assisted / prompt-lookup "
                    f"decoding and deferred stop checks are not supported with memory); "
                    f"use greedy, sampling or beam search")
        result = getattr(type(cache), name)(cache, *args, **kwargs)
        if entry is None:
            return result
        if name == "reset":
            cache.__dict__.pop(_CACHE_ATTR, None)
        elif name in _ROW_METHODS:  # the rows the cache keeps: indices, a bool mask or repeats
            value = args[0] if args else next(iter(kwargs.values()))
            if name == "batch_repeat_interleave":
                index = torch.arange(_state_batch(entry.state)).repeat_interleave(int(value))
            else:
                index = torch.as_tensor(value)
                if index.dtype == torch.bool:
                    index = torch.nonzero(index).reshape(-1)
            entry.state = [_index_state(s, index) for s in entry.state]
        return result


#: The cache methods that pick the rows the cache keeps (the state's rows follow).
_ROW_METHODS = ("reorder_cache", "batch_select_indices", "batch_repeat_interleave")
_FOLLOWED = (*_ROW_METHODS, "crop", "reset")


def _state_batch(states: list[Any]) -> int:
    first = states[0]
    return int((first.h if isinstance(first, StreamState) else first[0]).shape[0])


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
        self.model, self.path, self.owner, self.handle = model, path, owner, handle
        self.spec = spec
        self.streaming = bool(spec["streaming"])
        self._train_state: list[Any] | None = None
        self._names = _parameter_names(owner)
        self._hooks = [
            owner.register_forward_pre_hook(_Hook(self, "_before"), with_kwargs=True,
                                            prepend=True),
            owner.register_forward_hook(_Hook(self, "_after"), with_kwargs=True),
        ]
        for method in _REFUSED:
            if hasattr(model, method):
                model.__dict__[method] = _Refused(method)

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
        entry = getattr(cache, "__dict__", {}).get(_CACHE_ATTR)
        return None if entry is None else entry.state

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
            if isinstance(self.model.__dict__.get(method), _Refused):
                del self.model.__dict__[method]
        self.handle.remove()
        self._train_state = None
        if getattr(self.model, "_tmcore_hf_memory", None) is self:
            del self.model._tmcore_hf_memory
        if hasattr(self.model.config, CONFIG_KEY):
            delattr(self.model.config, CONFIG_KEY)
        _unmark_config(self.model.config)  # model_type included

    # ----------------------------------------------------------------- per call

    def _arg(self, args: tuple, kwargs: dict, name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        index = self._names.get(name)
        return args[index] if index is not None and index < len(args) else None

    def _first_arg(self, args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[str, Any]:
        """The first of the arguments ``names`` that is given (not None), and its name."""
        for name in names:
            value = self._arg(args, kwargs, name)
            if value is not None:
                return name, value
        return names[0], None

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        compiling = torch.compiler.is_compiling()
        if torch.is_grad_enabled() and not compiling:  # training (decoding: no_grad)
            _check_adapted_linears(self.handle.memories)
        name, cache = self._first_arg(args, kwargs, _CACHE_NAMES)
        _, tokens = self._first_arg(args, kwargs, ("input_ids", "inputs_embeds"))
        if not isinstance(tokens, Tensor) or tokens.dim() < 2:
            raise ValueError("input_ids: expected input_ids (B, N) or inputs_embeds (B, N, d)")
        batch, count = int(tokens.shape[0]), int(tokens.shape[1])
        start, past = None, 0
        if cache is None:
            if self.streaming and module.training and self._train_state is not None:
                if _state_batch(self._train_state) != batch:
                    raise ValueError(
                        f"input_ids: streaming training continues the previous batch of "
                        f"{_state_batch(self._train_state)} rows, got {batch} rows; drop the "
                        f"last incomplete batch (dataloader_drop_last=True) or call "
                        f"memory.reset_state() first")
                start = self._train_state
        else:
            start = self._cache_start(name, cache, compiling)
            past = 0 if compiling else cache.get_seq_length()
        self.handle.state = start  # a detached training state, a cache's (no grad) or None
        self.handle._state_cut = True
        self.handle._valid = _valid_mask(self._arg(args, kwargs, "attention_mask"), batch,
                                         count, compiling, past)

    def _cache_start(self, name: str, cache: Any, compiling: bool) -> list[Any] | None:
        transformers = _transformers()
        if type(cache).__name__ == "PagedAttentionCache":
            raise NotImplementedError(f"{name}: {_REFUSED['init_continuous_batching']}")
        if not isinstance(cache, transformers.Cache):
            raise TypeError(f"{name}: tmcore's memory follows a transformers Cache object "
                            f"(DynamicCache, StaticCache, ...); got {type(cache).__name__} "
                            f"(legacy tuple caches cannot carry the memory state)")
        past = cache.get_seq_length()
        entry = cache.__dict__.get(_CACHE_ATTR)
        if compiling:
            return None if entry is None else entry.state
        if past == 0:
            cache.__dict__.pop(_CACHE_ATTR, None)
            return None
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
        return entry.state

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        states = self.handle.state
        self.handle.state = None
        self.handle._valid = None
        if states is None:
            return
        _, passed = self._first_arg(args, kwargs, _CACHE_NAMES)
        cache = passed if passed is not None else _cache_in(output)
        if _on_graph(states):  # a cache never keeps the graph alive (truncated backprop)
            states = [detach_state(s) for s in states]
        transformers = _transformers()
        if isinstance(cache, transformers.Cache):
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
    skipped = []
    for index, residual in enumerate(memories):
        for name, sub in residual.named_modules():
            full = f"{_torch_attach.ATTRIBUTE}.{name} (block {index})"
            if _tuners.is_tuned(sub) and _tuners.check_tuned(sub, full, warn=False):
                skipped.append(full)
    if skipped:  # one warning for all the memory's layers
        _tuners.warn_dropout(skipped)


def _on_graph(states: list[Any]) -> bool:
    """Whether a state is attached to the autograd graph (checked on one field: the
    fields are computed together)."""
    first = states[0]
    return bool((first.h if isinstance(first, StreamState) else first[0]).requires_grad)


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


class _Refused:
    """An instance attribute shadowing a model method that starts a decoding mode the
    memory cannot follow: calling it raises (picklable: no reference to the model)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"tmcore.adapters.hf: {_REFUSED[self.name]}")


class _Hook:
    """The owner's forward pre-hook (``"_before"``) or hook (``"_after"``): that method
    of the memory (picklable)."""

    def __init__(self, memory: HFMemory, method: str):
        self.memory, self.method = memory, method

    def __call__(self, *args: Any) -> None:
        getattr(self.memory, self.method)(*args)


def _parameter_names(owner: nn.Module) -> dict[str, int]:
    try:
        params = list(inspect.signature(owner.forward).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return {}
    return {name: i for i, name in enumerate(params)}


def _cache_in(output: Any) -> Any:
    """The cache a base model's output holds (a ``ModelOutput`` field or a tuple entry;
    read by value, not by name: an old field name may be a deprecated alias)."""
    transformers = _transformers()
    if isinstance(output, transformers.utils.ModelOutput):
        values: Any = output.values()
    elif isinstance(output, tuple):
        values = output
    else:
        return None
    return next((v for v in values if isinstance(v, transformers.Cache)), None)


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _valid_from_4d(mask: Tensor, batch: int, tokens: int, past: int, compiling: bool
                   ) -> Tensor | None:
    """Validity from a prepared 4-D mask ``(B, H, N, K)`` (``generate`` passes one with
    static caches; bool True = may attend, or additive float 0 = may attend): a real
    token attends to itself, a padding token's row is masked out, so new token ``j`` is
    valid where its own key (index ``past + j``) is allowed in its row."""
    if tokens == 1:  # a decoding step: generated tokens are real (the 2-D mask gets a 1)
        return None
    if mask.shape[0] != batch or mask.shape[2] != tokens or mask.shape[3] < past + tokens:
        raise ValueError(f"attention_mask: a 4-D mask must be (B, heads, N, keys) with "
                         f"B = {batch}, N = {tokens}, keys >= {past + tokens}, "
                         f"got {tuple(mask.shape)}")
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    index = torch.arange(tokens, device=mask.device)
    valid = allowed[:, index, index + past]
    if compiling:
        return valid
    return None if bool(valid.all()) else valid


def _mask_from_mapping(masks: dict) -> Any:
    """One mask of the per-attention-type masks ``generate`` prepares for models mixing
    sliding and full attention (``{"full_attention": ..., "sliding_attention": ...}``,
    with ``cache_implementation="static"``): every kind lets a real token attend to
    itself and masks out a padding token's row, so each says which tokens are real; the
    full-attention one is read when there is one."""
    if "full_attention" in masks:
        return masks["full_attention"]
    for value in masks.values():
        if value is not None:
            return value
    return None


def _valid_mask(mask: Any, batch: int, tokens: int, compiling: bool, past: int = 0
                ) -> Tensor | None:
    """The new tokens' bool ``(B, N)`` validity from ``attention_mask (B, past + N)``, or
    from a prepared 4-D mask (:func:`_valid_from_4d`) or a mapping of them per attention
    kind (:func:`_mask_from_mapping`); ``None`` when there is no mask or no padding."""
    if isinstance(mask, dict):
        mask = _mask_from_mapping(mask)
    if mask is None:
        return None
    if isinstance(mask, Tensor) and mask.dim() == 4:
        return _valid_from_4d(mask, batch, tokens, past, compiling)
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask: expected a tensor of shape (B, past + N) of 0/1 "
                        f"ints or bools, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in _INT_DTYPES:
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
    if valid.dtype != torch.bool:
        if not compiling and bool(((valid != 0) & (valid != 1)).any()):
            raise ValueError("attention_mask: expected only 0 and 1 (1 = a real token)")
        valid = valid != 0
    if compiling:
        return valid
    return None if bool(valid.all()) else valid


# --------------------------------------------------------------------------- attach / detach


def memory_of(model: nn.Module) -> HFMemory | None:
    """The :class:`HFMemory` attached to ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        A model :func:`attach_memory` or :func:`from_pretrained` may have
        given a memory.

    Returns
    -------
    HFMemory or None
        Its memory, or ``None`` if it has none.
    """
    return getattr(model, "_tmcore_hf_memory", None)


def _norm_module(norm: str) -> Any:
    if norm not in _NORMS:
        raise ValueError(f"norm: expected one of {_NORMS}, got {norm!r}")
    return None if norm == "layernorm" else nn.Identity()


def attach_memory(
    model: nn.Module, *, memory_channels: int, memory_shape: Sequence[int], chunk_size: int,
    sigma_scale: float = 1.0, zero_init: bool = True, gate_init: float = 0.0,
    norm: str = "layernorm", blocks: str | None = None, streaming: bool = False,
    checkpoint_every: int = 1, radius: float | None = None, eps: float = 1e-6,
    forget_bias: float = 0.0, embed_dim: int | None = None, update: str = "dense",
    window: int | None = None, dynamics: str = "none", flow: bool = False,
) -> HFMemory:
    """Add a gated Tensor Memory after every decoder block of ``model`` (one call).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder (``LlamaForCausalLM``, ``GPT2LMHeadModel``,
        ``Qwen2ForCausalLM``, ...); its blocks are found by :func:`find_blocks`.
    memory_channels : int
        The grid channels ``C`` (:class:`tmcore.adapters.torch.TensorMemory`).
    memory_shape : sequence of int
        The grid shape ``S`` (1 to 4 positive ints).
    chunk_size : int
        The tokens per chunk ``L``.
    sigma_scale : float, default 1.0
        Multiplies the write spread.
    zero_init : bool, default True
        The read-outs start at zero: the model's outputs are bit-identical to
        the original's until the memory trains, and the read-outs still get a
        gradient.
    gate_init : float, default 0.0
        The residual gate's initial logit.
    norm : {"layernorm", "identity"}, default "layernorm"
        What the memory reads: a LayerNorm of the block's output, or the output.
    blocks : str or None, default None
        A dotted path to the blocks' ``nn.ModuleList``; overrides the search.
    streaming : bool, default False
        Streaming training: uncached forwards in training mode continue,
        detached, from the previous one (truncated backprop); ``False``: every
        uncached forward starts fresh. Cached calls always follow the cache.
    checkpoint_every : int, default 1
        As in :class:`tmcore.adapters.torch.TensorMemory`.
    radius : float or None, default None
        As in :func:`tmcore.gaussian_splat`.
    eps : float, default 1e-6
        As in :func:`tmcore.gaussian_splat`.
    forget_bias : float, default 0.0
        The ConvLSTM forget gate's initial bias.
    embed_dim : int or None, default None
        The token width ``d``; default the config's ``hidden_size``.
    update : {"dense", "local"}, default "dense"
        Experimental (as in :class:`tmcore.adapters.torch.TensorMemory`):
        ``"local"`` writes and updates only a window around each write.
    window : int or None, default None
        The window's cells per axis with ``update="local"``.
    dynamics : {"none", "warp"}, default "none"
        Experimental: ``"warp"`` resamples the state by a per-chunk shift
        before each update (adds the zero-initialized ``warp_net``).
    flow : bool, default False
        With ``dynamics="warp"``: a per-cell flow too (adds ``warp_flow``).

    Returns
    -------
    HFMemory
        The attached memories; :func:`detach_memory` (or ``.remove()``) undoes
        the attach exactly. The configuration is stored in
        ``model.config.tensor_memory``.

    Raises
    ------
    TypeError
        If ``model`` is not a ``PreTrainedModel``, ``streaming`` is not a bool
        or a size is not an int.
    ValueError
        If ``model`` already has a memory, its blocks are not found or their owner is
        not called with the tokens (an encoder's inner stack), ``embed_dim`` is not
        the hidden size, ``norm`` is unknown or a size or option is out of range (the
        layer's checks).
    """
    if memory_of(model) is not None:
        raise ValueError("model: already has a Tensor Memory attached; detach_memory first")
    path, owner, found = find_blocks(model, blocks)
    if embed_dim is None:
        embed_dim = _config_width(model)
        if embed_dim is None:
            raise ValueError("model: its config has no integer hidden_size; pass embed_dim=")
    if not isinstance(streaming, bool):
        raise TypeError(f"streaming: expected True or False, got {streaming!r}")
    config = tl.layer_config(embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale,
                             checkpoint_every=checkpoint_every, radius=radius, eps=eps,
                             forget_bias=forget_bias, zero_init=zero_init, update=update,
                             window=window, dynamics=dynamics, flow=flow)
    spec: dict[str, Any] = {
        "format": FORMAT, "blocks": path, "num_blocks": len(found), "mode": "causal",
        "gate_init": float(gate_init), "norm": norm, "streaming": streaming,
        **{k: getattr(config, k) for k in _LAYER_KEYS},
    }
    spec["memory_shape"] = list(config.memory_shape)  # (in place: config.json's order kept)
    return _attach_spec(model, spec, "embed_dim")


def _attach_spec(model: nn.Module, spec: dict[str, Any], where: str = f"{CONFIG_KEY}.embed_dim"
                 ) -> HFMemory:
    path, owner, found = find_blocks(model, spec["blocks"])
    if len(found) != spec["num_blocks"]:
        raise ValueError(f"{CONFIG_KEY}.num_blocks: stored {spec['num_blocks']} blocks at "
                         f"{path!r}, the model has {len(found)}")
    _check_fits(model, path, owner, spec["embed_dim"], where)
    layer = {k: spec[k] for k in _LAYER_KEYS  # the options only where not their default
             if k not in _OPTION_DEFAULTS or spec[k] != _OPTION_DEFAULTS[k]}
    handle = _attach_blocks(found, "causal", gate_init=spec["gate_init"],
                            norm=_norm_module(spec["norm"]), streaming=True, batch_first=True,
                            **{**layer, "memory_shape": tuple(spec["memory_shape"])})
    memory = HFMemory(model, path, owner, handle, spec)
    model._tmcore_hf_memory = memory
    setattr(model.config, CONFIG_KEY, dict(spec))
    _mark_config(model)
    return memory


def detach_memory(model: nn.Module) -> None:
    """Remove the memory :func:`attach_memory` added (the model is exactly as before).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A model with a memory attached.

    Raises
    ------
    ValueError
        If ``model`` has no memory attached.
    """
    memory = memory_of(model)
    if memory is None:
        raise ValueError("model: has no Tensor Memory attached")
    memory.remove()


# --------------------------------------------------------------------------- save / load


def check_spec(spec: Any) -> dict[str, Any]:
    """A stored configuration (``config.tensor_memory``), checked: every key present and
    known, each value of the right kind (the layer's checks); ``ValueError`` /
    ``TypeError`` naming ``tensor_memory.<key>``. The layer options (``update``,
    ``window``, ``dynamics``, ``flow``) may be absent (a configuration saved before
    them): their defaults then."""
    if not isinstance(spec, dict):
        raise TypeError(f"{CONFIG_KEY}: expected a dict in the model config, "
                        f"got {type(spec).__name__}")
    spec = {**_OPTION_DEFAULTS, **spec}
    missing = sorted(set(_SPEC_KEYS) - set(spec))
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if missing or unknown:
        raise ValueError(f"{CONFIG_KEY}: missing keys {missing}, unknown keys {unknown} "
                         f"(saved by another tmcore version?)")
    if spec["format"] != FORMAT:
        raise ValueError(f"{CONFIG_KEY}.format: expected {FORMAT}, got {spec['format']!r}")
    if spec["mode"] != "causal":
        raise ValueError(f"{CONFIG_KEY}.mode: expected 'causal', got {spec['mode']!r}")
    for key in ("streaming", "zero_init"):
        if not isinstance(spec[key], bool):
            raise TypeError(f"{CONFIG_KEY}.{key}: expected true or false, got {spec[key]!r}")
    if not isinstance(spec["gate_init"], (int, float)) or isinstance(spec["gate_init"], bool) \
            or not math.isfinite(spec["gate_init"]):
        raise ValueError(f"{CONFIG_KEY}.gate_init: expected a finite number, "
                         f"got {spec['gate_init']!r}")
    if spec["norm"] not in _NORMS:
        raise ValueError(f"{CONFIG_KEY}.norm: expected one of {_NORMS}, got {spec['norm']!r}")
    if not isinstance(spec["blocks"], str) or not isinstance(spec["num_blocks"], int):
        raise TypeError(f"{CONFIG_KEY}.blocks / num_blocks: expected a dotted path and an "
                        f"int, got {spec['blocks']!r}, {spec['num_blocks']!r}")
    config = _layer_config(spec)
    for key in _LAYER_KEYS:
        stored = tuple(spec[key]) if key == "memory_shape" else spec[key]
        if stored != getattr(config, key):
            raise ValueError(f"{CONFIG_KEY}.{key}: stored {stored!r} does not survive "
                             f"the layer's checks ({getattr(config, key)!r})")
    return dict(spec)



def _layer_config(spec: Mapping[str, Any]) -> tl.LayerConfig:
    """The layer a stored memory configuration describes (errors prefixed with its key)."""
    try:
        return tl.layer_config(**{k: spec[k] for k in _LAYER_KEYS})
    except (TypeError, ValueError) as error:
        raise type(error)(f"{CONFIG_KEY}: {error}") from error


def _check_saved_shapes(path: str, spec: Mapping[str, Any]) -> None:
    """Compare the memory weights' shapes in a folder's safetensors files with the stored
    configuration BEFORE any block is built: a few edited bytes of ``config.json``
    (``chunk_size`` 10**6) would otherwise allocate gigabytes first. Reads headers only;
    a folder without safetensors files is left to the strict load."""
    files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not files:
        return
    from safetensors import safe_open

    expected = {spec_.name: tuple(spec_.shape) for spec_ in tl.param_specs(_layer_config(spec))}
    marker = f"{_MARKER}memory."
    for name in files:
        with safe_open(os.path.join(path, name), "np") as handle:
            for key in handle.keys():
                if marker not in key:
                    continue
                leaf = key.split(marker, 1)[1]
                if leaf in expected:
                    stored = tuple(handle.get_slice(key).get_shape())
                    if stored != expected[leaf]:
                        raise ValueError(
                            f"{CONFIG_KEY}: the stored configuration does not fit the saved "
                            f"memory weights: {key} has shape {stored}, the configuration "
                            f"gives {expected[leaf]} (nothing was built)")

def _memory_tensors(path: str) -> dict[str, Tensor]:
    """The memory entries (``*.tensor_memory.*``) of a ``save_pretrained`` folder."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted({v for k, v in json.load(f)["weight_map"].items() if _MARKER in k})
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"path: {path!r} has no model.safetensors (save with "
                         f"save_pretrained(..., safe_serialization=True), the default)")
    out: dict[str, Tensor] = {}
    for name in files:
        out.update({k: v for k, v in load_file(os.path.join(path, name)).items()
                    if _MARKER in k})
    return out


def from_pretrained(path: str | os.PathLike, model_class: Any = None, **kwargs: Any
                    ) -> nn.Module:
    """Load a model saved with its memory (``save_pretrained``) and its memory, in one call.

    The memory configuration is read from ``config.json`` (``tensor_memory``) and
    checked (:func:`check_spec`); the memory weights are loaded strictly (every
    memory tensor present, none unknown, shapes and the grid checked), so the
    result equals the saved model bit for bit.

    Parameters
    ----------
    path : str or os.PathLike
        A local folder written by ``save_pretrained`` of a model with memory.
    model_class : type, optional
        The class to load with (default ``AutoModelForCausalLM``; an ``Auto*``
        class or a concrete one). Another head than the saved one reads the checkpoint
        as transformers does (``AutoModel``: the backbone, with its memory).
    **kwargs
        Passed to its ``from_pretrained`` (``torch_dtype``, ...).

    Returns
    -------
    transformers.PreTrainedModel
        The model with its memory attached (:func:`memory_of` gives it).

    Raises
    ------
    ValueError
        If ``path`` is not a folder, its config has no memory configuration
        or an invalid one, or the memory weights do not fit it.
    TypeError
        If a stored configuration value is of the wrong kind (:func:`check_spec`).
    """
    transformers = _transformers()
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path: expected a local folder written by save_pretrained, "
                         f"got {path!r}")
    config = kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(path)
    spec = getattr(config, CONFIG_KEY, None)
    if spec is None:
        raise ValueError(f"path: {path!r} has no '{CONFIG_KEY}' in its config.json (saved "
                         f"without memory?); load it with the model class's from_pretrained")
    spec = check_spec(spec)
    _check_saved_shapes(path, spec)
    _unmark_config(config)  # built as the base model (see _memory_model_class)
    if model_class is None:
        model_class = transformers.AutoModelForCausalLM
    concrete = model_class
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:
        concrete = mapping[type(config)]
    if getattr(concrete, "_tmcore_memory_class", False):  # the registered class: its base
        concrete = concrete.__mro__[1]                     # (the memory is attached below)
    marker = rf"\.{_torch_attach.ATTRIBUTE}\."
    saved = concrete.__dict__.get("_keys_to_ignore_on_load_unexpected", _NOTHING)
    concrete._keys_to_ignore_on_load_unexpected = [
        *(getattr(concrete, "_keys_to_ignore_on_load_unexpected", None) or []), marker]
    try:  # the base weights (the memory's are not the base model's: ignored here)
        model = concrete.from_pretrained(path, config=config, **kwargs)
    finally:
        if saved is _NOTHING:
            del concrete._keys_to_ignore_on_load_unexpected
        else:
            concrete._keys_to_ignore_on_load_unexpected = saved
    if memory_of(model) is not None:  # a registered memory class attached it: reattach
        memory_of(model).remove()     # below, its weights loaded strictly
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    moved = _blocks_of_this_head(model, spec)  # another head's checkpoint (AutoModel, ...)
    memory = _attach_spec(model, moved)
    tensors = _memory_tensors(path)
    if moved["blocks"] != spec["blocks"]:  # its keys move as transformers moves the rest
        old, new = spec["blocks"] + ".", moved["blocks"] + "."
        tensors = {new + k[len(old):] if k.startswith(old) else k: v
                   for k, v in tensors.items()}
    expected = {k for k in model.state_dict() if _MARKER in k}
    missing, unknown = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unknown:
        memory.remove()
        raise ValueError(f"path: the memory weights do not fit its {CONFIG_KEY} config: "
                         f"missing {_few(missing)}, unknown {_few(unknown)}")
    try:
        result = model.load_state_dict(tensors, strict=False)
    except RuntimeError as error:
        memory.remove()
        raise ValueError(f"{CONFIG_KEY}: the stored configuration does not fit the saved "
                         f"memory weights: {error}") from error
    if any(_MARKER in k for k in result.missing_keys):
        raise ValueError(f"path: memory weights missing: {result.missing_keys}")
    return model


_NOTHING: Any = object()


def _few(keys: list[str]) -> str:
    """An error's list of ``keys``: the first four, ``...`` after them if there are more."""
    return f"{keys[:4]}{'...' if len(keys) > 4 else ''}"


# --------------------------------------------------------------------------- Auto classes

#: The ``model_type`` a model with memory saves in ``config.json`` (registered with
#: ``AutoConfig``); ``base_model_type`` next to it names the model it extends.
MODEL_TYPE = "tensor_memory"
_BASE_KEY = "base_model_type"
_CONFIG_CLASSES: dict[type, type] = {}


def _memory_config_class(base: type) -> type:
    """The config class of ``base`` with memory: the same fields and behaviour, saved with
    ``model_type = "tensor_memory"`` and ``base_model_type`` (one class per base, made
    once, a module attribute so that pickling finds it)."""
    if getattr(base, "_tmcore_base", None) is not None:
        return base
    if base not in _CONFIG_CLASSES:
        name = f"TensorMemory{base.__name__}"

        def to_dict(self: Any) -> dict[str, Any]:
            out = base.to_dict(self)
            out[_BASE_KEY] = base.model_type
            return out

        cls = type(name, (base,), {"model_type": MODEL_TYPE, "_tmcore_base": base,
                                   "to_dict": to_dict, "__module__": __name__,
                                   "__doc__": f"{base.__name__} with Tensor Memory "
                                              f"(``config.{CONFIG_KEY}``)."})
        globals()[name] = cls
        _CONFIG_CLASSES[base] = cls
    return _CONFIG_CLASSES[base]


def _unmark_config(config: Any) -> type:
    """Give a config with memory its base model's class back; returns its class before."""
    cls = type(config)
    config.__class__ = getattr(cls, "_tmcore_base", cls)
    return cls


def _memory_model_class(config_class: type, model_class: type, auto: Any) -> type:
    """``model_class`` whose ``__init__`` attaches the memory its config stores, registered
    with the Auto class ``auto`` (``AutoModelForCausalLM``, ...) for ``config_class``."""
    if getattr(model_class, "_tmcore_memory_class", False):
        return model_class
    name = f"TensorMemory{model_class.__name__}"
    existing = globals().get(name)
    if existing is not None and existing.config_class is config_class:
        # registered again: the Auto class builds the class last asked for (a checkpoint's
        # own architecture, read just before its model is built)
        auto.register(config_class, existing, exist_ok=True)
        return existing

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        # as the base model (heads that build their body with AutoModel.from_config know
        # no memory config class)
        memory_config = _unmark_config(config)
        try:
            model_class.__init__(self, config, *args, **kwargs)
        finally:
            config.__class__ = memory_config
        spec = getattr(config, CONFIG_KEY, None)
        if spec is None:
            raise ValueError(f"config: {type(self).__name__} needs the memory configuration "
                             f"'{CONFIG_KEY}' in its config (saved by a model with memory)")
        _attach_spec(self, _blocks_of_this_head(self, check_spec(spec)))

    @classmethod
    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        info = kwargs.pop("output_loading_info", False)
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):  # before building
            stored = kwargs.get("config") or _transformers().AutoConfig.from_pretrained(path)
            spec = getattr(stored, CONFIG_KEY, None)
            if isinstance(spec, Mapping):
                _check_saved_shapes(os.fspath(path), check_spec(spec))
        model, loading = model_class.from_pretrained.__func__(cls, *args,
                                                              output_loading_info=True,
                                                              **kwargs)
        missing = sorted(k for k in loading.get("missing_keys", ()) if _MARKER in k)
        if missing:
            raise ValueError(f"pretrained_model_name_or_path: the checkpoint lacks memory "
                             f"weights its {CONFIG_KEY} config needs: {_few(missing)}; "
                             f"the memory cannot be restored")
        return (model, loading) if info else model

    cls = type(name, (model_class,), {"__init__": __init__, "from_pretrained": from_pretrained,
                                      "config_class": config_class,
                                      "_tmcore_memory_class": True, "__module__": __name__,
                                      "__doc__": f"{model_class.__name__} with Tensor Memory "
                                                 f"attached from its config."})
    globals()[name] = cls
    _share_conversions(model_class, name)
    auto.register(config_class, cls, exist_ok=True)
    return cls


def _blocks_of_this_head(model: nn.Module, spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with its blocks' path moved to ``model``'s layout: a head's checkpoint read
    by the base model (``AutoModel``: ``model.layers`` -> ``layers``) or the reverse, by
    the base model prefix transformers strips or adds when it loads."""
    blocks, prefix = spec["blocks"], getattr(model, "base_model_prefix", "") or ""

    def exists(path: str) -> bool:
        try:
            model.get_submodule(path)
        except AttributeError:
            return False
        return True

    if not prefix or exists(blocks):
        return spec
    if blocks.startswith(prefix + ".") and exists(blocks[len(prefix) + 1:]):
        return {**spec, "blocks": blocks[len(prefix) + 1:]}
    if exists(f"{prefix}.{blocks}"):
        return {**spec, "blocks": f"{prefix}.{blocks}"}
    return spec


def _share_conversions(model_class: type, name: str) -> None:
    """Give the memory class ``name`` the checkpoint key conversions transformers keeps
    under ``model_class``'s name (GPT-NeoX: ``embed_out`` <-> ``lm_head``): the base class
    saves with them, so the memory class must load with them (else a weight is left
    freshly initialized). Nothing where this transformers has no such registry."""
    try:
        from transformers import conversion_mapping
    except ImportError:
        return
    get = getattr(conversion_mapping, "get_checkpoint_conversion_mapping", None)
    register = getattr(conversion_mapping, "register_checkpoint_conversion_mapping", None)
    mapping = None if get is None or register is None else get(model_class.__name__)
    if mapping is not None:
        register(name, mapping, overwrite=True)


#: The Auto classes a model with memory is registered with, each for its own head
#: (``AutoModel``: the base model; a head builds its body with the base config class, so
#: the body gets no second memory).
_AUTO_HEADS = ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoModel",
               "AutoModelForTokenClassification", "AutoModelForQuestionAnswering")


def _register_heads(config_class: type, preferred: Sequence[type] = ()) -> bool:
    """Register, with each Auto class of :data:`_AUTO_HEADS` that has a head for the base
    config of ``config_class``, that head with memory: the first of ``preferred`` that is
    one (a subclass of it: a checkpoint's own architecture), else the head itself. Returns
    whether a class of ``preferred`` was registered."""
    transformers = _transformers()
    base = getattr(config_class, "_tmcore_base", config_class)
    found = False
    for name in _AUTO_HEADS:
        auto = getattr(transformers, name, None)
        try:
            head = auto._model_mapping[base]
        except (AttributeError, KeyError, ValueError):
            continue
        chosen = next((c for c in preferred if issubclass(c, head)), head)
        found = found or chosen in preferred
        _memory_model_class(config_class, chosen, auto)
    return found


def _mark_config(model: nn.Module) -> None:
    """Make ``model.config`` save as ``tensor_memory`` (its class, not its values, swapped)
    and register the pair with the Auto classes, so that ``AutoModelForCausalLM`` (or the
    Auto class of the model's head) loads the model back with its memory."""
    base = type(model.config)
    if getattr(base, "_tmcore_base", None) is None and getattr(base, "model_type", ""):
        model.config.__class__ = _memory_config_class(base)
    config_class = type(model.config)
    if not _register_heads(config_class, (type(model),)):
        # a model no Auto head knows (a custom class): AutoModelForCausalLM loads it, unless
        # its family has a causal LM there (it would replace it)
        transformers = _transformers()
        try:
            transformers.AutoModelForCausalLM._model_mapping[
                getattr(config_class, "_tmcore_base", config_class)]
        except (KeyError, ValueError):
            _memory_model_class(config_class, type(model), transformers.AutoModelForCausalLM)


def _auto_config_class() -> type:
    transformers = _transformers()

    class TensorMemoryConfig(transformers.PretrainedConfig):
        """The ``AutoConfig`` entry of ``model_type = "tensor_memory"``: builds the config
        of the base model named by ``base_model_type`` (with memory, registered with
        ``AutoModelForCausalLM``)."""

        model_type = MODEL_TYPE

        @classmethod
        def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
            config_dict = dict(config_dict)
            base_type = config_dict.pop(_BASE_KEY, None)
            config_dict.pop("model_type", None)
            mapping = transformers.CONFIG_MAPPING
            if base_type is None or base_type not in mapping:
                raise ValueError(f"{_BASE_KEY}: a '{MODEL_TYPE}' config must name the model "
                                 f"it extends (one of transformers' model types), got "
                                 f"{base_type!r}")
            if CONFIG_KEY not in config_dict:
                raise ValueError(f"{CONFIG_KEY}: a '{MODEL_TYPE}' config without its memory "
                                 f"configuration; the memory cannot be restored")
            check_spec(config_dict[CONFIG_KEY])
            base = mapping[base_type]
            config_class = _memory_config_class(base)
            named = (getattr(transformers, arch, None)
                     for arch in config_dict.get("architectures") or ())
            _register_heads(config_class, [c for c in named if isinstance(c, type)])
            return config_class.from_dict(config_dict, **kwargs)

    return TensorMemoryConfig


def register_auto_classes() -> None:
    """Register the ``tensor_memory`` model type with ``AutoConfig``.

    Done when ``tmcore.adapters.hf`` is imported with transformers installed. A model
    saved with memory writes ``model_type = "tensor_memory"`` and ``base_model_type``
    in its ``config.json``; after this registration ``AutoConfig`` /
    ``AutoModelForCausalLM.from_pretrained`` (and so ``pipeline``) load it with its
    memory. Without it, transformers refuses the unknown model type instead of
    silently dropping the memory.

    Raises
    ------
    ImportError
        If transformers is not installed.
    """
    transformers = _transformers()
    if MODEL_TYPE not in transformers.CONFIG_MAPPING:
        transformers.AutoConfig.register(MODEL_TYPE, _auto_config_class(), exist_ok=True)


try:  # registered on import, as fla registers its models
    register_auto_classes()
except ImportError:  # pragma: no cover - transformers absent: the adapter's calls say so
    pass
