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


# --------------------------------------------------------------------------- item 1: mixed


def mixed_attention(family: str) -> nn.Module:
    """Sliding and full attention layers in one model (a window shorter than the prompt)."""
    torch.manual_seed(0)
    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
             "sliding_window": 4, **COMMON}
    if family == "gemma2":
        return transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(head_dim=8, **sizes)).eval()
    config = transformers.Qwen2Config(use_sliding_window=True,
                                      layer_types=["sliding_attention", "full_attention"],
                                      **sizes)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_static_cache_with_mixed_sliding_and_full_attention(family):
    """Old main: the hook got the per-attention-type masks as a dict and raised
    'attention_mask: expected a tensor ... got dict'."""
    model = mixed_attention(family)
    hf.attach_memory(model, **MEMORY)
    x = ids(2, 7)
    mask = torch.ones_like(x)
    mask[0, :2] = 0  # left padding
    runs = {}
    with torch.no_grad():
        for name, kw in (("static", {"cache_implementation": "static"}), ("dynamic", {}),
                         ("uncached", {"use_cache": False})):
            runs[name] = model.generate(x, attention_mask=mask, max_new_tokens=6,
                                        do_sample=False, pad_token_id=0, **kw)
    assert torch.equal(runs["static"], runs["dynamic"])
    assert torch.equal(runs["static"], runs["uncached"])


def test_a_mapping_of_masks_in_a_forward_is_read_as_its_full_attention_mask():
    """A forward given the per-attention-type masks (as generate prepares them) equals the
    forward given the 2-D padding mask, at every real token."""
    model = mixed_attention("qwen2")
    hf.attach_memory(model, **MEMORY)
    x = ids(2, 6)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
    full = (causal & mask.bool()[:, :, None])[:, None]
    band = torch.ones(6, 6, dtype=torch.bool).triu(-3)[None, None]
    valid = mask.bool()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        plain = model(x, attention_mask=mask, position_ids=position_ids).logits
        got = model(x, attention_mask={"full_attention": full, "sliding_attention": full & band},
                    position_ids=position_ids).logits
    assert (got[valid] - plain[valid]).abs().max() <= 1e-5


# --------------------------------------------------------------------------- item 3: streaming


def _no_graph(states) -> bool:
    return all(t.grad_fn is None and not t.requires_grad
               for s in states for t in (s.h, s.c, s.pending, s.read))


def test_streaming_in_a_plain_training_loop_carries_the_state_detached():
    """model(x, labels=x) with the config's default use_cache=True: old main never carried
    the state to the next batch (the forward's own cache swallowed it) and that cache held a
    state attached to the autograd graph."""
    model = llama()
    assert model.config.use_cache
    memory = hf.attach_memory(model, streaming=True, **MEMORY)
    with torch.no_grad():
        for m in memory.memories:
            m.memory.out_proj.weight.normal_()
    model.train()
    long = ids(2, 12)
    first, second = long[:, :7], long[:, 7:]
    runs = []
    for kw in ({}, {"use_cache": False}):
        memory.reset_state()
        model.zero_grad()
        out = model(first, labels=first, **kw)
        out.loss.backward()
        if not kw:  # the forward's own cache holds a detached state
            assert out.past_key_values is not None
            assert _no_graph(memory.state_of(out.past_key_values))
        out = model(second, labels=second, **kw)
        out.loss.backward()
        runs.append(out.loss.detach())
    memory.reset_state()
    fresh = model(second, labels=second).loss.detach()
    assert torch.equal(runs[0], runs[1])          # the default cache carries as use_cache=False
    assert (runs[0] - fresh).abs() > 1e-6         # and the carried state mattered


def test_without_streaming_a_training_forward_carries_nothing_and_its_cache_is_detached():
    model = llama()
    memory = hf.attach_memory(model, **MEMORY)
    model.train()
    x = ids(2, 7)
    out = model(x, labels=x)
    assert _no_graph(memory.state_of(out.past_key_values))
    out.loss.backward()
    assert torch.equal(model(x, labels=x).loss, out.loss)


