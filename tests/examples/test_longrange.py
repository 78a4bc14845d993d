"""examples/longrange: the task generator, the window that really blocks, equal state sizes,
the baselines' streaming and state reset, a tiny end-to-end run and the committed results
rendered into the README."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                    "'tmcore[hf]')")
pytest.importorskip("matplotlib", reason="the example's plots need matplotlib")

from examples.longrange import __main__ as cli  # noqa: E402
from examples.longrange import render  # noqa: E402
from examples.longrange.models import ROWS, ModelConfig, build, state_sizes  # noqa: E402
from examples.longrange.task import (  # noqa: E402
    ASK,
    IGNORE,
    PAD,
    PASS,
    QUERY,
    Vocab,
    kv_example,
    make_batch,
    mixture_batch,
    passkey_example,
    reach,
    sequence_length,
)
from examples.longrange.train import Config, eval_batches, run  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


VOCAB = Vocab()


# --------------------------------------------------------------------------- the task


@pytest.mark.parametrize("keys, distance", [(1, 1), (3, 5), (8, 8), (8, 40)])
def test_kv_example_asks_for_a_written_fact_at_the_exact_distance(keys, distance):
    g = torch.Generator().manual_seed(keys * 100 + distance)
    length = sequence_length(40, 8, VOCAB.digits)
    for _ in range(20):
        tokens, tags, targets = kv_example(VOCAB, keys, distance, length, g)
        assert len(tokens) == len(tags) == len(targets) == length
        assert tags[-1] == QUERY and targets[-1] != IGNORE
        assert sum(t != IGNORE for t in targets) == 1  # no extra questions at evaluation
        fact = length - 1 - distance
        assert tokens[fact] == tokens[-1] and tags[fact] == targets[-1]
        facts = [i for i, t in enumerate(tags) if VOCAB.value0 <= t < VOCAB.place0]
        assert len(facts) == keys and fact in facts
        assert len({tokens[i] for i in facts}) == keys  # distinct keys
        assert facts == list(range(facts[0], facts[0] + keys))  # written together
        assert all(VOCAB.filler0 <= t for i, t in enumerate(tokens[1:facts[0]], 1))


def test_kv_extra_questions_answer_from_the_facts():
    g = torch.Generator().manual_seed(0)
    tokens, tags, targets = kv_example(VOCAB, 4, 60, 70, g, extra_every=2)
    facts = {tokens[i]: tags[i] for i, t in enumerate(tags) if VOCAB.value0 <= t < VOCAB.place0}
    asked = [i for i, t in enumerate(targets) if t != IGNORE]
    assert len(asked) > 5
    assert all(tags[i] == QUERY and facts[tokens[i]] == targets[i] for i in asked)


def test_passkey_questions_sit_at_the_distance_of_their_digit():
    g = torch.Generator().manual_seed(1)
    p, distance, length = VOCAB.digits, 17, 40
    tokens, tags, targets = passkey_example(VOCAB, distance, length, g)
    questions = [i for i, t in enumerate(targets) if t != IGNORE]
    assert questions == list(range(length - p, length))
    assert tokens[length - p - distance - 1] == PASS
    for q in questions:
        assert tags[q] == ASK and tokens[q - distance] == tokens[q]  # the same place token
        assert tags[q - distance] == targets[q]                        # its digit
        assert VOCAB.digit0 <= targets[q] < VOCAB.filler0
    with pytest.raises(ValueError, match="distance"):
        passkey_example(VOCAB, p - 1, length, g)
    with pytest.raises(ValueError, match="distance"):
        kv_example(VOCAB, 4, 3, length, g)
    with pytest.raises(ValueError, match="too short"):
        kv_example(VOCAB, 4, 30, 20, g)


def test_batches_have_the_shapes_and_the_mixture():
    g = torch.Generator().manual_seed(2)
    length = sequence_length(64, 8, VOCAB.digits)
    batch = mixture_batch(VOCAB, 16, 8, 64, 4, length, g, extra_every=8)
    assert batch.tokens.shape == batch.tags.shape == batch.targets.shape == (16, length)
    assert batch.kinds.count("passkey") == 4
    assert all(1 <= n <= 8 for n, k in zip(batch.keys, batch.kinds, strict=True) if k == "kv")
    assert int(batch.tokens.max()) < VOCAB.size and int(batch.tags.max()) < VOCAB.size
    again = mixture_batch(VOCAB, 16, 8, 64, 4, length, torch.Generator().manual_seed(2),
                          extra_every=8)
    assert torch.equal(batch.tokens, again.tokens) and torch.equal(batch.tags, again.tags)
    fixed = make_batch(VOCAB, [("kv", 2, 9), ("passkey", 0, 9)], length,
                       torch.Generator().manual_seed(3))
    assert fixed.distances == [9, 9] and fixed.keys == [2, 0]


def test_evaluation_splits_are_fixed_and_differ():
    task = Config().task
    a, b = eval_batches(task, 5), eval_batches(task, 5)
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0].tokens, eval_batches(task, 6)[0].tokens)
    assert sum(x.tokens.shape[0] for x in a) == task.eval_examples * len(
        {(k, n, d) for x in a for k, n, d in zip(x.kinds, x.keys, x.distances, strict=True)})


# --------------------------------------------------------------------------- the window


def _influence(built, q: int = 23, length: int = 24, reset_every: int | None = None
               ) -> list[int]:
    """Distances r at which changing the token at q - r changes the logits at q."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(5, 60, (1, length), generator=g)
    built.model.eval()
    with torch.no_grad():
        base = built.forward(x, reset_every=reset_every)[0, q]
        seen = []
        for r in range(1, q + 1):
            y = x.clone()
            y[0, q - r] = 5 + (int(y[0, q - r]) - 4) % 55
            if not torch.equal(built.forward(y, reset_every=reset_every)[0, q], base):
                seen.append(r)
    return seen


