"""Tests of the PyTorch adapter (tmcore.adapters.torch): gradients, layer, modes, tools.

Ground truths: ``torch.autograd.gradcheck`` (finite differences, float64),
torch autograd of plain-torch forwards of the same math (``grid_sample`` /
``Conv3d`` in the paper's reference layout for 3-D grids, tmcore's generic
array-API forward run on tensors for 1 to 4 axes), and the eager layer for
``torch.compile`` and DDP.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import torch.nn.functional as F  # noqa: E402
from _helpers import reference_state_dict  # noqa: E402
from torch import nn  # noqa: E402

import tmcore  # noqa: E402
import tmcore.adapters.torch as tmt  # noqa: E402
from tmcore import conv_params_from_pointwise, sigma_from_logit  # noqa: E402
from tmcore.adapters.torch import bridge as _torch_ops  # noqa: E402
from tmcore.scan import memory_scan_fwd  # noqa: E402
from tmcore.types import ConvParams  # noqa: E402

F64 = torch.float64
XP = _torch_ops._XP


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / max(scale, 1e-300)


def make_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def scan_args(batch=2, channels=2, shape=(3, 2, 3), steps=3, seed=0, requires_grad=True):
    """Float64 scan inputs with coordinates inside the grid (away from the borders)."""
    g = make_gen(seed)
    n = len(shape)

    def r(*s, lo=-1.0, hi=1.0):
        return (torch.rand(*s, generator=g, dtype=F64) * (hi - lo) + lo)

    h0 = torch.randn(batch, channels, *shape, generator=g, dtype=F64)
    c0 = torch.randn(batch, channels, *shape, generator=g, dtype=F64)
    rc, wc = r(batch, steps, n, lo=-0.8, hi=0.8), r(batch, steps, n, lo=-0.8, hi=0.8)
    sigma = r(batch, steps, lo=0.3, hi=0.8)
    content = torch.randn(batch, steps, channels, generator=g, dtype=F64)
    pointwise = torch.randn(4 * channels, 2 * channels, generator=g, dtype=F64) * 0.5
    params = [p + 0.1 * torch.randn(p.shape, generator=g, dtype=F64)
              for p in conv_params_from_pointwise(pointwise, n)]
    args = [h0, c0, rc, wc, sigma, content, *params]
    return [a.requires_grad_(requires_grad) for a in args]


# --------------------------------------------------------------------------- plain forwards


class _GateConv(nn.Module):
    """The reference's factorized conv: depthwise Conv3d per axis, then pointwise."""

    def __init__(self, c2: int):
        super().__init__()
        self.conv_d = nn.Conv3d(c2, c2, (3, 1, 1), padding=(1, 0, 0), groups=c2)
        self.conv_h = nn.Conv3d(c2, c2, (1, 3, 1), padding=(0, 1, 0), groups=c2)
        self.conv_w = nn.Conv3d(c2, c2, (1, 1, 3), padding=(0, 0, 1), groups=c2)
        self.pointwise = nn.Conv3d(c2, 2 * c2, 1)

    def forward(self, x):
        return self.pointwise(self.conv_w(self.conv_h(self.conv_d(x))))


class _Writer(nn.Module):
    def __init__(self, d: int, c: int):
        super().__init__()
        self.content_net = nn.Linear(d, c)
        self.sigma_net = nn.Linear(d, 1)


