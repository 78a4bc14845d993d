"""Smoke tests of the diagnostic suite (examples/diagnostics) at a tiny scale.

Each task trains its backbones for a few steps on minute inputs; the tests
check that losses are finite, that training lowers the loss, that the JSON
and PNG outputs exist with the expected keys, and that the table is printed.
The segment tests check the fair-comparison setting: attention never sees an
earlier segment, the memories' state does, and carrying the state segment by
segment equals one streamed call of the memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the diagnostics need PyTorch")
pytest.importorskip("matplotlib", reason="the diagnostics need matplotlib")
pytest.importorskip("rich", reason="the diagnostics need rich")

from examples.diagnostics.__main__ import main  # noqa: E402
from examples.diagnostics.runner import make_experiment, run_experiment  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, like the CLI's default: these tiny ops are far slower with two
    threads on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


RESULT_KEYS = {"task", "protocol", "scale", "command", "commit", "dirty", "config",
               "environment", "settings", "window_ceiling", "seeds", "rows", "runs"}


def _check_result(result: dict, out_dir) -> None:
    assert RESULT_KEYS <= result.keys()
    path = out_dir / f"{result['task']}-{result['protocol']}.json"
    on_disk = json.loads(path.read_text())
    assert RESULT_KEYS <= on_disk.keys()
    assert on_disk["rows"] == result["rows"]
    assert path.with_suffix(".png").stat().st_size > 0
    for run in result["runs"]:
        assert run["loss_curve"], run["model"]
        assert all(math.isfinite(loss) for _, loss in run["loss_curve"]), run["model"]
        assert set(run["accuracy"]) <= set(result["settings"])
        assert all(0.0 <= a <= 1.0 for a in run["accuracy"].values())
    for row in result["rows"]:
        assert len(row["seeds"]) == len(result["seeds"])
        assert all(0.0 <= v <= 100.0 for v in row["seeds"] + row["reset"])
    assert set(result["window_ceiling"]) == set(result["settings"])


@pytest.mark.parametrize("name, protocol", [("mapping", "paper"), ("mapping", "streaming"),
                                            ("occlusion", "paper"), ("occlusion", "streaming"),
                                            ("ablations", "streaming")])
def test_task_runs_and_writes_outputs(name, protocol, tmp_path, capsys):
    exp = make_experiment(name, "tiny", protocol=protocol)
    exp.entries = exp.entries[:2] if name == "ablations" else exp.entries
    result = run_experiment(exp, tmp_path, progress=False)
    _check_result(result, tmp_path)
    per_row = len(exp.task.eval_settings) if exp.per_setting else 1
    assert len(result["runs"]) == len(exp.entries) * per_row
    printed = capsys.readouterr().out
    assert f"{name}, protocol {protocol}" in printed
    # the ablations train on binding but must never overwrite binding's results
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [f"{name}-{protocol}.json"]


def test_noharm_training_lowers_the_loss(tmp_path):
    exp = make_experiment("noharm", "tiny", seeds=(0,), steps=30)
    exp.entries = [e for e in exp.entries if e.kind in ("transformer", "tensor_memory")]
    result = run_experiment(exp, tmp_path, progress=False)
    _check_result(result, tmp_path)
    for run in result["runs"]:
        losses = [loss for _, loss in run["loss_curve"]]
        assert np.mean(losses[-3:]) < 0.8 * losses[0], (run["model"], losses)
    tm = next(r for r in result["runs"] if r["model"] == "tensor_memory")
    assert all(0.0 < g < 1.0 for _, gates in tm["gate_curve"] for g in gates)


def test_demo_runs_both_protocols(tmp_path, capsys):
    """``make demo`` at tiny scale: binding under both protocols, results files with the
    command, the commit and per-seed rows, and both tables printed."""
    assert main(["demo", "--tiny", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "protocol paper" in printed and "protocol streaming" in printed
    assert "window ceiling" in printed
    for protocol in ("paper", "streaming"):
        result = json.loads((tmp_path / f"binding-{protocol}.json").read_text())
        _check_result(result, tmp_path)
        assert result["protocol"] == protocol
        assert result["command"].startswith("python -m examples.diagnostics demo")
        assert result["commit"] is None or len(result["commit"]) == 40
    paper = json.loads((tmp_path / "binding-paper.json").read_text())
    assert paper["config"]["model"]["segment"] is None and paper["config"]["per_setting"]
    assert set(paper["window_ceiling"].values()) == {100.0}
    streaming = json.loads((tmp_path / "binding-streaming.json").read_text())
    models = {r["model"] for r in streaming["rows"]}
    assert {"sliding_window", "transformer_xl", "lstm_memory", "memory_slots",
            "tensor_memory"} <= models
    assert (tmp_path / "binding-streaming-memory.png").stat().st_size > 0


def test_same_seed_same_numbers(tmp_path):
    """Item 5: two runs of the same seed give identical numbers, inline or in 2 worker
    processes (each job pins its threads, deterministic algorithms, seeded data)."""
    def run(jobs: int, out, cache=None) -> dict:
        exp = make_experiment("binding", "tiny", seeds=(0,), steps=12)
        exp.entries = [e for e in exp.entries
                       if e.kind in ("transformer_xl", "memory_slots", "tensor_memory")]
        return run_experiment(exp, out, progress=False, jobs=jobs, cache=cache)

    def curves(result: dict) -> list:  # as JSON (a cached run comes back from JSON)
        return json.loads(json.dumps([r["loss_curve"] for r in result["runs"]]))

    first, second = run(1, tmp_path / "a", tmp_path / "cache"), run(1, tmp_path / "b")
    assert first["rows"] == second["rows"]
    assert curves(first) == curves(second)
    parallel = run(2, tmp_path / "c")
    assert curves(parallel) == curves(first)
    assert parallel["environment"]["threads"] == 1
    # --cache: the finished jobs are reused as they were (an interrupted run resumes)
    assert len(list((tmp_path / "cache").glob("*.json"))) == 3
    resumed = run(1, tmp_path / "d", tmp_path / "cache")
    assert resumed["rows"] == first["rows"] and curves(resumed) == curves(first)


def test_results_file_is_a_job_store(tmp_path, monkeypatch):
    """A run records each job's key; ``resume`` reuses the jobs of the results file it
    replaces (the store that survives a fresh checkout) and trains only the others, and
    ``cached_only`` assembles the file's jobs without a cache folder."""
    from examples.diagnostics import runner
    from examples.diagnostics.jobstore import job_key
    from examples.reporting import cpu_features, cpu_model

    def experiment():
        exp = make_experiment("binding", "tiny", seeds=(0, 1), steps=6, protocol="paper")
        exp.entries = [e for e in exp.entries if e.kind in ("transformer", "tensor_memory")]
        return exp

    first = run_experiment(experiment(), tmp_path, progress=False)
    path = tmp_path / "binding-paper.json"
    keys = [r["job"] for r in first["runs"]]
    assert len(set(keys)) == len(keys) == 2 * 2 * len(first["settings"])
    assert all(r["ran_at"] == {"commit": first["commit"], "dirty": first["dirty"],
                               "cpu": cpu_model(), **cpu_features()} for r in first["runs"])
    # drop one finished job from the file: only that one is trained again
    stored = json.loads(path.read_text())
    dropped = stored["runs"].pop(3)
    path.write_text(json.dumps(stored))
    trained = []
    real = runner._run_job
    monkeypatch.setattr(runner, "_run_job", lambda job: trained.append(job) or real(job))
    resumed = run_experiment(experiment(), tmp_path, progress=False, resume=True)
    assert [job_key(j) for j in trained] == [dropped["job"]]
    assert resumed["rows"] == first["rows"]
    def curves(result: dict) -> list:  # as JSON (a reused run comes back from JSON)
        return json.loads(json.dumps([r["loss_curve"] for r in result["runs"]]))

    assert curves(resumed) == curves(first)
    # assembling from the file alone: every job is there, nothing is trained
    trained.clear()
    again = run_experiment(experiment(), tmp_path, progress=False, resume=True,
                           cached_only=True)
    assert not trained and again["rows"] == first["rows"]
    # without resume the file is not read: a rerun trains every job
    run_experiment(experiment(), tmp_path, progress=False)
    assert len(trained) == len(keys)


