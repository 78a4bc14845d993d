"""Where the memory goes in a Hugging Face model: its decoder blocks (:func:`find_blocks`),
the checks that they take a memory of a given width, and the key its configuration is
stored under in ``model.config``."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["BLOCK_PATHS", "CONFIG_KEY", "find_blocks"]

#: Key of the memory configuration in ``model.config`` (and so in ``config.json``).
CONFIG_KEY = "tensor_memory"
#: Where decoder blocks live, relative to the model (first match wins).
BLOCK_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers",
               "transformer.layers", "transformer.blocks", "model.language_model.layers",
               "layers", "h", "decoder.layers", "blocks")


def transformers_module() -> Any:
    """``transformers``, or an ``ImportError`` saying which extra installs it."""
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - the tests skip without it
        raise ImportError("tmcore.adapters.hf needs transformers: pip install 'tmcore[hf]'"
                          ) from error
    return transformers


def resolve(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def config_int(config: Any, name: str) -> int | None:
    """The int field ``name`` of a model config (a multimodal config's text config's),
    ``None`` if it is not an int."""
    value = getattr(config.get_text_config(), name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, nn.Module,
                                                                         nn.ModuleList]:
    """The decoder blocks of a Hugging Face model: where they are, who owns them, the list.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only model (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...).
    blocks : str or None, default None
        The dotted path of its ``nn.ModuleList`` of blocks (e.g. ``"model.layers"``);
        ``None``: the first of :data:`BLOCK_PATHS` that is a non-empty one. Either way
        the list has ``config.num_hidden_layers`` blocks when the config says.

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
        not a non-empty ``nn.ModuleList`` of ``num_hidden_layers`` blocks, or no
        blocks found.
    """
    transformers = transformers_module()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model: expected a transformers PreTrainedModel, "
                        f"got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"model: {type(model).__name__} is an encoder-decoder; "
                         f"tmcore.adapters.hf supports decoder-only (causal LM) models")
    layers = config_int(model.config, "num_hidden_layers")

    def fits(found: Any) -> bool:
        return isinstance(found, nn.ModuleList) and len(found) > 0 \
            and (layers is None or len(found) == layers)

    if blocks is not None and not isinstance(blocks, str):
        raise TypeError(f"blocks: expected a dotted path such as 'model.layers', "
                        f"got {type(blocks).__name__}")
    path = blocks if blocks is not None else next(
        (p for p in BLOCK_PATHS if fits(resolve(model, p))), None)
    if path is None:
        raise ValueError(f"model: could not find the decoder blocks of "
                         f"{type(model).__name__} (tried {', '.join(BLOCK_PATHS)}); "
                         f"pass blocks='dotted.path.to.the.ModuleList'")
    found = resolve(model, path)
    if not fits(found):  # a path the caller gave
        raise ValueError(f"blocks: {path!r} is not a non-empty nn.ModuleList of "
                         f"{type(model).__name__} with config.num_hidden_layers = "
                         f"{layers} blocks (got {type(found).__name__}"
                         f"{f' of {len(found)}' if hasattr(found, '__len__') else ''})")
    owner_path, _, _ = path.rpartition(".")
    return path, model if not owner_path else resolve(model, owner_path), found


def check_fits(model: nn.Module, path: str, owner: nn.Module, embed_dim: int,
               where: str = "embed_dim") -> None:
    """Refuse, before anything is attached, what would only fail at the first forward: a
    token width other than the blocks' (the hidden size), or blocks whose owner is not
    called with the tokens (an encoder's inner stack such as BERT's ``encoder.layer``,
    whose owner receives hidden states and an extended mask)."""
    width = config_int(model.config, "hidden_size")
    if width is not None and embed_dim != width:
        raise ValueError(f"{where}: the memory reads and writes the blocks' outputs of the "
                         f"model's hidden size {width} (config.hidden_size), got {embed_dim}; "
                         f"leave embed_dim unset or pass {width}")
    if not {"input_ids", "inputs_embeds"} & parameter_names(owner).keys():
        raise ValueError(
            f"blocks: {path!r} is owned by {type(owner).__name__}, whose forward is not "
            f"called with input_ids or inputs_embeds (an encoder's inner stack?); "
            f"tmcore.adapters.hf attaches to the blocks of a decoder's base model, whose "
            f"forward receives the tokens, the cache and the padding mask (model.layers, "
            f"transformer.h, ...). For other stacks use tmcore.adapters.torch.attach_memory")


def parameter_names(owner: nn.Module) -> dict[str, int]:
    """``{name: position}`` of the parameters of ``owner.forward``."""
    return {name: i for i, name in enumerate(inspect.signature(owner.forward).parameters)}


def unmark_config(config: Any) -> type:
    """Give a config with memory its base model's class back; returns its class before
    (a config with memory saves as ``model_type = "tensor_memory"``)."""
    cls = type(config)
    config.__class__ = getattr(cls, "_tmcore_base", cls)
    return cls
