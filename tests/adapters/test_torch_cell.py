"""``ConvLSTMCell.forward``: one cell step of the torch adapter, against the functional op
:func:`tmcore.convlstm_step` (values) and torch autograd of the generic path (gradients,
first and second order)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore  # noqa: E402
from tmcore.adapters.torch import ConvLSTMCell  # noqa: E402

F64 = torch.float64


def _cell_and_inputs(channels=2, shape=(3, 4), seed=0):
    torch.manual_seed(seed)
    cell = ConvLSTMCell(channels, len(shape), forget_bias=0.5, dtype=F64)
    with torch.no_grad():  # off the identity init, so every parameter matters
        for p in cell.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x, h, c = (torch.randn(2, channels, *shape, dtype=F64, requires_grad=True)
               for _ in range(3))
    return cell, x, h, c


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 2)])
def test_forward_is_the_functional_step(shape):
    cell, x, h, c = _cell_and_inputs(shape=shape)
    h_new, c_new = cell(x, (h, c))
    with tmcore.options(generic=True), torch.no_grad():
        want_h, want_c = tmcore.convlstm_step(x, h, c, cell.params())
    assert h_new.shape == c_new.shape == x.shape
    torch.testing.assert_close(h_new, want_h, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(c_new, want_c, rtol=1e-12, atol=1e-13)
    # no state: zeros
    zeros = torch.zeros_like(x)
    torch.testing.assert_close(cell(x)[1], cell(x, (zeros, zeros))[1], rtol=0, atol=0)


def test_gradients_are_autograd_of_the_generic_step():
    cell, x, h, c = _cell_and_inputs()
    g_h, g_c = torch.randn_like(x), torch.randn_like(x)
    leaves = (x, h, c, *cell.parameters())

    def loss(out):
        return (out[0] * g_h).sum() + (out[1] * g_c).sum()

    ours = torch.autograd.grad(loss(cell(x, (h, c))), leaves, create_graph=True)
    with tmcore.options(generic=True):
        ref = torch.autograd.grad(loss(tmcore.convlstm_step(x, h, c, cell.params())), leaves,
                                  create_graph=True)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    second = torch.autograd.grad(sum((a * a).sum() for a in ours), leaves)
    with tmcore.options(generic=True):
        second_ref = torch.autograd.grad(sum((a * a).sum() for a in ref), leaves)
    for a, b in zip(second, second_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradcheck():
    cell, x, h, c = _cell_and_inputs(channels=1, shape=(2, 3))
    assert torch.autograd.gradcheck(lambda *a: cell(a[0], (a[1], a[2])), (x, h, c))


@pytest.mark.parametrize("bad, error, match", [
    (lambda x: (x.numpy(force=True), None), TypeError, "x: expected a torch.Tensor"),
    (lambda x: (x, x), TypeError, "state: expected a pair"),
    (lambda x: (x[:, :1], None), ValueError, r"x: expected shape \(B, C, \*S\) with C = 2"),
    (lambda x: (x[..., 0], None), ValueError, "2 spatial axes"),
    (lambda x: (x, (x, x[:1])), ValueError, "state: c: expected shape"),
    (lambda x: (x.float(), None), TypeError, "x: expected dtype torch.float64"),
])
def test_bad_inputs_name_the_argument(bad, error, match):
    cell, x, _, _ = _cell_and_inputs()
    with pytest.raises(error, match=match):
        cell(*bad(x.detach()))
