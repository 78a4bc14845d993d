"""examples/lm: token-by-token decoding (KV cache + memory stream state) equals teacher forcing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from examples.lm.model import LMConfig, TinyLM, cache_bytes, generate  # noqa: E402


def _model(**kw):
    torch.manual_seed(0)
    config = LMConfig(width=32, layers=2, heads=4, memory_shape=(3, 3, 3), chunk_size=4, **kw)
    return TinyLM(config).double().eval()


@pytest.mark.parametrize("kw", [{}, {"window": 6}, {"memory": False}],
                         ids=["memory", "window+memory", "no-memory"])
def test_decoded_logits_equal_teacher_forced(kw):
    model = _model(**kw)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (2, 7), generator=gen)
    tokens, logits = generate(model, prompt, 13, temperature=1.0, generator=gen)
    with torch.no_grad():
        forced, _ = model(torch.cat([prompt, tokens[:, :-1]], dim=1))
    assert (forced[:, 6:] - logits).abs().max().item() < 1e-10


def test_ragged_prefill_pieces_equal_one_call():
    model = _model(window=5)
    text = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(text)
        cache, parts, i = None, [], 0
        for n in (3, 1, 9, 2, 8):
            out, cache = model(text[:, i:i + n], cache)
            parts.append(out)
            i += n
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-10
    # the sliding window keeps window - 1 keys; the memory state is fixed-size
    assert cache[0].k.shape[2] == 4
    assert cache_bytes(cache) == cache_bytes(model(text[:, :5])[1])  # does not grow


def test_model_is_causal():
    model = _model()
    text = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base, _ = model(text)
        for p in (0, 5, 13):
            changed = text.clone()
            changed[0, p] = (changed[0, p] + 1) % 256
            out, _ = model(changed)
            assert torch.equal(out[:, :p], base[:, :p])
            assert not torch.equal(out[:, p], base[:, p])


def test_generate_cli_runs():
    from examples.lm.generate import corpus, main

    assert corpus().numel() > 100_000  # CPython's help topics, bundled with Python
    text = main(["--steps", "1", "--tokens", "3", "--window", "8"])
    assert isinstance(text, str)


def test_readme_generation_table_is_rendered_from_results():
    import json
    from pathlib import Path

    from benchmarks.generation import RESULTS, table

    result = json.loads(Path(RESULTS).read_text())
    readme = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "streaming.md").read_text()
    assert result["command"].startswith("python -m benchmarks.generation") and result["commit"]
    assert table(result) in readme