class RefMemory(nn.Module):
    """A small re-implementation of the paper's reference memory layer, in its layout.

    ``grid_sample`` read, Gaussian write against ``grid_cache`` (cell centres,
    channels (x, y, z)), ``Conv3d`` gates; a Python loop over chunks.
    """

    def __init__(self, d, c, shape, chunk, sigma_scale=1.0):
        super().__init__()
        self.d, self.c, self.shape, self.chunk, self.sigma_scale = d, c, shape, chunk, sigma_scale
        self.write_proj = nn.Linear(chunk * d, d)
        self.writer = _Writer(d, c)
        self.coord_net = nn.Linear(d, 3)
        self.gate_conv = _GateConv(2 * c)
        self.out_proj = nn.Linear(c, d)
        zs, ys, xs = torch.meshgrid(*[torch.linspace(-1, 1, s, dtype=F64) for s in shape],
                                    indexing="ij")
        self.register_buffer("grid_cache", torch.stack([xs, ys, zs])[None])

    def forward(self, x, state=None):
        batch, tokens, d = x.shape
        steps = math.ceil(tokens / self.chunk)
        x = F.pad(x, (0, 0, 0, steps * self.chunk - tokens))
        if state is None:
            zeros = x.new_zeros(batch, self.c, *self.shape)
            state = (zeros, zeros)
        h, c = state
        outs = []
        for t in range(steps):
            chunk = x[:, t * self.chunk:(t + 1) * self.chunk]
            summary = self.write_proj(chunk.reshape(batch, -1))
            read_coord = torch.tanh(self.coord_net(chunk[:, 0]))
            write_coord = torch.tanh(self.coord_net(summary))
            read = F.grid_sample(h, read_coord.view(batch, 1, 1, 1, 3), mode="bilinear",
                                 padding_mode="border", align_corners=True).view(batch, self.c)
            content = self.writer.content_net(summary)
            sigma = (F.softplus(self.writer.sigma_net(summary)) + 1e-4) * self.sigma_scale
            dist2 = ((self.grid_cache - write_coord.view(batch, 3, 1, 1, 1)) ** 2).sum(
                1, keepdim=True)
            weight = torch.exp(-dist2 / (2 * sigma.view(batch, 1, 1, 1, 1) ** 2 + 1e-6))
            written = content.view(batch, self.c, 1, 1, 1) * weight
            i, f, o, g = self.gate_conv(torch.cat([written, h], 1)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(self.out_proj(read)[:, None].expand(batch, self.chunk, d))
        return torch.cat(outs, 1)[:, :tokens], (h, c)


def plain_forward(m: tmt.TensorMemory, x, state):
    """TensorMemory's math with tmcore's generic forward run on tensors (torch autograd)."""
    batch, tokens, d = x.shape
    size = m.chunk_size
    steps = math.ceil(tokens / size)
    x = F.pad(x, (0, 0, 0, steps * size - tokens))
    chunks = x.reshape(batch, steps, size, d)
    summary = m.write_proj(chunks.reshape(batch, steps, size * d))
    rc = torch.tanh(m.coord_net(chunks[:, :, 0]))
    wc = torch.tanh(m.coord_net(summary))
    content = m.content_net(summary)
    sigma = sigma_from_logit(m.sigma_net(summary)[..., 0], m.sigma_scale)
    with tmcore.options(generic=True):
        reads, h, c, _, _ = memory_scan_fwd(XP, *state, rc, wc, sigma, content,
                                            ConvParams(*m.cell.params()), eps=m.eps,
                                            radius=m.radius, checkpoint_every=steps)
    out = m.out_proj(reads)[:, :, None].expand(batch, steps, size, d)
    return out.reshape(batch, steps * size, d)[:, :tokens], (h, c)


def randomize_(module: nn.Module, seed: int, scale: float = 0.3) -> nn.Module:
    g = make_gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def layer_and_input(shape=(3, 2, 3), chunk=2, tokens=7, d=4, c=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = randomize_(tmt.TensorMemory(d, c, shape, chunk, **kw).double(), seed)
    g = make_gen(seed + 1)
    x = torch.randn(2, tokens, d, generator=g, dtype=F64, requires_grad=True)
    h0 = torch.randn(2, c, *shape, generator=g, dtype=F64, requires_grad=True)
    c0 = torch.randn(2, c, *shape, generator=g, dtype=F64, requires_grad=True)
    return m, x, (h0, c0)


def row_invariant_linear(x, weight, bias=None):
    """``F.linear`` as a sum of per-column products, for the tests that compare streamed
    pieces with one call bit for bit: each output row is a function of its own input
    row in a fixed order, whatever the number of rows ``M``. A BLAS gemm need not be:
    MKL runs a product's last ``M mod m_r`` rows through another micro-kernel (its
    ``m_r`` depends on the CPU), so a row of the layer's heads may round differently in
    a piece than in the one call, and the results agree to rounding only."""
    out = x[..., :1] * weight[:, 0]
    for k in range(1, weight.shape[1]):
        out = out + x[..., k:k + 1] * weight[:, k]
    return out if bias is None else out + bias


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("shape", [(4,), (3, 4), (3, 2, 3), (2, 2, 2, 3)])
def test_trilinear_sample_gradcheck(shape):
    g = make_gen(1)
    vol = torch.randn(2, 2, *shape, generator=g, dtype=F64, requires_grad=True)
    coords = (torch.rand(2, 3, len(shape), generator=g, dtype=F64) * 1.6 - 0.8).requires_grad_()
    assert torch.autograd.gradcheck(tmt.trilinear_sample, (vol, coords))
    assert torch.autograd.gradgradcheck(tmt.trilinear_sample, (vol, coords), fast_mode=True)


@pytest.mark.parametrize("radius", [None, 2.0])
@pytest.mark.parametrize("shape", [(4,), (3, 2, 3)])
def test_gaussian_splat_gradcheck(shape, radius):
    g = make_gen(2)
    content = torch.randn(2, 2, 3, generator=g, dtype=F64, requires_grad=True)
    mu = (torch.rand(2, 2, len(shape), generator=g, dtype=F64) * 1.6 - 0.8).requires_grad_()
    sigma = (torch.rand(2, 2, generator=g, dtype=F64) * 0.5 + 0.3).requires_grad_()

    def fn(a, b, s):
        return tmt.gaussian_splat(a, b, s, shape, radius=radius)

    assert torch.autograd.gradcheck(fn, (content, mu, sigma))
    assert torch.autograd.gradgradcheck(fn, (content, mu, sigma), fast_mode=True)


def test_primitives_match_torch_autograd():
    """Custom VJPs == torch autograd of grid_sample and of a plain Gaussian (float64)."""
    g = make_gen(3)
    vol = torch.randn(2, 3, 4, 3, 5, generator=g, dtype=F64, requires_grad=True)
    coords = (torch.rand(2, 6, 3, generator=g, dtype=F64) * 1.8 - 0.9).requires_grad_()
    cot = torch.randn(2, 6, 3, generator=g, dtype=F64)
    ours = torch.autograd.grad((tmt.trilinear_sample(vol, coords) * cot).sum(), (vol, coords))
    ref_out = F.grid_sample(vol, coords.view(2, 1, 1, 6, 3), mode="bilinear",
                            padding_mode="border", align_corners=True)
    ref_out = ref_out.view(2, 3, 6).transpose(1, 2)
    ref = torch.autograd.grad((ref_out * cot).sum(), (vol, coords))
    for a, b in zip(ours, ref, strict=True):
        assert a.is_contiguous()
        assert rel_err(a, b) < 1e-10

    shape = (4, 3, 5)
    content = torch.randn(2, 2, 3, generator=g, dtype=F64, requires_grad=True)
    mu = (torch.rand(2, 2, 3, generator=g, dtype=F64) * 1.6 - 0.8).requires_grad_()
    sigma = (torch.rand(2, 2, generator=g, dtype=F64) * 0.5 + 0.2).requires_grad_()
    cot = torch.randn(2, 3, *shape, generator=g, dtype=F64)
    ours = torch.autograd.grad((tmt.gaussian_splat(content, mu, sigma, shape) * cot).sum(),
                               (content, mu, sigma))
    zs, ys, xs = torch.meshgrid(*[torch.linspace(-1, 1, s, dtype=F64) for s in shape],
                                indexing="ij")
    grid = torch.stack([xs, ys, zs], -1)  # (D, H, W, 3) in (x, y, z) order
    dist2 = ((grid[None, None] - mu[:, :, None, None, None]) ** 2).sum(-1)
    weight = torch.exp(-dist2 / (2 * sigma[..., None, None, None] ** 2 + 1e-6))
    ref_out = torch.einsum("bkc,bkdhw->bcdhw", content, weight)
    ref = torch.autograd.grad((ref_out * cot).sum(), (content, mu, sigma))
    for a, b in zip(ours, ref, strict=True):
        assert rel_err(a, b) < 1e-10


def _scan(*args, checkpoint_every=2):
    reads, h, c = tmt.memory_scan(*args[:6], ConvParams(*args[6:]),
                                  checkpoint_every=checkpoint_every)
    return reads, h, c


def test_scan_gradcheck_and_second_order():
    args = scan_args(batch=1, channels=1, shape=(2, 3), steps=3)
    assert torch.autograd.gradcheck(_scan, args)
    assert torch.autograd.gradgradcheck(_scan, args, fast_mode=True)


def test_scan_vjp_matches_autograd_of_generic_forward():
    """The registered scan VJP (with checkpoint replay) == torch autograd of tmcore's
    generic forward on tensors, first and second order."""
    args = scan_args(batch=2, channels=2, shape=(3, 4, 2), steps=5, seed=4)
    g = make_gen(5)
    cots = [torch.randn(s, generator=g, dtype=F64) for s in
            [(2, 5, 2), (2, 2, 3, 4, 2), (2, 2, 3, 4, 2)]]

    def loss(outs):
        return sum((o * ct).sum() for o, ct in zip(outs, cots, strict=True))

    def plain(*a):
        with tmcore.options(generic=True):
            return memory_scan_fwd(XP, *a[:6], ConvParams(*a[6:]))[:3]

    ours = torch.autograd.grad(loss(_scan(*args)), args, create_graph=True)
    ref = torch.autograd.grad(loss(plain(*args)), args, create_graph=True)
    first = max(rel_err(a, b) for a, b in zip(ours, ref, strict=True))
    assert all(a.is_contiguous() for a in ours)
    assert first < 1e-10
    second_ours = torch.autograd.grad(sum((a * a).sum() for a in ours), args)
    second_ref = torch.autograd.grad(sum((a * a).sum() for a in ref), args)
    second = max(rel_err(a, b) for a, b in zip(second_ours, second_ref, strict=True))
    assert second < 1e-9


def test_layer_gradcheck():
    m, x, state = layer_and_input(shape=(2, 3), chunk=2, tokens=5, d=3, c=1)
    names = [k for k, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]

    def fn(x, h0, c0, *ps):
        out, (h, c) = torch.func.functional_call(m, dict(zip(names, ps, strict=True)),
                                                 (x, (h0, c0)), {"stream": False})
        return out, h, c

    assert torch.autograd.gradcheck(fn, (x, *state, *params), fast_mode=True)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 2, 2, 3)])
