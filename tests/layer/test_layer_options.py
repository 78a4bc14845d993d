"""The layer's options beyond the paper: ``update="local"`` and ``dynamics="warp"``.

Contract (tmcore.layer, tmcore.scan.warped, both adapters): the default config is untouched
(same parameters, same scan); a local layer equals the dense masked definition of the
local update (values and gradients, float64, <= 1e-12) and keeps every cell outside the
window bit for bit; a zero-initialized warp layer equals the default layer; the shift's
VJP matches finite differences; streaming pieces equal one call and packed documents
equal running each document alone, with either option, in NumPy, torch and JAX.
"""

from __future__ import annotations

import numpy as np
import pytest

import tmcore
from tmcore import layer as tl
from tmcore.ops.window import window_geometry, window_mask
from tmcore.scan import options as dy
from tmcore.types import StepInputs, WarpInputs

D, C, L = 5, 2, 2
OPTIONS = {
    "local": {"update": "local", "window": 2},
    "warp": {"dynamics": "warp"},
    "local+warp": {"update": "local", "window": 2, "dynamics": "warp"},
    "local+flow": {"update": "local", "window": 2, "dynamics": "warp", "flow": True},
}
FLOW_KEYS = [f"warp_flow.{k}" for k in ("depthwise_bias", "depthwise_weight",
                                         "pointwise_bias", "pointwise_weight")]


def _close(a, b, tol=1e-12):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    assert np.max(np.abs(a - b), initial=0.0) <= tol


# --------------------------------------------------------------------------- config


def test_default_config_has_exactly_the_former_parameters():
    config = tl.layer_config(D, C, (3, 4), L)
    assert (config.update, config.window, config.dynamics) == ("dense", None, "none")
    assert config == tl.layer_config(D, C, (3, 4), L, update="dense", dynamics="none")
    specs = [(s.name, s.shape) for s in tl.param_specs(config)]
    assert specs == [
        ("write_proj.weight", (D, L * D)), ("write_proj.bias", (D,)),
        ("content_net.weight", (C, D)), ("content_net.bias", (C,)),
        ("sigma_net.weight", (1, D)), ("sigma_net.bias", (1,)),
        ("coord_net.weight", (2, D)), ("coord_net.bias", (2,)),
        ("cell.depthwise_weight", (2, 2 * C, 3)), ("cell.depthwise_bias", (2, 2 * C)),
        ("cell.pointwise_weight", (4 * C, 2 * C)), ("cell.pointwise_bias", (4 * C,)),
        ("out_proj.weight", (D, C)), ("out_proj.bias", (D,)),
    ]
    assert tl.param_groups(config) == tl.GROUPS
    # the local update adds no parameter; the warp adds warp_net (zeros) at the end
    local = tl.layer_config(D, C, (3, 4), L, update="local", window=2)
    assert tl.param_specs(local) == tl.param_specs(config)
    warp = tl.param_specs(tl.layer_config(D, C, (3, 4), L, dynamics="warp"))
    assert warp[:-2] == tl.param_specs(config)
    assert [(s.name, s.shape, s.init, s.value) for s in warp[-2:]] == [
        ("warp_net.weight", (2, D), "constant", 0.0), ("warp_net.bias", (2,), "constant", 0.0)]


@pytest.mark.parametrize("kwargs, error, words", [
    ({"update": "sparse"}, ValueError, "update"),
    ({"update": 1}, TypeError, "update"),
    ({"update": "local"}, ValueError, "window"),
    ({"update": "local", "window": 5}, ValueError, "window"),
    ({"update": "local", "window": 0}, ValueError, "window"),
    ({"update": "local", "window": 2.0}, TypeError, "window"),
    ({"update": "local", "window": True}, TypeError, "window"),
    ({"window": 2}, ValueError, "window"),
    ({"dynamics": "flow"}, ValueError, "dynamics"),
    ({"dynamics": None}, TypeError, "dynamics"),
    ({"flow": True}, ValueError, "flow"),
    ({"dynamics": "warp", "flow": 1}, TypeError, "flow"),
])
def test_bad_options_are_named(kwargs, error, words):
    with pytest.raises(error, match=words):
        tl.layer_config(D, C, (3, 4), L, **kwargs)


def test_window_up_to_the_largest_axis():
    assert tl.layer_config(D, C, (3, 4), L, update="local", window=4).window == 4


