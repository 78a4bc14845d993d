"""PEFT on a model with memory (issue 50, item 2): ``target_modules="all-linear"`` wrapped the
memory's linear layers, which the memory reads by ``.weight``, so their LoRA got no gradient,
silently. Now such a wrapping is refused at the first training forward, naming the way out
(``exclude_modules=hf.PEFT_EXCLUDE``), and the recommended setup trains LoRA on the base
model and the memory itself."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'tmcore[hf]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from tmcore.adapters import hf  # noqa: E402

VOCAB = 48


def model_with_memory():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, vocab_size=VOCAB)
    model = transformers.LlamaForCausalLM(config)
    memory = hf.attach_memory(model, memory_channels=2, memory_shape=(2, 3, 2), chunk_size=3,
                              zero_init=False, gate_init=1.0)
    return model, memory


def ids():
    return torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def test_all_linear_lora_on_the_memory_is_refused_not_silently_dead():
    model, _ = model_with_memory()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=2,
                                                         init_lora_weights=False))
    x = ids()
    with pytest.raises(ValueError, match=r"target_modules.*tensor_memory.*PEFT_EXCLUDE"):
        wrapped(input_ids=x, labels=x)
    with torch.no_grad():  # inference is not refused (nothing to train)
        wrapped(input_ids=x)


def test_the_recommended_setup_trains_lora_and_the_memory():
    model, memory = model_with_memory()
    config = peft.LoraConfig(target_modules="all-linear", exclude_modules=hf.PEFT_EXCLUDE, r=2)
    wrapped = peft.get_peft_model(model, config)
    names = [n for n, _ in wrapped.named_modules()]
    assert not any("tensor_memory" in n and "lora" in n for n in names)
    assert any("q_proj.lora_A" in n for n in names)
    for p in memory.parameters():  # the memory trains in full next to the adapters
        p.requires_grad_(True)
    x = ids()
    wrapped(input_ids=x, labels=x).loss.backward()
    lora = [p.grad for n, p in wrapped.named_parameters() if "lora_B" in n]
    assert lora and all(g is not None and g.abs().max() > 0 for g in lora)
    grads = [p.grad for p in memory.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().max() > 0 for g in grads)
    assert all(m.memory.out_proj.weight.grad.abs().max() > 0 for m in memory.memories)
