"""The JAX adapter on two devices: shard_map, explicit and auto meshes, uncommitted init.

JAX fixes its device count when it is first initialized, and the main pytest
process may already have done so with one CPU device. So the checks run in a
subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``
(this file, run as a script); it prints one JSON line of results that the tests
below assert on. Float64, small shapes: every gradient must equal the
single-device one to ~1e-12, and no all-gather may appear in a data-parallel
step (the fused CPU kernels are split along the batch, not gathered).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")

D, C, S, L, B, N = 6, 2, (3, 2, 3), 2, 4, 5
TOL = 1e-12


def _checks() -> dict:  # runs in the 2-device subprocess
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tmcore
    from tmcore.adapters import jax as tmj

    assert jax.device_count() == 2, jax.devices()
    results: dict = {}
    rng = np.random.default_rng(0)
    params = tmj.init(jax.random.key(0), D, C, S, L, dtype=jnp.float64)
    params = jax.tree.map(lambda a: a + 0.1 * jnp.asarray(rng.normal(size=a.shape)), params)
    x = jnp.asarray(rng.normal(size=(B, N, D)))
    h0 = jnp.asarray(0.3 * rng.normal(size=(B, C, *S)))
    c0 = jnp.asarray(0.3 * rng.normal(size=(B, C, *S)))

    def loss(p, x_, state=None):
        p = {**p, "config": p["config"].replace(checkpoint_every=2)}
        out, (h, c, *_) = tmj.apply(p, x_, state)
        return jnp.sum(out ** 2) + jnp.sum(h * c)

    def loss_nostream(p, x_):
        out, (h, c) = tmj.apply(p, x_, stream=False)
        return jnp.mean(out ** 2) + jnp.mean(h * c)

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    grad_state = jax.value_and_grad(loss, argnums=(0, 1, 2))
    single = jax.jit(grad)(params, x)
    single_state = jax.jit(grad_state)(params, x, (h0, c0))

    def err(a, b) -> float:
        return max(float(jnp.max(jnp.abs(u - v)) / (jnp.max(jnp.abs(v)) + 1e-300))
                   for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    def gathers(compiled) -> int:
        return compiled.as_text().count("all-gather(")

    # shard_map with its default check_vma=True, state=None and a sharded state
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    auto = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def per_device(p, x_):
        value, grads = grad(p, x_)
        return jax.lax.psum(value, "data"), grads  # param grads come back summed already

    def per_device_state(p, x_, state):
        value, grads = grad_state(p, x_, state)
        return jax.lax.psum(value, "data"), grads

    data = P("data")
    mapped = jax.jit(jax.shard_map(per_device, mesh=auto, in_specs=(P(), data),
                                   out_specs=(P(), (P(), data))))
    results["shard_map"] = err(mapped(params, x), single)
    mapped_state = jax.jit(jax.shard_map(per_device_state, mesh=auto,
                                         in_specs=(P(), data, (data, data)),
                                         out_specs=(P(), (P(), data, (data, data)))))
    results["shard_map_state"] = err(mapped_state(params, x, (h0, c0)), single_state)

    # the bare scan under shard_map too
    read = jnp.asarray(rng.uniform(-1, 1, (B, 3, len(S))))
    sigma = jnp.asarray(rng.uniform(0.3, 0.8, (B, 3)))
    content = jnp.asarray(rng.normal(size=(B, 3, C)))
    cell = tmj.conv_params(params["cell"])

    def scan_loss(cell_, h, c, r, s, w):
        reads, h_t, _ = tmj.memory_scan(h, c, r, r, s, w, cell_, checkpoint_every=2)
        return jnp.sum(reads ** 2) + jnp.sum(h_t)

    scan_grad = jax.grad(scan_loss, argnums=tuple(range(6)))
    scan_args = (cell, h0, c0, read, sigma, content)
    mapped_scan = jax.jit(jax.shard_map(scan_grad, mesh=auto, in_specs=(P(),) + (data,) * 5,
                                        out_specs=(P(),) + (data,) * 5))
    results["shard_map_scan"] = err(mapped_scan(*scan_args), jax.jit(scan_grad)(*scan_args))

    def data_parallel(name, mesh_):
        """Batch-sharded steps with state=None and a sharded state vs one device;
        returns the sharded ``x`` and state."""
        xs = jax.device_put(x, NamedSharding(mesh_, data))
        state = tuple(jax.device_put(a, NamedSharding(mesh_, data)) for a in (h0, c0))
        for case, fn, args, expected in (("none", grad, (params, xs), single),
                                         ("state", grad_state, (params, xs, state),
                                          single_state)):
            step = jax.jit(fn)
            results[f"{name}_{case}"] = err(step(*args), expected)
            results[f"{name}_{case}_gathers"] = gathers(step.lower(*args).compile())
        return xs, state

    # explicit mesh: state=None (the zero state takes x's sharding), a sharded state
    with jax.set_mesh(mesh):
        xs, state_s = data_parallel("explicit", mesh)
        mean_grad = jax.value_and_grad(  # a mean: the cotangents come in sharded
            lambda p, a: jnp.mean(tmj.apply(p, a)[0] ** 2))
        results["explicit_mean"] = err(jax.jit(mean_grad)(params, xs),
                                       jax.jit(mean_grad)(params, x))
        out, new = jax.jit(lambda p, a, s: tmj.apply(p, a, s))(params, xs, state_s)
        results["explicit_specs"] = [str(jax.typeof(a).sharding.spec)
                                     for a in (out, new.h, new.c)]
        with tmcore.options(native=False):  # the generic path on the same mesh
            results["explicit_generic"] = err(jax.jit(grad)(params, xs), single)

    # explicit mesh WITHOUT jax.set_mesh (x sharded, the parameters uncommitted, so their
    # type names no mesh): the heads' and read-out's weight gradients contract over the
    # sharded B*T rows, which JAX types only when the weights are on x's mesh
    bare = jax.device_put(x, NamedSharding(mesh, data))
    results["bare_explicit_stream"] = err(jax.jit(grad)(params, bare), single)
    no_stream = jax.value_and_grad(loss_nostream)
    results["bare_explicit_nostream"] = err(jax.jit(no_stream)(params, bare),
                                            jax.jit(no_stream)(params, x))
    res32 = tmj.residual_init(jax.random.key(2), D, C, S, L)  # float32, as by default
    x32 = x.astype(jnp.float32)
    res_grad = jax.value_and_grad(  # norm and gate too
        lambda p, a: jnp.mean(tmj.residual_apply(p, a)[0] ** 2))
    results["bare_explicit_f32"] = err(
        jax.jit(res_grad)(res32, jax.device_put(x32, NamedSharding(mesh, data))),
        jax.jit(res_grad)(res32, x32))
    results["bare_explicit_f32_dtype"] = str(jax.tree.leaves(
        jax.jit(res_grad)(res32, jax.device_put(x32, NamedSharding(mesh, data))))[0].dtype)

    # auto mesh (jit with batch-sharded inputs): the kernels are split, not gathered
    xa, _ = data_parallel("auto", auto)
    # vmap of the partitioned kernels (an ensemble of two parameter sets)
    pair = jax.tree.map(lambda a: jnp.stack([a, 2.0 * a]), params)
    ensemble = jax.jit(jax.vmap(grad, in_axes=(0, None)))(pair, x)
    results["vmap"] = err(jax.tree.map(lambda a: a[1], ensemble),
                          jax.jit(grad)(jax.tree.map(lambda a: 2.0 * a, params), x))

    # a StreamState continued under jit on batch-sharded meshes (rows at different counts):
    # each row's chunk grid gathers only its own tokens, so nothing is all-gathered
    first = jnp.asarray(rng.random((B, 3)) > 0.4)
    _, st0 = tmj.apply(params, x[:, :3], valid=first)
    x2 = jnp.asarray(rng.normal(size=(B, N + 2, D)))
    results["continued_counts"] = sorted({int(k) for k in st0.count})

    pad = jnp.asarray(rng.random((B, N + 2)) > 0.3)  # a padding mask: skipped tokens
    starts = jnp.asarray(rng.random((B, N + 2)) > 0.6)  # packed documents (traced)

    def continued(p, a, st, v=None, m=None):
        out, new = tmj.apply(p, a, st, valid=v, doc_starts=m,
                             max_documents=None if m is None else N + 2)
        return jnp.sum(out ** 2) + jnp.sum(new.h * new.c) + jnp.sum(new.pending ** 2) \
            + jnp.sum(new.read)

    cont_forward = jax.jit(lambda p, a, st, v=None: tmj.apply(p, a, st,
                                                               valid=v))
    cont_step = jax.jit(jax.value_and_grad(continued, argnums=(0, 1)))
    cont_cases = (("forward", cont_forward, False), ("step", cont_step, False),
                  ("valid", cont_step, True), ("packed", cont_step, True))
    cont_single = [fn(params, x2, st0, pad if masked else None,
                      *((starts,) if case == "packed" else ()))
                   for case, fn, masked in cont_cases]

    def continued_on(name, mesh_):
        sharded = NamedSharding(mesh_, data)
        a = jax.device_put(x2, sharded)
        st = jax.tree.map(lambda v: jax.device_put(v, sharded), st0)
        v = jax.device_put(pad, sharded)
        m = jax.device_put(starts, sharded)
        for (case, fn, masked), expected in zip(cont_cases, cont_single, strict=True):
            args = (params, a, st, v if masked else None, *((m,) if case == "packed" else ()))
            results[f"{name}_continued_{case}"] = err(fn(*args), expected)
            results[f"{name}_continued_{case}_gathers"] = gathers(fn.lower(*args).compile())

    continued_on("auto", auto)
    with jax.set_mesh(mesh):
        continued_on("explicit", mesh)

    # init and the NNX modules make uncommitted arrays: they join sharded inputs
    fresh = tmj.init(jax.random.key(1), D, C, S, L, dtype=jnp.float64)
    results["init_committed"] = sum(bool(a.committed) for a in jax.tree.leaves(fresh))
    module = tmj.MemoryResidual(D, C, S, L, rngs=nnx.Rngs(0), dtype=jnp.float64)
    leaves = jax.tree.leaves(tmj.params_from_module(module))
    results["nnx_committed"] = sum(bool(a.committed) for a in leaves)
    out, _ = module(xa)
    results["nnx_auto_shape"] = list(out.shape)
    return results


@pytest.fixture(scope="module")
def results() -> dict:
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env = {**os.environ, "XLA_FLAGS": flags,
           "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["shard_map", "shard_map_state", "shard_map_scan"])
def test_shard_map_default_checks_match_one_device(results, name):
    assert results[name] < TOL, results


@pytest.mark.parametrize("name", ["explicit_none", "explicit_state", "explicit_mean",
                                  "explicit_generic"])
def test_explicit_mesh_matches_one_device(results, name):
    assert results[name] < TOL, results


def test_explicit_mesh_keeps_the_batch_sharding(results):
    assert results["explicit_specs"] == ["P('data', None, None)",
                                         "P('data', None, None, None, None)",
                                         "P('data', None, None, None, None)"], results
    assert results["explicit_none_gathers"] == results["explicit_state_gathers"] == 0, results


@pytest.mark.parametrize("name", ["bare_explicit_stream", "bare_explicit_nostream"])
def test_explicit_mesh_gradient_without_set_mesh(results, name):
    """A jitted gradient on a batch-sharded ``x`` of an Explicit mesh (``jax.make_mesh``'s
    default), outside ``jax.set_mesh``, equals one device (float64)."""
    assert results[name] < TOL, results


def test_explicit_mesh_float32_gradient_without_set_mesh(results):
    """The gated residual's jitted gradient in float32 on the same mesh: within 1e-6."""
    assert results["bare_explicit_f32_dtype"] == "float32", results
    assert results["bare_explicit_f32"] < 1e-6, results