# --------------------------------------------------------------------------- algebra


def _scan_args(shape, steps=3, batch=2, channels=C, seed=0):
    rng = np.random.default_rng(seed)
    n = len(shape)
    h0 = rng.standard_normal((batch, channels, *shape))
    c0 = rng.standard_normal((batch, channels, *shape))
    inputs = StepInputs(rng.uniform(-0.9, 0.9, (batch, steps, n)),
                        rng.uniform(-0.9, 0.9, (batch, steps, n)),
                        rng.uniform(0.2, 0.5, (batch, steps)),
                        rng.standard_normal((batch, steps, channels)))
    params = tmcore.ConvParams(rng.standard_normal((n, 2 * channels, 3)) * 0.5,
                               rng.standard_normal((n, 2 * channels)) * 0.1,
                               rng.standard_normal((4 * channels, 2 * channels)) * 0.5,
                               rng.standard_normal((4 * channels,)) * 0.1)
    shift = rng.uniform(-0.3, 0.3, (batch, steps, n))
    cot = (rng.standard_normal((batch, steps, channels)), rng.standard_normal(h0.shape),
           rng.standard_normal(h0.shape))
    return h0, c0, inputs, params, shift, cot


def _flat(grads):
    d_h, d_c, d_inputs, d_params = grads
    return [d_h, d_c, *d_inputs, *d_params]


@pytest.mark.parametrize("shape", [(6,), (5, 4), (4, 3, 3)])
@pytest.mark.parametrize("warp", [False, True])
def test_fast_local_scan_equals_masked_definition(shape, warp):
    h0, c0, inputs, params, shift, cot = _scan_args(shape)
    if warp:
        inputs = WarpInputs(*inputs, shift)
    kw = {"update": "local", "window": 2}
    for a, b in zip(dy.dynamic_memory_scan(h0, c0, inputs, params, **kw),
                    dy.dynamic_memory_scan(h0, c0, inputs, params, method="masked", **kw),
                    strict=True):
        _close(a, b)
    fast = dy.dynamic_memory_scan_vjp(h0, c0, inputs, params, *cot, **kw)
    masked = dy.dynamic_memory_scan_vjp(h0, c0, inputs, params, *cot, method="masked", **kw)
    assert type(fast[2]) is type(inputs)
    for a, b in zip(_flat(fast), _flat(masked), strict=True):
        _close(a, b)


@pytest.mark.parametrize("shape", [(6,), (5, 4), (4, 3, 3)])
def test_cells_outside_the_window_are_unchanged_bit_for_bit(shape):
    h0, c0, inputs, params, _, _ = _scan_args(shape, steps=1)
    _, h, c = dy.dynamic_memory_scan(h0, c0, inputs, params, update="local", window=2)
    geometry = window_geometry(np, inputs.write_coords[:, 0], shape, 2)
    outside = np.broadcast_to(~window_mask(np, geometry, shape), h0.shape)
    assert outside.any() and (~outside).any()
    assert np.array_equal(h[outside], h0[outside]) and np.array_equal(c[outside], c0[outside])
    assert not np.array_equal(h[~outside], h0[~outside])


@pytest.mark.parametrize("shape", [(6,), (5, 4)])
def test_zero_shift_is_the_dense_scan(shape):
    h0, c0, inputs, params, shift, cot = _scan_args(shape)
    warped = WarpInputs(*inputs, np.zeros_like(shift))
    for a, b in zip(dy.dynamic_memory_scan(h0, c0, warped, params),
                    tmcore.memory_scan(h0, c0, *inputs, params), strict=True):
        _close(a, b)
    d_h, d_c, d_inputs, d_params = dy.dynamic_memory_scan_vjp(h0, c0, warped, params, *cot)
    ref = tmcore.memory_scan_vjp(h0, c0, *inputs, params, *cot)
    for a, b in zip([d_h, d_c, *d_inputs[:4], *d_params], [*ref[:6], *ref.params], strict=True):
        _close(a, b)


