"""The fused CPU gates at the edge of float32 overflow agree with the generic math.

Every combination of a small grid of extreme values (cell ``c`` near 3e38 and +-inf,
pre-activations at +-inf, large, zero) for the torch kernels (ctypes) and the JAX
kernels (XLA FFI): where the generic path gives a finite value the fused path does too
(same NaN / inf pattern), and the finite values are close.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore  # noqa: E402
import tmcore.backends.native.build as native  # noqa: E402
from tmcore.backends.torch import gates  # noqa: E402
from tmcore.ops.cell import gates_fwd as generic_gates_fwd  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the fused kernels cannot be built here (no C compiler)")

_Z = (-np.inf, -100.0, 0.0, 3.0, 100.0, np.inf)
_C = (-np.inf, -3.4e38, -3e38, -1.0, 0.0, 3e38, 3.3e38, np.finfo(np.float32).max, np.inf)


def _grid() -> tuple[np.ndarray, np.ndarray]:
    """``z (1, 4, N)`` and ``c (1, 1, N)`` over every (i, f, o, g, c) of the grid."""
    rows = list(itertools.product(_Z, _Z, _Z, _Z, _C))
    table = np.array(rows, dtype=np.float32).T  # (5, N)
    return table[None, :4], table[None, 4:5]


def _assert_agree(got: np.ndarray, want: np.ndarray, what: str) -> None:
    for name, a, b in zip(("h'", "c'"), got, want, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        bad = (np.isnan(a) != np.isnan(b)) | (np.isinf(a) != np.isinf(b))
        finite = np.isfinite(a) & np.isfinite(b)
        bad |= finite & ~np.isclose(a, b, rtol=1e-5, atol=1e-6)
        bad |= np.isinf(a) & np.isinf(b) & (np.sign(a) != np.sign(b))
        assert not bad.any(), (f"{what} {name}: {int(bad.sum())} of {bad.size} combinations "
                               f"differ, e.g. fused {a[bad][:4]} vs generic {b[bad][:4]}")


def _generic(z: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(all="ignore"):
        h, c_new, _ = generic_gates_fwd(np, z.astype(np.float64), c.astype(np.float64))
    return h.astype(np.float32), c_new.astype(np.float32)


def test_torch_fused_gates_agree_with_the_generic_path_at_the_overflow_edge():
    z, c = _grid()
    zt, ct = torch.from_numpy(z), torch.from_numpy(c)
    h, c_new, res = gates.gates_fwd(None, zt, ct)
    assert isinstance(res, gates._NativeGateResiduals)  # the fused path ran
    _assert_agree((h.numpy(), c_new.numpy()), _generic(z, c), "torch fused")
    with tmcore.options(native=False):  # the torch ops it replaces agree too
        h_p, c_p, _ = gates.gates_fwd(None, zt, ct)
    _assert_agree((h.numpy(), c_new.numpy()), (h_p.numpy(), c_p.numpy()), "torch fused vs ops")


def test_jax_fused_gates_agree_with_the_generic_path_at_the_overflow_edge():
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import jax.numpy as jnp

    from tmcore.backends import jax as jax_backend

    if jax_backend._native_suffix(jnp.zeros(1, jnp.float32)) is None:
        pytest.skip("the JAX kernels cannot be built here")
    z, c = _grid()
    h, c_new = jax.jit(jax_backend._native_gates)(jnp.asarray(z), jnp.asarray(c))
    _assert_agree((np.asarray(h), np.asarray(c_new)), _generic(z, c), "jax fused")