def test_reused_runs_keep_the_cpu_they_ran_on():
    """A file assembled on another machine keeps where its older runs ran: a run whose
    ``ran_at`` does not name the CPU takes the environment of the file it came from, and
    the cost table's caption counts the runs per CPU."""
    from examples.diagnostics.jobstore import _archived_outputs
    from examples.diagnostics.render import runs_cpus

    old_env = {"cpu": "AMD EPYC", "cpu_vector": "AVX2", "cpu_flags": "aaaa", "threads": 1}
    new_place = {"commit": "c2", "dirty": False, "cpu": "Intel Xeon", "cpu_vector": "AVX-512",
                 "cpu_flags": "bbbb"}
    archived = {"environment": old_env, "carried": {"transformer": 0},
                "cached_jobs_ran_at": [{"commit": "c0", "dirty": False}],
                "runs": [{"model": "transformer", "seed": 0, "job": "k0"},
                         {"model": "transformer", "seed": 1, "job": "k1",
                          "ran_at": {"commit": "c1", "dirty": False}},
                         {"model": "transformer", "seed": 2, "job": "k2", "ran_at": new_place},
                         {"model": "transformer", "seed": 3}]}
    outputs = _archived_outputs(archived)
    assert sorted(outputs) == ["k0", "k1", "k2"]  # a run without a key is not a job
    assert outputs["k0"]["ran_at"] == {"commit": "c0", "dirty": False, "cpu": "AMD EPYC",
                                       "cpu_vector": "AVX2", "cpu_flags": "aaaa"}
    assert outputs["k1"]["ran_at"]["cpu"] == "AMD EPYC"
    assert outputs["k2"]["ran_at"] == new_place  # a run that names its CPU keeps it
    assembled = {"environment": {"cpu": "Intel Xeon"},
                 "runs": [{**o["run"], "ran_at": o["ran_at"]} for o in outputs.values()]}
    assert runs_cpus(assembled) == ("AMD EPYC (AVX2) for 2 runs (A), "
                                    "Intel Xeon (AVX-512) for 1 run (B)")
    assert runs_cpus({"environment": {"cpu": "Intel Xeon"}, "runs": [{}]}) == "Intel Xeon"
    single = {"runs": [{"ran_at": new_place}] * 2}
    assert runs_cpus(single) == "Intel Xeon (AVX-512)"


