"""A hostile ``StreamState.count`` in the framework-free layer (issue 51, item 1).

NumPy (eager): out of ``[0, L)`` is a ``ValueError`` naming ``state.count``; under
``jax.jit`` (values unknown at trace time) it is taken as 0, and row 0 never depends on
row 1's data (multi-token calls and the one-token decode step).
"""

from __future__ import annotations

import numpy as np
import pytest

import tmcore
from tmcore import layer as tl

L = 3
HOSTILE = [(13, 2), (-1, 2), (L, 0), (-(2 ** 31), 1), (2 ** 31 - 1, 1)]


def _setup(xp):
    config = tl.layer_config(6, 2, (3, 3), L)
    rng = np.random.default_rng(0)
    params = tl.init_params(np, config, lambda s: rng.uniform(-s.bound, s.bound, s.shape))
    params = {g: {k: xp.asarray(v) for k, v in leaves.items()} for g, leaves in params.items()}
    layer = tl.Layer(config)

    def scan(h, c, inputs, **masks):
        return tmcore.memory_scan(h, c, *inputs, tl.cell_params(params), **masks)

    _, st = layer.forward_stream(xp, params, xp.asarray(rng.standard_normal((2, 5, 6))), None,
                                 scan=scan)
    return layer, params, scan, st


@pytest.mark.parametrize("count", HOSTILE)
@pytest.mark.parametrize("tokens", [1, 4])
def test_numpy_hostile_count_is_named(count, tokens):
    layer, params, scan, st = _setup(np)
    st = st._replace(count=np.asarray(count, dtype=np.int64))
    x = np.random.default_rng(1).standard_normal((2, tokens, 6))
    with pytest.raises(ValueError, match=r"state\.count.*\[0, 3\)"):
        layer.forward_stream(np, params, x, st, scan=scan)


@pytest.mark.parametrize("count", HOSTILE)
@pytest.mark.parametrize("tokens", [1, 4])
def test_jitted_hostile_count_never_reads_another_row(count, tokens):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    layer, params, scan, st = _setup(jnp)
    run = jax.jit(lambda x, s: layer.forward_stream(jnp, params, x, s, scan=scan))
    st = st._replace(count=jnp.asarray(count, dtype=jnp.int32))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, tokens, 6)))
    out_a, st_a = run(x, st)
    noise = [jnp.asarray(rng.standard_normal(v.shape[1:]) * 10) for v in (x, st.h, st.c,
                                                                          st.pending, st.read)]
    out_b, st_b = run(x.at[1].set(noise[0]),
                      st._replace(h=st.h.at[1].set(noise[1]), c=st.c.at[1].set(noise[2]),
                                  pending=st.pending.at[1].set(noise[3]),
                                  read=st.read.at[1].set(noise[4])))
    assert bool(jnp.all(jnp.isfinite(out_a)))
    assert bool(jnp.all(out_a[0] == out_b[0]))
    assert all(bool(jnp.all(a[0] == b[0])) for a, b in zip(st_a, st_b, strict=True))
    fixed = jnp.asarray([k if 0 <= k < L else 0 for k in count], dtype=jnp.int32)
    ref, ref_st = layer.forward_stream(jnp, params, x, st._replace(count=fixed), scan=scan)
    assert float(jnp.max(jnp.abs(out_a - ref))) <= 1e-5
    assert [int(k) for k in st_a.count] == [int(k) for k in ref_st.count]