def test_layer_vjp_matches_plain_autograd(shape):
    m, x, state = layer_and_input(shape=shape, chunk=3, tokens=8, d=5, c=2, seed=6,
                                  checkpoint_every=2)
    out, (h, c) = m(x, state, stream=False)  # the reference writes the padded last chunk
    ref_out, (ref_h, ref_c) = plain_forward(m, x, state)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(h, ref_h) < 1e-12
    leaves = [x, *state, *m.parameters()]
    g = make_gen(7)
    cot = [torch.randn(t.shape, generator=g, dtype=F64) for t in (out, h, c)]

    def loss(outs):
        return sum((o * ct).sum() for o, ct in zip(outs, cot, strict=True))

    ours = torch.autograd.grad(loss((out, h, c)), leaves)
    ref = torch.autograd.grad(loss((ref_out, ref_h, ref_c)), leaves)
    assert max(rel_err(a, b) for a, b in zip(ours, ref, strict=True)) < 1e-10


# --------------------------------------------------------------------------- reference layout


def reference_pair(seed=8, shape=(3, 4, 2), chunk=3, d=6, c=2, sigma_scale=0.7):
    torch.manual_seed(seed)
    ref = randomize_(RefMemory(d, c, shape, chunk, sigma_scale).double(), seed, 0.2)
    ours = tmt.TensorMemory(d, c, shape, chunk, sigma_scale).double()
    ours.load_state_dict(tmt.convert_reference_state_dict(ref.state_dict()), strict=True)
    return ref, ours