def test_cost_table_marks_where_each_number_ran():
    """A results file from two CPUs marks every cost number with the CPUs its seeds ran
    on, and a ratio of numbers from different CPUs says so; a file from one CPU has no
    marks."""
    from examples.diagnostics.render import cost_marks, runs_cpus
    from examples.diagnostics.report import cost_table

    epyc = {"commit": "c", "cpu": "AMD EPYC", "cpu_vector": "AVX2"}
    xeon = {"commit": "c", "cpu": "Intel Xeon", "cpu_vector": "AVX-512"}

    def run(model: str, seed: int, setting: str, place: dict) -> dict:
        return {"model": model, "seed": seed, "accuracy": {setting: 0.5}, "ran_at": place}

    runs = [run("transformer", s, w, epyc) for s in (0, 1) for w in ("W=5", "W=50")]
    runs += [run("tensor_memory", 0, "W=5", epyc), run("tensor_memory", 0, "W=50", epyc),
             run("tensor_memory", 1, "W=5", epyc), run("tensor_memory", 1, "W=50", xeon)]
    cost = {m: {w: {"seconds": [1.0, 1.0], "ms_per_step": [k, k]} for w in ("W=5", "W=50")}
            for m, k in (("transformer", 10.0), ("tensor_memory", 40.0))}
    result = {"settings": ["W=5", "W=50"], "cost": cost, "config": {"per_setting": True},
              "runs": runs}
    marks = cost_marks(result)
    assert runs_cpus(result) == "AMD EPYC (AVX2) for 7 runs (A), Intel Xeon (AVX-512) for 1 run (B)"
    _, rows = cost_table(result, marks)
    assert rows[0][1:3] == ["10 (A)", "10 (A)"]
    assert rows[1][1:3] == ["40 (A)", "40 (A, B)"]
    assert rows[2][1:3] == ["4.0x", "4.0x (A, B / A)"]
    one_cpu = {**result, "runs": [dict(r, ran_at=epyc) for r in runs]}
    assert cost_marks(one_cpu) == {}
    assert cost_table(one_cpu, cost_marks(one_cpu))[1][2][1:3] == ["4.0x", "4.0x"]


def test_cpu_features_name_the_vector_unit():
    """Results record the CPU's widest vector unit and a hash of its flags: AVX2 and
    AVX-512 machines give different float32 numbers under one model name."""
    from examples.diagnostics.results import environment
    from examples.reporting import cpu_features

    avx2 = cpu_features("model name : AMD EPYC\nflags : fpu sse2 avx avx2 fma\n")
    avx512 = cpu_features("flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n")
    assert avx2["cpu_vector"] == "AVX2" and avx512["cpu_vector"] == "AVX-512"
    assert avx2["cpu_flags"] != avx512["cpu_flags"] and len(avx2["cpu_flags"]) == 12
    assert cpu_features("Features : fp asimd sve\n")["cpu_vector"] == "SVE"
    assert cpu_features("")["cpu_flags"] == "unknown"
    here = cpu_features()
    assert {k: environment(1)[k] for k in here} == here


def test_job_key_ignores_the_runs_seed_list():
    """A job finished by a one-seed run (``--seeds 1``) is the same job in a run over all
    the seeds; the key still tells seeds, settings and configs apart."""
    from examples.diagnostics.jobstore import job_key
    from examples.diagnostics.runner import Job

    exp = make_experiment("binding", "tiny", seeds=(0, 1, 2), steps=6)
    task = exp.task.fixed_to(exp.task.eval_settings[0])

    def key(seed: int, seeds: tuple[int, ...], steps: int = 6) -> str:
        train = replace(exp.train, seeds=seeds, steps=steps)
        return job_key(Job(exp.entries[0], seed, task, train, exp.model, {}, "token"))

    assert key(1, (0, 1, 2)) == key(1, (1,)) == key(1, (1, 2))
    assert len({key(0, (0, 1, 2)), key(1, (0, 1, 2)), key(1, (1,), steps=7)}) == 3


