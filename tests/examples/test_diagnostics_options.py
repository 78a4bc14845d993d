"""The diagnostics' rows with the layer options beyond the paper (local updates, warped
dynamics): how the examples build those layers, and the experiments that declare the rows.

The options themselves are tested with the layer (tests/layer/test_layer_options.py); here:
the ablation layer passes them through and computes the adapter's function, the row
switches reach the layer that is built, and the option experiments keep the sizes,
seeds and hyper-parameters of the experiments they are compared with.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="the diagnostics need PyTorch")
pytest.importorskip("matplotlib", reason="the diagnostics need matplotlib")
pytest.importorskip("rich", reason="the diagnostics need rich")
adapter = pytest.importorskip("tmcore.adapters.torch", reason="no PyTorch adapter")

from examples.diagnostics.memory import make_tensor_memory  # noqa: E402
from examples.diagnostics.runner import make_experiment, run_experiment  # noqa: E402
from examples.diagnostics.variants import VariantTensorMemory  # noqa: E402

OPTIONS = [{"update": "local", "window": 2}, {"dynamics": "warp"},
           {"update": "local", "window": 2, "dynamics": "warp"}]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("options", OPTIONS, ids=["local", "warp", "warp+local"])
def test_variant_layer_with_options_matches_the_adapter(options):
    """With the default switches and an option, the ablation layer is the adapter's layer
    with that option: same outputs, final state and parameter gradients (float64)."""
    torch.manual_seed(0)
    real = adapter.TensorMemory(8, 3, (3, 4, 5), 2, **options).double()
    with torch.no_grad():  # a non-zero warp and non-identity taps, so that both matter
        for p in real.parameters():
            p.add_(0.2 * torch.randn_like(p))
    variant = VariantTensorMemory(8, 3, (3, 4, 5), 2, **options).double()
    variant.load_state_dict({k: v for k, v in real.state_dict().items()
                             if not k.endswith("_extra_state")})
    assert variant.config.update == real.config.update == options.get("update", "dense")
    assert variant.config.dynamics == options.get("dynamics", "none")
    x = torch.randn(2, 7, 8, dtype=torch.double)
    results = []
    for layer in (real, variant):
        out, (h, c) = layer(x, stream=False)
        grads = torch.autograd.grad((out ** 2).sum() + h.sum() + c.sum(),
                                    list(layer.parameters()))
        results.append((out, h, c, grads))
    (out_r, h_r, c_r, g_r), (out_v, h_v, c_v, g_v) = results
    torch.testing.assert_close(out_v, out_r)
    torch.testing.assert_close(h_v, h_r)
    torch.testing.assert_close(c_v, c_r)
    for a, b in zip(g_v, g_r, strict=True):
        torch.testing.assert_close(a, b)


def test_variant_layer_with_options_differs_from_the_dense_layer():
    """The pass-through is not a no-op: a non-zero warp changes the ablation layer's output
    (so the options' rows do not silently run the dense, unwarped scan)."""
    torch.manual_seed(0)
    plain = VariantTensorMemory(8, 3, (3, 4, 5), 2).double()
    warped = VariantTensorMemory(8, 3, (3, 4, 5), 2, dynamics="warp").double()
    warped.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 7, 8, dtype=torch.double)
    same = warped(x, stream=False)[0]
    torch.testing.assert_close(same, plain(x, stream=False)[0])  # zero warp at init
    with torch.no_grad():
        warped.warp_net.bias.fill_(0.3)
    assert (warped(x, stream=False)[0] - same).abs().max() > 1e-6


def test_make_tensor_memory_routes_the_options():
    """The options go to whichever layer is built; alone they keep the adapter's layer."""
    plain = make_tensor_memory(8, 3, (4, 4, 4), 1, update="local", window=2, dynamics="warp")
    assert type(plain) is adapter.TensorMemory
    assert (plain.config.update, plain.config.window, plain.config.dynamics) == (
        "local", 2, "warp")
    switched = make_tensor_memory(8, 3, (4, 4, 4), 1, write="gaussian", update="local",
                                  window=2)
    assert isinstance(switched, VariantTensorMemory)
    assert (switched.config.update, switched.config.window) == ("local", 2)
    with pytest.raises(ValueError, match="write='hard'"):
        make_tensor_memory(8, 3, (4, 4, 4), 1, write="hard", dynamics="warp")
    with pytest.raises(ValueError, match="window"):
        make_tensor_memory(8, 3, (4, 4, 4), 1, update="local")


