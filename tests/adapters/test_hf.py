"""tmcore.adapters.hf on tiny random-weight transformers models of three families (issue 22):
the memory state follows the generation (fresh per generation and per uncached pass,
reordered with beams, crop refused), attention_mask honoured, generate equal to an exact
uncached reference, save / load with the config, identity at init, checkpointing, compile,
hidden states, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'tmcore[hf]')")
from torch import nn  # noqa: E402

from tmcore.adapters import hf  # noqa: E402

F64 = torch.float64
VOCAB = 48
FAMILIES = ("llama", "gpt2", "qwen2")


def make_model(family: str, seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if family == "llama":
        config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=layers, num_attention_heads=2,
                                          num_key_value_heads=1, max_position_embeddings=64,
                                          **common)
        model = transformers.LlamaForCausalLM(config)
    elif family == "gpt2":
        config = transformers.GPT2Config(n_embd=16, n_layer=layers, n_head=2, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         **common)
        model = transformers.GPT2LMHeadModel(config)
    elif family == "mistral":  # a sliding window shorter than the prompt
        config = transformers.MistralConfig(hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=layers, num_attention_heads=2,
                                            num_key_value_heads=1, max_position_embeddings=64,
                                            sliding_window=4, **common)
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=layers, num_attention_heads=2,
                                          num_key_value_heads=1, max_position_embeddings=64,
                                          **common)
        model = transformers.Qwen2ForCausalLM(config)
    return model.eval()


def with_memory(family: str, seed: int = 0, **kw) -> tuple[nn.Module, hf.HFMemory]:
    """A model with a memory that matters (random read-out, open gate)."""
    model = make_model(family, seed)
    kw = {"memory_channels": 2, "memory_shape": (2, 3, 2), "chunk_size": 3,
          "zero_init": False, "gate_init": 1.0, **kw}
    memory = hf.attach_memory(model, **kw)
    return model, memory


def ids(batch: int, tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------- attach / remove


@pytest.mark.parametrize("family", FAMILIES)
def test_attach_finds_the_blocks_and_remove_restores_the_model(family):
    model = make_model(family)
    x = ids(2, 8)
    with torch.no_grad():
        before = model(x).logits
    keys = list(model.state_dict())
    memory = hf.attach_memory(model, memory_channels=2, memory_shape=(2, 2), chunk_size=3,
                              zero_init=False)
    assert memory.path == ("transformer.h" if family == "gpt2" else "model.layers")
    assert len(memory.memories) == 2 and model.config.tensor_memory["chunk_size"] == 3
    with torch.no_grad():
        assert not torch.allclose(model(x).logits, before)
    hf.detach_memory(model)
    assert list(model.state_dict()) == keys and not hasattr(model.config, "tensor_memory")
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)
    assert hf.memory_of(model) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_init_is_an_exact_identity_that_trains(family):
    model = make_model(family).train()
    x = ids(2, 10)
    before = model(x, labels=x).loss
    memory = hf.attach_memory(model, memory_channels=2, memory_shape=(2, 2, 2), chunk_size=4)
    out = model(x, labels=x, output_hidden_states=True)
    assert torch.equal(out.loss, before)
    out.loss.backward()
    read_out = [m.memory.out_proj.weight.grad for m in memory.memories]
    assert all(g is not None and g.abs().max() > 0 for g in read_out)


def test_gate_init_out_of_range_is_refused():
    model = make_model("llama")
    for bad in (-3.5e38, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gate_init"):
            hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2,
                             gate_init=bad)
        assert hf.memory_of(model) is None


# --------------------------------------------------------------------------- generate


def _gen(model, x, mask, **kw):
    return model.generate(x, attention_mask=mask, max_new_tokens=5, output_scores=True,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                          **kw)


STRATEGIES = {"greedy": {"do_sample": False}, "sample": {"do_sample": True, "top_k": 8},
              "beams": {"do_sample": False, "num_beams": 3}}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_generate_equals_the_uncached_reference(family, strategy):
    """Cached generation (the memory state on the cache, reordered with beams) equals
    generation where every step is a fresh full forward (use_cache=False), with left
    padding; old main: 1/36 and 8/36 tokens differed under beam search."""
    model, _ = with_memory(family)
    x = ids(2, 7)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding
    results = []
    for use_cache in (True, False):
        torch.manual_seed(3)
        with torch.no_grad():
            results.append(_gen(model, x, mask, use_cache=use_cache, **STRATEGIES[strategy]))
    cached, reference = results
    assert torch.equal(cached.sequences, reference.sequences)
    for a, b in zip(cached.scores, reference.scores, strict=True):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        assert (a[finite] - b[finite]).abs().max() <= 1e-5
    if strategy == "greedy":  # and the reference is the full forward of the sequence
        seq = cached.sequences
        full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - x.shape[1],
                                                dtype=mask.dtype)], 1)
        with torch.no_grad():
            logits = model(seq, attention_mask=full_mask, position_ids=positions(full_mask)
                           ).logits
        for k, step in enumerate(cached.logits):
            assert (step - logits[:, x.shape[1] - 1 + k]).abs().max() <= 1e-5


@pytest.mark.parametrize("kw", [{}, {"num_beams": 2}, {"cache_implementation": "static"}])
def test_sliding_window_generation_equals_the_uncached_reference(kw):
    """A fourth family (Mistral) whose cache layers slide: the memory still follows."""
    model, _ = with_memory("mistral")
    x = ids(2, 7)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    uncached = {k: v for k, v in kw.items() if k != "cache_implementation"}
    with torch.no_grad():
        cached = model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                pad_token_id=0, **kw)
        reference = model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   pad_token_id=0, use_cache=False, **uncached)
    assert torch.equal(cached, reference)


def test_generations_are_independent_and_batch_size_may_change():
    """Old main: a second generate continued the first one's stream and a new batch size
    raised a shape error."""
    model, _ = with_memory("llama")
    x = ids(2, 6)
    with torch.no_grad():
        first = model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
        alone = model.generate(x[1:], max_new_tokens=4, do_sample=False, pad_token_id=0)
        again = model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(first, again)
    assert torch.equal(alone[0], first[1])
    # a static cache (reused and reset by generate, 4-D masks while decoding), left padding
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    with torch.no_grad():
        runs = [model.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               pad_token_id=0, **kw)
                for kw in ({"cache_implementation": "static"},
                           {"cache_implementation": "static"}, {"use_cache": False})]
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[2])


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_rows_equal_each_row_alone(family):
    """Left and right padding (any pad id): every valid position equals the row run alone
    (old main: up to 0.12 off, 0.057 from the pad id alone)."""
    model, _ = with_memory(family, chunk_size=2)
    x = ids(3, 9)
    mask = torch.ones_like(x)
    mask[0, :4] = 0   # left padding
    mask[1, 6:] = 0   # right padding
    with torch.no_grad():
        for pad in (0, 7):
            padded = torch.where(mask.bool(), x, torch.full_like(x, pad))
            out = model(padded, attention_mask=mask, position_ids=positions(mask)).logits
            for row in range(3):
                keep = mask[row].bool()
                alone = model(x[row:row + 1, keep]).logits[0]
                assert (out[row, keep] - alone).abs().max() <= 1e-5, (pad, row)


def test_bool_and_int_masks_agree_and_bad_masks_are_refused():
    model, _ = with_memory("llama")
    x = ids(2, 6)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    with torch.no_grad():
        a = model(x, attention_mask=mask).logits
        b = model(x, attention_mask=mask.bool()).logits
        assert torch.equal(a, b)
        with pytest.raises(ValueError, match="attention_mask"):
            model(x, attention_mask=mask[:1])
        with pytest.raises(TypeError, match="attention_mask"):
            model(x, attention_mask=mask.float())
        with pytest.raises(ValueError, match="attention_mask"):
            model(x, attention_mask=mask * 2)
        with pytest.raises(ValueError, match="attention_mask"):  # 4-D of another shape
            model(x, attention_mask=torch.ones(2, 1, 5, 6, dtype=torch.bool))
        # a prepared 4-D mask (causal, pads masked out) says the same as the 2-D one
        keys = torch.ones(6, 6, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
        four = keys & mask.bool()[:, :, None]
        c = model(x, attention_mask=four[:, None]).logits
        valid = mask.bool()
        assert (c[valid] - a[valid]).abs().max() <= 1e-5


# --------------------------------------------------------------------------- the cache


def test_cached_pieces_equal_one_call_and_the_state_rides_on_the_cache():
    model, memory = with_memory("gpt2")
    x = ids(2, 10)
    with torch.no_grad():
        whole = model(x).logits
        cache = transformers.DynamicCache()
        pieces = [model(x[:, a:b], cache=cache, use_cache=True).logits
                  for a, b in ((0, 4), (4, 5), (5, 10))]
    assert (torch.cat(pieces, 1) - whole).abs().max() <= 1e-5
    state = memory.state_of(cache)
    assert state is not None and len(state) == 2 and state[0].h.shape[0] == 2
    # beam-style reordering follows the cache
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(memory.state_of(cache)[0].h[0], state[0].h[1])
    cache.batch_repeat_interleave(2)  # (contrastive / assisted paths) followed too
    assert memory.state_of(cache)[1].h.shape[0] == 4
    cache.batch_select_indices(torch.tensor([0, 3]))
    assert torch.equal(memory.state_of(cache)[1].pending, state[1].pending[[1, 1]])
    # cropping tokens cannot be followed: refused; crop(0) is fine
    cache.crop(0)
    with pytest.raises(RuntimeError, match="cannot be rolled back"):
        cache.crop(-1)


def test_unfollowable_caches_are_refused():
    model, _ = with_memory("llama")
    x = ids(1, 4)
    with torch.no_grad():
        out = model(x, use_cache=True)
        filled = transformers.DynamicCache()
        hf.detach_memory(model)
        model(x, cache=filled, use_cache=True)  # filled without the memory
        hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2)
        with pytest.raises(RuntimeError, match="no Tensor Memory state"):
            model(x, cache=filled, use_cache=True)
        legacy = tuple((k, v) for k, v in zip(out.cache.layers[0].keys[None],
                                              out.cache.layers[0].values[None], strict=True))
        with pytest.raises(TypeError, match="cache"):
            model.model(x, cache=legacy, use_cache=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forwards_carry_nothing_unless_streaming(family):
    model, memory = with_memory(family)
    model.train()
    x = ids(2, 8)
    first = model(x, labels=x).loss
    second = model(x, labels=x).loss        # no carry across batches
    assert torch.equal(first, second)
    model(ids(3, 8), labels=ids(3, 8)).loss.backward()  # another batch size
    hf.detach_memory(model)
    memory = hf.attach_memory(model, memory_channels=2, memory_shape=(2, 3, 2), chunk_size=3,
                              zero_init=False, gate_init=1.0, streaming=True)
    with torch.no_grad():
        for m in memory.memories:
            m.memory.out_proj.weight.normal_()
    long = ids(2, 12)
    fresh = model(long[:, 7:], use_cache=False).logits.detach()
    memory.reset_state()
    model(long[:, :7], use_cache=False).logits.sum().backward()
    carried = model(long[:, 7:], use_cache=False).logits
    carried.sum().backward()   # truncated backprop: the carried state is detached
    assert (carried.detach() - fresh).abs().max() > 1e-4  # the memory carried the first half
    memory.reset_state()       # a document boundary
    assert torch.equal(model(long[:, 7:], use_cache=False).logits.detach(), fresh)
    with pytest.raises(ValueError, match="reset_state"):
        model(ids(3, 4), use_cache=False)
    memory.reset_state()
    model(ids(3, 4), use_cache=False)
    model.eval()               # evaluation never continues the training stream
    with torch.no_grad():
        assert torch.equal(model(long[:, 7:], use_cache=False).logits, fresh)
        # and the same handle generates (old main: one handle could not serve both)
        cached = model.generate(long[:1, :5], max_new_tokens=3, do_sample=False,
                                pad_token_id=0)
        uncached = model.generate(long[:1, :5], max_new_tokens=3, do_sample=False,
                                  pad_token_id=0, use_cache=False)
    assert torch.equal(cached, uncached)


# --------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_and_load_with_the_memory_config(family, tmp_path):
    model, memory = with_memory(family, sigma_scale=0.7, forget_bias=1.5, radius=3.0,
                                eps=1e-5, checkpoint_every=2)
    x = ids(2, 7)
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["tensor_memory"]
    # the layer's fields are LayerConfig.to_dict's, next to the adapter's own
    layer = memory.memories[0].memory.config.to_dict()
    assert stored == {"format": 2, "blocks": memory.path, "num_blocks": 2, "gate_init": 1.0,
                      "norm": "layernorm", "streaming": False, **layer}
    assert stored["sigma_scale"] == 0.7 and stored["radius"] == 3.0
    loaded = hf.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, expected)
    if family == "gpt2":  # tied weights stay tied
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    # every stored value is checked on load
    for key, value, error in (("memory_shape", [2, 3], ValueError),
                              ("chunk_size", 0, ValueError), ("sigma_scale", "1", TypeError),
                              ("extra", 1, ValueError)):
        config = json.loads((tmp_path / "config.json").read_text())
        config["tensor_memory"][key] = value
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(config))
        (bad / "model.safetensors").symlink_to(tmp_path / "model.safetensors")
        with pytest.raises(error, match="tensor_memory|memory_shape"):
            hf.from_pretrained(bad)
    plain = make_model(family)
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="tensor_memory"):
        hf.from_pretrained(tmp_path / "plain")


def test_save_and_load_with_the_layer_options(tmp_path):
    """update="local" / window / dynamics="warp" (and flow) are stored in config.json, checked
    on load and rebuilt: from_pretrained gives the same logits bit for bit."""
    model, memory = with_memory("llama", update="local", window=2, dynamics="warp", flow=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # shift and flow heads that move the state (zero at init)
        for m in memory.memories:
            m.memory.warp_net.weight.copy_(0.3 * torch.randn(m.memory.warp_net.weight.shape,
                                                             generator=g))
            m.memory.warp_flow.pointwise_weight.copy_(
                0.2 * torch.randn(m.memory.warp_flow.pointwise_weight.shape, generator=g))
    x = ids(2, 7)
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["tensor_memory"]
    assert (stored["update"], stored["window"], stored["dynamics"], stored["flow"]) == (
        "local", 2, "warp", True)
    loaded = hf.from_pretrained(tmp_path)
    options = hf.memory_of(loaded).memories[0].memory.config
    assert (options.update, options.window, options.dynamics, options.flow) == (
        "local", 2, "warp", True)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, expected)
        plain = make_model("llama")
        hf.attach_memory(plain, memory_channels=2, memory_shape=(2, 3, 2), chunk_size=3,
                         zero_init=False, gate_init=1.0)
        plain.load_state_dict({k: v for k, v in loaded.state_dict().items()
                               if ".warp_" not in k})
        assert not torch.equal(plain(x).logits, expected)  # the options matter here
    for key, value, error in (("window", 0, ValueError), ("dynamics", "spin", ValueError),
                              ("flow", 1, TypeError), ("update", "dense", ValueError)):
        config = json.loads((tmp_path / "config.json").read_text())
        config["tensor_memory"][key] = value
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(config))
        (bad / "model.safetensors").symlink_to(tmp_path / "model.safetensors")
        with pytest.raises(error, match=f"tensor_memory.*{key}"):
            hf.from_pretrained(bad)


def test_a_config_missing_a_layer_field_is_refused(tmp_path):
    """Every field is stored and read back (LayerConfig.from_dict): a config without the
    layer options (written before they existed) is refused, naming them."""
    model, _ = with_memory("gpt2")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("update", "window", "dynamics", "flow"):
        del config["tensor_memory"][key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor_memory: missing keys \['update', 'window', "
                                         r"'dynamics', 'flow'\]"):
        hf.from_pretrained(tmp_path)


# --------------------------------------------------------------------------- training machinery


def _checkpointing(model, on, reentrant=False):
    """transformers' activation checkpointing (its newer name where it has one)."""
    if on:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={
                "use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
                "use_reentrant": reentrant})
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def _grads(model, x):
    model.zero_grad()
    model(x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_the_memory_with_exact_gradients(reentrant):
    model, memory = with_memory("llama")
    model.double().train()
    x = ids(2, 9)
    expected = _grads(model, x)
    _checkpointing(model, True, reentrant)
    got = _grads(model, x)
    assert sorted(got) == sorted(expected)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12, msg=name)

    # the memory's activations are not kept: bytes saved for the backward with memory
    # minus without memory, checkpointed, are a small part of the same difference
    # without checkpointing
    def saved_bytes(m):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(x, labels=x)
        return total[0]

    with_ckpt = saved_bytes(model)
    _checkpointing(model, False)
    without_ckpt = saved_bytes(model)
    handle_state = model.config.tensor_memory
    hf.detach_memory(model)
    base_plain = saved_bytes(model)
    _checkpointing(model, True, reentrant)
    base_ckpt = saved_bytes(model)
    assert handle_state["chunk_size"] == 3
    assert with_ckpt - base_ckpt < 0.25 * (without_ckpt - base_plain)