def test_converted_reference_gives_identical_outputs_and_gradients():
    ref, ours = reference_pair()
    g = make_gen(9)
    x = torch.randn(2, 11, 6, generator=g, dtype=F64, requires_grad=True)  # ragged last chunk
    h0 = torch.randn(2, 2, 3, 4, 2, generator=g, dtype=F64, requires_grad=True)
    c0 = torch.randn(2, 2, 3, 4, 2, generator=g, dtype=F64, requires_grad=True)
    out, (h, c) = ours(x, (h0, c0), stream=False)  # the reference pads the ragged chunk
    ref_out, (ref_h, ref_c) = ref(x, (h0, c0))
    assert rel_err(out, ref_out) < 1e-12
    assert rel_err(h, ref_h) < 1e-12 and rel_err(c, ref_c) < 1e-12
    cot = [torch.randn(t.shape, generator=g, dtype=F64) for t in (out, h, c)]
    loss = sum((o * ct).sum() for o, ct in zip((out, h, c), cot, strict=True))
    ref_loss = sum((o * ct).sum() for o, ct in zip((ref_out, ref_h, ref_c), cot, strict=True))
    grads = torch.autograd.grad(loss, [x, h0, c0, *ours.parameters()])
    ref_params = dict(ref.named_parameters())
    ref_grads = torch.autograd.grad(ref_loss, [x, h0, c0, *ref_params.values()])
    for a, b in zip(grads[:3], ref_grads[:3], strict=True):
        assert rel_err(a, b) < 1e-10
    ref_as_ours = tmt.convert_reference_state_dict(
        dict(zip(ref_params, ref_grads[3:], strict=True)) | {"grid_cache": ref.grid_cache})
    for (name, _), grad in zip(ours.named_parameters(), grads[3:], strict=True):
        assert rel_err(grad, ref_as_ours[name]) < 1e-10, name


def test_convert_reference_state_dict_layout_and_prefix():
    c, d, L = 3, 5, 2
    g = make_gen(10)

    def t(*s):
        return torch.randn(*s, generator=g)

    sd = reference_state_dict(torch, d, c, L, grid=(4, 4, 4), seed=10, scale=1.0)
    prefixed = {f"layers.0.memory.{k}": v for k, v in sd.items()} | {"layers.0.attn.w": t(2)}
    for given, prefix in ((sd, ""), (prefixed, "layers.0.memory.")):
        out = tmt.convert_reference_state_dict(given, prefix=prefix)
        m = tmt.TensorMemory(d, c, (4, 4, 4), L)
        m.load_state_dict(out, strict=True)
        assert torch.equal(m.content_net.weight, sd["writer.content_net.weight"])
        assert torch.equal(m.cell.depthwise_weight[1], sd["gate_conv.conv_h.weight"][:, 0, 0, :, 0])
        assert torch.equal(m.cell.depthwise_bias[2], sd["gate_conv.conv_w.bias"])
        assert torch.equal(m.cell.pointwise_weight, sd["gate_conv.pointwise.weight"][..., 0, 0, 0])
    with pytest.raises(ValueError, match="missing"):
        tmt.convert_reference_state_dict({k: v for k, v in sd.items() if k != "out_proj.bias"})
    with pytest.raises(ValueError, match="prefix"):
        tmt.convert_reference_state_dict(sd, prefix="nope.")
    bad = dict(sd, **{"gate_conv.conv_h.weight": t(2 * c, 1, 3, 1, 1)})
    with pytest.raises(ValueError, match="conv_h"):
        tmt.convert_reference_state_dict(bad)


# --------------------------------------------------------------------------- layer behaviour


