"""Robustness of the PyTorch and JAX adapters: clear errors on bad configuration and
input, and checkpoints (safetensors / .npz, never pickle) that round-trip exactly,
refuse a wrong shape, and load the paper's reference layout.

Every gap these tests recorded (as ``xfail``) is closed in the adapters.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import reference_state_dict

import tmcore

D, C, L = 8, 2, 4
GRID = (2, 3, 2)


def _fragments(error, *fragments):
    for fragment in fragments:
        assert fragment in str(error.value), f"{fragment!r} not in {str(error.value)!r}"


# =========================================================================== PyTorch


@pytest.fixture(scope="module")
def ta():
    pytest.importorskip("torch")
    return pytest.importorskip("tmcore.adapters.torch")


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _memory(ta, torch, seed=0, **kwargs):
    torch.manual_seed(seed)
    config = dict(embed_dim=D, memory_channels=C, memory_shape=GRID, chunk_size=L)
    config.update(kwargs)
    return ta.TensorMemory(**config)


TORCH_BAD_CONFIG = [
    ("chunk-zero", dict(chunk_size=0), ["chunk_size", ">= 1", "0"]),
    ("chunk-negative", dict(chunk_size=-3), ["chunk_size", "-3"]),
    ("channels-zero", dict(memory_channels=0), ["memory_channels", "0"]),
    ("shape-empty", dict(memory_shape=()), ["memory_shape", "1 to 4 positive ints", "()"]),
    ("shape-zero", dict(memory_shape=(2, 0, 2)), ["memory_shape", "(2, 0, 2)"]),
    ("shape-negative", dict(memory_shape=(2, -1)), ["memory_shape", "(2, -1)"]),
    ("shape-five-axes", dict(memory_shape=(2,) * 5), ["memory_shape", "1 to 4"]),
    ("sigma-scale-zero", dict(sigma_scale=0.0), ["sigma_scale", "> 0"]),
    ("radius-zero", dict(radius=0.0), ["radius", "positive"]),
]


@pytest.mark.parametrize("kwargs, fragments", [c[1:] for c in TORCH_BAD_CONFIG],
                         ids=[c[0] for c in TORCH_BAD_CONFIG])
def test_torch_config_errors(ta, torch, kwargs, fragments):
    with pytest.raises(ValueError) as info:
        _memory(ta, torch, **kwargs)
    _fragments(info, *fragments)


def test_torch_input_and_state_errors(ta, torch):
    memory = _memory(ta, torch)
    x = torch.randn(2, 10, D)
    with pytest.raises(ValueError) as info:
        memory(x[0])
    _fragments(info, "x", "(B, N, d)", "(10, 8)")
    with pytest.raises(ValueError) as info:
        memory(x[..., :7])
    _fragments(info, "x", "embed_dim = 8", "(2, 10, 7)")
    with pytest.raises(ValueError) as info:
        memory(x, (torch.zeros(2, C, 2, 3, 3), torch.zeros(2, C, 2, 3, 3)))
    _fragments(info, "state", "(2, 2, 2, 3, 2)", "(2, 2, 2, 3, 3)")
    with pytest.raises(ValueError) as info:
        memory(x, memory.init_state(3))
    _fragments(info, "state", "(3, 2, 2, 3, 2)")
    with pytest.raises(ValueError, match="state: expected a pair"):
        memory(x, torch.zeros(2, C, *GRID))
    with pytest.raises(ValueError, match="reset"):
        memory(x, reset=torch.zeros(3, dtype=torch.bool))


def test_torch_dtype_and_device_mismatch_named(ta, torch):
    memory = _memory(ta, torch)
    x = torch.randn(2, 10, D)
    state64 = memory.init_state(2, dtype=torch.float64)
    for call, error, fragments in [
        (lambda: memory(x.double()), TypeError, ["x", "torch.float32", "torch.float64"]),
        (lambda: memory(x.to(torch.int64)), TypeError, ["x", "torch.float32", "torch.int64"]),
        (lambda: memory(x.to("meta")), ValueError, ["x", "cpu", "meta"]),
        (lambda: memory(x, state64), TypeError, ["state", "torch.float32", "torch.float64"]),
        (lambda: memory(x, (state64[0].float().to("meta"), state64[1].float())), ValueError,
         ["state", "cpu", "meta"]),
    ]:
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        assert isinstance(info.value, error), repr(info.value)
        _fragments(info, *fragments)
    memory(x, memory.init_state(2))  # the parameters' dtype and device are accepted


def test_torch_functional_scan_validates(ta, torch):
    params = ta.ConvLSTMCell(C, 3).params()
    args = [torch.zeros(1, C, 3, 3, 3), torch.zeros(1, C, 3, 3, 3), torch.zeros(1, 4, 3),
            torch.zeros(1, 4, 3), torch.ones(1, 4), torch.zeros(1, 4, C), params]
    with pytest.raises(ValueError, match="checkpoint_every"):
        ta.memory_scan(*args, checkpoint_every=0)
    with pytest.raises(ValueError, match="radius"):
        ta.memory_scan(*args, radius=0.0)
    with pytest.raises(ValueError, match="eps"):
        ta.memory_scan(*args, eps=-1.0)
    reads, h, c = ta.memory_scan(*args)  # valid input runs
    assert reads.shape == (1, 4, C) and h.shape == c.shape == (1, C, 3, 3, 3)
    # tmcore's validate mode reaches the functional scan (and only then reads values)
    nan_content = [*args[:5], torch.full((1, 4, C), float("nan")), params]
    ta.memory_scan(*nan_content)
    with tmcore.options(validate=True), pytest.raises(ValueError, match="write_content"):
        ta.memory_scan(*nan_content)
    with tmcore.options(validate=True), pytest.raises(ValueError, match="write_sigma"):
        ta.memory_scan(*args[:4], -torch.ones(1, 4), *args[5:])
    args[3] = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="write_coords"):
        ta.memory_scan(*args)
    args[3] = torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match="write_content"):
        ta.memory_scan(*args[:5], torch.zeros(1, 4, C + 1), params)


def _outputs(memory, torch, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(2, 11, D)  # ragged last chunk
    out, state = memory(x)  # a StreamState: (h, c) and the unfinished chunk
    return [t.detach() for t in (out, state.h, state.c, state.pending, state.read)]


def test_torch_state_dict_round_trip_safetensors(ta, torch, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    for make in (lambda seed: _memory(ta, torch, seed),
                 lambda seed: ta.MemoryResidual(_memory(ta, torch, seed), gate_init=-2.0)):
        source, target = make(0), make(123)
        path = tmp_path / "memory.safetensors"
        safetensors_torch.save_file(source.state_dict(), str(path))
        missing, unexpected = target.load_state_dict(safetensors_torch.load_file(str(path)),
                                                     strict=True)
        assert not missing and not unexpected
        for a, b in zip(_outputs(source, torch), _outputs(target, torch), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("other, names", [
    (dict(embed_dim=16), ["write_proj.weight", "size mismatch"]),
    (dict(memory_channels=3), ["content_net.weight", "cell.depthwise_weight"]),
    (dict(memory_shape=(2, 3)), ["coord_net.weight", "cell.depthwise_weight"]),
    (dict(chunk_size=2), ["write_proj.weight"]),
])
def test_torch_load_with_wrong_shapes_names_the_tensor(ta, torch, tmp_path, other, names):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "memory.safetensors"
    safetensors_torch.save_file(_memory(ta, torch).state_dict(), str(path))
    target = _memory(ta, torch, **other)
    with pytest.raises(RuntimeError) as info:
        target.load_state_dict(safetensors_torch.load_file(str(path)), strict=True)
    _fragments(info, *names)


def test_torch_load_from_a_different_grid_is_refused(ta, torch, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "memory.safetensors"
    safetensors_torch.save_file(_memory(ta, torch).state_dict(), str(path))
    target = _memory(ta, torch, memory_shape=(4, 4, 4))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises((RuntimeError, ValueError), match="memory_shape|grid") as info:
        target.load_state_dict(safetensors_torch.load_file(str(path)), strict=True)
    _fragments(info, "memory_shape", "(2, 3, 2)", "(4, 4, 4)")
    with pytest.raises((RuntimeError, ValueError), match="memory_shape"):  # not strict either
        target.load_state_dict(safetensors_torch.load_file(str(path)), strict=False)
    with pytest.raises(ValueError, match="memory_shape"):
        target.set_extra_state(torch.tensor(GRID))
    # the grid is stored under _extra_state, per memory of a model
    assert torch.equal(_memory(ta, torch).state_dict()["_extra_state"], torch.tensor(GRID))
    residual = ta.MemoryResidual(_memory(ta, torch))
    assert "memory._extra_state" in residual.state_dict()
    # a state dict from before the grid was stored (no _extra_state) still loads strictly
    legacy = {k: v for k, v in _memory(ta, torch, seed=4, memory_shape=(4, 4, 4))
              .state_dict().items() if k != "_extra_state"}
    missing, unexpected = target.load_state_dict(legacy, strict=True)
    assert not missing and not unexpected
    assert not torch.equal(target.write_proj.weight, before["write_proj.weight"])


def _reference_state_dict(torch, d=D, c=C, length=L, grid=(3, 4, 5), seed=0):
    """A state dict in the paper's reference layout (docs/LAYER.md), this file's sizes."""
    return reference_state_dict(torch, d, c, length, grid, seed)


def test_reference_checkpoint_loads_through_convert(ta, torch, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    reference = {f"layers.0.memory.{k}": v for k, v in _reference_state_dict(torch).items()}
    path = tmp_path / "reference.safetensors"
    safetensors_torch.save_file(reference, str(path))
    loaded = safetensors_torch.load_file(str(path))
    converted = ta.convert_reference_state_dict(loaded, prefix="layers.0.memory.")
    memory = _memory(ta, torch, memory_shape=(3, 4, 5))
    memory.load_state_dict(converted, strict=True)
    # the gate conv equals the reference's conv_d -> conv_h -> conv_w -> pointwise
    sd = _reference_state_dict(torch)
    x = torch.randn(2, 2 * C, 3, 4, 5, dtype=torch.float32)
    y = x
    for name, pad in (("conv_d", (1, 0, 0)), ("conv_h", (0, 1, 0)), ("conv_w", (0, 0, 1))):
        y = torch.nn.functional.conv3d(y, sd[f"gate_conv.{name}.weight"],
                                       sd[f"gate_conv.{name}.bias"], padding=pad, groups=2 * C)
    y = torch.nn.functional.conv3d(y, sd["gate_conv.pointwise.weight"],
                                   sd["gate_conv.pointwise.bias"])
    ours = tmcore.factorized_conv(x, memory.cell.params())
    torch.testing.assert_close(ours.detach(), y, rtol=1e-5, atol=1e-5)
    out, _ = memory(torch.randn(2, 9, D))
    assert out.shape == (2, 9, D) and torch.isfinite(out).all()
    # round trip of the converted weights
    path2 = tmp_path / "converted.safetensors"
    safetensors_torch.save_file(memory.state_dict(), str(path2))
    again = _memory(ta, torch, seed=5, memory_shape=(3, 4, 5))
    again.load_state_dict(safetensors_torch.load_file(str(path2)), strict=True)
    # grid_cache (1, 3, D, H, W) carries the reference's grid: another grid is refused
    assert torch.equal(converted["_extra_state"], torch.tensor((3, 4, 5)))
    with pytest.raises(RuntimeError, match="memory_shape") as info:
        _memory(ta, torch, memory_shape=(5, 4, 3)).load_state_dict(converted, strict=True)
    _fragments(info, "(3, 4, 5)", "(5, 4, 3)")


def test_reference_checkpoint_errors(ta, torch):
    sd = _reference_state_dict(torch)
    with pytest.raises(ValueError, match="prefix"):
        ta.convert_reference_state_dict(sd, prefix="nothing.")
    missing = {k: v for k, v in sd.items() if k != "writer.sigma_net.bias"}
    with pytest.raises(ValueError) as info:
        ta.convert_reference_state_dict(missing)
    _fragments(info, "missing", "writer.sigma_net.bias")
    extra = {**sd, "surprise.weight": torch.zeros(1)}
    with pytest.raises(ValueError) as info:
        ta.convert_reference_state_dict(extra)
    _fragments(info, "unknown", "surprise.weight")
    bad = {**sd, "gate_conv.conv_h.weight": torch.zeros(2 * C, 1, 3, 1, 1)}
    with pytest.raises(ValueError) as info:
        ta.convert_reference_state_dict(bad)
    _fragments(info, "conv_h", "(4, 1, 1, 3, 1)")
    with pytest.raises(ValueError) as info:
        ta.convert_reference_state_dict({**sd, "grid_cache": torch.zeros(3, 4, 5)})
    _fragments(info, "grid_cache", "(1, 3, D, H, W)", "(3, 4, 5)")
    converted = ta.convert_reference_state_dict(_reference_state_dict(torch, c=3))
    with pytest.raises(RuntimeError, match="size mismatch"):
        _memory(ta, torch).load_state_dict(converted, strict=True)


# --------------------------------------------------------------------------- issue 13: torch


def test_torch_functional_ops_go_through_dispatch_and_validation(ta, torch):
    """adapters.torch.trilinear_sample / gaussian_splat: tmcore's checks, validate mode,
    dispatch and float16 rule (old main: none of them; e.g. eps=-1 gave values ~1e7)."""
    gen = torch.Generator().manual_seed(0)
    vol = torch.randn(2, 3, 4, 5, 6, generator=gen)
    coords = torch.rand(2, 7, 3, generator=gen) * 2 - 1
    content, sigma = torch.randn(2, 2, 3, generator=gen), torch.rand(2, 2, generator=gen) + 0.1
    mu = coords[:, :2]
    # float16: the float32-compute rule of tmcore.trilinear_sample / gaussian_splat
    for ours, public in (
            (lambda v, c: ta.trilinear_sample(v, c), tmcore.trilinear_sample),
            (lambda k, m, s: ta.gaussian_splat(k, m, s, (4, 5, 6)),
             lambda k, m, s: tmcore.gaussian_splat(k, m, s, (4, 5, 6)))):
        args = (vol, coords) if ours.__code__.co_argcount == 2 else (content, mu, sigma)
        half = [a.half() for a in args]
        got, want = ours(*half), public(*half)
        assert got.dtype == torch.float16 and torch.equal(got, want)
        exact = public(*[a.double() for a in args])
        assert (got.double() - exact).abs().max() <= 1.0e-3 * exact.abs().max() + 1e-3
    cases = [
        (lambda: ta.gaussian_splat(content, mu, sigma, (4, 5, 6), eps=-1.0), ValueError, "eps"),
        (lambda: ta.gaussian_splat(content, mu, sigma, (4, 5, 6), radius=-1.0), ValueError,
         "radius"),
        (lambda: ta.gaussian_splat(content, mu, sigma, (4, 0, 6)), ValueError, "shape"),
        (lambda: ta.gaussian_splat(content, mu, sigma, (4.7, 5, 6)), TypeError, "shape"),
        (lambda: ta.gaussian_splat(content.long(), mu, sigma, (4, 5, 6)), TypeError,
         "content: expected a real floating dtype"),
        (lambda: ta.trilinear_sample(vol[:, :, :0], coords), ValueError, "volume"),
        (lambda: ta.trilinear_sample(vol.int(), coords), TypeError, "volume"),
        (lambda: ta.trilinear_sample(vol.to("meta"), coords), ValueError, "device"),
    ]
    for call, error, fragment in cases:
        with pytest.raises(error, match=fragment):
            call()
    bad = coords.clone()
    bad[0, 0, 0] = float("nan")
    ta.trilinear_sample(vol, bad)  # NaN propagates outside validate mode
    with tmcore.options(validate=True):
        with pytest.raises(ValueError, match="coords: expected finite values"):
            ta.trilinear_sample(vol, bad)
        with pytest.raises(ValueError, match="sigma: expected every value > 0"):
            ta.gaussian_splat(content, mu, -sigma, (4, 5, 6))


def test_torch_functional_ops_keep_gradients_and_options(ta, torch):
    vol = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    coords = (torch.rand(1, 5, 2, dtype=torch.float64) * 2 - 1).requires_grad_()
    assert torch.autograd.gradcheck(ta.trilinear_sample, (vol, coords))
    with tmcore.options(generic=True):  # the option reaches the op (and its backward)
        generic = torch.autograd.grad(ta.trilinear_sample(vol, coords).sum(), (vol, coords))
    fast = torch.autograd.grad(ta.trilinear_sample(vol, coords).sum(), (vol, coords))
    for a, b in zip(generic, fast, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_torch_small_items(ta, torch):
    np_ = np
    # NumPy integers as sizes; floats and bools refused with a TypeError
    memory = ta.TensorMemory(np_.int64(D), np_.int64(C), (np_.int64(2), 3, np_.int32(2)),
                             np_.int64(L), checkpoint_every=np_.int64(2))
    assert memory.memory_shape == GRID and memory.chunk_size == L
    for bad in ({"embed_dim": 2.0}, {"embed_dim": True}, {"chunk_size": 4.0}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            _memory(ta, torch, **bad)
    with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
        _memory(ta, torch, eps=-1.0)
    # a float reset mask is refused, a bool one works
    x = torch.randn(2, 8, D)
    with pytest.raises(TypeError, match="reset: expected a bool mask"):
        memory(x, reset=torch.tensor([1.0, 0.0]))
    memory(x, reset=torch.tensor([True, False]))
    # detach_state is exported and detaches a state or a list of states
    out, state = memory(x.requires_grad_())
    assert state[0].grad_fn is not None
    detached = ta.detach_state(state)
    assert all(t.grad_fn is None for t in detached)
    assert all(t.grad_fn is None for s in ta.detach_state([state, state]) for t in s)
    # forward mode is refused with a clear error
    vol = torch.randn(1, 2, 3, 3)
    coords = torch.zeros(1, 2, 2)
    with pytest.raises(NotImplementedError, match="tmcore.*forward-mode.*reverse mode"):
        torch.func.jvp(lambda v: ta.trilinear_sample(v, coords), (vol,), (vol,))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda t: memory(t)[0], (x.detach(),), (x.detach(),))
    # factorized_conv with mixed dtypes names the argument
    params = tmcore.conv_params_from_pointwise(torch.randn(8, 4), 2)
    with pytest.raises(TypeError, match="params.depthwise_weight: expected x's dtype"):
        tmcore.factorized_conv(torch.randn(1, 4, 3, 3, dtype=torch.float64), params)


def test_torch_gate_is_one_dimensional_and_a_0_dim_gate_is_refused(ta, torch):
    residual = ta.MemoryResidual(_memory(ta, torch), gate_init=-2.0)
    assert residual.gate.shape == (1,)
    old = residual.state_dict()
    old["gate"] = torch.tensor(1.5)  # the 0-dim gate of 0.1's checkpoints: no longer read
    fresh = ta.MemoryResidual(_memory(ta, torch, seed=3))
    with pytest.raises(RuntimeError, match="size mismatch for gate"):
        fresh.load_state_dict(old, strict=True)
    assert fresh.gate.item() == 0.0


def test_torch_no_grad_scan_keeps_no_checkpoints(ta, torch, monkeypatch):
    """Inference memory does not grow with the sequence: under no_grad the scan keeps one
    checkpoint (the initial state) instead of one per step (old main: T of them, ~450 MiB
    for 3000 chunks)."""
    from tmcore.adapters.torch import bridge as _torch_ops

    kept = []
    original = _torch_ops.memory_scan_fwd

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        kept.append(out[3].shape[0])
        return out

    monkeypatch.setattr(_torch_ops, "memory_scan_fwd", spy)
    memory = _memory(ta, torch)
    x = torch.randn(1, 20 * L, D)
    with torch.no_grad():
        out_nograd, state = memory(x)
    assert kept == [1]
    with torch.inference_mode():
        memory(x)
    assert kept == [1, 1]
    out, state2 = memory(x)  # with grad: one checkpoint per step (checkpoint_every=1)
    assert kept[-1] == 20
    assert torch.equal(out.detach(), out_nograd) and torch.equal(state2[0].detach(), state[0])


def test_torch_reference_conversion_errors_name_the_key(ta, torch):
    sd = _reference_state_dict(torch)
    cases = [
        ({"gate_conv.pointwise.weight": torch.zeros(8)}, ValueError,
         ["gate_conv.pointwise.weight", "(4C, 2C, 1, 1, 1)", "(8,)"]),
        ({"gate_conv.pointwise.bias": torch.zeros(4 * C + 1)}, ValueError,
         ["gate_conv.pointwise.bias", "(4C,)", "(9,)"]),
        ({"writer.content_net.bias": torch.zeros(C + 1)}, ValueError,
         ["writer.content_net.bias", "(3,)"]),
        ({"gate_conv.conv_d.bias": torch.zeros(2)}, ValueError, ["gate_conv.conv_d.bias"]),
        ({"out_proj.weight": np.zeros((D, C), np.float32)}, TypeError,
         ["out_proj.weight", "ndarray", "torch.as_tensor"]),
        ({"coord_net.bias": [0.0, 0.0, 0.0]}, TypeError, ["coord_net.bias", "list"]),
        ({"coord_net.bias": torch.zeros(3, dtype=torch.int64)}, TypeError,
         ["coord_net.bias", "torch.int64"]),
    ]
    for change, error, fragments in cases:
        with pytest.raises(error) as info:
            ta.convert_reference_state_dict({**sd, **change})
        _fragments(info, *fragments)


# =========================================================================== JAX


@pytest.fixture(scope="module")
def ja():
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    return pytest.importorskip("tmcore.adapters.jax")


@pytest.fixture(scope="module")
def jax():
    return pytest.importorskip("jax")


def _jax_params(ja, jax, seed=0, **kwargs):
    config = dict(embed_dim=D, memory_channels=C, memory_shape=GRID, chunk_size=L)
    config.update(kwargs)
    return ja.init(jax.random.PRNGKey(seed), **config)


JAX_BAD_CONFIG = [
    ("chunk-zero", dict(chunk_size=0), ["chunk_size", "positive", "0"]),
    ("channels-zero", dict(memory_channels=0), ["memory_channels"]),
    ("shape-empty", dict(memory_shape=()), ["memory_shape", "1 to 4 positive ints"]),
    ("shape-zero", dict(memory_shape=(2, 0)), ["memory_shape", "(2, 0)"]),
    ("shape-five-axes", dict(memory_shape=(2,) * 5), ["memory_shape"]),
    ("sigma-scale-zero", dict(sigma_scale=0.0), ["sigma_scale"]),
]


@pytest.mark.parametrize("kwargs, fragments", [c[1:] for c in JAX_BAD_CONFIG],
                         ids=[c[0] for c in JAX_BAD_CONFIG])
def test_jax_config_errors(ja, jax, kwargs, fragments):
    with pytest.raises(ValueError) as info:
        _jax_params(ja, jax, **kwargs)
    _fragments(info, *fragments)


def _with(params, **changes):
    """``params`` with its config changed (checked as layer_config checks it)."""
    return {**params, "config": params["config"].replace(**changes)}


def test_jax_input_and_state_errors(ja, jax):
    jnp = jax.numpy
    params = _jax_params(ja, jax)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 10, D)), jnp.float32)
    with pytest.raises(ValueError) as info:
        ja.apply(params, x[0])
    _fragments(info, "x", "(B, N, d)", "(10, 8)")
    with pytest.raises(ValueError) as info:
        ja.apply(params, x[..., :7])
    _fragments(info, "x", "d = 8", "(2, 10, 7)")
    with pytest.raises(TypeError) as info:  # a pytree without its config
        ja.apply({k: v for k, v in params.items() if k != "config"}, x)
    _fragments(info, "params", "LayerConfig", "'config'")
    with pytest.raises(ValueError) as info:
        ja.apply(_with(params, chunk_size=3), x)
    _fragments(info, "write_proj.weight", "(8, 24)", "(8, 32)")
    with pytest.raises(ValueError) as info:
        ja.apply(params, x, state=ja.init_state(3, C, GRID))
    _fragments(info, "state.h", "(3, 2, 2, 3, 2)")
    with pytest.raises(ValueError) as info:
        ja.apply(_with(params, memory_shape=(2, 3)), x)
    _fragments(info, "coord_net.weight", "(2, 8)", "(3, 8)")
    with pytest.raises(ValueError, match="sigma_scale"):
        _with(params, sigma_scale=0.0)


def test_jax_apply_checks_the_rest(ja, jax):
    jnp = jax.numpy
    params = _jax_params(ja, jax)
    x = jnp.zeros((2, 10, D), jnp.float32)
    calls = [
        (lambda: ja.apply(_with(params, memory_shape=(2, 0, 2)), x), "memory_shape"),
        (lambda: ja.apply(_with(params, eps=-1.0), x), "eps"),
        (lambda: ja.apply(_with(params, radius=0.0), x), "radius"),
        (lambda: ja.apply(params, x, state=(jnp.zeros((2, C, *GRID)),
                                            jnp.zeros((2, C, 2, 3, 3)))), "state"),
        (lambda: ja.apply({**params, "content_net": {"weight": jnp.zeros((3, D)),
                                                     "bias": jnp.zeros(C)}},
                          x), "content_net"),
    ]
    for call, name in calls:
        try:
            call()
        except (ValueError, TypeError) as error:
            assert name in str(error), str(error)
        else:
            raise AssertionError(f"{name}: accepted")


def test_jax_apply_and_init_check_parameters_and_dtypes(ja, jax):
    jnp = jax.numpy
    params = _jax_params(ja, jax)
    x = jnp.zeros((2, 10, D), jnp.float32)
    no_sigma_bias = {**params, "sigma_net": {"weight": params["sigma_net"]["weight"]}}
    with pytest.raises(KeyError, match="sigma_net.bias"):
        ja.apply(no_sigma_bias, x)
    no_cell = {k: v for k, v in params.items() if k != "cell"}
    with pytest.raises(KeyError, match="cell.depthwise_weight"):
        ja.apply(no_cell, x)
    with pytest.raises(TypeError) as info:
        ja.apply(params, jnp.zeros((2, 10, D), jnp.int32))
    _fragments(info, "x", "int32")
    bad_cell = {**params, "cell": {**params["cell"], "pointwise_bias": jnp.zeros(3)}}
    with pytest.raises(ValueError) as info:
        ja.apply(bad_cell, x)
    _fragments(info, "cell.pointwise_bias", "(8,)", "(3,)")
    with pytest.raises(TypeError) as info:
        ja.apply(params, x, state=(jnp.zeros((2, C, *GRID), jnp.int32),) * 2)
    _fragments(info, "state.h", "floating", "int32")
    # all static: the same checks hold under jit
    with pytest.raises(ValueError, match="radius"):
        jax.jit(lambda p, x_: ja.apply(_with(p, radius=-1.0), x_))(params, x)
    # init rejects non-integer sizes instead of truncating them
    for bad in [(2, 2.5, 2), (2.0, 3, 2), (2, True)]:
        with pytest.raises(TypeError) as info:
            _jax_params(ja, jax, memory_shape=bad)
        _fragments(info, "memory_shape", "not an int")
    with pytest.raises(TypeError, match="chunk_size"):
        _jax_params(ja, jax, chunk_size=4.0)


def _jax_outputs(ja, jax, params):
    x = jax.numpy.asarray(np.random.default_rng(1).normal(size=(2, 11, D)), jax.numpy.float32)
    out, state = ja.apply(params, x)
    return [np.asarray(a) for a in (out, state.h, state.c)]


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_jax_params_round_trip(ja, jax, tmp_path, fmt):
    params = _jax_params(ja, jax)
    flat = ja.state_dict_from_params(params)
    if fmt == "npz":
        path = tmp_path / "params.npz"
        np.savez(path, **flat)
        with np.load(path, allow_pickle=False) as data:
            loaded = {k: data[k] for k in data.files}
    else:
        safetensors_numpy = pytest.importorskip("safetensors.numpy")
        path = tmp_path / "params.safetensors"
        safetensors_numpy.save_file(flat, str(path))
        loaded = safetensors_numpy.load_file(str(path))
    restored = ja.params_from_state_dict(loaded, prefix="")
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(_jax_outputs(ja, jax, params), _jax_outputs(ja, jax, restored), strict=True):
        assert a.tobytes() == b.tobytes()


def test_jax_params_from_a_torch_checkpoint(ja, jax, ta, torch, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    memory = _memory(ta, torch)
    path = tmp_path / "torch.safetensors"
    safetensors_torch.save_file(memory.state_dict(), str(path))
    params = ja.params_from_state_dict(safetensors_numpy.load_file(str(path)))
    x = np.random.default_rng(2).normal(size=(2, 11, D)).astype(np.float32)
    expected, _ = memory(torch.as_tensor(x))
    out, _ = ja.apply(params, jax.numpy.asarray(x))
    np.testing.assert_allclose(np.asarray(out), expected.detach().numpy(), rtol=1e-4, atol=1e-5)
    # the grid the torch checkpoint stores (_extra_state) makes the config, and is checked
    assert params["config"] == memory.config
    np.testing.assert_array_equal(ja.state_dict_from_params(params)["_extra_state"], GRID)
    with pytest.raises(ValueError) as info:
        ja.params_from_state_dict(safetensors_numpy.load_file(str(path)),
                                  config=memory.config.replace(memory_shape=(2, 3, 3)))
    _fragments(info, "memory_shape", "(2, 3, 3)", "(2, 3, 2)")


def test_jax_params_with_wrong_shapes_are_refused(ja, jax):
    params = _jax_params(ja, jax, embed_dim=16)
    x = jax.numpy.zeros((2, 10, D), jax.numpy.float32)
    with pytest.raises(ValueError) as info:
        ja.apply(params, x)
    _fragments(info, "x", "d = 16")
    incomplete = {k: v for k, v in ja.state_dict_from_params(_jax_params(ja, jax)).items()
                  if k != "sigma_net.bias"}
    with pytest.raises(KeyError, match="sigma_net.bias"):
        ja.params_from_state_dict(incomplete, prefix="")
    other_n = _jax_params(ja, jax, memory_shape=(2, 3))
    with pytest.raises(ValueError) as info:
        ja.apply(_with(other_n, memory_shape=GRID), x)
    _fragments(info, "coord_net.weight", "(3, 8)", "(2, 8)")


def test_flax_load_params_with_wrong_shapes_is_refused(ja, jax):
    nnx = pytest.importorskip("flax.nnx")
    module = ja.TensorMemory(D, C, GRID, L, rngs=nnx.Rngs(0))
    before = ja.params_from_module(module)
    other = _jax_params(ja, jax, memory_channels=C + 1)
    with pytest.raises((ValueError, TypeError)) as info:
        ja.load_params(module, other)
    _fragments(info, "content_net.weight", "(2, 8)", "(3, 8)")
    other_n = _jax_params(ja, jax, memory_shape=(2, 3))
    with pytest.raises(ValueError) as info:
        ja.load_params(module, other_n)
    _fragments(info, "coord_net.weight", "(3, 8)", "(2, 8)")
    incomplete = {k: v for k, v in _jax_params(ja, jax).items() if k != "out_proj"}
    with pytest.raises(ValueError, match="out_proj"):
        ja.load_params(module, incomplete)
    # nothing was changed by the refused loads
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(ja.params_from_module(module)),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # a pytree of the module's shapes loads, its config's grid checked
    same = _jax_params(ja, jax, seed=3)
    ja.load_params(module, same)
    np.testing.assert_array_equal(ja.params_from_module(module)["out_proj"]["weight"],
                                  same["out_proj"]["weight"])
    with pytest.raises(ValueError, match="memory_shape"):
        ja.load_params(module, _with(same, memory_shape=(4, 4, 4)))