@pytest.mark.parametrize("name", ["auto_none", "auto_state", "vmap"])
def test_auto_mesh_matches_one_device(results, name):
    assert results[name] < TOL, results


def test_auto_mesh_never_gathers_the_batch(results):
    assert results["auto_none_gathers"] == results["auto_state_gathers"] == 0, results


@pytest.mark.parametrize("mesh", ["auto", "explicit"])
@pytest.mark.parametrize("case", ["forward", "step", "valid", "packed"])
def test_continued_stream_state_stays_on_its_rows(results, mesh, case):
    """A :class:`StreamState` continued under ``jit`` (rows at different counts) on a
    batch-sharded Auto or Explicit mesh: equal to one device, and no all-gather in the
    forward, the training step, a padded (``valid``) step or a packed one (traced
    ``doc_starts`` with ``max_documents``: the scan's per-step masks are sharded like
    its inputs): the chunk grid gathers each row's own tokens (issue 50 item 10)."""
    assert len(results["continued_counts"]) > 1, results  # a per-row plan, not a boundary
    assert results[f"{mesh}_continued_{case}"] < TOL, results
    assert results[f"{mesh}_continued_{case}_gathers"] == 0, results


def test_init_and_modules_are_uncommitted(results):
    assert results["init_committed"] == results["nnx_committed"] == 0, results
    assert results["nnx_auto_shape"] == [B, N, D]


if __name__ == "__main__":
    print(json.dumps(_checks()))


def test_benchmark_script_runs(tmp_path):
    """``benchmarks/jax_sharding.py`` (BENCHMARKS.md's 1 vs 2 device table) at the tiny
    config: every row timed, no all-gather in any compiled step."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "jax_sharding.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.jax_sharding", "--config", "tiny",
                          "--reps", "1", "--out", str(out)], cwd=root, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["devices"], r["batch"]) for r in rows] == [(1, 2), (1, 4), (2, 4)] * 2
    assert all(r["all_gathers"] == 0 and r["min"] > 0 for r in rows), rows
