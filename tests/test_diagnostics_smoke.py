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


RESULT_KEYS = {"task", "settings", "runs", "summary", "train_config", "model_config", "files"}


def _check_result(result: dict, out_dir) -> None:
    assert RESULT_KEYS <= result.keys()
    on_disk = json.loads((out_dir / result["task"] / "results.json").read_text())
    assert RESULT_KEYS <= on_disk.keys()
    assert (out_dir / result["task"] / "accuracy.png").stat().st_size > 0
    for run in result["runs"]:
        assert run["loss_curve"], run["model"]
        assert all(math.isfinite(loss) for _, loss in run["loss_curve"]), run["model"]
        assert set(run["accuracy"]) == set(result["settings"])
        assert all(0.0 <= a <= 1.0 for a in run["accuracy"].values())
    assert set(result["summary"]) == {e for e in {r["model"] for r in result["runs"]}}


@pytest.mark.parametrize("name", ["mapping", "occlusion", "ablations"])
def test_task_runs_and_writes_outputs(name, tmp_path, capsys):
    exp = make_experiment(name, "tiny")
    result = run_experiment(exp, tmp_path, progress=False)
    _check_result(result, tmp_path)
    assert len(result["runs"]) == len(exp.entries)
    printed = capsys.readouterr().out
    assert f"{exp.task.name} — accuracy" in printed


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


def test_demo_binding_and_noharm(tmp_path, capsys):
    """``make demo`` at tiny scale: both tasks run, write outputs and print their tables."""
    assert main(["demo", "--tiny", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "binding — accuracy" in printed and "noharm — accuracy" in printed
    for model in ("transformer_wide", "memory_slots", "tensor_memory"):
        assert model in printed
    for task in ("binding", "noharm"):
        _check_result(json.loads((tmp_path / task / "results.json").read_text()), tmp_path)
    # the Tensor Memory model draws its state; memory gates are plotted over training
    assert (tmp_path / "binding" / "memory_state.png").stat().st_size > 0
    assert (tmp_path / "binding" / "gates.png").stat().st_size > 0


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
    out_r, (h_r, c_r) = real(x)
    out_v, (h_v, c_v) = variant(x)
    torch.testing.assert_close(out_v, out_r)
    torch.testing.assert_close(h_v, h_r)
    torch.testing.assert_close(c_v, c_r)


def _final_segment_change(kind: str, segment: int | None) -> float:
    """Max change of the last segment's logits when a token of the FIRST segment changes."""
    from dataclasses import replace

    from examples.diagnostics.config import ModelConfig
    from examples.diagnostics.models import build_model

    cfg = replace(ModelConfig(d_model=16, n_layers=2, n_heads=2, memory_channels=2,
                              memory_shape=(3, 3, 3), n_slots=4), segment=segment, max_len=12)
    torch.manual_seed(0)
    model = build_model(kind, 5, 3, cfg).eval()
    x = torch.randn(2, 12, 5)
    y = x.clone()
    y[:, 0] += 1.0
    with torch.no_grad():
        return float((model(x)[:, -4:] - model(y)[:, -4:]).abs().max())


@pytest.mark.parametrize("kind", ["transformer", "transformer_wide"])
def test_segments_hide_earlier_segments_from_attention(kind):
    """Segments of 4: a plain transformer's last segment cannot see the first one."""
    assert _final_segment_change(kind, 4) == 0.0
    assert _final_segment_change(kind, None) > 1e-4  # one full window: it does


@pytest.mark.parametrize("kind", ["memory_slots", "tensor_memory"])
def test_memory_state_crosses_segments(kind):
    """The recurrent state carries the first segment into the last one."""
    assert _final_segment_change(kind, 4) > 1e-5


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
        _, (h, c) = original(residual.last_input)
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


@pytest.mark.parametrize("memory_first", [True, False])
def test_jax_binding_runs_in_segments(tmp_path, memory_first):
    """``binding --framework jax`` (tmcore.adapters.jax) trains at a tiny scale, memory before
    or after the attention, and its init carries the forget bias."""
    pytest.importorskip("jax", reason="jax is not installed")
    pytest.importorskip("flax", reason="flax is not installed")
    from dataclasses import replace

    import jax

    from examples.diagnostics.jax_binding import init_params

    exp = make_experiment("binding", "tiny", steps=6)
    exp.model = replace(exp.model, memory_first=memory_first)
    exp.entries = [e for e in exp.entries if e.kind == "tensor_memory"]
    result = run_experiment(exp, tmp_path, framework="jax", progress=False)
    _check_result(result, tmp_path)
    params = init_params(jax.random.key(0), exp.task.in_features, exp.task.n_classes,
                         replace(exp.model, max_len=exp.task.max_len()))
    c = exp.model.memory_channels
    bias = np.asarray(params["blocks"][0]["memory"]["memory"]["cell"]["pointwise_bias"])
    np.testing.assert_array_equal(bias[c:2 * c], exp.model.forget_bias)