def test_layer_init_and_contract():
    m = tmt.TensorMemory(8, 3, (4, 5, 2), 4)
    assert torch.all(m.sigma_net.bias == 1.0)
    assert torch.equal(m.cell.depthwise_weight, torch.tensor([0.0, 1.0, 0.0]).expand(3, 6, 3))
    assert torch.all(m.cell.depthwise_bias == 0) and torch.all(m.cell.pointwise_bias == 0)
    bound = math.sqrt(6.0 / (6 + 12))
    assert m.cell.pointwise_weight.abs().max() <= bound and m.cell.pointwise_weight.std() > 0
    h, c = m.init_state(2, "cpu", torch.float32)
    assert h.shape == (2, 3, 4, 5, 2) and not h.any() and not c.any()
    x = torch.randn(2, 10, 8)
    out, state = m(x)
    # streaming by default (issue 23): the state carries the unfinished chunk (10 = 2*4 + 2)
    assert isinstance(state, tmt.StreamState) and list(state.count) == [2, 2]
    assert out.shape == x.shape
    out_explicit, _ = m(x, (h, c))
    assert torch.equal(out, out_explicit)
    out_padded, (h1, _) = m(x, stream=False)  # opt-in: the zero-padded chunk is written
    assert torch.equal(out_padded, out) and h1.shape == h.shape
    assert not torch.equal(h1, state.h)
    # one read per chunk, broadcast to the chunk's tokens
    assert torch.equal(out[:, 4], out[:, 7]) and torch.equal(out[:, 8], out[:, 9])
    # the sigma head is tmcore.sigma_from_logit (overflow-free softplus), also at +-40
    m2 = tmt.TensorMemory(1, 1, (2,), 1, sigma_scale=0.5).double()
    with torch.no_grad():
        m2.write_proj.weight.fill_(1.0)
        m2.write_proj.bias.zero_()
        m2.sigma_net.weight.fill_(1.0)
        m2.sigma_net.bias.zero_()
    z = torch.tensor([-50.0, -1.0, 0.0, 3.0, 40.0], dtype=F64)
    sigma = m2.layer.heads(XP, m2.params(), z[:, None, None]).write_sigma
    assert torch.equal(sigma, sigma_from_logit(z, 0.5))


def test_forget_bias_option():
    """``forget_bias`` sets the forget quarter (i, f, o, g) of the pointwise bias, survives
    ``reset_parameters``, and is refused when not a finite number."""
    m = tmt.TensorMemory(8, 3, (4, 4), 2, forget_bias=3.0)
    bias = m.cell.pointwise_bias.detach()
    assert torch.all(bias[3:6] == 3.0) and not bias[:3].any() and not bias[6:].any()
    with torch.no_grad():
        m.cell.pointwise_bias.zero_()
    m.cell.reset_parameters()
    assert torch.all(m.cell.pointwise_bias[3:6] == 3.0)
    assert "forget_bias=3.0" in repr(m)
    with pytest.raises(TypeError, match="forget_bias"):
        tmt.TensorMemory(8, 3, (4, 4), 2, forget_bias="3")
    with pytest.raises(ValueError, match="forget_bias"):
        tmt.TensorMemory(8, 3, (4, 4), 2, forget_bias=float("inf"))


def test_layer_validation_errors():
    with pytest.raises(ValueError, match="chunk_size"):
        tmt.TensorMemory(8, 2, (4, 4), 0)
    with pytest.raises(ValueError, match="memory_shape"):
        tmt.TensorMemory(8, 2, (), 2)
    with pytest.raises(ValueError, match="memory_shape"):
        tmt.TensorMemory(8, 2, (4, 0), 2)
    with pytest.raises(ValueError, match="memory_shape"):
        tmt.TensorMemory(8, 2, (2, 2, 2, 2, 2), 2)
    m = tmt.TensorMemory(8, 2, (4, 4), 2)
    with pytest.raises(ValueError, match=r"x: expected shape \(B, N, d\)"):
        m(torch.randn(3, 8))
    with pytest.raises(ValueError, match="embed_dim"):
        m(torch.randn(1, 3, 7))
    with pytest.raises(ValueError, match="state"):
        m(torch.randn(1, 3, 8), m.init_state(2))
    with pytest.raises(ValueError, match="reset"):
        m(torch.randn(1, 3, 8), reset=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="mode"):
        tmt.attach_memory(nn.ModuleList([nn.Linear(8, 8)]), "bidirectional", embed_dim=8,
                          memory_channels=2, memory_shape=(4,), chunk_size=2)


