"""``jax.export`` of the JAX layer with a symbolic batch (issue 60): it exports, and the
exported call equals the concrete one at several batch sizes (the size gates skip sizes
they cannot read, a symbolic batch plans the grid with arrays)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")

import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from tmcore.adapters import jax as tmj  # noqa: E402


@pytest.mark.parametrize("tokens", [8, 11])
def test_export_with_a_symbolic_batch_equals_the_concrete_call(tokens):
    params = tmj.init(jax.random.key(0), 16, 4, (4, 4, 4), 4)

    def call(p, x):
        out, state = tmj.apply(p, x)
        return out, state.h

    f = jax.jit(call)
    batch = export.symbolic_shape("b")[0]
    exported = export.export(f)(params, jax.ShapeDtypeStruct((batch, tokens, 16), jnp.float32))
    for b in (1, 3):
        x = jax.random.normal(jax.random.key(b), (b, tokens, 16))
        for got, want in zip(exported.call(params, x), f(params, x), strict=True):
            assert got.shape == want.shape
            assert float(jnp.max(jnp.abs(got - want))) <= 1e-6
