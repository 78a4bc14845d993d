"""The warp scan's checkpoints (``checkpoint_every``, :mod:`tmcore.scan.warped`).

Contract: with a warp, :func:`tmcore.scan.warped.scan_fwd` keeps only the states entering
steps ``0, k, 2k, ...`` (``ceil(T / k)`` of each of ``h, c``; ``k >= T``: the initial
state only) and :func:`tmcore.scan.warped.scan_bwd` replays each segment, so the values and
gradients are those of ``k = 1`` bit for bit (NumPy, torch, JAX); the torch Function and
the JAX ``custom_vjp`` keep only those checkpoints; the layer's ``checkpoint_every``
reaches the options' scan; a bad ``checkpoint_every`` is a named error.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import tmcore
from tmcore import layer as tl
from tmcore.scan import options as dy
from tmcore.types import StepInputs, WarpInputs

B, C, GRID = 2, 2, (3, 3, 3)
N = len(GRID)


def _args(steps, seed=0):
    """Float64 ``(h0, c0, WarpInputs, params, flow_params, (g_reads, g_h, g_c))``."""
    rng = np.random.default_rng(seed)
    h0 = rng.standard_normal((B, C, *GRID))
    c0 = rng.standard_normal((B, C, *GRID))
    inputs = WarpInputs(rng.uniform(-0.9, 0.9, (B, steps, N)),
                           rng.uniform(-0.9, 0.9, (B, steps, N)),
                           rng.uniform(0.2, 0.5, (B, steps)),
                           rng.standard_normal((B, steps, C)),
                           rng.uniform(-0.3, 0.3, (B, steps, N)))
    params = tmcore.ConvParams(rng.standard_normal((N, 2 * C, 3)) * 0.5,
                               rng.standard_normal((N, 2 * C)) * 0.1,
                               rng.standard_normal((4 * C, 2 * C)) * 0.5,
                               rng.standard_normal((4 * C,)) * 0.1)
    flow = tmcore.ConvParams(rng.standard_normal((N, C, 3)) * 0.5,
                             rng.standard_normal((N, C)) * 0.1,
                             rng.standard_normal((N, C)) * 0.1,
                             rng.standard_normal(N) * 0.05)
    cot = (rng.standard_normal((B, steps, C)), rng.standard_normal(h0.shape),
           rng.standard_normal(h0.shape))
    return h0, c0, inputs, params, flow, cot


def _leaves(tree):
    out = []
    for x in tree:
        if isinstance(x, tuple):
            out.extend(_leaves(x))
        elif x is not None:
            out.append(x)
    return out


def _everies(steps):
    return sorted({1, 2, 3, steps, steps + 2})


def _kw(update):
    return {"update": update, "window": 2 if update == "local" else None}


# --------------------------------------------------------------------------- NumPy


@pytest.mark.parametrize("flow", [False, True])
@pytest.mark.parametrize("update", ["dense", "local"])
def test_checkpointed_warp_scan_equals_every_state_bit_for_bit(update, flow):
    for steps in (1, 4, 7):
        h0, c0, inputs, params, flow_params, cot = _args(steps, seed=steps)
        kw = dict(_kw(update), flow_params=flow_params if flow else None)
        base_values = dy.dynamic_memory_scan(h0, c0, inputs, params, **kw)
        base = _leaves(dy.dynamic_memory_scan_vjp(h0, c0, inputs, params, *cot, **kw))
        assert len(base) == (2 + 5 + 4 + (4 if flow else 0))
        for every in _everies(steps):
            values = dy.dynamic_memory_scan(h0, c0, inputs, params, checkpoint_every=every,
                                            **kw)
            for a, b in zip(values, base_values, strict=True):
                assert np.array_equal(a, b)
            grads = _leaves(dy.dynamic_memory_scan_vjp(h0, c0, inputs, params, *cot,
                                                       checkpoint_every=every, **kw))
            for i, (a, b) in enumerate(zip(grads, base, strict=True)):
                assert a.shape == b.shape
                assert np.array_equal(a, b), (steps, every, i)


@pytest.mark.parametrize("steps", [1, 4, 7])
def test_scan_fwd_keeps_ceil_t_over_k_states(steps):
    h0, c0, inputs, params, flow_params, _ = _args(steps)
    for every in _everies(steps):
        options = dy.ScanOptions(checkpoint_every=every)
        reads, h, c, residuals = dy.scan_fwd(np, h0, c0, inputs, params, options,
                                             flow_params=flow_params)
        count = math.ceil(steps / every)
        assert residuals.log is None
        assert residuals.h.shape == (count, *h0.shape)
        assert residuals.c.shape == (count, *c0.shape)
        # the checkpoints are the states entering steps 0, k, 2k, ...
        assert np.array_equal(residuals.h[0], h0)
        assert np.array_equal(residuals.c[0], c0)
        if count > 1:
            _, h_k, c_k, _ = dy.scan_fwd(np, h0, c0, WarpInputs(
                *(x[:, :every] for x in inputs)), params, options, keep=False,
                flow_params=flow_params)
            assert np.array_equal(residuals.h[1], h_k)
            assert np.array_equal(residuals.c[1], c_k)
        nbytes = sum(x.nbytes for x in (residuals.h, residuals.c))
        assert nbytes == count * 2 * h0.nbytes


def test_the_local_scan_without_warp_ignores_checkpoint_every():
    h0, c0, inputs, params, _, cot = _args(4)
    plain = StepInputs(*inputs[:4])
    base = _leaves(dy.dynamic_memory_scan_vjp(h0, c0, plain, params, *cot, **_kw("local")))
    for every in (2, 9):
        grads = dy.dynamic_memory_scan_vjp(h0, c0, plain, params, *cot, checkpoint_every=every,
                                           **_kw("local"))
        for a, b in zip(_leaves(grads), base, strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError),
                                          (2.0, TypeError), (True, TypeError),
                                          (None, TypeError)])
def test_bad_checkpoint_every_is_named(value, error):
    h0, c0, inputs, params, _, cot = _args(2)
    with pytest.raises(error, match="checkpoint_every"):
        dy.dynamic_memory_scan(h0, c0, inputs, params, checkpoint_every=value)
    with pytest.raises(error, match="checkpoint_every"):
        dy.dynamic_memory_scan_vjp(h0, c0, inputs, params, *cot, checkpoint_every=value)
    with pytest.raises(error, match="checkpoint_every"):
        dy.check_options(dy.ScanOptions(checkpoint_every=value))
    with pytest.raises(error, match="checkpoint_every"):
        tl.layer_config(5, C, GRID, 2, dynamics="warp", checkpoint_every=value)


def test_scan_options_carry_the_layers_checkpoint_every():
    config = tl.layer_config(5, C, GRID, 2, dynamics="warp", checkpoint_every=4)
    assert dy.scan_options(config).checkpoint_every == 4
    assert dy.scan_options(config, "masked") == dy.ScanOptions(
        "dense", None, config.eps, config.radius, "masked", 4)
    assert dy.scan_options(tl.layer_config(5, C, GRID, 2, dynamics="warp")).checkpoint_every \
        == tl.LayerConfig.checkpoint_every == dy.ScanOptions().checkpoint_every == 1


# --------------------------------------------------------------------------- torch


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed")


@pytest.mark.parametrize("flow", [False, True])
@pytest.mark.parametrize("update", ["dense", "local"])
def test_torch_function_saves_only_the_checkpoints_and_gives_the_same_bits(update, flow):
    torch = _torch()
    from tmcore.adapters.torch.bridge import _OPTION_SCANS, option_scan
    from tmcore.types import ConvParams

    steps = 7
    h0, c0, inputs, params, flow_params, cot = _args(steps, seed=5)
    values = (h0, c0, *inputs, *params, *(flow_params if flow else ()))

    def run(every):
        tensors = [torch.tensor(a, requires_grad=True) for a in values]
        options = dy.ScanOptions(update, 2 if update == "local" else None,
                                 checkpoint_every=every)
        # the op's residual outputs: what its backward keeps
        kept = list(_OPTION_SCANS[(True, flow)].op(*tensors, *options, True)[3:5])
        reads, h, c = option_scan(options, tensors[0], tensors[1], WarpInputs(*tensors[2:7]),
                                  ConvParams(*tensors[7:11]),
                                  ConvParams(*tensors[11:]) if flow else None)
        loss = sum((x * torch.tensor(g)).sum() for x, g in zip((reads, h, c), cot,
                                                               strict=True))
        loss.backward()
        return [reads, h, c], [t.grad for t in tensors], kept

    base_out, base_grads, base_kept = run(1)
    assert [k.shape[0] for k in base_kept] == [steps, steps]
    for every in _everies(steps):
        out, grads, kept = run(every)
        count = math.ceil(steps / every)
        assert [k.shape for k in kept] == [(count, B, C, *GRID)] * 2
        assert sum(k.nbytes for k in kept) == count * 2 * h0.nbytes
        for a, b in zip(out, base_out, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(grads, base_grads, strict=True):
            assert torch.equal(a, b), every


def test_torch_layer_passes_its_checkpoint_every_to_the_options_scan():
    torch = _torch()
    from tmcore.adapters.torch import TensorMemory

    x = torch.randn(2, 10, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = {}
    for every in (1, 2, 9):
        torch.manual_seed(0)
        module = TensorMemory(5, C, GRID, 2, dynamics="warp", flow=True,
                              checkpoint_every=every, dtype=torch.float64)
        with torch.no_grad():  # a moving warp
            module.warp_net.weight.copy_(0.3 * torch.randn(N, 5, dtype=torch.float64,
                                                           generator=torch.Generator()
                                                           .manual_seed(2)))
        kept = []
        scan = module._scan

        def spy(h0, c0, inputs, scan=scan, kept=kept):
            reads, h, c = scan(h0, c0, inputs)
            kept.append(reads.grad_fn.saved_tensors[-3].shape[0])  # the saved h states
            return reads, h, c

        module._scan = spy
        out, _ = module(x, stream=False)
        out.square().sum().backward()
        assert kept == [math.ceil(5 / every)]  # 10 tokens, chunks of 2: T = 5
        results[every] = [out.detach(), *(p.grad for p in module.parameters())]
    for every in (2, 9):
        for a, b in zip(results[every], results[1], strict=True):
            assert torch.equal(a, b)


def test_torch_function_names_a_bad_checkpoint_every():
    torch = _torch()
    from tmcore.adapters.torch import option_scan
    from tmcore.types import ConvParams

    h0, c0, inputs, params, _, _ = _args(2)
    tensors = [torch.tensor(a) for a in (h0, c0, *inputs, *params)]
    with pytest.raises(ValueError, match="checkpoint_every"):
        option_scan(dy.ScanOptions(checkpoint_every=0), tensors[0], tensors[1],
                    WarpInputs(*tensors[2:7]), ConvParams(*tensors[7:]))


# --------------------------------------------------------------------------- JAX


def _jax():
    return pytest.importorskip("jax", reason="jax is not installed")


def _xla_default_pipeline() -> bool:
    """Whether XLA compiles with its default optimization pipeline (the suite may lower it
    to compile faster, tests/conftest.py; TMCORE_TEST_XLA_DEFAULTS=1 restores it)."""
    return "--xla_backend_optimization_level=0" not in os.environ.get("XLA_FLAGS", "")


@pytest.mark.parametrize("update, flow", [("dense", False),
                                          pytest.param("local", True, marks=pytest.mark.slow)])
def test_jax_custom_vjp_keeps_only_the_checkpoints_and_gives_the_same_values(update, flow):
    jax = _jax()
    from tmcore.adapters.jax import bridge
    from tmcore.types import ConvParams, WarpParams

    steps = 3
    h0, c0, inputs, params, flow_params, cot = _args(steps, seed=6)
    with jax.enable_x64(True):
        import jax.numpy as jnp

        args = jax.tree_util.tree_map(jnp.asarray, (h0, c0, inputs, params,
                                                    flow_params if flow else None))
        cot = tuple(jnp.asarray(g) for g in cot)

        def scan(options, h0, c0, inputs, params, flow):
            step = dy.step_for(options, warp=True)
            return bridge.LayerScan(step, WarpParams(ConvParams(*params), flow),
                                    options.checkpoint_every)(h0, c0, inputs)

        def run(every):
            options = dy.ScanOptions(update, 2 if update == "local" else None,
                                     checkpoint_every=every)
            h, c, inputs, params, flow = args
            static = bridge.ScanStatic(dy.step_for(options, warp=True), every,
                                       bridge.options_key())
            xs = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 1, 0), inputs)
            out, (_, _, checkpoints, tail) = bridge._scan_fwd(
                static, WarpParams(ConvParams(*params), flow), xs, h, c)
            # the states kept: one per full segment, plus the tail segment's start
            kept = [jnp.concatenate([s, *([] if tail is None else [t[None]])])
                    for s, t in zip(checkpoints, tail or (None, None), strict=True)]
            out = (jnp.moveaxis(out[0], 0, 1), *out[1:])
            _, pullback = jax.vjp(lambda *a: scan(options, *a), *args)
            return out, jax.tree_util.tree_leaves(pullback(cot)), kept

        base_out, base_grads, base_kept = run(1)
        assert [k.shape[0] for k in base_kept] == [steps, steps]
        out, grads, kept = run(2)
        assert [k.shape for k in kept] == [(2, B, C, *GRID)] * 2
        for a, b in zip(out, base_out, strict=True):
            assert np.array_equal(a, b)
        assert len(grads) == len(base_grads) == 2 + 5 + 4 + (4 if flow else 0)
        for a, b in zip(grads, base_grads, strict=True):
            if _xla_default_pipeline():  # the replay compiles to the forward's bits
                assert np.array_equal(a, b)
            else:  # XLA at optimization level 0 rounds the two programs differently
                np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)
        with pytest.raises(ValueError, match="checkpoint_every"):
            scan(dy.ScanOptions(checkpoint_every=0), *args)


def test_jax_layer_scan_gets_the_configs_checkpoint_every():
    _jax()
    pytest.importorskip("flax", reason="the JAX adapter needs flax")
    from tmcore.adapters.jax import functional as tj

    config = tl.layer_config(5, C, GRID, 2, dynamics="warp", checkpoint_every=3)
    scan = tj._layer_scan(config, None, {"warp_flow": None})
    assert scan.checkpoint_every == 3
