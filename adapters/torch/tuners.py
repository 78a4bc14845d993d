"""The weight and bias a memory linear layer computes with when a PEFT tuner wraps it.

:class:`~tmcore.adapters.torch.TensorMemory` never calls its linear layers (it reads their
weights), so a LoRA wrapper's update is folded into the weight instead, on the autograd
graph, as ``merge_and_unload()`` would write it; ``lora_dropout`` cannot be expressed in a
weight and is skipped with a warning, and tuners that are not a weight delta are refused
(docs/guides/huggingface.md, PEFT / LoRA). :func:`computed` does the same for a weight an
old-style ``weight_norm`` / ``spectral_norm`` pre-hook computes.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor, nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["check_tuned", "computed", "effective_weight", "fold_tuned", "is_tuned",
           "warn_dropout"]

# (layer, adapter) pairs already warned about their dropout: a training step calls the
# memory once per block and chunked stream, the warning is said once
_WARNED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()

_HOW_TO_EXCLUDE = ("exclude the memory's layers from the tuner (exclude_modules="
                   "tmcore.adapters.hf.PEFT_EXCLUDE) and train the memory itself")


def is_tuned(linear: nn.Module) -> bool:
    """Whether a PEFT tuner layer (``base_layer`` and ``active_adapters``) wraps ``linear``."""
    return "base_layer" in linear._modules and hasattr(linear, "active_adapters")


# the pre-hooks of the old-style weight_norm / spectral_norm (they set the weight attribute)
_RECOMPUTING = (WeightNorm, SpectralNorm)


def computed(module: nn.Module, leaf: str) -> Tensor | None:
    """``module.<leaf>`` (``"weight"`` or ``"bias"``; an attribute, not a registered parameter)
    as the module's ``forward`` would see it: recomputed first by an old-style ``weight_norm`` /
    ``spectral_norm`` pre-hook (which would never run: a stale weight), else as it is (FSDP1's
    flat-parameter views); ``None`` if absent."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _RECOMPUTING) and hook.name == leaf:
            hook(module, ())
    return getattr(module, leaf, None)


def _own(module: nn.Module, leaf: str) -> Tensor | None:
    registered = module._parameters.get(leaf)
    return registered if registered is not None else computed(module, leaf)


def _active(linear: nn.Module) -> list[str]:
    # peft's forward skips the active names this layer has no adapter of
    return [a for a in linear.active_adapters if a in linear.lora_A]


def check_tuned(linear: nn.Module, name: str, *, warn: bool = True) -> bool:
    """Refuse a PEFT tuner on memory layer ``linear`` (named ``name`` in messages) that
    :func:`effective_weight` cannot fold in (``ValueError``), and return whether an active
    adapter's LoRA dropout is skipped here for the first time (warned about here unless not
    ``warn``: then :func:`warn_dropout`, once for many layers)."""
    if not is_tuned(linear) or linear.disable_adapters:
        return False
    kind = type(linear).__name__
    # peft's LoRA layers (lora.Linear and its quantized kinds) by what this module uses
    if not all(hasattr(linear, a) for a in ("lora_A", "lora_B", "scaling", "get_delta_weight")):
        raise ValueError(f"{name}: a PEFT {kind} tuner wraps this memory layer; the memory "
                         f"reads its layers' weights, and only plain LoRA is folded into "
                         f"them (its update is a weight delta); {_HOW_TO_EXCLUDE}")
    if is_tuned(linear.base_layer):
        raise ValueError(f"{name}: PEFT tuners wrap this memory layer twice "
                         f"({kind} around {type(linear.base_layer).__name__}); only one LoRA "
                         f"tuner is supported on the memory's layers; {_HOW_TO_EXCLUDE}")
    # peft's `adapter_names=` (one adapter per row) reaches its layers as a forward pre-hook
    # that adds the argument; the memory never calls the layer, so it is refused
    if any(getattr(getattr(hook, "func", hook), "__name__", "") == "_adapter_names_pre_forward_hook"
           for hook in linear._forward_pre_hooks.values()):
        raise ValueError(f"{name}: adapter_names (one adapter per row) is not supported on "
                         f"the memory's LoRA layers (the memory folds the active adapters "
                         f"into one weight for the whole batch); {_HOW_TO_EXCLUDE}")
    variants = getattr(linear, "lora_variant", {})
    dora = getattr(linear, "use_dora", {})
    skipped = False
    for adapter in _active(linear):
        if adapter in variants or dora.get(adapter, False):
            variant = type(variants[adapter]).__name__ if adapter in variants else "DoRA"
            raise ValueError(f"{name}: the PEFT adapter {adapter!r} ({kind}) is a LoRA variant "
                             f"({variant}) whose update is not a weight delta the memory can "
                             f"fold in; use plain LoRA (no use_dora=True, ...) or "
                             f"{_HOW_TO_EXCLUDE}")
        dropout = linear.lora_dropout[adapter] if adapter in linear.lora_dropout else None
        # not while compiling: a warning is a graph break (the eager call warns)
        if linear.training and isinstance(dropout, nn.Dropout) and dropout.p > 0 \
                and not torch.compiler.is_compiling():
            warned = _WARNED.setdefault(linear, set())
            if adapter not in warned:
                warned.add(adapter)
                skipped = True
    if skipped and warn:
        warn_dropout([name])
    return skipped


