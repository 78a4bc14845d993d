"""Which Tensor Memory layer the examples use.

The PyTorch adapter ``tmcore.adapters.torch.TensorMemory`` by default;
:class:`~examples.diagnostics.variants.VariantTensorMemory` (the adapter's layer
with ablation switches) when a switch is set or ``set_implementation("variant")``
asks for it. The layer options beyond the paper (:data:`LAYER_OPTIONS`: local updates,
warped dynamics) go to either.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.diagnostics.variants import VariantTensorMemory

__all__ = ["make_tensor_memory", "adapter_name", "set_implementation", "init_write_proj",
           "init_forget_bias", "LAYER_OPTIONS"]

_IMPL = {"name": "adapter"}


def set_implementation(name: str) -> None:
    """``"adapter"`` (default: tmcore.adapters.torch) or ``"variant"`` (the pure-PyTorch
    layer, same function and parameters)."""
    if name not in ("adapter", "variant"):
        raise ValueError(f"implementation: expected 'adapter' or 'variant', got {name!r}")
    _IMPL["name"] = name


def _adapter_class():
    if _IMPL["name"] == "variant":
        return None
    from tmcore.adapters.torch import TensorMemory

    return TensorMemory


def adapter_name() -> str:
    """``"tmcore.adapters.torch"`` or ``"VariantTensorMemory"``."""
    return "tmcore.adapters.torch" if _adapter_class() is not None else "VariantTensorMemory"


@torch.no_grad()
def init_write_proj(memory: nn.Module) -> nn.Module:
    """Start the write summary as the chunk's FIRST token: ``write_proj.weight = [I, 0, ...]``,
    bias 0 (``write_proj`` maps the chunk's ``L * d`` concatenated tokens to ``d``).

    With the default (random) initialisation the tied coordinate head sees
    unrelated vectors on its read path (the first token) and on its write path
    (``write_proj`` of the chunk), so a token's read and write addresses start
    uncorrelated, and with a few hundred steps the model never finds that
    reads should go where the matching writes went (binding stays at the
    attention-window accuracy, the memory unused). Starting the summary as the
    first token makes a key's read and write addresses start equal; everything
    stays trainable. Returns ``memory``.
    """
    weight = memory.write_proj.weight  # (d, L * d)
    d = weight.shape[0]
    weight.zero_()
    weight[:, :d] = torch.eye(d, dtype=weight.dtype, device=weight.device)
    memory.write_proj.bias.zero_()
    return memory


@torch.no_grad()
def init_forget_bias(memory: nn.Module, value: float) -> nn.Module:
    """Set the ConvLSTM's forget-gate bias (the second quarter of the pointwise bias,
    gate order ``i, f, o, g``) to ``value``. Returns ``memory``.

    The adapter's ``TensorMemory(forget_bias=...)`` does the same at construction;
    this helper serves :class:`VariantTensorMemory` too.
    With the layer's default bias 0 the forget gate starts at ``sigmoid(0) = 0.5``:
    with one update per token (chunk 1), a write made 30 tokens before its query
    is scaled by ``0.5 ** 30`` and leaves no gradient for the model to discover
    the memory with. A positive bias (the usual LSTM remedy) starts the cell
    remembering: ``sigmoid(3) = 0.95``.
    """
    channels = memory.cell.pointwise_bias.shape[0] // 4
    memory.cell.pointwise_bias[channels : 2 * channels] = value
    return memory


#: The layer options beyond the paper (``tmcore.layer.layer_config``) a row may set in its
#: ``variant``: ``update`` (``"dense"`` / ``"local"``), ``window`` (cells per axis of a local
#: update) and ``dynamics`` (``"none"`` / ``"warp"``). They are arguments of the adapter's
#: layer itself, so unlike the ablation switches they do not select the variant layer.
LAYER_OPTIONS = ("update", "window", "dynamics")


def make_tensor_memory(embed_dim: int, memory_channels: int, memory_shape: tuple[int, ...],
                       chunk_size: int, sigma_scale: float = 1.0, write_init: str = "first_token",
                       forget_bias: float = 0.0, **variant: object) -> nn.Module:
    """A Tensor Memory layer; ``variant`` switches (``write``, ``tied``, ``conv``) select
    :class:`VariantTensorMemory`, as does ``set_implementation("variant")``; the
    :data:`LAYER_OPTIONS` in ``variant`` go to whichever layer is built. ``write_init``:
    ``"first_token"`` (:func:`init_write_proj`) or ``"default"`` (the layer's own);
    ``forget_bias``: see :func:`init_forget_bias` (0: the layer's own)."""
    if write_init not in ("first_token", "default"):
        raise ValueError(f"write_init: expected 'first_token' or 'default', got {write_init!r}")
    options = {k: variant[k] for k in LAYER_OPTIONS if k in variant}
    switches = {k: v for k, v in variant.items() if k not in options}
    cls = _adapter_class()
    if switches or cls is None:
        memory = VariantTensorMemory(embed_dim, memory_channels, tuple(memory_shape),
                                     chunk_size, sigma_scale, **switches, **options)
    else:
        memory = cls(embed_dim, memory_channels, tuple(memory_shape), chunk_size,
                     sigma_scale=sigma_scale, **options)
    if forget_bias:
        init_forget_bias(memory, forget_bias)
    return init_write_proj(memory) if write_init == "first_token" else memory
