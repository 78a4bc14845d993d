"""The generic factorized conv on namespaces with chunks (dask) or shardings (JAX).

- dask: the zero-padded neighbours must keep the state's chunking; before the
  fix every conv cut the blocks at 1 and S-1 until each cell was one block
  (the task graph grew with T * cells).
- JAX explicit meshes: the zero pad is built from the input, so it has the
  input's sharding and the concat accepts it.
- JAX init: :func:`tmcore.conv_params_from_pointwise` leaves the new leaves
  uncommitted (no ``device=``), so jit with batch-sharded inputs accepts them.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tmcore

REPO = Path(__file__).resolve().parents[2]


def _params(rng: np.random.Generator, n: int, c_in: int, c_out: int) -> tmcore.ConvParams:
    return tmcore.ConvParams(rng.standard_normal((n, c_in, 3)), rng.standard_normal((n, c_in)),
                             rng.standard_normal((c_out, c_in)), rng.standard_normal((c_out,)))


def _n_tasks(*arrays) -> int:
    """Distinct tasks in the (unoptimized) graphs of ``arrays`` together."""
    graph: dict = {}
    for a in arrays:
        graph.update(dict(a.__dask_graph__()))
    return len(graph)


def test_dask_conv_keeps_one_block_and_matches_numpy():
    da = pytest.importorskip("dask.array", reason="dask is not installed")
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((2, 3, 5, 6, 4)), rng.standard_normal((2, 2, 5, 6, 4))
    params = _params(rng, 3, 3, 2)
    dparams = tmcore.ConvParams(*(da.from_array(p) for p in params))
    out = tmcore.factorized_conv(da.from_array(x), dparams)
    d_x, d_p = tmcore.factorized_conv_vjp(da.from_array(x), dparams, da.from_array(g))
    # one block in, one block out (the old code split every spatial axis per cell)
    assert out.numblocks == (1,) * 5, out.chunks
    assert d_x.numblocks == (1,) * 5, d_x.chunks
    np.testing.assert_allclose(out.compute(), tmcore.factorized_conv(x, params),
                               rtol=1e-13, atol=1e-13)
    ref_dx, ref_dp = tmcore.factorized_conv_vjp(x, params, g)
    np.testing.assert_allclose(d_x.compute(), ref_dx, rtol=1e-13, atol=1e-13)
    for got, want in zip(d_p, ref_dp, strict=True):
        np.testing.assert_allclose(got.compute(), want, rtol=1e-12, atol=1e-12)


def test_dask_batch_chunks_survive_the_conv():
    da = pytest.importorskip("dask.array", reason="dask is not installed")
    rng = np.random.default_rng(1)
    x = da.from_array(rng.standard_normal((4, 2, 4, 4)), chunks=(2, 2, 4, 4))
    out = tmcore.factorized_conv(x, tmcore.ConvParams(
        *(da.from_array(p) for p in _params(rng, 2, 2, 2))))
    assert out.chunks == ((2, 2), (2,), (4,), (4,))


def test_dask_scan_vjp_task_graph_stays_linear_in_steps():
    """Graph size of memory_scan_vjp grows ~linearly in T, not with T * cells.

    Measured for this graph: the old per-cell blocks gave 31 448 tasks at T = 2
    and 69 976 at T = 4 (h0's gradient: 48 blocks at T = 1); with one block per
    axis 703 at T = 1 and 2 085 at T = 3.
    """
    da = pytest.importorskip("dask.array", reason="dask is not installed")
    rng = np.random.default_rng(2)
    B, C, S = 1, 2, (4, 4, 4)

    def graph(steps: int) -> int:
        def mk(*shape, low=None):
            a = rng.standard_normal(shape) if low is None else rng.uniform(low, 1.0, shape)
            return da.from_array(a)

        state = mk(B, C, *S)
        p = tmcore.ConvParams(*(da.from_array(a) for a in _params(rng, 3, 2 * C, 4 * C)))
        grads = tmcore.memory_scan_vjp(
            state, state, mk(B, steps, 3, low=-1.0), mk(B, steps, 3, low=-1.0),
            mk(B, steps, low=0.2), mk(B, steps, C), p, mk(B, steps, C), mk(B, C, *S),
            mk(B, C, *S), checkpoint_every=2)
        leaves = [*grads[:6], *grads[6]]
        assert all(a.numblocks == (1,) * 5 for a in leaves[:2])  # h0, c0 grads: one block
        return _n_tasks(*leaves)

    small, large = graph(1), graph(3)
    per_step = (large - small) / 2
    assert per_step < 800, (small, large)
    assert large < 3000, (small, large)


def test_jax_conv_params_from_pointwise_are_uncommitted():
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed")
    params = tmcore.conv_params_from_pointwise(jnp.ones((4, 2), dtype=jnp.float32), 3)
    # committed arrays are pinned to one device and break jit on sharded inputs
    assert [leaf.committed for leaf in params] == [False] * 4
    np.testing.assert_array_equal(np.asarray(params.depthwise_weight[1, 0]), [0.0, 1.0, 0.0])


def test_torch_conv_params_from_pointwise_follow_the_input_device_and_dtype():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    weight = torch.ones((4, 2), dtype=torch.float64)
    params = tmcore.conv_params_from_pointwise(weight, 2)
    assert {leaf.device for leaf in params} == {weight.device}
    assert {leaf.dtype for leaf in params} == {torch.float64}


_MESH_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import tmcore
    from tmcore.ops.conv import conv_bwd, conv_fwd

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 3, 4, 5)).astype(np.float32)
    g = rng.standard_normal((4, 3, 3, 4, 5)).astype(np.float32)
    shapes = [(3, 2, 3), (3, 2), (3, 2), (3,)]
    p_np = tmcore.ConvParams(*(rng.standard_normal(s).astype(np.float32) for s in shapes))
    p = tmcore.ConvParams(*(jnp.asarray(a) for a in p_np))

    def fwd_bwd(x, g):  # the generic path itself, whatever the dispatch picks
        z, stages = conv_fwd(jnp, x, p)
        return z, conv_bwd(jnp, stages, p, g)

    with jax.set_mesh(mesh):
        sharding = NamedSharding(mesh, P("data"))
        z, (d_x, d_p) = jax.jit(fwd_bwd)(jax.device_put(x, sharding), jax.device_put(g, sharding))
        assert z.sharding.spec[0] == "data", z.sharding
    ref_z = tmcore.factorized_conv(x, p_np)
    ref_dx, ref_dp = tmcore.factorized_conv_vjp(x, p_np, g)
    np.testing.assert_allclose(np.asarray(z), ref_z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_x), ref_dx, rtol=1e-5, atol=1e-5)
    for got, want in zip(d_p, ref_dp):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    print("MESH_OK")
""")


def test_jax_generic_conv_under_an_explicit_mesh():
    jax = pytest.importorskip("jax", reason="jax is not installed")
    if not hasattr(jax, "set_mesh") or not hasattr(jax.sharding, "AxisType"):
        pytest.skip("this JAX has no explicit-sharding meshes (jax.set_mesh, AxisType)")
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], capture_output=True,
                            text=True, cwd=REPO, env=env, timeout=300, check=False)
    assert result.returncode == 0 and "MESH_OK" in result.stdout, (
        result.stdout + result.stderr)[-3000:]


def test_numpy_neighbours_are_exact_shifts():
    from tmcore.ops.conv import neighbours

    x = np.arange(1.0, 1.0 + math.prod((2, 3, 4))).reshape(2, 3, 4)
    prev, nxt = neighbours(np, x, 2)
    np.testing.assert_array_equal(prev[..., 1:], x[..., :-1])
    np.testing.assert_array_equal(nxt[..., :-1], x[..., 1:])
    assert not prev[..., 0].any() and not nxt[..., -1].any()
    assert prev.dtype == x.dtype
