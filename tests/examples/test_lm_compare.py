"""examples/lm comparison: every model is causal, linear attention is right, the WikiText-2
loader reads its files, a run is deterministic, and render writes the table and plot."""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tqdm")

from examples.lm import compare  # noqa: E402
from examples.lm.baselines import MODELS, CompareLM, ModelSizes, linear_attention  # noqa: E402
from examples.lm.data import pydoc_split, wikitext_split  # noqa: E402

SIZES = ModelSizes(width=16, layers=2, heads=2, window=5, segment=6, memory_channels=2,
                   memory_shape=(2, 2, 2), chunk_size=4, linear_chunk=4)


@pytest.mark.parametrize("kind", MODELS)
def test_whole_model_is_causal(kind):
    torch.manual_seed(0)
    model = CompareLM(kind, SIZES).double().eval()
    tokens = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(tokens)
        for p in (1, 7, 13, 22):
            changed = tokens.clone()
            changed[:, p] = (changed[:, p] + 17) % 256
            out = model(changed)
            assert torch.equal(out[:, :p], base[:, :p]), (kind, p)
            assert not torch.equal(out[:, p:], base[:, p:]), (kind, p)  # p itself does count


def test_window_and_xl_limit_what_they_see():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 0] += 1
    for kind, reach in (("window", SIZES.window), ("full", 24)):
        model = CompareLM(kind, dataclasses.replace(SIZES, layers=1)).double().eval()
        with torch.no_grad():
            diff = (model(tokens) - model(changed)).abs().amax(dim=(0, 2))
        assert (diff[reach:] == 0).all() and (diff[:reach] > 0).all(), kind
    # XL, one layer: segment 1 (tokens 6..11) sees segment 0's cache, segment 2 does not
    model = CompareLM("xl", dataclasses.replace(SIZES, layers=1)).double().eval()
    with torch.no_grad():
        diff = (model(tokens) - model(changed)).abs().amax(dim=(0, 2))
    assert (diff[:12] > 0).all() and (diff[12:] == 0).all()


def test_linear_attention_matches_the_quadratic_form():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 11, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    scores = (phi_q @ phi_k.transpose(-1, -2)).tril()
    expected = (scores @ v) / (scores.sum(-1, keepdim=True) + 1e-6)
    for chunk in (1, 4, 11, 16):
        assert torch.allclose(linear_attention(q, k, v, chunk), expected, atol=1e-12)


def test_wikitext_loader_reads_a_fixture(tmp_path):
    texts = {"wiki.train.raw": " = Title = \n hello world \n", "wiki.valid.raw": " valid é\n",
             "wiki.test.raw": " test <unk> \n"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    parts = wikitext_split(tmp_path)
    assert bytes(parts["train"].tolist()) == texts["wiki.train.raw"].encode()
    assert bytes(parts["valid"].tolist()).decode() == " valid é\n"
    assert parts["test"].dtype == torch.long and int(parts["valid"].max()) > 127
    (tmp_path / "wiki.test.raw").unlink()
    with pytest.raises(ValueError, match="wiki.test.raw"):
        wikitext_split(tmp_path)
    with pytest.raises(ValueError, match="data"):
        wikitext_split(tmp_path / "missing")


def test_pydoc_split_is_disjoint_and_deduplicated():
    from pydoc_data.topics import topics

    train, held = pydoc_split()
    train_text, held_text = bytes(train.tolist()).decode(), bytes(held.tolist()).decode()
    assert 0 < held.numel() < train.numel() / 5
    unique = set(topics.values())
    assert len(train_text) + len(held_text) == sum(map(len, unique)) + 2 * (len(unique) - 2)
    for text in unique:
        assert (text in train_text) != (text in held_text) or len(text) < 200


def test_tiny_run_is_deterministic_and_renders(tmp_path):
    config = dataclasses.replace(compare.SCALES["tiny"], steps=2, eval_tokens=256,
                                 models=("window", "window+memory"), seeds=(0, 1))
    records = [compare.run_one(kind, seed, config, None, "cpu", 1, False)
               for kind in config.models for seed in config.seeds]
    again = compare.run_one("window+memory", 1, config, None, "cpu", 1, False)
    assert again["perplexity"] == records[-1]["perplexity"]
    assert again["bits_per_byte"] == records[-1]["bits_per_byte"]
    assert records[0]["perplexity"] != records[1]["perplexity"]  # the seed matters
    result = compare.build_results(records, config, "cmd", "pydoc", 1, "cpu", 1.0,
                                   {"commit": "abc", "dirty": False})
    assert [r["model"] for r in result["rows"]] == ["window", "window+memory"]
    assert result["rows"][1]["seeds"] == [records[2]["perplexity"], records[3]["perplexity"]]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.json").write_text(json.dumps(result))
    assert compare.render(tmp_path / "results", tmp_path / "figures", "x")
    assert not compare.render(tmp_path / "results", tmp_path / "figures", "x", check=True)
    assert (tmp_path / "figures" / "x.png").stat().st_size > 0
    assert " ± " in (tmp_path / "results" / "x.md").read_text()
    assert compare.CompareConfig.from_dict(result["config"]) == config


def test_committed_results_match_the_readme_and_table():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    results = root / "examples" / "lm" / "results"
    if not (results / "compare.json").is_file():
        pytest.skip("no committed examples/lm/results/compare.json")
    result = json.loads((results / "compare.json").read_text())
    assert len(result["seeds"]) >= 3 and all(len(r["seeds"]) == len(result["seeds"])
                                             for r in result["rows"])
    text = compare.markdown(result, "compare")
    assert (results / "compare.md").read_text() == text  # else: python -m examples.lm render
    table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    assert table in (root / "docs" / "guides" / "experiments.md").read_text()
