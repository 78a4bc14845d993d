"""The authors' toy models (``--authors-exact``), the collapse sweep and the full-size sweep.

Each test pins one difference the audit in examples/diagnostics/README.md lists between
the suite's backbone and the authors' scripts: no positional information in binding,
the summed type / key / value embedding, the non-causal slots and threaded Tensor Memory
state, the occlusion read-out from the final frame's mean, the wide baseline's MLP.
Tiny shapes only.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the diagnostics need PyTorch")
pytest.importorskip("matplotlib", reason="the diagnostics need matplotlib")
pytest.importorskip("rich", reason="the diagnostics need rich")

from examples.diagnostics.authors import WIDE_MLP_RATIO, build_authors_model  # noqa: E402
from examples.diagnostics.config import ModelConfig  # noqa: E402
from examples.diagnostics.models import build_model  # noqa: E402
from examples.diagnostics.runner import (  # noqa: E402
    AUTHORS_EXACT,
    make_experiment,
    results_stem,
    run_experiment,
)
from examples.diagnostics.tasks import CoordinateBinding, MapBuilding  # noqa: E402
from examples.diagnostics.tasks.occlusion import OcclusionFinalFrame  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CFG = ModelConfig(d_model=16, n_layers=2, n_heads=2, segment=None, memory_channels=2,
                  memory_shape=(3, 3, 3), n_slots=4, dropout=0.1, max_len=32)


def _binding(writes: int = 5) -> tuple[CoordinateBinding, torch.Tensor]:
    task = CoordinateBinding(writes=(writes,), n_values=8, n_queries=2, noises=())
    batch = task.batch(np.random.default_rng(0), 3, {"writes": writes, "noise": 0.0})
    return task, torch.from_numpy(batch.inputs)


def _model(kind: str, task, cfg: ModelConfig = CFG, **kw):
    torch.manual_seed(0)
    return build_authors_model(kind, task, cfg, **kw).eval()


def test_authors_binding_has_no_positional_information():
    """One block, no positions: a query's output is the same whatever the order of the
    writes before it. The suite's backbone (learned positions) depends on the order."""
    task, x = _binding()
    perm = torch.tensor([3, 0, 4, 1, 2, 5, 6])  # writes shuffled, queries in place
    one = replace(CFG, n_layers=1)
    exact = _model("transformer", task, one)
    with torch.no_grad():
        a, b = exact(x)[:, 5:], exact(x[:, perm])[:, 5:]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    ours = build_model("transformer", task.in_features, task.n_classes, one).eval()
    with torch.no_grad():
        assert not torch.allclose(ours(x)[:, 5:], ours(x[:, perm])[:, 5:], atol=1e-4)


def test_authors_binding_embedding_sums_type_key_and_value():
    """A write is type(0) + key map + value embedding, a query type(1) + key map; the
    embeddings are ``nn.Embedding``'s N(0, 1) (the suite's one linear map starts with
    entries below 1 / sqrt(F))."""
    task, x = _binding()
    model = _model("transformer", task)
    emb = model.embed
    with torch.no_grad():
        out = emb(x)
        value = x[0, 0, 5:].argmax()
        want = emb.type_emb.weight[0] + emb.coord(x[0, 0, 2:5]) + emb.value_emb.weight[value]
        torch.testing.assert_close(out[0, 0], want)
        query = emb.type_emb.weight[1] + emb.coord(x[0, 5, 2:5])
        torch.testing.assert_close(out[0, 5], query)
    assert 0.6 < float(emb.value_emb.weight.detach().std()) < 1.4
    ours = build_model("transformer", task.in_features, task.n_classes, CFG)
    assert float(ours.embed.weight.detach().abs().max()) <= task.in_features ** -0.5


@pytest.mark.parametrize("kind, threaded, sees_later", [
    ("transformer", True, False), ("memory_slots", True, True),
    ("tensor_memory", True, True), ("tensor_memory", False, False)])
def test_what_a_position_of_the_authors_models_sees(kind, threaded, sees_later):
    """The authors' slots (written from every token) and their threaded Tensor Memory
    state (one block's final state starts the next) let position 0 see the last token;
    their transformer and the causal Tensor Memory (``threaded=False``) do not."""
    task, x = _binding()
    model = _model(kind, task, threaded=threaded)
    changed = x.clone()
    changed[:, -1, 2:5] = -changed[:, -1, 2:5] + 0.3
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert not torch.allclose(a[:, -1], b[:, -1])  # the changed token itself
    assert torch.allclose(a[:, 0], b[:, 0], atol=1e-6) != sees_later


def test_authors_tensor_memory_is_one_shared_layer_with_a_gate_per_block():
    task, _ = _binding()
    model = _model("tensor_memory", task)
    shared = model.shared
    assert all(b.memory.memory is shared for b in model.blocks)
    assert model.gate_values() == [0.5, 0.5]
    names = [n for n, _ in model.named_parameters()]
    assert sum(n.endswith("sigma_net.bias") for n in names) == 1  # listed once
    assert float(shared.sigma_net.bias.detach()) == 1.0
    c = CFG.memory_channels
    assert torch.all(shared.cell.pointwise_bias[c:2 * c] == 0)  # forget bias 0
    assert model.carried_numbers() == 2 * c * 27


