"""PEFT on a model with memory (issue 50, item 2): ``target_modules="all-linear"`` wraps the
memory's linear layers, which the memory reads by ``.weight`` (it never calls them). Their
LoRA deltas are folded into the weights it reads (``tmcore.adapters.torch.tuners``), so they
train, change the output and merge like any other LoRA layer; tuners that are no weight
delta (DoRA, IA3) are refused naming the layer, a skipped ``lora_dropout`` is warned about,
and ``exclude_modules=hf.PEFT_EXCLUDE`` still keeps the memory out of the adapters."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'tmcore[hf]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from tmcore.adapters import hf  # noqa: E402
from tmcore.adapters.torch import TensorMemory  # noqa: E402
from tmcore.adapters.torch.tuners import effective_weight  # noqa: E402

VOCAB = 48
LINEARS = ("write_proj", "content_net", "sigma_net", "coord_net", "out_proj")


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


def all_linear(model, **kwargs):
    return peft.get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=2,
                                                      **kwargs))


def memory_lora(wrapped, which):
    """The memory's ``lora_A`` / ``lora_B`` parameters, by name."""
    return {n: p for n, p in wrapped.named_parameters()
            if "tensor_memory" in n and f".{which}." in n}


def base_and_wrapped():
    """Tokens, the memory model's logits on them before LoRA, and the model wrapped
    (``all-linear`` LoRA, eval mode)."""
    model, _ = model_with_memory()
    x = ids()
    with torch.no_grad():
        base = model(input_ids=x).logits
    return x, base, all_linear(model).eval()


def randomize_(params, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


def test_all_linear_lora_on_the_memory_trains_every_memory_layer():
    model, _ = model_with_memory()
    wrapped = all_linear(model)
    lora_a, lora_b = memory_lora(wrapped, "lora_A"), memory_lora(wrapped, "lora_B")
    assert len(lora_b) == 2 * len(LINEARS)  # both blocks' five linear layers
    assert all(p.requires_grad and p.abs().max() == 0 for p in lora_b.values())  # B starts at 0
    x = ids()
    wrapped(input_ids=x, labels=x).loss.backward()
    # B = 0: A's gradient (B^T times the rest) is zero, B's is not
    assert all(p.grad is not None and p.grad.abs().max() == 0 for p in lora_a.values())
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in lora_b.values()), \
        [n for n, p in lora_b.items() if p.grad is None or p.grad.abs().max() == 0]


def test_the_memory_lora_changes_the_output_and_disabling_it_restores_the_base():
    x, base, wrapped = base_and_wrapped()
    randomize_(memory_lora(wrapped, "lora_B").values(), 2)  # the base model's B stay zero
    with torch.no_grad():
        adapted = wrapped(input_ids=x).logits
        with wrapped.disable_adapter():
            disabled = wrapped(input_ids=x).logits
    assert (adapted - disabled).abs().max() > 1e-3  # only the memory's LoRA can do it
    torch.testing.assert_close(disabled, base, rtol=0, atol=0)


def test_merge_and_unload_equals_the_unmerged_adapted_model():
    model, _ = model_with_memory()
    x = ids()
    wrapped = all_linear(model).eval()
    randomize_([p for n, p in wrapped.named_parameters() if "lora_B" in n], 3)
    with torch.no_grad():
        adapted = wrapped(input_ids=x).logits
        merged = wrapped.merge_and_unload()
        assert not any("lora" in n for n, _ in merged.named_modules())
        torch.testing.assert_close(merged(input_ids=x).logits, adapted, rtol=1e-5, atol=1e-5)


