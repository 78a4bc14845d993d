"""PyTorch and JAX adapters agree: same parameters, same input and state -> same outputs,
final state and gradients (float64, relative 1e-10).

The torch module's ``state_dict`` (as NumPy arrays) goes through
``tmcore.adapters.jax.params_from_state_dict``; both frameworks then run the same
tokens from the same non-zero state and are differentiated with the same cotangents.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
jax = pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")
tm_torch = pytest.importorskip("tmcore.adapters.torch",
                               reason="the PyTorch adapter (adapters/torch.py) is missing")
if not hasattr(tm_torch, "TensorMemory"):
    pytest.skip("tmcore.adapters.torch has no TensorMemory", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from tmcore.adapters import jax as tmj  # noqa: E402
from tmcore.testing.finite_diff import relative_error  # noqa: E402

D, C, SHAPE, L = 6, 3, (3, 4, 2), 3
TOL = 1e-10


@pytest.fixture(autouse=True, scope="module")
def x64():
    with jax.enable_x64(True):
        yield


def _torch_memory(seed: int, sigma_scale: float):
    torch.manual_seed(seed)
    memory = tm_torch.TensorMemory(D, C, SHAPE, L, sigma_scale=sigma_scale, dtype=torch.float64)
    with torch.no_grad():  # move the cell away from its identity init
        for p in memory.cell.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return memory


def _inputs(seed: int, tokens: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, tokens, D))
    h0, c0 = (0.3 * rng.normal(size=(2, C, *SHAPE)) for _ in range(2))
    g_out = rng.normal(size=(2, tokens, D))
    g_h, g_c = (rng.normal(size=(2, C, *SHAPE)) for _ in range(2))
    return (x, h0, c0), (g_out, g_h, g_c)


def _compare(module, jax_fn, params, inputs, cotangents):
    """Run both, return {name: relative error} for outputs, state and every gradient."""
    t_in = [torch.tensor(a, requires_grad=True) for a in inputs]
    out, (h, c, *_) = module(t_in[0], (t_in[1], t_in[2]))  # a StreamState (the default)
    loss = sum((o * torch.tensor(g)).sum() for o, g in zip((out, h, c), cotangents,
                                                           strict=True))
    loss.backward()

    def run(p, x, h0, c0):
        out, state = jax_fn(p, x, tmj.MemoryState(h0, c0))
        return out, state.h, state.c

    j_out, vjp = jax.vjp(jax.jit(run), params, *map(jnp.asarray, inputs))
    j_grads = vjp(tuple(map(jnp.asarray, cotangents)))
    errors = {}
    for name, a, b in zip(("out", "h", "c"), j_out, (out, h, c), strict=True):
        errors[name] = relative_error(np.asarray(a), b.detach().numpy())
    for name, a, b in zip(("d_x", "d_h0", "d_c0"), j_grads[1:], t_in, strict=True):
        errors[name] = relative_error(np.asarray(a), b.grad.numpy())
    j_param_grads = tmj.state_dict_from_params(j_grads[0])
    for name, param in module.named_parameters():
        errors[f"d_{name}"] = relative_error(j_param_grads[name], param.grad.numpy())
    return errors


@pytest.mark.parametrize("tokens", [9, 8])  # whole chunks; a ragged last chunk
def test_layer_agrees_with_torch(tokens):
    memory = _torch_memory(0, sigma_scale=0.7)
    sd = {k: v.detach().numpy() for k, v in memory.state_dict().items()}
    params = tmj.params_from_state_dict(sd, config=memory.config)
    assert set(tmj.state_dict_from_params(params)) == set(sd)
    inputs, cotangents = _inputs(1, tokens)
    errors = _compare(memory, lambda p, x, s: tmj.apply(p, x, s), params,
                      inputs, cotangents)
    print(f"\ntorch vs jax, layer, N={tokens}: max relative error "
          f"{max(errors.values()):.2e} ({max(errors, key=errors.get)})")
    assert max(errors.values()) < TOL, errors


def test_gated_residual_agrees_with_torch():
    memory = _torch_memory(2, sigma_scale=1.0)
    residual = tm_torch.MemoryResidual(memory, gate_init=-2.0)
    with torch.no_grad():
        residual.norm.weight.add_(0.1 * torch.randn_like(residual.norm.weight))
        residual.norm.bias.add_(0.1 * torch.randn_like(residual.norm.bias))
    sd = {f"blocks.3.{k}": v.detach().numpy() for k, v in residual.state_dict().items()}
    params = tmj.params_from_state_dict(sd)  # prefix "blocks.3." inferred
    assert sorted(params) == ["gate", "memory", "norm"]
    inputs, cotangents = _inputs(3, 9)
    errors = _compare(residual, tmj.residual_apply, params, inputs, cotangents)
    print(f"\ntorch vs jax, gated residual: max relative error {max(errors.values()):.2e} "
          f"({max(errors, key=errors.get)})")
    assert max(errors.values()) < TOL, errors


def test_checkpointed_layer_agrees_with_torch():
    """Both adapters' checkpointing scans (every 2nd chunk state kept) give the same
    outputs and gradients as each other."""
    torch.manual_seed(4)
    memory = tm_torch.TensorMemory(D, C, SHAPE, L, sigma_scale=0.7, dtype=torch.float64,
                                   checkpoint_every=2)
    with torch.no_grad():
        for p in memory.cell.parameters():
            p.add_(0.2 * torch.randn_like(p))
    sd = {k: v.detach().numpy() for k, v in memory.state_dict().items()}
    params = tmj.params_from_state_dict(sd, config=memory.config)
    inputs, cotangents = _inputs(5, 14)  # 5 chunks: two full segments and a tail
    errors = _compare(memory, tmj.apply, params, inputs, cotangents)
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize(("name", "value", "error"), [
    ("embed_dim", 2.0, TypeError), ("memory_channels", True, TypeError),
    ("chunk_size", 0, ValueError), ("memory_shape", (3, 0, 2), ValueError),
])
def test_config_errors_have_the_same_type(name, value, error):
    """One config check (tmcore.layer) behind both adapters: same exception type, and the
    message names the argument."""
    config = {"embed_dim": D, "memory_channels": C, "memory_shape": SHAPE, "chunk_size": L,
              name: value}
    with pytest.raises(error, match=name):
        tm_torch.TensorMemory(**config)
    with pytest.raises(error, match=name):
        tmj.init(jax.random.key(0), **config)
