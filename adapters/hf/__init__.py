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

:func:`attach_memory` adds a gated :class:`~tmcore.adapters.torch.MemoryResidual` after
each decoder block (:func:`find_blocks`), in the ``causal`` mode of
:func:`tmcore.adapters.torch.attach_memory`. The memory state belongs to the generation,
the way the KV cache does (:class:`HFMemory`); the memory configuration travels in
``model.config.tensor_memory``, so ``save_pretrained`` writes it and
:func:`from_pretrained`, ``AutoModelForCausalLM`` and ``pipeline`` load the model with its
memory (docs/guides/huggingface.md says what is supported). Its modules, one job each:
:mod:`~tmcore.adapters.hf.blocks` (where the memory goes),
:mod:`~tmcore.adapters.hf.cache` (the state per generation) and
:mod:`~tmcore.adapters.hf.attach` (attach, detach, save and load).
"""

from contextlib import suppress

from tmcore.adapters.hf.attach import (
    MODEL_TYPE,
    attach_memory,
    check_spec,
    detach_memory,
    from_pretrained,
    memory_of,
    register_auto_classes,
)
from tmcore.adapters.hf.blocks import BLOCK_PATHS, CONFIG_KEY, find_blocks
from tmcore.adapters.hf.cache import PEFT_EXCLUDE, HFMemory

__all__ = ["BLOCK_PATHS", "CONFIG_KEY", "MODEL_TYPE", "PEFT_EXCLUDE", "HFMemory",
           "attach_memory", "check_spec", "detach_memory", "find_blocks", "from_pretrained",
           "memory_of", "register_auto_classes"]

with suppress(ImportError):  # registered on import, as fla registers its models (without
    register_auto_classes()  # transformers, the adapter's calls say it is missing)