def _live(built) -> None:
    """Give every memory a non-zero read-out (they start at zero: an exact identity)."""
    with torch.no_grad():
        for module in built.model.modules():
            if hasattr(module, "out_proj") and module is not built.model:
                torch.nn.init.normal_(module.out_proj.weight)


@pytest.mark.parametrize("layers, placement", [(1, "after"), (2, "after"), (2, "before")])
def test_the_window_really_blocks_what_lies_beyond_its_reach(layers, placement):
    config = ModelConfig(hidden=16, heads=2, intermediate=32, window=4, layers=layers,
                         memory_channels=2, memory_shape=(2, 2, 2), delta_heads=1,
                         placement=placement)
    window = build("window", config, 60, 0)
    assert _influence(window) == list(range(1, reach(4, layers) + 1))
    assert _influence(build("full", config, 60, 0)) == list(range(1, 24))
    xl = build("xl", config, 60, 0)
    cache = state_sizes(config)["xl"]["tokens"]
    assert _influence(xl) == list(range(1, layers * (4 + cache - 1) + 1))
    assert _influence(xl, reset_every=4) == list(range(1, reach(4, layers) + 1))  # no cache
    for row in ("tensor_memory", "lstm", "delta"):
        built = build(row, config, 60, 0)
        assert _influence(built) == list(range(1, reach(4, layers) + 1)), row  # zero_init
        _live(built)
        assert _influence(built) == list(range(1, 24)), row


@pytest.mark.parametrize("row, placement", [("tensor_memory", "after"),
                                            ("tensor_memory", "before"), ("lstm", "after"),
                                            ("delta", "after")])
def test_state_reset_cuts_everything_before_the_segment(row, placement):
    config = ModelConfig(hidden=16, heads=2, intermediate=32, window=4, layers=1,
                         memory_channels=2, memory_shape=(2, 2, 2), delta_heads=1,
                         placement=placement)
    built = build(row, config, 60, 0)
    _live(built)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(5, 60, (2, 24), generator=g)
    y = x.clone()
    # q = 23 is in the segment 20..23, whose block outputs attend back to 17: with the
    # state reset at 20, nothing before 17 can reach q
    y[:, :17] = torch.randint(5, 60, (2, 17), generator=g)
    with torch.no_grad():
        assert not torch.equal(built.forward(x)[:, 23], built.forward(y)[:, 23])
        assert torch.equal(built.forward(x, reset_every=4)[:, 23],
                           built.forward(y, reset_every=4)[:, 23])


# --------------------------------------------------------------------------- equal state