def test_authors_wide_baseline_widens_the_mlp():
    task, _ = _binding()
    wide = _model("transformer_wide", task)
    assert wide.blocks[0].mlp[0].out_features == int(CFG.d_model * WIDE_MLP_RATIO)
    assert _model("transformer", task).blocks[0].mlp[0].out_features == 4 * CFG.d_model


def test_authors_occlusion_reads_the_mean_of_the_final_frame():
    task = OcclusionFinalFrame(lengths=(0,), frames=3, frame_size=4, patch=2)
    x = torch.from_numpy(task.batch(np.random.default_rng(0), 2, {"occluded": 0}).inputs)
    model = _model("transformer", task)
    seen = {}
    model.ln_f.register_forward_hook(lambda m, i, out: seen.update(h=out))
    with torch.no_grad():
        logits = model(x)
        want = model.head(seen["h"][:, -task.tokens_per_frame:].mean(1))
    torch.testing.assert_close(logits[:, -1], want)


def test_authors_map_positions_start_at_zero():
    task = MapBuilding(horizons=(4,), grid=4, n_queries=1)
    model = _model("transformer", task)
    assert torch.all(model.embed.pos == 0)


def test_authors_exact_experiment_and_its_label():
    exp = make_experiment("binding", "tiny", protocol="paper", authors_exact=True)
    assert exp.protocol == AUTHORS_EXACT == "paper-exact"
    assert [e.label for e in exp.entries] == ["transformer", "transformer_wide",
                                              "memory_slots", "tensor_memory",
                                              "tensor_memory (causal)"]
    assert all(e.variant["authors_exact"] for e in exp.entries)
    with pytest.raises(ValueError, match="authors_exact"):
        make_experiment("binding", "tiny", protocol="streaming", authors_exact=True)
    assert results_stem("binding", "paper", "full") == "binding-paper-full"
    assert results_stem("binding", "paper", "cpu") == "binding-paper"


def test_collapse_rows_train_their_budgets_and_record_their_cost(tmp_path):
    from examples.diagnostics.render import markdown

    exp = make_experiment("collapse", "tiny", seeds=(0,), protocol="paper", steps=6)
    exp.entries = [replace(e, train_overrides={"steps": s}) for e, s in
                   zip(exp.entries, (2, 4, 6, 2, 4, 6), strict=True)]
    result = run_experiment(exp, tmp_path, progress=False)
    assert (tmp_path / "collapse-paper.json").exists()
    labels = [e.label for e in exp.entries]  # "<kind>, <budget> steps" (CPU budgets)
    assert labels[0].startswith("transformer, ") and labels[3].startswith("tensor_memory, ")
    steps = {r["model"]: r["steps"] for r in result["runs"]}
    assert [steps[label] for label in labels] == [2, 4, 6, 2, 4, 6]
    assert all(r["train_seconds"] > 0 for r in result["runs"])
    cost = result["cost"][labels[4]]["W=4"]
    assert len(cost["ms_per_step"]) == 1 and cost["ms_per_step"][0] > 0
    text = markdown("collapse-paper", json.loads(json.dumps(result)))
    assert "ms per training step" in text
    assert f"ratio {labels[3]} / {labels[0]}" in text


def test_sweep_parts_and_estimate(tmp_path):
    from examples.diagnostics.render import markdown
    from examples.diagnostics.sweep import estimate_sweep, sweep_experiments

    parts = sweep_experiments(scale="tiny", seeds=(0,))
    assert [p.name for p, _ in parts] == ["binding", "binding-exact", "collapse", "mapping",
                                          "occlusion"]
    full = dict((p.name, e) for p, e in sweep_experiments(("binding", "collapse")))
    assert full["binding"].scale == "full" and full["binding"].train.steps == 2000
    assert full["binding"].train.seeds == (0, 1, 2)
    assert sorted({s["writes"] for s in full["collapse"].task.eval_settings}) == [20, 50, 100,
                                                                                  200]
    with pytest.raises(ValueError, match="parts"):
        sweep_experiments(("nope",))
    picked = sweep_experiments(("binding-exact", "collapse"), models=("transformer",))
    assert [[e.label for e in exp.entries] for _, exp in picked] == [
        ["transformer"], ["transformer, 500 steps", "transformer, 2000 steps",
                          "transformer, 4000 steps"]]
    noise0 = dict((p.name, e) for p, e in sweep_experiments(("binding-exact", "collapse"),
                                                           noises=(0.0,)))
    assert {s["noise"] for s in noise0["binding-exact"].task.eval_settings} == {0.0}
    assert [s["writes"] for s in noise0["binding-exact"].task.eval_settings] == [5, 10, 20, 50]
    assert (noise0["collapse"].task.eval_settings
            == full["collapse"].task.eval_settings)  # a part without noise settings: as is
    with pytest.raises(ValueError, match="noises"):
        sweep_experiments(("binding",), noises=(0.3,))
    l6 = sweep_experiments(("occlusion", "mapping"), settings=("L=6",))
    assert l6[1][1].task.eval_settings == [{"occluded": 6}]
    assert len(l6[0][1].task.eval_settings) == 3  # mapping has no L=6: kept as is
    with pytest.raises(ValueError, match="settings"):
        sweep_experiments(("occlusion",), settings=("L=7",))
    est = estimate_sweep(tmp_path, parts=("binding-exact",), scale="tiny", seeds=(0,),
                         steps=1)
    assert (tmp_path / "sweep-estimate.json").exists()
    assert {r["model"] for r in est["rows"]} >= {"transformer", "tensor_memory (causal)"}
    assert est["cpu_hours_total"] >= 0 and all(r["ms_per_step"] > 0 for r in est["rows"])
    assert "CPU hours by part" in markdown("sweep-estimate", est)