def test_the_folded_weight_is_peft_s_merged_weight_with_lora_bias_and_two_adapters():
    torch.manual_seed(4)
    memory = TensorMemory(8, 2, (2, 2, 2), chunk_size=2)
    config = dict(target_modules=list(LINEARS), r=2, lora_alpha=3, lora_bias=True)
    wrapped = peft.get_peft_model(memory, peft.LoraConfig(**config), adapter_name="first")
    wrapped.add_adapter("second", peft.LoraConfig(**config))
    wrapped.base_model.set_adapter(["first", "second"])
    randomize_([p for n, p in wrapped.named_parameters() if "lora_" in n], 5)
    x = torch.randn(2, 5, 8)
    out, _ = memory(x)
    for name in LINEARS:
        layer = getattr(memory, name)
        weight, bias = effective_weight(layer, name)
        expected = torch.nn.Linear(layer.in_features, layer.out_features)
        with torch.no_grad():
            expected.weight.copy_(layer.base_layer.weight)
            expected.bias.copy_(layer.base_layer.bias)
        for adapter in ("first", "second"):
            with torch.no_grad():
                expected.weight += layer.get_delta_weight(adapter)
                expected.bias += layer.lora_B[adapter].bias * layer.scaling[adapter]
        torch.testing.assert_close(weight, expected.weight, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(bias, expected.bias, rtol=1e-6, atol=1e-6)
    merged = wrapped.merge_and_unload()
    torch.testing.assert_close(merged(x)[0], out, rtol=1e-5, atol=1e-5)


def test_dora_on_the_memory_is_refused_naming_the_layer():
    model, _ = model_with_memory()
    wrapped = all_linear(model, use_dora=True)
    x = ids()
    with pytest.raises(ValueError, match=r"tensor_memory\.memory\.write_proj \(block 0\): .*"
                                         r"Dora.*PEFT_EXCLUDE"):
        wrapped(input_ids=x, labels=x)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^write_proj: .*Dora"):
        wrapped(input_ids=x)  # inference reads the weights too: refused as well


def test_ia3_on_the_memory_is_refused_naming_the_layer_and_the_tuner():
    model, _ = model_with_memory()
    config = peft.IA3Config(target_modules="all-linear", feedforward_modules=[])
    wrapped = peft.get_peft_model(model, config)
    x = ids()
    with pytest.raises(ValueError, match=r"tensor_memory\.memory\.write_proj \(block 0\): a "
                                         r"PEFT Linear tuner.*only plain LoRA"):
        wrapped(input_ids=x, labels=x)


def test_lora_dropout_on_the_memory_warns_once():
    model, _ = model_with_memory()
    wrapped = all_linear(model, lora_dropout=0.1).train()
    x = ids()
    with pytest.warns(UserWarning, match=r"tensor_memory\.memory\.write_proj \(block 0\) and 9 "
                                         r"more memory layers: .*lora_dropout is not applied"):
        wrapped(input_ids=x, labels=x).loss.backward()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lora_dropout")
        wrapped(input_ids=x, labels=x)  # said once


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


def lora_memory(**kwargs):
    """A bare TensorMemory (no transformers model) with LoRA on its five linear layers."""
    torch.manual_seed(6)
    memory = TensorMemory(8, 2, (2, 2, 2), chunk_size=2)
    peft.get_peft_model(memory, peft.LoraConfig(target_modules=list(LINEARS), r=2, **kwargs))
    return memory


def test_a_bare_memory_warns_once_for_all_its_layers_skipped_dropout():
    memory = lora_memory(lora_dropout=0.2).train()
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memory(x)
        memory(x)
    said = [str(w.message) for w in caught if "lora_dropout" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("write_proj and 4 more memory layers: ")
    eval_memory = lora_memory(lora_dropout=0.2).eval()  # no dropout in eval: nothing skipped
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lora_dropout")
        eval_memory(x)


def test_a_lora_memory_compiles_without_graph_breaks():
    memory = lora_memory()
    x = torch.randn(2, 5, 8)
    try:
        explained = torch._dynamo.explain(lambda t: memory(t)[0])(x)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons


def test_per_row_adapter_names_are_refused_on_the_memory_layers():
    model, _ = model_with_memory()
    wrapped = all_linear(model).eval()
    with torch.no_grad(), pytest.raises(ValueError, match=r"^write_proj: adapter_names"):
        wrapped(input_ids=ids(), adapter_names=["default", "__base__"])


def test_generate_with_the_memory_lora_equals_the_merged_model():
    model, _ = model_with_memory()
    wrapped = all_linear(model).eval()
    randomize_([p for n, p in wrapped.named_parameters() if "lora_B" in n], 7)
    x = ids()
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        adapted = wrapped.generate(input_ids=x, **kwargs)
        merged = wrapped.merge_and_unload().generate(input_ids=x, **kwargs)
    torch.testing.assert_close(torch.stack(adapted.scores), torch.stack(merged.scores),
                               rtol=1e-5, atol=1e-5)


def test_merge_adapter_in_place_and_disabling_it_as_peft_does():
    x, base, wrapped = base_and_wrapped()
    randomize_([p for n, p in wrapped.named_parameters() if "lora_B" in n], 8)
    with torch.no_grad():
        adapted = wrapped(input_ids=x).logits
        wrapped.merge_adapter()  # the deltas are in the base weights now: not added twice
        torch.testing.assert_close(wrapped(input_ids=x).logits, adapted, rtol=1e-5, atol=1e-5)
        with wrapped.disable_adapter():  # every layer unmerges itself, the memory's too
            torch.testing.assert_close(wrapped(input_ids=x).logits, base, rtol=1e-5,
                                       atol=1e-5)


def test_prefix_tuning_is_refused_naming_it_and_prompt_tuning_runs():
    """Prefix tuning puts virtual key/values in the cache that the memory never read: the
    refusal said the cache was "filled before the memory was attached, or by another
    model". Prompt tuning (virtual token embeddings, read by the memory) runs."""
    model, _ = model_with_memory()
    prefix = peft.get_peft_model(model, peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                num_virtual_tokens=4))
    with pytest.raises(RuntimeError, match="PEFT prefix tuning is not supported"):
        prefix(input_ids=ids())
    model, _ = model_with_memory()
    prompt = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                num_virtual_tokens=4))
    assert prompt(input_ids=ids()).logits.shape == (2, 4 + 8, VOCAB)