def test_every_carried_state_holds_as_many_numbers_as_tensor_memorys():
    for config in (ModelConfig(), ModelConfig(memory_channels=8, delta_heads=4)):
        sizes = state_sizes(config)
        tm = sizes["tensor_memory"]["numbers"]
        assert tm == 2 * config.memory_channels * math.prod(config.memory_shape)
        for row in ("lstm", "delta", "xl"):
            assert sizes[row]["numbers"] == tm, (row, sizes[row])
    config = ModelConfig()
    sizes = state_sizes(config)
    x = torch.randint(5, 60, (3, 10))
    from transformers import DynamicCache

    for row in ("tensor_memory", "lstm", "delta"):
        built = build(row, config, 60, 0)
        assert built.numbers == sizes[row]["numbers"]
        cache = DynamicCache(config=built.model.config)
        with torch.no_grad():
            built.model(input_ids=x, cache=cache, use_cache=True)
        if row == "tensor_memory":
            states = built.handle.state_of(cache)
            carried = [s.h.numel() + s.c.numel() for s in states]
        else:
            states = cache._longrange_state[1]
            carried = [sum(t.numel() for t in (s if isinstance(s, tuple) else (s,)))
                       for s in states]
        assert carried == [3 * sizes[row]["numbers"]] * config.layers, row
    xl = build("xl", config, 60, 0)
    assert xl.model.config.longrange_xl_cache * 2 * config.hidden == sizes["xl"]["numbers"]


@pytest.mark.parametrize("row", ["lstm", "delta", "tensor_memory"])
def test_streaming_in_pieces_equals_one_call(row):
    from transformers import DynamicCache

    config = ModelConfig(hidden=16, heads=2, intermediate=32, window=4, memory_channels=2,
                         memory_shape=(2, 2, 2), delta_heads=1)
    built = build(row, config, 60, 0)
    _live(built)
    x = torch.randint(5, 60, (2, 15))
    model = built.model.eval()
    with torch.no_grad():
        whole = model(input_ids=x, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        pieces = [model(input_ids=x[:, a:b], cache=cache, use_cache=True).logits
                  for a, b in ((0, 4), (4, 5), (5, 11), (11, 15))]
    assert torch.allclose(torch.cat(pieces, 1), whole, atol=1e-5)


# --------------------------------------------------------------------------- the run


def test_tiny_run_writes_a_results_file(tmp_path):
    out = tmp_path / "recall.json"
    cli.main(["run", "--tiny", "--no-progress", "--out", str(out)])
    results = json.loads(out.read_text())
    assert {"command", "commit", "config", "rows", "tuning", "state_sizes", "environment",
            "settings", "reach"} <= set(results)
    assert list(results["rows"]) == list(ROWS)
    for row, data in results["rows"].items():
        assert len(data["seeds"]) == len(Config.tiny().seeds)
        for entry in data["seeds"]:
            assert set(entry["accuracy"]) == set(results["settings"])
            assert all(0 <= v <= 1 for v in entry["accuracy"].values())
            assert ("reset" in entry) == (row not in ("window", "full"))
        assert len(results["tuning"][row]["points"]) == len(Config.tiny().train.lrs)
    text = render.tables(results)
    assert all(data["label"] in text for data in results["rows"].values())


def test_a_rerun_gives_the_same_numbers():
    config = replace(Config.tiny(), rows=("window", "delta"))
    a = run(config, progress=False, log=lambda *_: None)
    b = run(config, progress=False, log=lambda *_: None)
    for row in config.rows:
        for x, y in zip(a["rows"][row]["seeds"], b["rows"][row]["seeds"], strict=True):
            assert x["accuracy"] == y["accuracy"] and x["loss_curve"] == y["loss_curve"]


def test_committed_results_have_every_row_with_three_seeds():
    results = json.loads(cli.RESULTS.read_text())
    assert results["commit"] and results["command"].startswith("python -m examples.longrange run")
    assert list(results["rows"]) == list(ROWS)
    assert results["environment"]["torch_threads"] == 1
    for row, data in results["rows"].items():
        assert [s["seed"] for s in data["seeds"]] == [0, 1, 2], row
        assert data["carried_per_layer"] == results["state_sizes"][row]["numbers"]
    assert results["config"]["train"]["steps"] == Config().train.steps
    cost = json.loads(cli.COST.read_text())
    assert {r["row"] for r in cost["rows"]} >= {"full", "window", "tensor_memory"}
    assert all(r["tokens"] == 16384 for r in cost["rows"])
    for name in ("recall.png", "cost.png"):
        assert (cli.HERE / "results" / name).stat().st_size > 0


def test_committed_results_render_into_the_pages(tmp_path):
    copies = []
    for page in render.PAGES:
        copy = tmp_path / page.name
        shutil.copy(page, copy)
        copies.append(copy)
        assert "<!-- longrange: " in page.read_text(), page
    assert render.render_all(check=True, pages=copies) == [], "README is stale: render it"
    named = render.blocks(json.loads(cli.RESULTS.read_text()), json.loads(cli.COST.read_text()),
                          json.loads(cli.SEARCH.read_text()))
    readme = render.PAGES[0].read_text()
    for name in ("distance", "keys", "passkey", "grid", "tuning", "cost", "search",
                 "search-best", "search-tuning"):
        assert named[name] in readme, name
    tampered = tmp_path / "tampered.md"  # one number inside a block no longer the file's
    tampered.write_text(readme.replace("32.5 ± 5.0 |", "33.5 ± 5.0 |", 1))
    assert tampered.read_text() != readme
    assert render.render_all(check=True, pages=[tampered]) == [str(tampered)]
    assert tampered.read_text() != readme  # --check does not rewrite
    bad = tmp_path / "bad.md"
    bad.write_text("<!-- longrange: nothing -->\nx\n<!-- /longrange -->\n")
    with pytest.raises(SystemExit, match="nothing"):
        render.render_all(check=True, pages=[bad])
    assert PAD == 0


# --------------------------------------------------------------------------- the search


TINY_MODEL = ModelConfig(hidden=16, heads=2, intermediate=32, window=4, memory_channels=2,
                         memory_shape=(2, 2, 2), delta_heads=1)


def test_the_memory_sits_before_the_attention_and_its_write_may_start_as_the_identity():
    built = build("tensor_memory", replace(TINY_MODEL, placement="before",
                                           write_init="identity"), 60, 0)
    blocks = built.model.model.layers
    assert [b.tensor_memory for b in blocks] == built.handle.memories
    for memory in built.handle.memories:
        proj = memory.memory.write_proj
        assert torch.equal(proj.weight, torch.eye(16)) and not proj.bias.any()
    seen = []
    hook = blocks[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["hidden_states"]), with_kwargs=True)
    _live(built)
    x = torch.randint(5, 60, (2, 6))
    with torch.no_grad():
        built.forward(x)
    hook.remove()
    # the attention of block 0 sees the memory's read: its input is not the plain norm
    embeds = built.embed(x)
    assert not torch.allclose(seen[0], blocks[0].input_layernorm(embeds))
    with pytest.raises(ValueError, match="placement"):
        build("tensor_memory", replace(TINY_MODEL, placement="middle"), 60, 0)
    kept = build("tensor_memory", replace(TINY_MODEL, input_bias=-3.0), 60, 0, retention=5.0)
    for memory in kept.handle.memories:  # gates i, f, o, g: a quarter each
        assert memory.memory.cell.pointwise_bias.tolist() == [-3.0] * 2 + [5.0] * 2 + [0.0] * 4