def test_collapse_verdict_names_the_smallest_budget_beyond_the_seed_spread():
    from examples.diagnostics.report import collapse_verdict

    def row(model, setting, seeds, reset=()):
        return {"model": model, "setting": setting, "seeds": seeds, "reset": list(reset)}

    result = {"config": {"task": {"budgets": [500, 2000]}}, "settings": ["W=20", "W=50"],
              "rows": [row("transformer, 500 steps", "W=20", [50.0, 52.0, 54.0]),
                       row("tensor_memory, 500 steps", "W=20", [51.0, 53.0, 55.0]),
                       row("transformer, 2000 steps", "W=20", [60.0, 61.0, 62.0]),
                       row("tensor_memory, 2000 steps", "W=20", [70.0, 71.0, 72.0],
                           reset=[69.0, 70.0, 71.0]),
                       row("transformer, 500 steps", "W=50", [10.0, 30.0, 50.0]),
                       row("tensor_memory, 500 steps", "W=50", [40.0, 40.0, 40.0]),
                       row("transformer, 2000 steps", "W=50", [90.0, 90.0, 90.0]),
                       row("tensor_memory, 2000 steps", "W=50", [80.0, 80.0, 80.0])]}
    lines = collapse_verdict(result)
    assert lines[0].startswith("W=20: Tensor Memory ahead") and "2000 steps (+10.0" in lines[0]
    # the lead that is left with the state reset: here most of it, so not the memory's
    assert lines[0].endswith("(+10.0 points; +9.0 with its state reset every token)")
    assert lines[1].startswith("W=50: Tensor Memory is never ahead")  # +10 < spread 20
    assert lines[1].endswith("at the budgets compared (500, 2000 steps)")
    assert lines[2] == "smallest such setting: W=20 at 2000 steps"
    assert collapse_verdict({"config": {"task": {}}, "rows": [], "settings": []}) == []
    # a partial sweep: a setting whose rows have not both run is named as not compared
    partial = {**result, "settings": ["W=20", "W=100"],
               "rows": [*result["rows"][:4],
                        row("transformer, 500 steps", "W=100", [6.0, 16.0, 15.0])]}
    lines = collapse_verdict(partial)
    assert lines[1] == "W=100: not compared yet (no budget has >= 2 seeds of both rows)"


@pytest.mark.parametrize("name", ["mapping", "occlusion"])
def test_authors_exact_runs_the_other_paper_tasks(name, tmp_path):
    exp = make_experiment(name, "tiny", seeds=(0,), steps=3, protocol="paper",
                          authors_exact=True)
    exp.entries = [e for e in exp.entries if e.label in ("transformer", "tensor_memory")]
    exp.task.eval_settings = exp.task.eval_settings[:1]
    result = run_experiment(exp, tmp_path, progress=False)
    assert (tmp_path / f"{name}-paper-exact.json").exists()
    assert {r["model"] for r in result["rows"]} == {"transformer", "tensor_memory"}
    tm = next(r for r in result["rows"] if r["model"] == "tensor_memory")
    assert tm["reset"] and result["carried"]["tensor_memory"] > 0


@pytest.mark.parametrize(("part", "selection"), [
    ("collapse", {"settings": ("W=50",)}),  # a shorter stream than the part's longest
    ("collapse", {"settings": ("W=20", "W=100"), "models": ("tensor_memory, 500 steps",)}),
    ("binding", {"noises": (0.0,), "models": ("transformer",)}),
    ("occlusion", {"settings": ("L=2",)}),
])
def test_a_sweep_selection_runs_jobs_of_the_whole_part(part, selection):
    """``--settings`` / ``--noises`` / ``--models`` only select: each job they run has the
    key (and so the model, positional table included) of the same job in the whole part,
    so a later run or assembly without them reuses it."""
    from examples.diagnostics.jobstore import job_key
    from examples.diagnostics.runner import experiment_jobs
    from examples.diagnostics.sweep import sweep_experiments

    def keys(**kw):
        (_, exp), = sweep_experiments((part,), seeds=(0,), **kw)
        return {job_key(job): job.model.max_len for job in experiment_jobs(exp)}

    whole, picked = keys(), keys(**selection)
    assert picked and len(picked) < len(whole)
    assert set(picked) <= set(whole), (
        f"max_len {set(picked.values())} vs the part's {set(whole.values())}")
