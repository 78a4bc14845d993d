"""The JAX native kernels under ``vmap`` and ``jax.export`` (issue 50, item 12).

``vmap`` over streams folds the mapped axis into the kernels' own axes: one custom
call per kernel, no loop (the HLO has no ``while``), results equal to the per-example
ones, per-example gradients included. ``jax.export`` serializes the generic math in
place of the custom calls (an exported artifact may run where tmcore's targets are not
registered), with the same results.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")

import jax.numpy as jnp  # noqa: E402

import tmcore  # noqa: E402
import tmcore.backends.native.build as native  # noqa: E402
from tmcore.types import ConvParams  # noqa: E402

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu",
                       reason="the JAX kernels serve the CPU backend only"),
    pytest.mark.skipif(native.jax_library() is None,
                       reason="the JAX kernels cannot be built here (no compilers)"),
]

V, B, C, S = 3, 2, 2, (3, 4)


def _case(seed: int = 0):
    rng = np.random.default_rng(seed)

    def arr(*s, scale=1.0):
        return jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)

    x, h, c = arr(V, B, C, *S), arr(V, B, C, *S), arr(V, B, C, *S)
    cell = ConvParams(arr(2, 2 * C, 3), arr(2, 2 * C), arr(4 * C, 2 * C, scale=0.5),
                      arr(4 * C))
    return x, h, c, cell


def _step(x, h, c, cell):
    return tmcore.convlstm_step(x, h, c, cell)


def _loss(cell, x, h, c):
    h_new, c_new = _step(x, h, c, cell)
    return jnp.sum(h_new ** 2) + jnp.sum(jnp.sin(c_new))


def _close(got, want):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-5)


def _custom_calls(hlo: str, kernel: str) -> int:
    return hlo.count(f"custom_call @tmcore_{kernel}_f32(")


def test_vmap_over_streams_is_one_call_per_kernel_and_equals_per_example():
    x, h, c, cell = _case()
    stepped = jax.jit(jax.vmap(_step, in_axes=(0, 0, 0, None)))
    got = stepped(x, h, c, cell)
    per_example = [_step(x[v], h[v], c[v], cell) for v in range(V)]
    want = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_example)
    _close(got, want)
    hlo = stepped.lower(x, h, c, cell).as_text()
    assert _custom_calls(hlo, "gates_fwd") == 1 and _custom_calls(hlo, "dw_fwd") == 1, hlo
    assert "while" not in hlo  # no loop over the mapped axis


@pytest.mark.parametrize("shared_params", [True, False])
def test_vmap_of_gradients_gives_per_example_gradients_in_one_call(shared_params):
    x, h, c, cell = _case(1)
    if not shared_params:  # per-example cell weights (mapped too)
        cell = jax.tree_util.tree_map(lambda p: jnp.stack([p, 0.5 * p, -p]), cell)
    axis = None if shared_params else 0
    grads = jax.jit(jax.vmap(jax.grad(_loss, argnums=(0, 1, 2, 3)), in_axes=(axis, 0, 0, 0)))
    got = grads(cell, x, h, c)

    def one(v):
        p = cell if shared_params else jax.tree_util.tree_map(lambda a: a[v], cell)
        with tmcore.options(native=False):
            return jax.grad(_loss, argnums=(0, 1, 2, 3))(p, x[v], h[v], c[v])

    per_example = [one(v) for v in range(V)]
    want = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_example)
    _close(got, want)
    hlo = grads.lower(cell, x, h, c).as_text()
    for kernel in ("dw_fwd", "gates_fwd", "gates_bwd", "dw_bwd"):
        assert _custom_calls(hlo, kernel) == 1, (kernel, hlo)
    assert "while" not in hlo


def test_jax_export_works_with_the_native_kernels_on():
    x, h, c, cell = _case(2)
    args = (cell, x[0], h[0], c[0])
    value_and_grad = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)))
    exported = jax.export.export(value_and_grad)(*args)
    assert "tmcore_" not in exported.mlir_module()  # the generic math, no custom call
    try:  # serialized and read back where the serializer is installed
        restored = jax.export.deserialize(exported.serialize())
    except ImportError:  # jax's serialization needs the optional flatbuffers
        restored = exported
    with tmcore.options(native=False):
        want = jax.value_and_grad(_loss, argnums=(0, 1))(*args)
    _close(restored.call(*args), want)
    # the same function jitted (not exported) still runs the kernels
    assert _custom_calls(value_and_grad.lower(*args).as_text(), "gates_fwd") == 1