def test_a_memory_learning_rate_of_its_own():
    from examples.longrange.train import train

    config = replace(Config.tiny(), model=TINY_MODEL)
    config = replace(config, train=replace(config.train, memory_lr_scale=0.0,
                                           memory_weight_decay=0.0))
    built = build("tensor_memory", config.model, config.task.vocab.size, 0)
    memory = {id(p) for p in built.memory_parameters()}
    before = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    train(built, config, 1e-2, 0, 3)
    changed = {n for n, p in built.model.named_parameters() if not torch.equal(p, before[n])}
    names = {n for n, p in built.model.named_parameters() if id(p) in memory}
    assert names and all(".tensor_memory." in n for n in names)
    assert not changed & names           # the memory's rate is 0 (and no decay): unchanged
    assert changed                        # the rest trained


def test_eta_squared_is_the_keys_share_of_the_variance():
    from examples.longrange.addressing import eta_squared

    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    centres = torch.tensor([[0.0, 1.0], [1.0, 0.0], [-1.0, -1.0]])
    assert eta_squared(centres[groups], groups) == pytest.approx(1.0)
    noise = torch.tensor([[0.1, 0.0], [-0.1, 0.0]] * 3)
    within = 0.01 * 2 * 3  # sum of squares around each group's mean
    between = float((centres - centres.mean(0)).square().sum()) * 2
    assert eta_squared(centres[groups] + noise, groups) == pytest.approx(
        between / (between + within))
    assert eta_squared(torch.ones(4, 3), torch.tensor([0, 1, 0, 1])) == 0.0


