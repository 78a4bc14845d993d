"""A model saved with memory loads anywhere transformers' Auto classes load (issue 50, item 8):
``AutoModelForCausalLM.from_pretrained`` gives it back with its memory (logits equal),
``pipeline("text-generation")`` runs it, and what cannot be restored is refused."""

from __future__ import annotations

import json

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


def make_model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                         **COMMON)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, **COMMON)
    return transformers.LlamaForCausalLM(config).eval()


def ids(batch: int, tokens: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_auto_model_from_pretrained_comes_back_with_its_memory(family, tmp_path):
    """Old main: the plain Auto load silently dropped the memory (logits off by 1.23)."""
    model = make_model(family)
    hf.attach_memory(model, **MEMORY)
    x = ids(2, 8)
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["model_type"] == hf.MODEL_TYPE
    assert stored["base_model_type"] == family and "tensor_memory" in stored
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.memory_of(loaded) is not None
    assert isinstance(loaded, type(model))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, expected)
        cached = loaded.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
        reference = model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(cached, reference)
    # hf.from_pretrained reads the same folder (the model's own class, memory attached)
    again = hf.from_pretrained(tmp_path)
    assert type(again) is type(model)
    with torch.no_grad():
        assert torch.equal(again(x).logits, expected)
    # detaching gives back the base config: saved again, a plain model
    hf.detach_memory(model)
    assert type(model.config) is type(make_model(family).config)
    model.save_pretrained(tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert plain["model_type"] == family and "tensor_memory" not in plain
    assert hf.memory_of(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "plain")) is None


def _tokenizer():
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="<pad>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")


def test_a_pipeline_runs_the_model_loaded_with_its_memory(tmp_path):
    model = make_model("llama")
    hf.attach_memory(model, **MEMORY)
    tokenizer = _tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompt = "w5 w9 w11 w20 w7"
    generator = transformers.pipeline("text-generation", model=str(tmp_path))
    assert hf.memory_of(generator.model) is not None
    out = generator(prompt, max_new_tokens=4, do_sample=False, return_full_text=False)
    x = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        tokens = model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out[0]["generated_text"].split() == tokenizer.decode(
        tokens[0, x.shape[1]:]).split()


def test_what_cannot_be_restored_is_refused(tmp_path):
    model = make_model("llama")
    hf.attach_memory(model, **MEMORY)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())

    def variant(name, change=None, weights=True):
        folder = tmp_path / name
        folder.mkdir()
        edited = json.loads(json.dumps(config))
        if change:
            change(edited)
        (folder / "config.json").write_text(json.dumps(edited))
        if weights:
            (folder / "model.safetensors").symlink_to(tmp_path / "model.safetensors")
        return folder

    auto = transformers.AutoModelForCausalLM
    with pytest.raises(ValueError, match="tensor_memory"):
        auto.from_pretrained(variant("no-spec", lambda c: c.pop("tensor_memory")))
    with pytest.raises(ValueError, match="base_model_type"):
        auto.from_pretrained(variant("no-base", lambda c: c.pop("base_model_type")))
    with pytest.raises(ValueError, match="tensor_memory.chunk_size|chunk_size"):
        auto.from_pretrained(variant("bad", lambda c: c["tensor_memory"].update(chunk_size=0)))
    # weights without the memory's: refused, not initialized at random
    from safetensors.torch import load_file, save_file

    folder = variant("no-memory-weights", weights=False)
    tensors = {k: v.contiguous() for k, v in load_file(tmp_path / "model.safetensors").items()
               if ".tensor_memory." not in k}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="memory cannot be restored"):
        auto.from_pretrained(folder)


def test_a_config_saved_before_the_model_type_still_loads_with_hf_from_pretrained(tmp_path):
    """Checkpoints written with the base model_type and tensor_memory (earlier 0.2.0 dev)."""
    model = make_model("gpt2")
    hf.attach_memory(model, **MEMORY)
    x = ids(1, 6)
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = config.pop("base_model_type")
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = hf.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, expected)


@pytest.mark.parametrize("loader", ["hf", "auto"])
def test_an_edited_chunk_size_is_refused_before_any_block_is_built(tmp_path, loader):
    """A few bytes of config.json (chunk_size 10**6) are compared with the saved weights'
    shapes (safetensors headers) before anything is built: no gigabytes, no minutes."""
    import json
    import resource

    transformers = pytest.importorskip("transformers")
    from tmcore.adapters import hf

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    hf.attach_memory(model, memory_channels=4, memory_shape=(4, 4, 4), chunk_size=4)
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    stored = json.loads(path.read_text())
    stored[hf.CONFIG_KEY]["chunk_size"] = 10**6
    path.write_text(json.dumps(stored))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    load = (hf.from_pretrained if loader == "hf"
            else transformers.AutoModelForCausalLM.from_pretrained)
    with pytest.raises(ValueError, match=r"write_proj.weight has shape .*\(nothing was built\)"):
        load(tmp_path)
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
    assert grew_mib < 100, grew_mib


@pytest.mark.parametrize("loader", ["hf", "auto", "auto-config"])
def test_a_million_layers_in_config_json_are_refused_before_any_is_built(tmp_path, loader):
    """``num_hidden_layers: 10**6`` against the 2 blocks the memory config records: refused
    naming both before the model is built (it was built first: minutes, gigabytes)."""
    import resource

    model = make_model("llama")
    hf.attach_memory(model, **MEMORY)
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    stored = json.loads(path.read_text())
    stored["num_hidden_layers"] = 10**6
    path.write_text(json.dumps(stored))
    load = {"hf": hf.from_pretrained,
            "auto": transformers.AutoModelForCausalLM.from_pretrained,
            "auto-config": lambda p: transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(p))}[loader]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"num_hidden_layers: the config asks for 1000000 "
                                         r"decoder layers, its tensor_memory records 2 blocks"):
        load(tmp_path)
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
    assert grew_mib < 100, grew_mib