def test_jobs_start_setting_major():
    """Jobs are listed seed-major but started every seed of one (row, setting) first, so
    a sweep stopped part-way leaves complete settings (results stay in job order)."""
    from types import SimpleNamespace

    from examples.diagnostics.runner import _setting_major

    def job(seed: int, row: str, writes: int):
        return SimpleNamespace(seed=seed, entry=SimpleNamespace(label=row),
                               task=SimpleNamespace(eval_settings=[{"writes": writes}]))

    jobs = [job(s, r, n) for s in (0, 1, 2) for r in ("a", "b") for n in (5, 50)]
    started = [(jobs[i].entry.label, jobs[i].task.eval_settings[0]["writes"], jobs[i].seed)
               for i in _setting_major(jobs)]
    assert started == [(r, n, s) for r in ("a", "b") for n in (5, 50) for s in (0, 1, 2)]


def test_committed_readme_tables_equal_the_results_files():
    """Item 4: every README results block is the rendering of its committed results file."""
    from examples.diagnostics.render import READMES, render_files
    from examples.diagnostics.results import RESULTS_DIR, load_results

    found = load_results(RESULTS_DIR)
    for name, result in found.items():
        if result.get("kind") == "tuning":
            assert result["chosen"] and result["rows"], name
            continue
        if result.get("kind") == "estimate":  # the full-size sweep's cost estimate
            assert result["rows"] and result["cpu_hours"], name
            continue
        assert RESULT_KEYS <= result.keys(), name
        assert result["protocol"] in ("paper", "paper-exact", "streaming")
        assert len(result["seeds"]) >= 3, f"{name}: fewer than 3 seeds"
        assert all(len(r["seeds"]) == len(r.get("seed_ids", result["seeds"]))
                   for r in result["rows"])
    assert render_files(check=True) == []
    text = "".join(p.read_text() for p in READMES if p.exists())
    for name in found:
        assert f"<!-- results: {name} -->" in text, f"{name} is not rendered in a README"


def test_render_replaces_a_stale_block():
    from examples.diagnostics.render import render_text

    result = {"task": "binding", "protocol": "streaming", "scale": "cpu", "command": "x",
              "commit": "0" * 40, "dirty": False, "environment": {"threads": 1},
              "config": {"model": {"segment": 8}, "per_setting": False, "reset": "segment"},
              "settings": ["W=8"], "window_ceiling": {"W=8": 52.6}, "seeds": [0, 1],
              "rows": [{"model": "tensor_memory", "setting": "W=8", "seeds": [80.0, 90.0],
                        "reset": [50.0, 52.0]}],
              "params": {"tensor_memory": 10}, "carried": {"tensor_memory": 1024}}
    text = "a\n<!-- results: x -->\nold table\n<!-- /results -->\nb\n"
    out = render_text(text, {"x": result})
    assert "old table" not in out and "85.0 ± 7.1" in out and "2/2" in out
    assert "52.6" in out and out.startswith("a\n") and out.endswith("b\n")
    assert render_text(out, {"x": result}) == out


def test_window_ceiling_of_binding():
    """8 writes + 4 queries in segments of 8: the last segment holds the last 4 writes, so
    half the answers are visible: 0.5 + 0.5 / 16."""
    from examples.diagnostics.tasks import CoordinateBinding

    task = CoordinateBinding(writes=(8,), noises=())
    ceiling = task.window_ceiling({"writes": 8, "noise": 0.0}, 8)
    assert abs(ceiling - (0.5 + 0.5 / 16)) < 0.03
    assert task.window_ceiling({"writes": 8, "noise": 0.0}, None) == 1.0


def test_slot_write_addresses_slots_at_chunk_1():
    """The slots' write at chunk size 1 must not give every slot the same update (the old
    write took a softmax over the chunk's ONE token: every slot became tanh(value))."""
    from examples.diagnostics.slots import SlotMemory

    torch.manual_seed(0)
    memory = SlotMemory(8, 4, 1)
    with torch.no_grad():
        memory.update_gate.bias.fill_(20.0)  # gate ~1: the old write overwrote every slot
    _, slots = memory(torch.randn(1, 1, 8))
    spread = (slots - slots.mean(1, keepdim=True)).abs().max()
    assert spread > 1e-3


def test_lstm_memory_state_and_forget_bias_match_tensor_memory():
    from dataclasses import replace

    from examples.diagnostics.config import ModelConfig
    from examples.diagnostics.models import build_model, carried_numbers

    cfg = replace(ModelConfig(d_model=16, n_layers=2, n_heads=2, memory_channels=2,
                              memory_shape=(3, 3, 3)), segment=4, max_len=12)
    lstm, tm = (build_model(k, 5, 3, cfg) for k in ("lstm_memory", "tensor_memory"))
    xl = build_model("transformer_xl", 5, 3, cfg)
    assert carried_numbers(lstm) == carried_numbers(tm) == cfg.state_numbers() == 108
    assert carried_numbers(xl) <= cfg.state_numbers() < carried_numbers(xl) + 2 * 16
    rnn = lstm.memories()[0].memory.rnn
    hidden = rnn.hidden_size
    assert torch.all(rnn.bias_ih_l0[hidden:2 * hidden] == cfg.forget_bias)
    assert torch.all(rnn.bias_hh_l0[hidden:2 * hidden] == 0.0)