def test_options_experiments_keep_their_references_setup():
    """``occlusion-options`` is ``occlusion``'s streaming setup with Tensor Memory rows only
    (its tuned point: the tuning file of occlusion); ``ablations-options`` is the
    ablations' setup with local rows at a fixed window."""
    occ, ref = make_experiment("occlusion-options"), make_experiment("occlusion")
    assert (occ.train, occ.model, vars(occ.task)) == (ref.train, ref.model, vars(ref.task))
    assert occ.tuning_from == "occlusion" and occ.train.seeds == (0, 1, 2)
    assert [e.label for e in occ.entries] == ["tensor_memory", "tensor_memory +warp",
                                              "tensor_memory +warp +local w=2"]
    assert {e.kind for e in occ.entries} == {"tensor_memory"}
    assert occ.entries[2].variant == {"dynamics": "warp", "update": "local", "window": 2}
    abl, ref = make_experiment("ablations-options"), make_experiment("ablations")
    assert (abl.train, abl.model, vars(abl.task)) == (ref.train, ref.model, vars(ref.task))
    assert abl.entries[0] == ref.entries[0]
    local = [e for e in abl.entries if e.variant.get("update") == "local"]
    assert [e.overrides["memory_shape"] for e in local] == [(8,) * 3, (16,) * 3, (32,) * 3]
    assert {e.variant["window"] for e in local} == {4}
    # tiny scale: the grids shrink to 3^3, and so do the windows
    tiny = make_experiment("ablations-options", "tiny")
    assert {e.variant["window"] for e in tiny.entries if "window" in e.variant} == {3}


def test_occlusion_options_run_at_tiny_scale(tmp_path):
    """The options' rows train (finite losses) and land in their own results file, never in
    occlusion's; the warp adds its zero-initialised head's parameters."""
    exp = make_experiment("occlusion-options", "tiny", steps=3)
    result = run_experiment(exp, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "occlusion-options-streaming.json"]
    on_disk = json.loads((tmp_path / "occlusion-options-streaming.json").read_text())
    assert on_disk["rows"] == result["rows"]
    params = result["params"]
    assert params["tensor_memory +warp"] > params["tensor_memory"]
    assert params["tensor_memory +warp +local w=2"] == params["tensor_memory +warp"]
    for run in result["runs"]:
        assert all(loss == loss and abs(loss) < 1e6 for _, loss in run["loss_curve"])
    assert set(result["cost"]) == {r["model"] for r in result["rows"]}


def test_video_option_models_build_their_layers():
    """The video example's ``memory_warp`` / ``memory_warp_local`` rows are its ``memory``
    row with the options on every attached memory; ``memory`` keeps the paper's layer."""
    from examples.video.train import SCALES, ClipClassifier

    config = SCALES["tiny"]
    layers = {kind: [m.memory.config for m in ClipClassifier(kind, config, 1, 3)
                     .backbone.handle.memories]
              for kind in ("memory", "memory_warp", "memory_warp_local")}
    assert {(c.update, c.dynamics) for c in layers["memory"]} == {("dense", "none")}
    assert {(c.update, c.dynamics) for c in layers["memory_warp"]} == {("dense", "warp")}
    assert {(c.update, c.window, c.dynamics) for c in layers["memory_warp_local"]} == {
        ("local", 2, "warp")}


def test_cost_table_counts_a_one_model_run_once():
    """A row trained once for every setting lists its seconds under each setting; its wall
    time is those seconds once (one model per setting: the sum over settings)."""
    from examples.diagnostics.report import cost_table

    cost = {"tensor_memory": {s: {"seconds": [100.0, 200.0], "ms_per_step": [10.0, 20.0]}
                              for s in ("L=2", "L=4")}}
    result = {"settings": ["L=2", "L=4"], "cost": cost, "config": {"per_setting": False}}
    assert cost_table(result)[1][0] == ["tensor_memory", "15", "15", "300 s"]
    result["config"]["per_setting"] = True
    assert cost_table(result)[1][0][-1] == "600 s"