def warn_dropout(names: list[str]) -> None:
    """Warn once for the memory layers ``names`` that their LoRA dropout is not applied."""
    where = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more memory layers"
    warnings.warn(f"{where}: the PEFT adapter's lora_dropout is not applied on the memory's "
                  f"LoRA path (the memory folds the adapter into its weight, and dropout acts "
                  f"on the adapter's input); the model's other LoRA layers apply it",
                  UserWarning, stacklevel=3)


def effective_weight(linear: nn.Module, name: str = "linear", *, check: bool = True
                     ) -> tuple[Tensor, Tensor | None]:
    """``(weight (out, in), bias (out,) or None)`` that ``linear`` computes with, LoRA included.

    A plain layer gives its own; a LoRA-wrapped one (:func:`is_tuned`) its base layer's plus
    each active adapter's ``get_delta_weight`` (and ``B.bias * scaling`` with
    ``lora_bias=True``), on the graph, exactly as the wrapper's ``forward`` would (nothing
    when the adapters are disabled or merged). ``check``: :func:`check_tuned` first
    (``ValueError`` naming ``name``); the dropout is not applied."""
    if not is_tuned(linear):
        return _own(linear, "weight"), _own(linear, "bias")
    if check:
        check_tuned(linear, name)
    base = linear.base_layer
    weight, bias = _own(base, "weight"), _own(base, "bias")
    if linear.disable_adapters:
        if linear.merged:  # what the layer's forward does: the base weight alone again
            linear.unmerge()
            # peft unmerges through ``.data``, which leaves the version counters as they
            # were: bump them, so that whatever recorded the merged weight by its version
            # (a decode step's reused output) sees the change
            for changed in (weight, bias):
                if changed is not None:
                    torch.autograd.graph.increment_version(changed)
        return weight, bias
    if linear.merged:  # peft's forward adds no unmerged adapter next to a merged one either
        return weight, bias
    lora_bias = getattr(linear, "lora_bias", {})
    for adapter in _active(linear):
        scaling = linear.scaling[adapter]
        weight = weight + linear.get_delta_weight(adapter).to(weight.dtype)
        if lora_bias.get(adapter, False):
            bias = bias + (linear.lora_B[adapter].bias * scaling).to(bias.dtype)
    return weight, bias


def fold_tuned(layers: dict[str, nn.Module]) -> dict[str, dict[str, Tensor | None]]:
    """:func:`effective_weight` of several named layers, checked first, with one warning for
    all whose LoRA dropout is skipped: ``{name: {"weight": (out, in), "bias": (out,) or None}}``."""
    skipped = [name for name, linear in layers.items() if check_tuned(linear, name, warn=False)]
    if skipped:
        warn_dropout(skipped)
    return {name: dict(zip(("weight", "bias"), effective_weight(linear, name, check=False),
                           strict=True)) for name, linear in layers.items()}