def test_the_format_version_is_an_int_and_the_base_type_a_real_one(tmp_path):
    """``format: true`` or ``2.0`` passed as the version (``True == 1``, ``2.0 == 2``), and
    ``base_model_type: "tensor_memory"`` was reported as "got None"."""
    model = make_model("llama")
    hf.attach_memory(model, **MEMORY)
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    for value in (True, 2.0, "2"):
        with pytest.raises(ValueError, match=rf"tensor_memory.format: expected the int 2, "
                                             rf"got {value!r}"):
            hf.check_spec({**stored["tensor_memory"], "format": value})
    path = tmp_path / "config.json"
    for value in ("tensor_memory", 7):
        path.write_text(json.dumps({**stored, "base_model_type": value}))
        with pytest.raises(ValueError, match=rf"base_model_type: .* got {value!r}"):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


HEADS = ["AutoModelForSequenceClassification", "AutoModelForTokenClassification",
         "AutoModelForQuestionAnswering"]


def _head_outputs(out):
    return [t for t in (getattr(out, k, None) for k in ("logits", "start_logits",
                                                        "end_logits")) if t is not None]


@pytest.mark.parametrize("auto_name", HEADS)
def test_another_head_loads_with_its_auto_class_and_its_memory(auto_name, tmp_path):
    """``AutoModelForSequenceClassification.from_pretrained`` of a head saved with memory
    raised ("Unrecognized configuration class TensorMemoryLlamaConfig"), likewise for the
    token-classification and question-answering heads; the causal LMs still load."""
    auto = getattr(transformers, auto_name)
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64,
                                      num_labels=3, **COMMON)
    torch.manual_seed(0)
    head = auto.from_config(config).eval()
    hf.attach_memory(head, **MEMORY)
    x = ids(2, 7)
    with torch.no_grad():
        expected = _head_outputs(head(input_ids=x))
    head.save_pretrained(tmp_path)
    loaded = auto.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, type(head)) and hf.memory_of(loaded) is not None
    with torch.no_grad():
        got = _head_outputs(loaded(input_ids=x))
    assert len(got) == len(expected) and all(map(torch.equal, got, expected))
    causal = make_model("llama")
    hf.attach_memory(causal, **MEMORY)
    causal.save_pretrained(tmp_path / "causal")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "causal")
    assert isinstance(back, transformers.LlamaForCausalLM)


def test_a_new_process_loads_a_head_with_its_memory_through_the_auto_class(tmp_path):
    """What a user does: save in one process, load in another with the Auto class of the
    head (registered from the saved config, no attach call in that process)."""
    import subprocess
    import sys

    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64,
                                      num_labels=3, **COMMON)
    torch.manual_seed(0)
    head = transformers.LlamaForSequenceClassification(config).eval()
    hf.attach_memory(head, **MEMORY)
    x = ids(2, 7)
    with torch.no_grad():
        torch.save({"x": x, "logits": head(input_ids=x).logits}, tmp_path / "expected.pt")
    head.save_pretrained(tmp_path / "model")
    script = (
        "import torch, transformers\n"
        "import tmcore.adapters.hf as hf\n"
        f"e = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        f"m = transformers.AutoModelForSequenceClassification.from_pretrained("
        f"{str(tmp_path / 'model')!r}).eval()\n"
        "assert hf.memory_of(m) is not None\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(m(input_ids=e['x']).logits, e['logits'])\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def _memories(model):
    return sum(1 for name, _ in model.named_modules() if name.endswith(".tensor_memory"))


def test_auto_model_reads_a_causal_lm_checkpoint_with_its_memory(tmp_path):
    """``AutoModel.from_pretrained`` of a causal LM saved with memory (the backbone, as for
    any transformers checkpoint) raised; a head loaded from it gets one memory per block
    (its body is built without a second one), and a backbone saved with memory loads
    back as a causal LM (the blocks' path moves by the base model prefix both ways)."""
    model = make_model("llama")
    hf.attach_memory(model, **MEMORY)
    x = ids(2, 7)
    with torch.no_grad():
        hidden = model.model(input_ids=x).last_hidden_state
    model.save_pretrained(tmp_path)
    backbone = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(backbone, transformers.LlamaModel) and hf.memory_of(backbone) is not None
    assert _memories(backbone) == 2
    with torch.no_grad():
        assert torch.equal(backbone(input_ids=x).last_hidden_state, hidden)
    head = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert _memories(head) == 2
    # hf.from_pretrained likewise (it raised: 'model.layers' is not ... of LlamaModel)
    plain = hf.from_pretrained(tmp_path, model_class=transformers.AutoModel).eval()
    assert type(plain) is transformers.LlamaModel and _memories(plain) == 2
    with torch.no_grad():
        assert torch.equal(plain(input_ids=x).last_hidden_state, hidden)
    backbone.save_pretrained(tmp_path / "backbone")
    causal = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "backbone").eval()
    assert _memories(causal) == 2
    again = hf.from_pretrained(tmp_path / "backbone", model_class=transformers.LlamaForCausalLM)
    for loaded in (causal, again.eval()):
        assert _memories(loaded) == 2
        with torch.no_grad():
            assert torch.equal(loaded.model(input_ids=x).last_hidden_state, hidden)