@pytest.mark.parametrize(("checkpoint_every", "cuts"), [
    (1, (0, 8, 12, 24)), (3, (0, 8, 12, 24)),
    # 37 chunk steps: the one call makes its write volumes in blocks of 16 steps, the
    # pieces in blocks of 5 and 16 + 5 + 11: every row must still round the same
    (1, (0, 20, 104, 148)), (5, (0, 20, 104, 148)),
])
def test_streaming_equals_one_call_bitwise(checkpoint_every, cuts, monkeypatch):
    m, x, _ = layer_and_input(shape=(3, 2, 3), chunk=4, tokens=cuts[-1], d=4, c=2, seed=11,
                              checkpoint_every=checkpoint_every)
    x = x.detach()

    def one_call_and_pieces():
        out, state = m(x)
        pieces, carried = [], None
        for start, stop in zip(cuts[:-1], cuts[1:], strict=True):  # multiples of chunk_size
            piece, carried = m(x[:, start:stop], carried)
            pieces.append(piece)
        return (out, *state[:2]), (torch.cat(pieces, 1), *carried[:2])

    whole, streamed = one_call_and_pieces()  # the BLAS's products: equal to rounding
    for a, b in zip(streamed, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    monkeypatch.setattr(F, "linear", row_invariant_linear)
    whole, streamed = one_call_and_pieces()  # rows independent of M: the same bits
    for a, b in zip(streamed, whole, strict=True):
        assert torch.equal(a, b)


def test_reset_mask_starts_sequences_from_zeros():
    m, x, _ = layer_and_input(shape=(3, 3), chunk=2, tokens=6, seed=12)
    x = x.detach()
    _, state = m(x)
    out, new_state = m(x, state, reset=torch.tensor([True, False]))
    fresh, fresh_state = m(x)
    carried, carried_state = m(x, state)
    assert torch.equal(out[0], fresh[0]) and torch.equal(new_state[0][0], fresh_state[0][0])
    assert torch.equal(out[1], carried[1]) and torch.equal(new_state[1][1], carried_state[1][1])


def test_memory_residual_gate():
    torch.manual_seed(0)
    m = tmt.TensorMemory(8, 2, (3, 3, 3), 2)
    for gate_init in (0.0, -2.0):
        res = tmt.MemoryResidual(m, gate_init=gate_init)
        x = torch.randn(2, 6, 8)
        y, state = res(x)
        out, state2 = m(res.norm(x))
        assert isinstance(res.norm, nn.LayerNorm) and res.gate.item() == gate_init
        torch.testing.assert_close(y, x + torch.sigmoid(torch.tensor(gate_init)) * out)
        assert torch.equal(state[0], state2[0])


# --------------------------------------------------------------------------- attach / modes


class CausalStack(nn.Module):
    """Two causal transformer blocks (a model we attach memory to without editing it)."""

    def __init__(self, d=8, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True)
            for _ in range(layers))

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return x


def test_causal_mode_is_causal_and_threaded_is_not():
    torch.manual_seed(13)
    model = CausalStack().double().eval()
    x = torch.randn(2, 16, 8, dtype=F64)
    p = 9  # chunk 2 spans positions 8..11: p is inside it
    x2 = x.clone()
    x2[:, p + 1:] = torch.randn(2, 16 - p - 1, 8, dtype=F64)
    results = {}
    for mode in ("causal", "threaded"):
        torch.manual_seed(14)
        handle = tmt.attach_memory(model.blocks, mode, embed_dim=8, memory_channels=2,
                                   memory_shape=(3, 3, 3), chunk_size=4)
        with torch.no_grad():
            results[mode] = (model(x), model(x2))
        handle.remove()
    a, b = results["causal"]
    assert torch.equal(a[:, :p + 1], b[:, :p + 1])
    assert not torch.equal(a[:, p + 1:], b[:, p + 1:])
    a, b = results["threaded"]
    assert not torch.equal(a[:, :p + 1], b[:, :p + 1])  # the reference leaks the future
    assert (a[:, 0] - b[:, 0]).abs().max() > 0  # even the very first position


def test_attach_then_detach_restores_outputs_exactly():
    torch.manual_seed(15)
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), num_layers=2,
        enable_nested_tensor=False).eval()
    x = torch.randn(6, 2, 8)  # (N, B, d): batch_first=False is detected
    before = encoder(x)
    handle = tmt.attach_memory(encoder, "threaded", embed_dim=8, memory_channels=2,
                               memory_shape=(2, 3), chunk_size=3, gate_init=-2.0)
    assert len(handle.memories) == 2 and not handle.batch_first
    assert handle.memories[0].memory.write_proj.weight is not \
        handle.memories[1].memory.write_proj.weight
    assert handle.memories[0].gate.item() == -2.0
    with_memory = encoder(x)
    assert not torch.equal(with_memory, before)
    assert handle.state[1][0].shape == (2, 2, 2, 3)
    tmt.detach_memory(handle)
    assert torch.equal(encoder(x), before)
    assert not handle.attached and not encoder.layers[0]._forward_hooks