@pytest.mark.parametrize("shape", [(6,), (5, 4), (4, 3, 3)])
@pytest.mark.parametrize("update", ["dense", "local"])
def test_warp_scan_vjp_matches_central_differences(shape, update):
    h0, c0, inputs, params, shift, (g_reads, g_h, g_c) = _scan_args(shape, steps=2, seed=1)
    kw = {"update": update, "window": 2 if update == "local" else None}

    def loss(shift_=shift, h=h0, content=inputs.write_content):
        args = WarpInputs(*inputs[:3], content, shift_)
        reads, h_t, c_t = dy.dynamic_memory_scan(h, c0, args, params, **kw)
        return np.sum(reads * g_reads) + np.sum(h_t * g_h) + np.sum(c_t * g_c)

    d_h, _, d_inputs, _ = dy.dynamic_memory_scan_vjp(
        h0, c0, WarpInputs(*inputs, shift), params, g_reads, g_h, g_c, **kw)
    rng = np.random.default_rng(3)
    e = 1e-6
    for value, grad, make in ((shift, d_inputs.shift, lambda v: {"shift_": v}),
                              (h0, d_h, lambda v: {"h": v}),
                              (inputs.write_content, d_inputs.write_content,
                               lambda v: {"content": v})):
        v = rng.standard_normal(value.shape)
        fd = (loss(**make(value + e * v)) - loss(**make(value - e * v))) / (2 * e)
        assert abs(fd - np.sum(grad * v)) <= 1e-6 * max(1.0, abs(fd))


@pytest.mark.parametrize("update", ["dense", "local"])
def test_flow_vjp_matches_central_differences_and_zero_flow_is_the_shift(update):
    h0, c0, inputs, params, shift, (g_reads, g_h, g_c) = _scan_args((4, 3), steps=2, seed=2)
    rng = np.random.default_rng(4)
    n = 2
    flow = tmcore.ConvParams(rng.standard_normal((n, C, 3)) * 0.5,
                             rng.standard_normal((n, C)) * 0.1,
                             rng.standard_normal((n, C)) * 0.1, rng.standard_normal(n) * 0.05)
    warped = WarpInputs(*inputs, shift)
    kw = {"update": update, "window": 2 if update == "local" else None}
    zero = tmcore.ConvParams(flow[0], flow[1], np.zeros((n, C)), np.zeros(n))
    for a, b in zip(dy.dynamic_memory_scan(h0, c0, warped, params, flow_params=zero, **kw),
                    dy.dynamic_memory_scan(h0, c0, warped, params, **kw), strict=True):
        _close(a, b)

    def loss(fp=flow, h=h0):
        reads, h_t, c_t = dy.dynamic_memory_scan(h, c0, warped, params, flow_params=fp, **kw)
        return np.sum(reads * g_reads) + np.sum(h_t * g_h) + np.sum(c_t * g_c)

    d_h, *_, d_flow = dy.dynamic_memory_scan_vjp(h0, c0, warped, params, g_reads, g_h, g_c,
                                                 flow_params=flow, **kw)
    e = 1e-6
    for k in range(4):
        v = rng.standard_normal(flow[k].shape)
        up, down = list(flow), list(flow)
        up[k], down[k] = flow[k] + e * v, flow[k] - e * v
        fd = (loss(tmcore.ConvParams(*up)) - loss(tmcore.ConvParams(*down))) / (2 * e)
        assert abs(fd - np.sum(d_flow[k] * v)) <= 1e-6 * max(1.0, abs(fd))
    v = rng.standard_normal(h0.shape)
    fd = (loss(h=h0 + e * v) - loss(h=h0 - e * v)) / (2 * e)
    assert abs(fd - np.sum(d_h * v)) <= 1e-6 * max(1.0, abs(fd))
    with pytest.raises(ValueError, match="flow_params"):
        dy.dynamic_memory_scan(h0, c0, inputs, params, flow_params=flow)


# --------------------------------------------------------------------------- NumPy layer