@pytest.mark.parametrize("kind", ["sliding_window", "transformer_xl", "lstm_memory",
                                  "memory_slots", "tensor_memory"])
def test_reset_at_segments_forgets_the_past(kind):
    """``reset="segment"``: nothing of the first segment reaches the last one."""
    x, y = _streams()
    model = _model(kind, 4)
    with torch.no_grad():
        assert float((model(x, reset="segment")[:, -4:]
                      - model(y, reset="segment")[:, -4:]).abs().max()) == 0.0


def test_cached_attention_with_reset_is_the_plain_transformer():
    """Sliding window and XL with their caches reset are the segment-local transformer."""
    x, _ = _streams()
    plain = _model("transformer", 4)
    for kind in ("sliding_window", "transformer_xl"):
        cached = _model(kind, 4)
        cached.load_state_dict(plain.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(cached(x, reset="segment"), plain(x))
            assert float((cached(x) - plain(x)).abs().max()) > 1e-5


def test_variant_layer_matches_the_adapter():
    """The ablation layer computes the adapter's function with the same parameters."""
    adapter = pytest.importorskip("tmcore.adapters.torch", reason="no PyTorch adapter yet")
    from examples.diagnostics.variants import VariantTensorMemory

    torch.manual_seed(0)
    real = adapter.TensorMemory(16, 4, (3, 4, 5), 2).double()
    with torch.no_grad():
        real.cell.depthwise_weight.add_(0.3 * torch.randn_like(real.cell.depthwise_weight))
        real.cell.depthwise_bias.add_(0.3 * torch.randn_like(real.cell.depthwise_bias))
    variant = VariantTensorMemory(16, 4, (3, 4, 5), 2).double()
    # the adapter may keep metadata (``_extra_state``); the parameters must match one to one
    variant.load_state_dict({k: v for k, v in real.state_dict().items()
                             if not k.endswith("_extra_state")})
    x = torch.randn(2, 7, 16, dtype=torch.double)
    out_r, (h_r, c_r) = real(x, stream=False)  # plain (h, c) states, not StreamStates
    out_v, (h_v, c_v) = variant(x, stream=False)
    torch.testing.assert_close(out_v, out_r)
    torch.testing.assert_close(h_v, h_r)
    torch.testing.assert_close(c_v, c_r)


def _variant_pair(**switches):
    """A default variant and a switched one with the same parameters (float64)."""
    from examples.diagnostics.variants import VariantTensorMemory

    torch.manual_seed(1)
    base = VariantTensorMemory(8, 3, (3, 4, 5), 2).double()
    with torch.no_grad():  # non-identity taps, so that the conv switch matters
        base.cell.depthwise_weight.add_(0.3 * torch.randn_like(base.cell.depthwise_weight))
        base.cell.depthwise_bias.add_(0.3 * torch.randn_like(base.cell.depthwise_bias))
    variant = VariantTensorMemory(8, 3, (3, 4, 5), 2, **switches).double()
    variant.load_state_dict(base.state_dict(), strict=False)
    return base, variant


def test_variant_hard_write_puts_content_in_one_cell():
    """``write="hard"``: each written volume is the content in the one nearest cell, and the
    layer's scan with it gives no gradient to the spread head."""
    from examples.diagnostics.variants import hard_write
    from tmcore.types import StepInputs

    shape = (3, 4, 5)
    coords = torch.tensor([[-1.0, -1.0, -1.0], [0.9, -0.2, 0.4], [0.3, 0.99, -0.6]],
                          dtype=torch.double)  # (x, y, z) -> axes (W, H, D)
    content = torch.randn(3, 2, dtype=torch.double)
    inputs = StepInputs(None, coords, torch.full((3,), 0.5, dtype=torch.double), content)
    written = hard_write(inputs, shape)
    assert written.shape == (3, 2, *shape)
    for b in range(3):
        nearest = tuple(int(torch.argmin((torch.linspace(-1, 1, size, dtype=torch.double)
                                          - coords[b, 2 - axis]).abs()))
                        for axis, size in enumerate(shape))
        expected = torch.zeros(2, *shape, dtype=torch.double)
        expected[(slice(None), *nearest)] = content[b]
        assert torch.equal(written[b], expected), (b, nearest)

    base, hard = _variant_pair(write="hard")
    x = torch.randn(2, 7, 8, dtype=torch.double)
    out_g, _ = base(x)
    out_h, _ = hard(x)
    assert float((out_h - out_g).detach().abs().max()) > 1e-6  # the write changed
    out_h.sum().backward()
    grad = hard.sigma_net.weight.grad  # no spread in a hard write: no gradient (None, or
    assert grad is None or not grad.any()  # zeros when the heads run as one fused product)
    assert float(hard.content_net.weight.grad.abs().sum()) > 0


def test_variant_stepwise_scan_equals_memory_scan():
    """The ablations' loop scan with the Gaussian write is tmcore's ``memory_scan``
    (values and gradients), so a hard write changes only the write."""
    from examples.diagnostics.variants import _stepwise_scan, gaussian_write
    from tmcore.adapters.torch import ConvLSTMCell, memory_scan
    from tmcore.types import StepInputs

    torch.manual_seed(2)
    B, T, C, shape = 2, 3, 2, (3, 4, 2)
    cell = ConvLSTMCell(C, 3).double()
    with torch.no_grad():
        cell.depthwise_weight.add_(0.3 * torch.randn_like(cell.depthwise_weight))
    leaves = [torch.randn(B, C, *shape, dtype=torch.double),
              torch.randn(B, C, *shape, dtype=torch.double),
              torch.rand(B, T, 3, dtype=torch.double) * 2 - 1,
              torch.rand(B, T, 3, dtype=torch.double) * 2 - 1,
              torch.rand(B, T, dtype=torch.double) + 0.2,
              torch.randn(B, T, C, dtype=torch.double)]
    leaves = [v.requires_grad_() for v in leaves]
    results = []
    for scan in ("loop", "memory_scan"):
        if scan == "loop":
            got = _stepwise_scan(leaves[0], leaves[1], StepInputs(*leaves[2:]), cell.params(),
                                 gaussian_write(1e-6, None))
        else:
            got = memory_scan(*leaves, cell.params(), eps=1e-6)
        loss = sum((g * w).sum() for g, w in zip(got, (1.0, 0.7, -0.4), strict=True))
        grads = torch.autograd.grad(loss, [*leaves, *cell.parameters()])
        results.append((got, grads))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_variant_untied_heads_have_their_own_write_head():
    """``tied=False``: ``write_coord_net`` is an extra parameter group that sets the write
    coordinates (the reads still use ``coord_net``); equal to the tied layer when it is a
    copy of ``coord_net``."""
    base, untied = _variant_pair(tied=False)
    keys = set(untied.state_dict()) - set(base.state_dict())
    assert keys == {"write_coord_net.weight", "write_coord_net.bias"}
    assert untied.write_coord_net.weight is not untied.coord_net.weight
    x = torch.randn(2, 7, 8, dtype=torch.double)
    with torch.no_grad():
        untied.write_coord_net.load_state_dict(base.coord_net.state_dict())
        out_b, (h_b, _) = base(x, stream=False)
        out_u, (h_u, _) = untied(x, stream=False)
        torch.testing.assert_close(out_u, out_b, rtol=0, atol=0)
        torch.testing.assert_close(h_u, h_b, rtol=0, atol=0)
        untied.write_coord_net.weight.add_(0.5)
        out_u2, (h_u2, _) = untied(x, stream=False)
    assert float((h_u2 - h_b).abs().max()) > 1e-6  # the write head moves the writes
    # the first chunk's read comes before any write: the write head cannot change it
    torch.testing.assert_close(out_u2[:, :2], out_b[:, :2], rtol=0, atol=0)
    assert float((out_u2[:, 2:] - out_b[:, 2:]).abs().max()) > 1e-6
    out_u2 = untied(x)[0]
    out_u2.sum().backward()
    assert float(untied.write_coord_net.weight.grad.abs().sum()) > 0


def test_variant_pointwise_conv_ignores_the_taps():
    """``conv="pointwise"``: the depthwise taps and bias have no effect (and no gradient);
    it equals the factorized layer with identity taps and zero depthwise bias."""
    base, pointwise = _variant_pair(conv="pointwise")
    x = torch.randn(2, 7, 8, dtype=torch.double)
    with torch.no_grad():
        out_p, _ = pointwise(x)
        out_b, _ = base(x)
    assert float((out_p - out_b).abs().max()) > 1e-6  # the random taps matter to the default
    with torch.no_grad():
        base.cell.depthwise_weight.zero_()
        base.cell.depthwise_weight[..., 1] = 1.0
        base.cell.depthwise_bias.zero_()
        pointwise.cell.depthwise_weight.mul_(-2.0)  # ignored
        out_i, (h_i, _) = base(x, stream=False)
    out_p2, (h_p2, _) = pointwise(x, stream=False)
    torch.testing.assert_close(out_p2, out_p, rtol=0, atol=0)
    torch.testing.assert_close(out_p2, out_i)
    torch.testing.assert_close(h_p2, h_i)
    out_p2.sum().backward()
    assert pointwise.cell.depthwise_weight.grad is None
    assert float(pointwise.cell.pointwise_weight.grad.abs().sum()) > 0


def test_variant_switches_are_checked():
    from examples.diagnostics.variants import VariantTensorMemory

    with pytest.raises(ValueError, match="write"):
        VariantTensorMemory(8, 2, (3, 3, 3), 2, write="soft")
    with pytest.raises(ValueError, match="conv"):
        VariantTensorMemory(8, 2, (3, 3, 3), 2, conv="depthwise")
    with pytest.raises(TypeError, match="tied"):
        VariantTensorMemory(8, 2, (3, 3, 3), 2, tied=0)


def _model(kind: str, segment: int | None):
    from dataclasses import replace

    from examples.diagnostics.config import ModelConfig
    from examples.diagnostics.models import build_model

    cfg = replace(ModelConfig(d_model=16, n_layers=2, n_heads=2, memory_channels=2,
                              memory_shape=(3, 3, 3), n_slots=4), segment=segment, max_len=12)
    torch.manual_seed(0)
    return build_model(kind, 5, 3, cfg).eval()


def _streams() -> tuple:
    torch.manual_seed(1)
    x = torch.randn(2, 12, 5)
    y = x.clone()
    y[:, 0] += 1.0
    return x, y


def _final_segment_change(kind: str, segment: int | None) -> float:
    """Max change of the last segment's logits when a token of the FIRST segment changes."""
    model = _model(kind, segment)
    x, y = _streams()
    with torch.no_grad():
        return float((model(x)[:, -4:] - model(y)[:, -4:]).abs().max())


@pytest.mark.parametrize("kind", ["transformer", "transformer_wide", "sliding_window"])
def test_segments_hide_earlier_segments_from_attention(kind):
    """Segments of 4: a plain transformer's last segment cannot see the first one, nor can
    a sliding window of 4 tokens (2 layers reach 6 tokens back, token 0 is 8 back)."""
    assert _final_segment_change(kind, 4) == 0.0
    if kind != "sliding_window":
        assert _final_segment_change(kind, None) > 1e-4  # one full window: it does


@pytest.mark.parametrize("kind", ["memory_slots", "tensor_memory", "lstm_memory"])
def test_memory_state_crosses_segments(kind):
    """The recurrent state carries the first segment into the last one."""
    assert _final_segment_change(kind, 4) > 1e-5


def test_xl_cache_reaches_the_previous_segment():
    """The XL cache (3 tokens here) carries the previous segment's end into the last one."""
    model = _model("transformer_xl", 4)
    x, _ = _streams()
    y = x.clone()
    y[:, 7] += 1.0  # last token of the middle segment
    with torch.no_grad():
        assert float((model(x)[:, -4:] - model(y)[:, -4:]).abs().max()) > 1e-5


def test_segments_equal_streaming_the_memory():
    """In segment mode the memory of block 0 sees the whole stream: streaming its recorded
    input from the zero state in one call reproduces the state the segments reached."""
    from dataclasses import replace

    from examples.diagnostics.config import ModelConfig
    from examples.diagnostics.models import build_model

    cfg = replace(ModelConfig(d_model=16, n_layers=1, n_heads=2, memory_channels=2,
                              memory_shape=(3, 3, 3)), segment=4, max_len=10)
    torch.manual_seed(0)
    model = build_model("tensor_memory", 5, 3, cfg).eval()
    residual = model.memories()[0]
    states = []
    original = residual.memory.forward

    def spy(x, state=None):
        out, new = original(x, state)
        states.append(new)
        return out, new

    residual.memory.forward = spy
    residual.record_inputs = True
    with torch.no_grad():
        model(torch.randn(2, 10, 5))  # left-padded to 12 = 3 segments
        assert len(states) == 3 and residual.last_input.shape[1] == 12
        _, (h, c) = original(residual.last_input, stream=False)
    torch.testing.assert_close(h, states[-1][0])
    torch.testing.assert_close(c, states[-1][1])


def test_forget_bias_init_is_the_same_for_adapter_and_variant():
    """``ModelConfig.forget_bias`` reaches both Tensor Memory layers (adapter and variant)."""
    from examples.diagnostics.memory import init_forget_bias, make_tensor_memory
    from examples.diagnostics.variants import VariantTensorMemory

    adapter = make_tensor_memory(16, 4, (3, 3, 3), 1, forget_bias=3.0)
    variant = make_tensor_memory(16, 4, (3, 3, 3), 1, forget_bias=3.0, write="gaussian")
    assert isinstance(variant, VariantTensorMemory)
    for layer in (adapter, variant):
        bias = layer.cell.pointwise_bias.detach()
        assert torch.all(bias[4:8] == 3.0) and not bias[:4].any() and not bias[8:].any()
    assert torch.all(init_forget_bias(variant, -1.0).cell.pointwise_bias[4:8] == -1.0)


def test_jax_binding_runs_in_segments(tmp_path):
    """``binding --framework jax`` (tmcore.adapters.jax) trains at a tiny scale with the
    memory after the attention (the paper's placement), and its init carries the forget
    bias. (One placement only: JAX compiles slowly on a busy 2-core machine.)"""
    memory_first = False
    pytest.importorskip("jax", reason="jax is not installed")
    pytest.importorskip("flax", reason="flax is not installed")
    from dataclasses import replace

    import jax

    from examples.diagnostics.jax_binding import init_params

    exp = make_experiment("binding", "tiny", steps=6)
    exp.model = replace(exp.model, memory_first=memory_first)
    exp.entries = [e for e in exp.entries if e.kind == "tensor_memory"]
    with jax.enable_x64(False):  # as in `python -m examples.diagnostics` (other tests set x64)
        result = run_experiment(exp, tmp_path, framework="jax", progress=False)
    _check_result(result, tmp_path)
    params = init_params(jax.random.key(0), exp.task.in_features, exp.task.n_classes,
                         replace(exp.model, max_len=exp.task.max_len()))
    c = exp.model.memory_channels
    bias = np.asarray(params["blocks"][0]["memory"]["memory"]["cell"]["pointwise_bias"])
    np.testing.assert_array_equal(bias[c:2 * c], exp.model.forget_bias)


def test_demo_compares_its_seed_0_with_the_committed_results(capsys):
    """``make demo`` checks its table against seed 0 of the committed results (same config):
    identical numbers say "identical", a changed number says "different"."""
    import copy

    from rich.console import Console

    from examples.diagnostics.__main__ import _compare_with_committed
    from examples.diagnostics.results import RESULTS_DIR

    path = RESULTS_DIR / "binding-streaming.json"
    if not path.exists():
        pytest.skip("no committed streaming results")
    committed = json.loads(path.read_text())
    demo = copy.deepcopy(committed)
    demo["seeds"] = [0]
    demo["config"]["train"]["seeds"] = (0,)
    demo["config"]["model"]["memory_shape"] = tuple(demo["config"]["model"]["memory_shape"])
    for row in demo["rows"]:
        row["seeds"] = row["seeds"][:1]
    console = Console(width=200)
    _compare_with_committed(demo, console)
    demo["rows"][0]["seeds"][0] += 0.01
    _compare_with_committed(demo, console)
    out = capsys.readouterr().out
    assert "identical" in out and "different" in out
    assert "environment differs" not in out
    # another vector unit: the message names what differs (numbers may then differ too)
    demo["environment"] = {**demo["environment"], "cpu_vector": "SVE"}
    _compare_with_committed(demo, console)
    out = capsys.readouterr().out
    assert "cpu_vector" in out and "SVE here" in out and "vector unit" in out


def test_partial_assembly_marks_the_seeds_of_each_cell():
    """A file assembled from finished jobs says which seeds each number has: one set for
    the whole row goes with the row's name, else each partial cell names its seeds; the
    row of accuracies after a reset carries the same marks as its model's row."""
    from examples.diagnostics.report import table
    from examples.diagnostics.results import build_results

    def run(model: str, seed: int, setting: str) -> dict:
        return {"model": model, "seed": seed, "params": 10, "accuracy": {setting: 0.5},
                "gate_curve": [], "reset": {setting: 0.25}}

    runs = [run("a", s, "L=6") for s in (0, 1, 2)] + [run("a", 0, "L=0")]
    runs += [run("b", s, w) for s in (0, 1) for w in ("L=0", "L=6")]
    result = build_results(task="t", protocol="paper", scale="full", command="", runs=runs,
                           settings=["L=0", "L=6"], ceilings={"L=0": 1.0, "L=6": 1.0},
                           carried={}, config={}, environment={}, seconds=0.0)
    _, rows = table(result)
    a, b = rows[0], rows[1]
    assert a[0] == "a" and a[3] == "50.0 (seed 0)" and a[4] == "50.0 ± 0.0"
    assert b[0] == "b (seeds 0, 1 only)" and b[3] == b[4] == "50.0 ± 0.0"
    reset_a, reset_b = (next(r for r in rows if r[0].startswith(f"{m}") and "reset" in r[0])
                        for m in ("a", "b"))
    assert reset_a[0] == "a, state reset every segment"
    assert reset_a[3] == "25.0 (seed 0)" and reset_a[4] == "25.0 ± 0.0"
    assert reset_b[0] == "b (seeds 0, 1 only), state reset every segment"
    assert reset_b[3] == reset_b[4] == "25.0 ± 0.0"


def test_uses_state_pairs_partial_cells_by_seed():
    """"uses state" counts seeds, each averaged over the settings it has run: a cell with
    seed 2 only is paired with seed 2 of the others, not with the cells' first seed."""
    from examples.diagnostics.report import table
    from examples.diagnostics.results import build_results

    def run(seed: int, setting: str, acc: float, reset: float) -> dict:
        return {"model": "m", "seed": seed, "params": 10, "accuracy": {setting: acc},
                "gate_curve": [], "reset": {setting: reset}}

    # seed 0 and 1 lean on the state at L=6; seed 2 has run only at L=0, where it does not
    runs = [run(0, "L=6", 1.0, 0.4), run(1, "L=6", 1.0, 0.5), run(2, "L=0", 1.0, 0.99)]
    result = build_results(task="t", protocol="paper", scale="full", command="", runs=runs,
                           settings=["L=0", "L=6"], ceilings={"L=0": 1.0, "L=6": 1.0},
                           carried={}, config={}, environment={}, seconds=0.0)
    _, rows = table(result)
    assert rows[0][-2] == "2/3"
