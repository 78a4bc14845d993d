"""tmcore.adapters.hf where Hugging Face users still tripped (issue 50, items 1-7): sizes and
blocks refused at attach, mixed sliding / full attention with a static cache, streaming in a
plain training loop, caches filled by a compiled forward, unsupported decoding modes refused
up front, and no graph break from a padding mask."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'tmcore[hf]')")
from torch import nn  # noqa: E402

from tmcore.adapters import hf  # noqa: E402

VOCAB = 48
COMMON = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
MEMORY = {"memory_channels": 2, "memory_shape": (2, 3, 2), "chunk_size": 3,
          "zero_init": False, "gate_init": 1.0}


def llama(seed: int = 0, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64,
                                      **COMMON)
    return transformers.LlamaForCausalLM(config).eval()


def ids(batch: int, tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- item 5: attach


def test_an_embed_dim_other_than_the_hidden_size_is_refused_at_attach():
    """Old main: accepted, and the forward failed inside the memory's LayerNorm."""
    model = llama(hidden=64)
    with pytest.raises(ValueError, match=r"embed_dim.*hidden size 64.*32"):
        hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2,
                         embed_dim=32)
    assert hf.memory_of(model) is None and not hasattr(model.config, hf.CONFIG_KEY)
    memory = hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2,
                              embed_dim=64)  # the hidden size itself is fine
    assert memory.memories[0].memory.config.embed_dim == 64


def test_blocks_of_an_encoder_stack_are_refused_at_attach():
    """Old main: BERT's encoder.layer was accepted and every forward then said
    'input_ids: expected input_ids' although they were passed."""
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=VOCAB)
    model = transformers.BertModel(config).eval()
    with pytest.raises(ValueError, match=r"blocks: 'encoder.layer' is owned by BertEncoder.*"
                                         r"input_ids or inputs_embeds"):
        hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2,
                         blocks="encoder.layer")
    assert hf.memory_of(model) is None
    assert not any("tensor_memory" in k for k in model.state_dict())