# --------------------------------------------------------------------------- item 4: compile


def test_a_cache_filled_by_a_compiled_forward_continues_eagerly():
    """Old main: 'the cache now holds 7 tokens, its memory state belongs to 0'."""
    model = llama()
    memory = hf.attach_memory(model, **MEMORY)
    x = ids(2, 11)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        whole = model(x).logits
        cache = transformers.DynamicCache()
        pieces = [compiled(x[:, :7], past_key_values=cache, use_cache=True).logits]
        assert memory.state_of(cache) is not None
        pieces += [model(x[:, a:b], past_key_values=cache, use_cache=True).logits
                   for a, b in ((7, 8), (8, 11))]
    assert (torch.cat(pieces, 1) - whole).abs().max() <= 1e-5
    with pytest.raises(RuntimeError, match="cannot be rolled back"):
        cache.crop(-1)  # an eager call recorded the length again: still followed


# --------------------------------------------------------------------------- item 6: modes


@pytest.mark.parametrize("mode", ["prompt_lookup", "assisted", "continuous_batching",
                                  "paged_cache"])
def test_unsupported_decoding_modes_are_refused_before_any_token(mode):
    """Old main: continuous batching failed every request with a message about legacy
    tuple caches; assisted / prompt-lookup decoding raised only at the first rejected
    candidate."""
    model = llama()
    hf.attach_memory(model, **MEMORY)
    calls = []
    hook = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    x = ids(1, 10)
    with torch.no_grad(), pytest.raises(NotImplementedError) as caught:
        if mode == "prompt_lookup":
            model.generate(x, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=3)
        elif mode == "assisted":
            model.generate(x, max_new_tokens=4, do_sample=False, assistant_model=llama(1))
        elif mode == "paged_cache":  # generate switches to continuous batching
            model.generate(x, max_new_tokens=4, do_sample=False, cache_implementation="paged")
        else:
            config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False,
                                                   eos_token_id=2, pad_token_id=0)
            model.generate_batch([[5, 6, 7], [8, 9]], generation_config=config)
    hook.remove()
    assert calls == []  # refused at the start: not one forward ran
    message = str(caught.value)
    if mode in ("continuous_batching", "paged_cache"):
        assert "continuous batching" in message and "paged" in message
    else:
        assert "assisted and prompt-lookup" in message and "rolled back" in message
    hf.detach_memory(model)  # the model's own methods again
    assert "_get_candidate_generator" not in model.__dict__
    assert "init_continuous_batching" not in model.__dict__


# --------------------------------------------------------------------------- item 7: breaks


@pytest.mark.parametrize("use_cache", [False, True])
def test_a_padding_mask_causes_no_graph_break(use_cache):
    """Old main: 11-12 graph breaks (Tensor.tolist() reading the padding mask on the host)."""
    model = llama()
    hf.attach_memory(model, **MEMORY)
    x = ids(2, 8)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    with torch.no_grad():
        expected = model(x, attention_mask=mask, use_cache=use_cache).logits
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(x, attention_mask=mask, use_cache=use_cache)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        got = compiled(x, attention_mask=mask, use_cache=use_cache).logits
    valid = mask.bool()
    assert (got[valid] - expected[valid]).abs().max() <= 1e-5


def test_a_cached_decoding_step_causes_no_graph_break():
    """What the guide now says: a cached call continuing a memory state compiles whole."""
    model = llama()
    hf.attach_memory(model, **MEMORY)
    x = ids(2, 9)
    with torch.no_grad():
        whole = model(x).logits
        cache = transformers.DynamicCache()
        model(x[:, :8], past_key_values=cache, use_cache=True)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        step = compiled(x[:, 8:], past_key_values=cache, use_cache=True).logits
    assert (step[:, 0] - whole[:, 8]).abs().max() <= 1e-5