def _np_layer(options, grid=(4, 3), seed=0, warp_scale=0.0, method="fast"):
    config = tl.layer_config(D, C, grid, L, **options)
    rng = np.random.default_rng(seed)
    params = tl.init_params(np, config, lambda s: rng.uniform(-s.bound, s.bound, s.shape))
    if config.dynamics == "warp":
        params[tl.WARP_GROUP]["weight"] = warp_scale * rng.standard_normal((len(grid), D))
    flow = None
    if config.flow:
        params[tl.FLOW_GROUP]["pointwise_weight"] = warp_scale * rng.standard_normal(
            (len(grid), C))
        flow = tl.cell_params({"cell": params[tl.FLOW_GROUP]})
    options = dy.scan_options(config, method)

    def scan(h, c, inputs, **masks):
        return dy.dynamic_memory_scan(h, c, inputs, tl.cell_params(params),
                                      update=options.update, window=options.window,
                                      flow_params=flow, **masks)

    return tl.Layer(config), params, scan


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_numpy_layer_pieces_equal_one_call_and_packed_docs_equal_alone(name):
    layer, params, scan = _np_layer(OPTIONS[name], warp_scale=0.3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 9, D))
    out, state = layer.forward_stream(np, params, x, None, scan=scan)
    s, pieces = None, []
    for a, b in ((0, 3), (3, 4), (4, 9)):
        o, s = layer.forward_stream(np, params, x[:, a:b], s, scan=scan)
        pieces.append(o)
    _close(np.concatenate(pieces, axis=1), out, 1e-10)
    _close(s.h, state.h, 1e-10)
    starts = np.zeros((2, 9), dtype=bool)
    starts[0, 5] = starts[1, 3] = True
    packed, _ = layer.forward_stream(np, params, x, None, scan=scan, doc_starts=starts)
    for row, cut in ((0, 5), (1, 3)):
        first, _ = layer.forward_stream(np, params, x[row:row + 1, :cut], None, scan=scan)
        second, _ = layer.forward_stream(np, params, x[row:row + 1, cut:], None, scan=scan)
        _close(packed[row, :cut], first[0], 1e-10)
        _close(packed[row, cut:], second[0], 1e-10)


# --------------------------------------------------------------------------- torch


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed")


def _torch_pair(options, seed=0, grid=(4, 3)):
    """A default TensorMemory and one with ``options`` holding the same parameters."""
    torch = _torch()
    from tmcore.adapters.torch import TensorMemory

    torch.manual_seed(seed)
    kw = {"embed_dim": D, "memory_channels": C, "memory_shape": grid, "chunk_size": L,
          "dtype": torch.float64}
    base = TensorMemory(**kw)
    other = TensorMemory(**kw, **options)
    missing, unexpected = other.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected
    expected = (["warp_net.bias", "warp_net.weight"] if options.get("dynamics") == "warp"
                else []) + (FLOW_KEYS if options.get("flow") else [])
    assert sorted(missing) == sorted(expected)
    return base, other


def _perturb_warp(torch, module, seed):
    """Non-zero shift (and flow) heads, so the warp moves the state."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if hasattr(module, "warp_net"):
            module.warp_net.weight.copy_(0.3 * torch.randn(2, D, dtype=torch.float64,
                                                           generator=g))
        if hasattr(module, "warp_flow"):
            module.warp_flow.pointwise_weight.copy_(
                0.2 * torch.randn(2, C, dtype=torch.float64, generator=g))


def _grads(torch, module, x):
    module.zero_grad()
    out, _ = module(x, stream=False)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    return out.detach(), {k: p.grad.clone() for k, p in module.named_parameters()}


def _masked(module):
    """Use the masked (dense) definition of the local update as the module's scan."""
    from tmcore.adapters.torch import option_scan

    options = dy.scan_options(module.config, "masked")
    module._scan = lambda h0, c0, inputs, **masks: option_scan(
        options, h0, c0, inputs, module.cell.params(),
        module.warp_flow.params() if module.config.flow else None, **masks)
    return module