class Affine(nn.Module):
    """A token-wise block of exactly rounded ops (its result never depends on N)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight + self.bias


class TokenwiseStack(nn.Module):
    def __init__(self, d=6, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(Affine(d) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_attached_streaming_state_reset_and_detach(monkeypatch):
    monkeypatch.setattr(F, "linear", row_invariant_linear)  # bits independent of the BLAS
    torch.manual_seed(16)
    model = TokenwiseStack().double()
    handle = tmt.attach_memory(model.blocks, "causal", streaming=True, embed_dim=6,
                               memory_channels=2, memory_shape=(3, 3), chunk_size=2)
    x = torch.randn(2, 12, 6, dtype=F64)
    whole = model(x)
    whole_state = handle.state
    handle.reset_state()
    pieces = [model(x[:, :4]), model(x[:, 4:6])]
    handle.detach_state()
    assert all(s[0].grad_fn is None for s in handle.state)  # s: a StreamState (h, c, ...)
    pieces.append(model(x[:, 6:]))
    assert torch.equal(torch.cat(pieces, 1).detach(), whole.detach())
    for s, s2 in zip(handle.state, whole_state, strict=True):
        assert torch.equal(s[0].detach(), s2[0].detach())
        assert torch.equal(s[1].detach(), s2[1].detach())
    # a document boundary in sequence 0 only
    handle.reset_state(torch.tensor([True, False]))
    after_reset = model(x[:, :4])
    handle.reset_state()
    fresh = model(x[:, :4])
    assert torch.equal(after_reset[0], fresh[0]) and not torch.equal(after_reset[1], fresh[1])
    handle.remove()


# --------------------------------------------------------------------------- framework features


def test_opcheck_custom_ops():
    args = scan_args(batch=2, channels=1, shape=(3, 2, 2), steps=3, seed=17)
    torch.library.opcheck(_torch_ops.memory_scan_op, (*args, 1e-6, 2.0, 2))
    h0, _, rc, wc, sigma, content = args[:6]
    torch.library.opcheck(_torch_ops.trilinear_sample_op, (h0, rc))
    torch.library.opcheck(_torch_ops.gaussian_splat_op, (content, wc, sigma, [3, 2, 2], 1e-6, 1.5))


class MemoryModel(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.memory = tmt.MemoryResidual(tmt.TensorMemory(d, 4, (4, 4, 4), 4))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        y, _ = self.memory(self.inp(x))
        return self.head(y)


def _step_grads(model, x):
    model.zero_grad()
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(18)
    model = MemoryModel()
    x = torch.randn(2, 14, 16)  # ragged last chunk
    out, grads = _step_grads(model, x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    c_out, c_grads = _step_grads(compiled, x)
    torch.testing.assert_close(c_out, out, rtol=1e-5, atol=1e-6)
    for a, b in zip(c_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_torch_compile_inference_without_grad():
    """A compiled model in no_grad / frozen-parameter inference runs and equals eager."""
    torch._dynamo.reset()
    torch.manual_seed(19)
    model = MemoryModel()
    x = torch.randn(2, 14, 16)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-6)


def test_torch_compile_scan_validation_and_validate_mode():
    """The functional scan's checks hold under torch.compile (at trace time), and tmcore's
    validate mode neither breaks the graph nor reads fake values."""
    import tmcore

    torch._dynamo.reset()
    args = scan_args(batch=1, channels=2, shape=(3, 3, 3), steps=4, seed=21)

    def scan(*a):
        return tmt.memory_scan(*a[:6], ConvParams(*a[6:]), checkpoint_every=2)

    compiled = torch.compile(scan, backend="aot_eager", fullgraph=True)
    with tmcore.options(validate=True):
        out = compiled(*args)
    for a, b in zip(out, scan(*args), strict=True):
        torch.testing.assert_close(a, b)
    bad = list(args)
    bad[3] = bad[3][..., :2]
    with pytest.raises((ValueError, RuntimeError), match="write_coords"):
        compiled(*bad)


def test_vmap_and_func_grad():
    m, x, _ = layer_and_input(shape=(3, 3), chunk=2, tokens=6, d=4, c=2, seed=19)
    xs = torch.randn(3, 2, 6, 4, dtype=F64)
    # vmap needs the non-streaming path (the stream's chunk grid is planned per row)
    batched = torch.func.vmap(lambda xi: m(xi, stream=False)[0])(xs)
    looped = torch.stack([m(xi, stream=False)[0] for xi in xs])
    assert torch.allclose(batched, looped, rtol=1e-12, atol=0)
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(ps, xi):
        return torch.func.functional_call(m, ps, (xi,), {"stream": False})[0].square().sum()

    grads = torch.func.grad(loss)(params, x.detach())
    m.zero_grad()
    loss(dict(m.named_parameters()), x.detach()).backward()
    for name, p in m.named_parameters():
        assert rel_err(grads[name], p.grad) < 1e-12
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)
    assert per_sample["cell.pointwise_weight"].shape == (3, 8, 4)
    one = torch.func.grad(loss)(params, xs[1])
    assert rel_err(per_sample["cell.pointwise_weight"][1], one["cell.pointwise_weight"]) < 1e-12


class WithMemory(nn.Module):
    """The DDP pattern: one module holding the model and the attached memories."""

    def __init__(self, model, handle):
        super().__init__()
        self.model, self.memory = model, handle

    def forward(self, x):
        return self.model(x)


def test_ddp_single_process_training_step(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.nn.parallel import DistributedDataParallel

    def build():
        torch.manual_seed(20)
        model = TokenwiseStack(d=8)
        handle = tmt.attach_memory(model.blocks, "causal", embed_dim=8, memory_channels=2,
                                   memory_shape=(3, 3, 3), chunk_size=4)
        return WithMemory(model, handle)

    x = torch.randn(2, 12, 8)
    plain = build()
    plain(x).square().mean().backward()
    expected = [p.grad.clone() for p in plain.parameters()]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    ddp = opt = None
    try:
        wrapped = build()
        before = [p.detach().clone() for p in wrapped.parameters()]
        ddp = DistributedDataParallel(wrapped)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(x).square().mean().backward()
        for p, g in zip(wrapped.parameters(), expected, strict=True):
            torch.testing.assert_close(p.grad, g)
        opt.step()
        assert all(not torch.equal(p, b) for p, b in zip(wrapped.parameters(), before,
                                                          strict=True))
    finally:
        # DDP's reducer goes before its process group: freed after it (when the test's
        # locals go), its destructor joined gloo's threads and hung once in a CI run
        del ddp, opt
        dist.destroy_process_group()


def test_backward_allocates_nothing_the_size_of_the_checkpoints():
    """The scan's checkpoint outputs get no materialized zero cotangents: those would be a
    second copy of every saved state at the start of each backward (the peak-memory
    regression that ``ctx.set_materialize_grads(False)`` fixed). Every aten op of the
    backward is recorded, and none may produce a tensor of the checkpoints' shape."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor):
                    self.shapes.append((str(func), tuple(o.shape)))
            return out

    m = tmt.TensorMemory(8, 3, (4, 4, 4), 2)
    x = torch.randn(2, 10, 8, requires_grad=True)
    out, _ = m(x)
    recorder = RecordShapes()
    with recorder:
        out.sum().backward()
    checkpoints = (5, 2, 3, 4, 4, 4)  # (T / checkpoint_every, B, C, *S)
    assert recorder.shapes, "the recorder saw no ops"
    assert [s for s in recorder.shapes if s[1] == checkpoints] == []
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_fullgraph_compile_continues_a_stream_state():
    """A compiled one-token step that continues a StreamState traces without a graph break
    (no options ContextVar, no scalar promotion in the stream path) and equals eager."""
    torch.manual_seed(0)
    m = tmt.TensorMemory(16, 4, (3, 3, 3), 4)
    _, state = m(torch.randn(2, 6, 16))
    step = torch.compile(lambda x, st: m(x, st), fullgraph=True)
    x = torch.randn(2, 1, 16)
    got, got_state = step(x, state)
    want, want_state = m(x, state)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_state, want_state, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_grad_scan_passes_one_checkpoint_interval_for_every_length(monkeypatch):
    """Under no_grad the scan keeps only h0, c0 with an interval that does not depend on
    T (an interval equal to T made a compiled no_grad call recompile per length)."""
    seen = []
    call = _torch_ops.call

    def spy(function, op, *args, **kwargs):
        seen.append(args[-3])  # the checkpoint interval (the statics end with the masks)
        return call(function, op, *args, **kwargs)

    monkeypatch.setattr(_torch_ops, "call", spy)
    for steps in (3, 7):
        args = scan_args(steps=steps)
        with torch.no_grad():
            reads, h, c = _scan(*args)
        seen_reads, seen_h, _ = _scan(*args)  # with grad: checkpoint_every=2
        assert torch.equal(reads, seen_reads.detach()) and torch.equal(h, seen_h.detach())
    assert seen[0] == seen[2] and seen[0] >= 7 and seen[1] == seen[3] == 2


