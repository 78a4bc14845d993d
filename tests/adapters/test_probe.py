"""tmcore.adapters.torch.probe: the traced reads, states and read sizes are the layer's own
(a bare residual, a Hugging Face model with attached memory), the shapes, and clear errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
from torch import nn  # noqa: E402

from tmcore.adapters.torch import MemoryResidual, TensorMemory  # noqa: E402
from tmcore.adapters.torch.probe import plot, trace  # noqa: E402

F64 = torch.float64


def _residual(chunk_size: int = 3, **kw) -> MemoryResidual:
    torch.manual_seed(0)
    memory = TensorMemory(8, 2, (3, 2, 4), chunk_size, dtype=F64, forget_bias=1.0, **kw)
    return MemoryResidual(memory, gate_init=0.7)


@pytest.mark.parametrize("tokens, stream", [(9, True), (10, False), (4, True)])
def test_reads_states_and_sizes_are_the_layers(tokens, stream):
    residual = _residual(chunk_size=1 if tokens == 4 else 3)
    x = torch.randn(2, tokens, 8, dtype=F64)
    h0 = torch.randn(2, 2, 3, 2, 4, dtype=F64)
    state = (h0, torch.randn_like(h0))
    outs = []
    handle = residual.memory.register_forward_hook(lambda m, a, out: outs.append(out))
    (y, new), traces = trace(residual, lambda: residual(x, state, stream=stream))
    handle.remove()
    (tr,) = traces
    size = residual.memory.chunk_size
    chunks = -(-tokens // size)
    assert tr.read_coords.shape == tr.write_coords.shape == (2, chunks, 3)
    assert tr.sigma.shape == tr.h_norm.shape == tr.c_norm.shape == (2, chunks)
    assert tr.content.shape == tr.reads.shape == (2, chunks, 2)
    assert tr.read_rms.shape == tr.stream_rms.shape == (2, tokens)
    assert bool((tr.read_coords.abs() < 1).all()) and bool((tr.sigma > 0).all())
    # the reads, read out and spread over their chunks, are the memory's output
    out = residual.memory.out_proj(tr.reads).repeat_interleave(size, 1)[:, :tokens]
    torch.testing.assert_close(out, outs[0][0], rtol=1e-12, atol=1e-12)
    h, c = new[:2]
    torch.testing.assert_close(tr.h_norm[:, -1], h.flatten(1).norm(dim=1))
    torch.testing.assert_close(tr.c_norm[:, -1], c.flatten(1).norm(dim=1))
    assert tr.gate == pytest.approx(float(torch.sigmoid(torch.tensor(0.7))))
    torch.testing.assert_close(tr.read_rms, (y - x).square().mean(-1).sqrt())
    torch.testing.assert_close(tr.stream_rms, x.square().mean(-1).sqrt())


def test_a_hugging_face_model_with_attached_memory():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from tmcore.adapters import hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    memory = hf.attach_memory(model, memory_channels=2, memory_shape=(2, 2, 2), chunk_size=2,
                              zero_init=False, gate_init=-1.0)
    ids = torch.randint(0, 40, (3, 8))
    cache = transformers.DynamicCache(config=model.config)
    _, traces = trace(model, lambda: model(input_ids=ids, cache=cache, use_cache=True))
    assert len(traces) == 2
    for tr, state in zip(traces, memory.state_of(cache), strict=True):
        assert tr.read_coords.shape == (3, 4, 3) and tr.read_rms.shape == (3, 8)
        torch.testing.assert_close(tr.h_norm[:, -1], state.h.flatten(1).norm(dim=1))
        assert tr.gate == pytest.approx(float(torch.sigmoid(torch.tensor(-1.0))))
        assert bool((tr.read_rms > 0).all())
    assert not any(m._forward_pre_hooks for m in memory.memories)  # the hooks are gone


def test_what_the_probe_does_not_recompute_is_refused():
    with pytest.raises(ValueError, match="model: holds no TensorMemory"):
        trace(nn.Linear(2, 2), lambda: None)
    residual = _residual()
    x = torch.randn(1, 6, 8, dtype=F64)
    with pytest.raises(ValueError, match="run: called memory 0 2 times"):
        trace(residual, lambda: (residual(x), residual(x)))
    with pytest.raises(ValueError, match="run: called memory 0 0 times"):
        trace(residual, lambda: None)
    with pytest.raises(ValueError, match="reset"):
        trace(residual, lambda: residual(x, reset=torch.tensor([True])))
    with pytest.raises(ValueError, match="unfinished chunk"):
        trace(residual, lambda: residual(x[:, :5]))
    _, state = residual(x[:, :5])
    with pytest.raises(ValueError, match="state: a StreamState with an unfinished chunk"):
        trace(residual, lambda: residual(x[:, :3], state))
    local = _residual(update="local", window=1)
    with pytest.raises(ValueError, match="update='local'"):
        trace(local, lambda: local(x))
    assert not residual.memory._forward_pre_hooks and not residual._forward_pre_hooks


def test_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    residual = _residual()
    x = torch.randn(2, 6, 8, dtype=F64)
    _, traces = trace(residual, lambda: residual(x))
    path = tmp_path / "probe.png"
    plot(traces * 2, path, row=1, title="two layers")
    assert path.stat().st_size > 1000
