"""The decode step's fused single-write splat (:mod:`tmcore.backends.torch.scan`) makes
the generic splat's volume bit for bit, in fewer ops."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tmcore.adapters.torch.bridge import _XP  # noqa: E402
from tmcore.backends.torch.scan import single_write  # noqa: E402
from tmcore.ops.splat import splat_fwd  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(4, 4, 4), (3, 5, 2), (6, 7), (9,)])
@pytest.mark.parametrize("radius", [None, 1.5])
def test_single_write_equals_the_generic_splat_bit_for_bit(dtype, shape, radius):
    torch.manual_seed(0)
    b, c, n = 5, 3, len(shape)
    mu = torch.rand(b, n, dtype=dtype) * 2.4 - 1.2          # some centres outside the grid
    sigma = torch.rand(b, dtype=dtype) * 0.8 + 0.01
    content = torch.randn(b, c, dtype=dtype)
    want = splat_fwd(_XP, content[:, None, :], mu[:, None, :], sigma[:, None], shape, 1e-6,
                     radius)
    got = single_write(content, mu, sigma, shape, 1e-6, radius)
    assert got.shape == (b, c, want[0, 0].numel())
    assert torch.equal(got, want.reshape(got.shape))
    out = torch.empty(b, c, got.shape[2], dtype=dtype)
    assert single_write(content, mu, sigma, shape, 1e-6, radius, out=out) is out
    assert torch.equal(out, got)


def test_single_write_keeps_nan_and_declines_without_eps():
    mu = torch.tensor([[0.1, float("nan"), 0.3], [0.0, 0.0, 0.0]])
    sigma = torch.tensor([0.5, 0.5])
    content = torch.ones(2, 2)
    got = single_write(content, mu, sigma, (3, 3, 3), 1e-6, 2.0)
    want = splat_fwd(_XP, content[:, None, :], mu[:, None, :], sigma[:, None], (3, 3, 3),
                     1e-6, 2.0).reshape(got.shape)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[0]).any()
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    # eps <= 0: the degenerate spreads are the generic splat's (it declines)
    assert single_write(content, mu, sigma, (3, 3, 3), 0.0, None) is None