@pytest.mark.parametrize("native", [True, False])
def test_no_grad_scan_returns_no_storage_of_its_state(native):
    """Without grad the scan runs without the autograd wrapper; a state it did not change
    (every step inactive) still comes back in storage of its own, as with grad."""
    args = scan_args(steps=2, requires_grad=False)
    h0, c0 = args[0].clone(), args[1].clone()
    inactive = torch.zeros(2, 2, dtype=torch.bool)
    with torch.no_grad(), tmcore.options(native=native):
        _, h, c = tmt.memory_scan(*args[:6], ConvParams(*args[6:]), active=inactive)
    assert torch.equal(h, h0) and torch.equal(c, c0)
    for out, state in ((h, args[0]), (c, args[1])):
        assert out.untyped_storage().data_ptr() != state.untyped_storage().data_ptr()
        out.add_(1.0)
    assert torch.equal(args[0], h0) and torch.equal(args[1], c0)


@pytest.mark.slow
def test_compiled_no_grad_call_serves_every_length_with_one_graph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    memory = tmt.TensorMemory(8, memory_channels=2, memory_shape=(3, 3, 3), chunk_size=4)
    compiled = torch.compile(lambda x: memory(x, stream=False)[0], dynamic=True)
    with torch.no_grad():
        for tokens in (16, 32, 64):
            x = torch.randn(2, tokens, 8)
            assert torch.allclose(compiled(x), memory(x, stream=False)[0], atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