def test_the_addressing_measures_of_a_tiny_model():
    from examples.longrange.addressing import measures

    task = Config.tiny().task
    built = build("tensor_memory", TINY_MODEL, task.vocab.size, 0)
    out = measures(built, eval_batches(task, 3), task.vocab)
    assert len(out) == TINY_MODEL.layers
    for layer in out:
        assert 0 <= layer["eta2_write"] <= 1 and 0 <= layer["eta2_read"] <= 1
        assert 0 <= layer["nearest"] <= 1 and layer["nearest_chance"] == pytest.approx(0.5)
        assert layer["sigma_facts"] > 0 and layer["sigma_filler"] > 0
        assert layer["read_ratio"] == 0.0 and layer["gate"] == 0.5  # zero_init: reads 0


def test_the_oracle_addresses_by_key_and_the_probe_sees_it():
    from examples.longrange.addressing import measures

    task = Config.tiny().task
    built = build("tensor_memory", replace(TINY_MODEL, addressing="oracle"),
                  task.vocab.size, 0)
    cells = built.oracle.cells
    assert len({tuple(c.tolist()) for c in cells}) == 8 and cells.abs().max() == 1
    for layer in measures(built, eval_batches(task, 3), task.vocab):
        assert layer["eta2_write"] == layer["eta2_read"] == 1.0 and layer["nearest"] == 1.0
    learned = build("tensor_memory", TINY_MODEL, task.vocab.size, 0)
    _live(built)
    _live(learned)
    learned.model.load_state_dict(built.model.state_dict())
    batch = eval_batches(task, 3)[0]
    with torch.no_grad():  # the same weights: only the addresses differ
        assert not torch.allclose(built.forward(batch.tokens, batch.tags),
                                  learned.forward(batch.tokens, batch.tags))
        assert torch.equal(built.forward(batch.tokens), learned.forward(batch.tokens))


def test_the_best_variant_is_chosen_on_validation_among_complete_ones():
    def variant(validation: float, seeds: list[int], steps: int = 800) -> dict:
        return {"points": [{"validation_mean": validation}],
                "config": {"seeds": [0, 1, 2], "train": {"steps": steps}},
                "seeds": [{"seed": s} for s in seeds]}

    search = {"variants": {"a": variant(0.2, [0, 1, 2]), "b": variant(0.3, [0, 1, 2]),
                           "one_seed": variant(0.9, [0]),
                           "longer": variant(0.5, [0, 1, 2], steps=3200)}}
    assert render.best_variant(search) == "longer"
    # at the baselines' budget, a longer-trained variant is not eligible
    assert render.best_variant(search, steps=800) == "b"
    committed = json.loads(cli.SEARCH.read_text())
    best = render.best_variant(committed)
    assert len(committed["variants"][best]["seeds"]) == 3
    assert all(len(v["seeds"]) < 3 or max(p["validation_mean"] for p in v["points"])
               <= max(p["validation_mean"] for p in committed["variants"][best]["points"])
               for v in committed["variants"].values())


def test_a_tiny_search_writes_and_resumes(tmp_path):
    from examples.longrange.search import VARIANTS, search

    out = tmp_path / "search.json"
    names = ["default", "before", "lstm_long"]
    search(names, Config.tiny(), out, plots=tmp_path, plot_names=("before",),
           log=lambda *_: None)
    results = json.loads(out.read_text())
    assert list(results["variants"]) == names
    for name in names:
        entry = results["variants"][name]
        assert entry["row"] == VARIANTS[name].row and entry["commit"]
        assert [s["seed"] for s in entry["seeds"]] == list(Config.tiny().seeds)
        assert len(entry["points"]) == len(Config.tiny().train.lrs)
        assert ("measures" in entry["seeds"][0]) == (entry["row"] == "tensor_memory")
    assert results["variants"]["lstm_long"]["config"]["train"]["steps"] == 4 * 3
    assert (tmp_path / "probe_before.png").stat().st_size > 0
    done = []
    again = search(names, Config.tiny(), out, log=done.append)
    assert not [line for line in done if "seed" in line]  # nothing trained again
    assert again["variants"] == results["variants"]
    text = render.search_table(again, None)
    assert "`before`" in text and "`lstm_long`" in text