def test_torch_compile_fullgraph_has_no_graph_break():
    model, _ = with_memory("llama")
    x = ids(2, 8)
    with torch.no_grad():
        expected = model(x, use_cache=False).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(x, use_cache=False).logits
    assert (got - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_output_hidden_states_include_the_memory_whenever_attached(family):
    """Old main: asking for hidden states before attaching installed transformers' recording
    hooks first, so they missed the memory while the logits had it."""
    model = make_model(family)
    x = ids(1, 6)
    with torch.no_grad():
        model(x, output_hidden_states=True)  # transformers installs its recording hooks
        hf.attach_memory(model, memory_channels=2, memory_shape=(2, 2), chunk_size=2,
                         zero_init=False, gate_init=2.0)
        seen = {}
        blocks = model.transformer.h if family == "gpt2" else model.model.layers
        hook = blocks[1].register_forward_pre_hook(
            lambda m, args: seen.setdefault("input", args[0]))
        out = model(x, output_hidden_states=True)
        hook.remove()
    assert torch.equal(out.hidden_states[1], seen["input"])  # block 0's output, memory in


def test_blocks_not_found_and_bad_arguments_are_clear_errors():
    model = make_model("llama")
    with pytest.raises(TypeError, match="model"):
        hf.attach_memory(nn.Linear(2, 2), memory_channels=2, memory_shape=(2,), chunk_size=2)
    with pytest.raises(ValueError, match="blocks"):
        hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2,
                         blocks="model.norm")
    layers = model.model.layers
    del model.model.layers
    with pytest.raises(ValueError, match="could not find the decoder blocks"):
        hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2)
    model.model.layers = layers
    hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2)
    with pytest.raises(ValueError, match="already has a Tensor Memory"):
        hf.attach_memory(model, memory_channels=2, memory_shape=(2,), chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size"):
        hf.attach_memory(make_model("gpt2"), memory_channels=2, memory_shape=(2,),
                         chunk_size=0)