@pytest.mark.parametrize("name", ["local", "local+warp", "local+flow"])
def test_torch_local_layer_equals_the_masked_definition(name):
    torch = _torch()
    _, local = _torch_pair(OPTIONS[name])
    _, masked = _torch_pair(OPTIONS[name])
    masked.load_state_dict(local.state_dict())
    for m in (local, masked):
        _perturb_warp(torch, m, 5)
    _masked(masked)
    x = torch.randn(2, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, grads = _grads(torch, local, x)
    ref, ref_grads = _grads(torch, masked, x)
    _close(out, ref)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        _close(grads[key], ref_grads[key])


def test_torch_full_window_and_zero_warp_equal_the_default_layer():
    torch = _torch()
    x = torch.randn(2, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for options in ({"update": "local", "window": 4}, {"dynamics": "warp"},
                    {"update": "local", "window": 4, "dynamics": "warp"},
                    {"dynamics": "warp", "flow": True}):
        base, other = _torch_pair(options)
        ref, ref_grads = _grads(torch, base, x)
        out, grads = _grads(torch, other, x)
        _close(out, ref)
        for key, value in ref_grads.items():
            _close(grads[key], value)
        if "dynamics" in options:  # the shift (and flow) heads get a gradient at zero
            assert grads["warp_net.weight"].abs().sum() > 0
        if options.get("flow"):
            assert grads["warp_flow.pointwise_weight"].abs().sum() > 0


def test_torch_local_layer_keeps_the_state_outside_the_window_bit_for_bit():
    torch = _torch()
    _, m = _torch_pair(OPTIONS["local"], grid=(5, 4))
    g = torch.Generator().manual_seed(12)
    h0, c0 = (torch.randn(2, C, 5, 4, dtype=torch.float64, generator=g) for _ in range(2))
    x = torch.randn(2, L, D, dtype=torch.float64, generator=g)  # one chunk
    with torch.no_grad():
        _, (h, c) = m(x, (h0, c0), stream=False)
        write = m.layer.heads(tl_xp(), m.params(), x[:, None]).write_coords[:, 0]
    outside = ~window_mask(np, window_geometry(np, write.numpy(), (5, 4), 2), (5, 4))
    outside = torch.from_numpy(np.broadcast_to(outside, h0.shape).copy())
    assert outside.any() and (~outside).any()
    assert torch.equal(h[outside], h0[outside]) and torch.equal(c[outside], c0[outside])
    assert not torch.equal(h[~outside], h0[~outside])


def tl_xp():
    from tmcore.adapters.torch import bridge as _torch_ops

    return _torch_ops._XP


def test_torch_default_layer_keeps_its_scan(monkeypatch):
    torch = _torch()
    from tmcore.adapters.torch import modules

    def refuse(*args, **kwargs):
        raise AssertionError("the default layer must not use the local/warp scan")

    monkeypatch.setattr(modules, "option_scan", refuse)
    base, _ = _torch_pair({})
    base(torch.randn(1, 4, D, dtype=torch.float64))


def test_torch_scan_function_passes_gradcheck():
    torch = _torch()
    from tmcore.adapters.torch import option_scan
    from tmcore.types import ConvParams

    h0, c0, inputs, params, shift, _ = _scan_args((4, 3), steps=2, batch=1, channels=1)
    values = (h0, c0, *inputs, shift, *params)
    # the state, the write centre, the shift and the gates' matrix: every path of the VJP
    checked = {0, 3, 6, 9}
    tensors = [torch.tensor(a, requires_grad=i in checked) for i, a in enumerate(values)]
    options = dy.ScanOptions("local", 2)
    assert torch.autograd.gradcheck(
        lambda *t: option_scan(options, t[0], t[1], WarpInputs(*t[2:7]), ConvParams(*t[7:])),
        tensors, eps=1e-6, atol=1e-6)


def test_torch_shift_head_gradient_matches_finite_differences():
    torch = _torch()
    _, warp = _torch_pair({"dynamics": "warp", "update": "local", "window": 2})
    with torch.no_grad():
        warp.warp_net.weight.copy_(0.3 * torch.randn(2, D, dtype=torch.float64,
                                                     generator=torch.Generator().manual_seed(6)))
    x = torch.randn(2, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def loss():
        out, _ = warp(x, stream=False)
        return (out * torch.cos(torch.arange(out.numel(), dtype=out.dtype))
                .reshape(out.shape)).sum()

    warp.zero_grad()
    loss().backward()
    grad = warp.warp_net.weight.grad.clone()
    e = 1e-6
    with torch.no_grad():
        for index in [(0, 0), (1, 3), (0, 4)]:
            weight = warp.warp_net.weight
            weight[index] += e
            up = loss().item()
            weight[index] -= 2 * e
            down = loss().item()
            weight[index] += e
            assert abs((up - down) / (2 * e) - grad[index].item()) <= 1e-7


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_torch_streaming_and_packed_documents(name):
    torch = _torch()
    _, m = _torch_pair(OPTIONS[name])
    _perturb_warp(torch, m, 8)
    x = torch.randn(2, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out, state = m(x)
        s, pieces = None, []
        for a, b in ((0, 1), (1, 4), (4, 9)):
            o, s = m(x[:, a:b], s)
            pieces.append(o)
        _close(torch.cat(pieces, dim=1), out, 1e-10)
        _close(s.h, state.h, 1e-10)
        starts = torch.zeros(2, 9, dtype=torch.bool)
        starts[0, 5] = starts[1, 3] = True
        packed, _ = m(x, doc_starts=starts)
        for row, cut in ((0, 5), (1, 3)):
            _close(packed[row, :cut], m(x[row:row + 1, :cut])[0][0], 1e-10)
            _close(packed[row, cut:], m(x[row:row + 1, cut:])[0][0], 1e-10)
        reset, _ = m(x, state, reset=torch.tensor([True, False]))
        _close(reset[0], out[0], 1e-10)


# --------------------------------------------------------------------------- JAX


def _jax():
    jax = pytest.importorskip("jax", reason="jax is not installed")
    pytest.importorskip("flax", reason="the JAX adapter needs flax")
    return jax


@pytest.mark.parametrize("name", [pytest.param("local", marks=pytest.mark.slow),
                                  pytest.param("warp", marks=pytest.mark.slow),
                                  pytest.param("local+warp", marks=pytest.mark.slow),
                                  "local+flow"])
def test_jax_equals_torch_with_each_option(name):
    jax = _jax()
    torch = _torch()
    from tmcore.adapters import jax as tj

    _, m = _torch_pair(OPTIONS[name])
    _perturb_warp(torch, m, 10)
    x = torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    out, grads = _grads(torch, m, x)
    with jax.enable_x64(True):
        import jax.numpy as jnp

        params = {g: {k: jnp.asarray(v.detach().numpy()) for k, v in leaves.items()}
                  for g, leaves in m.params().items()}
        params["config"] = m.config
        xj = jnp.asarray(x.numpy())
        weights = jnp.linspace(-1, 1, out.numel(), dtype=jnp.float64).reshape(out.shape)

        def loss(p):
            y, _ = tj.apply(p, xj, stream=False)
            return jnp.sum(y * weights), y

        (_, y), g = jax.value_and_grad(loss, has_aux=True)(params)
        _close(y, out.numpy(), 1e-10)
        for key, value in grads.items():
            group, leaf = key.split(".")
            _close(g[group][leaf], value.numpy(), 1e-10)


def test_jax_streaming_and_packed_documents_with_both_options():
    jax = _jax()
    from tmcore.adapters import jax as tj

    options = OPTIONS["local+warp"]
    with jax.enable_x64(True):
        import jax.numpy as jnp

        params = tj.init(jax.random.PRNGKey(0), D, C, (4, 3), L, dtype=jnp.float64,
                         **options)
        params[tl.WARP_GROUP]["weight"] = 0.3 * jax.random.normal(
            jax.random.PRNGKey(1), (2, D), jnp.float64)
        x = jax.random.normal(jax.random.PRNGKey(2), (2, 4, D), jnp.float64)
        full, state = tj.apply(params, x)
        first, s = tj.apply(params, x[:, :1])
        second, s = tj.apply(params, x[:, 1:], s)
        _close(jnp.concatenate([first, second], axis=1), full, 1e-10)
        _close(s.h, state.h, 1e-10)
        starts = np.zeros((2, 4), dtype=bool)
        starts[:, 1] = True
        packed, _ = tj.apply(params, x, doc_starts=jnp.asarray(starts))
        alone, _ = tj.apply(params, x[:, 1:])
        _close(packed[:, :1], first, 1e-10)
        _close(packed[:, 1:], alone, 1e-10)


def test_jax_warp_needs_its_parameters_and_init_makes_them():
    jax = _jax()
    from tmcore.adapters import jax as tj

    warp = tj.init(jax.random.PRNGKey(0), D, C, (4, 3), L, dynamics="warp")
    assert warp[tl.WARP_GROUP]["weight"].shape == (2, D)
    assert not np.any(np.asarray(warp[tl.WARP_GROUP]["weight"]))
    assert not np.any(np.asarray(warp[tl.WARP_GROUP]["bias"]))
    plain = {group: leaves for group, leaves in warp.items() if group != tl.WARP_GROUP}
    with pytest.raises(KeyError, match="warp_net"):
        tj.apply(plain, jax.numpy.ones((1, 4, D)))  # its config says dynamics="warp"


def test_layer_options_benchmark_measures_and_renders_a_tiny_grid():
    _torch()
    from benchmarks import local_update

    rows = local_update.measure_layer_options([4], 1, 1, 2, 0.0, steps=2)
    assert {(r["option"], r["pass"]) for r in rows} == {
        (name, p) for name, _, _ in local_update.LAYER_OPTIONS for p in ("fwd", "fwd+bwd")}
    assert all(r["ms_min"] > 0 and r["reps"] >= 3 for r in rows)
    text = local_update.layer_table({"config": {"grids": [4], "steps": 2}, "rows": rows})
    assert "| local + warp | fwd+bwd |" in text


@pytest.mark.parametrize("name", [pytest.param("local", marks=pytest.mark.slow),
                                  pytest.param("warp", marks=pytest.mark.slow),
                                  pytest.param("local+warp", marks=pytest.mark.slow),
                                  "local+flow"])
def test_jax_nnx_modules_with_each_option_equal_apply(name):
    """The NNX TensorMemory / MemoryResidual take the options, make warp_net / warp_flow
    like init, and compute what apply / residual_apply do with their parameters."""
    jax = _jax()
    from flax import nnx

    from tmcore.adapters import jax as tj

    options = OPTIONS[name]
    import jax.numpy as jnp

    module = tj.TensorMemory(D, C, (4, 3), L, rngs=nnx.Rngs(0), **options)
    params = tj.params_from_module(module)
    want = tl.param_specs(tl.layer_config(D, C, (4, 3), L, **options))
    assert params["config"] == tl.layer_config(D, C, (4, 3), L, **options)
    assert sorted((g, k) for g, leaves in params.items() if g != "config"
                  for k in leaves) == sorted((s.group, s.leaf) for s in want)
    reference = tj.init(jax.random.PRNGKey(0), D, C, (4, 3), L,
                        **{k: v for k, v in options.items() if k in ("dynamics", "flow")})
    for spec in want:  # the option groups start as init makes them (zeros, identity taps)
        if spec.group in (tl.WARP_GROUP, tl.FLOW_GROUP):
            np.testing.assert_array_equal(params[spec.group][spec.leaf],
                                          reference[spec.group][spec.leaf])
    if tl.WARP_GROUP in params:  # a shift (and flow) that moves the state
        params[tl.WARP_GROUP]["weight"] = 0.3 * jax.random.normal(jax.random.PRNGKey(1),
                                                                  (2, D))
    if tl.FLOW_GROUP in params:
        params[tl.FLOW_GROUP]["pointwise_weight"] = 0.2 * jax.random.normal(
            jax.random.PRNGKey(2), (2, C))
    tj.load_params(module, params)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, D), jnp.float32)
    out, state = module(x)
    expected, expected_state = tj.apply(params, x)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(state.h, expected_state.h)
    default = {k: v for k, v in params.items() if k not in (tl.WARP_GROUP, tl.FLOW_GROUP)}
    default["config"] = tl.layer_config(D, C, (4, 3), L)
    plain, _ = tj.apply(default, x)  # the options matter here
    assert np.max(np.abs(np.asarray(plain) - np.asarray(out))) > 1e-6
    residual = tj.MemoryResidual(D, C, (4, 3), L, gate_init=1.0, rngs=nnx.Rngs(0), **options)
    rparams = tj.params_from_module(residual)
    rparams["memory"] = params
    tj.load_params(residual, rparams)
    out, _ = residual(x)
    expected, _ = tj.residual_apply(rparams, x)
    np.testing.assert_array_equal(out, expected)
    assert jnp.issubdtype(out.dtype, jnp.floating)


def test_jax_nnx_default_module_keeps_its_parameters():
    _jax()
    from flax import nnx

    from tmcore.adapters import jax as tj

    module = tj.TensorMemory(D, C, (4, 3), L, rngs=nnx.Rngs(0))
    config = tl.layer_config(D, C, (4, 3), L)
    assert module.config == config
    assert module.param_keys == tuple((s.group, s.leaf) for s in tl.param_specs(config))
    assert set(tj.params_from_module(module)) == {*tl.GROUPS, "config"}
    with pytest.raises(ValueError, match="window"):
        tj.TensorMemory(D, C, (4, 3), L, rngs=nnx.Rngs(0), update="local")


@pytest.mark.parametrize("precision", ["float32", pytest.param("float64",
                                                                marks=pytest.mark.slow)])
def test_state_dict_round_trip_torch_jax_torch_with_warp_flow_local(precision):
    """params_from_state_dict carries warp_net / warp_flow (shapes checked like the other
    groups) and state_dict_from_params writes them back: torch -> JAX -> torch of a local
    warp+flow layer loads strictly and every output agrees."""
    jax = _jax()
    torch = _torch()
    from tmcore.adapters import jax as tj
    from tmcore.adapters.torch import TensorMemory

    options = OPTIONS["local+flow"]
    tdtype = getattr(torch, precision)
    tol = 1e-6 if precision == "float32" else 1e-12
    torch.manual_seed(0)
    kw = {"embed_dim": D, "memory_channels": C, "memory_shape": (4, 3), "chunk_size": L,
          "dtype": tdtype, **options}
    m = TensorMemory(**kw)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        m.warp_net.weight.copy_(0.3 * torch.randn(2, D, dtype=tdtype, generator=g))
        m.warp_flow.pointwise_weight.copy_(0.2 * torch.randn(2, C, dtype=tdtype, generator=g))
    x = torch.randn(2, 5, D, dtype=tdtype, generator=g)
    with torch.no_grad():
        out, _ = m(x, stream=False)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    assert {k for k in sd if k.startswith(("warp_net.", "warp_flow."))} == {
        "warp_net.weight", "warp_net.bias", *FLOW_KEYS}
    with jax.enable_x64(precision == "float64"):
        params = tj.params_from_state_dict(sd, config=m.config)
        assert set(params[tl.FLOW_GROUP]) == {k.split(".")[1] for k in FLOW_KEYS}
        y, _ = tj.apply(params, jax.numpy.asarray(x.numpy()), stream=False)
        _close(y, out.numpy(), tol)
        back = tj.state_dict_from_params(params)
    assert set(back) == set(sd)
    again = TensorMemory(**kw)
    again.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in back.items()},
                          strict=True)
    with torch.no_grad():
        out2, _ = again(x, stream=False)
    _close(out2.numpy(), out.numpy(), tol)
    # the option groups are validated like the others, naming the key
    bad = dict(sd, **{"warp_flow.pointwise_weight": np.zeros((2, C + 1), sd["warp_net.bias"]
                                                             .dtype)})
    with pytest.raises(ValueError, match=r"sd\['warp_flow.pointwise_weight'\]: expected shape"):
        tj.params_from_state_dict(bad)
    no_shift = {k: v for k, v in sd.items() if not k.startswith("warp_net.")}
    with pytest.raises(KeyError, match="warp_net.weight"):
        tj.params_from_state_dict(no_shift)
    with pytest.raises(ValueError, match="not parameters"):
        tj.params_from_state_dict(dict(sd, **{"warp_net.scale": sd["warp_net.bias"]}))
    # a warp-only layer converts too (no warp_flow), the default one keeps its names
    plain = tj.params_from_state_dict({k: v for k, v in sd.items()
                                       if not k.startswith("warp_flow.")})
    assert tl.WARP_GROUP in plain and tl.FLOW_GROUP not in plain


@pytest.mark.parametrize("name", ["local", "local+flow"])
def test_jax_option_scan_compiles_to_one_loop_whatever_the_length(name):
    """The local / warp scan is one lax.scan (not a Python loop unrolled under jit): the
    gradient's program is the same size for 8 and 128 chunks (an op count, not a time)."""
    jax = _jax()
    import jax.numpy as jnp

    from tmcore.adapters import jax as tj

    options = OPTIONS[name]
    params = tj.init(jax.random.key(0), D, C, (4, 3), 1, **options)

    def program_lines(tokens):
        x = jnp.ones((2, tokens, D), dtype=jnp.float32)  # the parameters' (x64 or not)

        def loss(p):
            return jnp.sum(tj.apply(p, x, stream=False)[0])

        return len(str(jax.make_jaxpr(jax.grad(loss))(params)).splitlines())

    short, long = program_lines(8), program_lines(128)
    # a few lines of chunk bookkeeping differ; an unrolled loop would add a step's
    # hundreds of equations per chunk (120 more chunks)
    assert abs(long - short) <= 32, (short, long)
