"""The torch backend's fused CPU local scan (``backends/torch/local.py``) against the
generic loop of :mod:`tmcore.scan.local` (the fast method, ``native=False``).

Reads, final state, the undo-log residuals and every gradient, float64 and float32;
1 to 4 spatial axes, odd sizes, axes of size 1, windows larger than an axis, writes on
and beyond the border, NaN coordinates, the Gaussian's ``eps`` / ``radius`` and a zero
spread, T = 1 and 4; ``overwrite_state``; a forward on
one path and the backward on the other; that the table takes the fused path and how
few torch ops a step dispatches there; where it declines; bad calls.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore  # noqa: E402
import tmcore.backends.native as native  # noqa: E402
from tmcore.backends.native import calls  # noqa: E402
from tmcore.backends.torch import local as cpu_local  # noqa: E402
from tmcore.runtime import dispatch  # noqa: E402
from tmcore.scan import local as local  # noqa: E402
from tmcore.types import LocalScanResiduals  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the fused kernels cannot be built here (no C compiler)")

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
XP = tmcore.runtime.validate.namespace_of(h=torch.zeros(1))


def _case(shape, dtype=torch.float64, batch=2, channels=3, steps=4, seed=0, span=1.3):
    """``(scan args, (g_reads, g_h, g_c))``: writes drawn on both sides of the border."""
    g = torch.Generator().manual_seed(seed)
    n = len(shape)

    def normal(*s):
        return torch.randn(*s, generator=g, dtype=dtype)

    def uniform(lo, hi, *s):
        return torch.rand(*s, generator=g, dtype=dtype) * (hi - lo) + lo

    args = [normal(batch, channels, *shape) * 0.5, normal(batch, channels, *shape) * 0.5,
            uniform(-1.1, 1.1, batch, steps, n), uniform(-span, span, batch, steps, n),
            uniform(0.2, 0.6, batch, steps), normal(batch, steps, channels),
            tmcore.ConvParams(normal(n, 2 * channels, 3) * 0.6, normal(n, 2 * channels) * 0.3,
                              normal(4 * channels, 2 * channels) * 0.5,
                              normal(4 * channels) * 0.3)]
    cotangents = (normal(batch, steps, channels), normal(batch, channels, *shape),
                  normal(batch, channels, *shape))
    return args, cotangents


def _flat(values):
    for v in values:
        if isinstance(v, tuple):
            yield from _flat(v)
        else:
            yield v


def _assert_agree(got, want, dtype):
    got, want = list(_flat(got)), list(_flat(want))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        a, b = torch.nan_to_num(a), torch.nan_to_num(b)
        if b.numel():
            scale = max(float(b.abs().max()), 1.0)
            assert float((a - b).abs().max()) <= TOL[dtype] * scale


@pytest.fixture
def taken(monkeypatch):
    """How many times the fused forward / backward returned a result (did not decline)."""
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = cpu_local.scan_fwd, cpu_local.scan_bwd

    def spy_fwd(*args, **kwargs):
        out = fwd(*args, **kwargs)
        calls["fwd"] += out is not None
        return out

    def spy_bwd(*args, **kwargs):
        out = bwd(*args, **kwargs)
        calls["bwd"] += out is not None
        return out

    monkeypatch.setattr(cpu_local, "scan_fwd", spy_fwd)
    monkeypatch.setattr(cpu_local, "scan_bwd", spy_bwd)
    dispatch.clear_cache()  # the tables bind the entries when they are built
    yield calls
    dispatch.clear_cache()


def _fwd(args, window, **kw):
    return local.local_scan_fwd(XP, *args, window=window, **kw)


def _bwd(residuals, args, cotangents, window):
    return local.local_scan_bwd(XP, residuals, *args[2:], *cotangents, window=window)


def _generic(args, cotangents, window):
    with tmcore.options(native=False):
        out = _fwd(args, window)
        return out, _bwd(out[3], args, cotangents, window)


CASES = [((5,), 2, 4), ((9,), 12, 1), ((7, 3), 4, 4), ((1, 5), 2, 4), ((5, 6, 7), 3, 4),
         ((3, 3, 3), 9, 1), ((2, 3, 1, 3), 2, 4)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("shape", "window", "steps"), CASES)
def test_matches_generic(taken, shape, window, steps, dtype):
    args, cotangents = _case(shape, dtype, steps=steps)
    h0, c0 = args[0].clone(), args[1].clone()
    g_copy = [g.clone() for g in cotangents]
    out = _fwd(args, window)
    grads = _bwd(out[3], args, cotangents, window)
    assert taken == {"fwd": 1, "bwd": 1}
    assert isinstance(out[3], LocalScanResiduals) and isinstance(grads, tmcore.ScanGrads)
    ref, ref_grads = _generic(args, cotangents, window)
    assert taken == {"fwd": 1, "bwd": 1}  # native=False: the generic loop ran
    _assert_agree(out, ref, dtype)
    _assert_agree(grads, ref_grads, dtype)
    assert torch.equal(args[0], h0) and torch.equal(args[1], c0)  # not overwritten
    assert all(torch.equal(a, b) for a, b in zip(cotangents, g_copy, strict=True))


def test_writes_on_and_beyond_the_border_and_nan(taken):
    args, cotangents = _case((5, 6, 7), steps=4)
    args[3][0, 0] = torch.tensor([1.0, -1.0, 1.5], dtype=torch.float64)
    args[3][1, 1] = torch.tensor([-2.0, 1.0, -1.0], dtype=torch.float64)
    args[3][1, 2, 0] = float("nan")
    args[2][0, 1, 1] = float("nan")
    args[2][1, 3] = torch.tensor([1.0, -1.0, 3.0], dtype=torch.float64)
    out = _fwd(args, 3)
    grads = _bwd(out[3], args, cotangents, 3)
    assert taken == {"fwd": 1, "bwd": 1}
    ref, ref_grads = _generic(args, cotangents, 3)
    _assert_agree(out, ref, torch.float64)
    _assert_agree(grads, ref_grads, torch.float64)
    assert torch.isnan(grads.read_coords[0, 1]).all() and torch.isnan(out[0][0, 1]).all()


def test_public_vjp_and_radius(taken):
    args, cotangents = _case((6, 5), steps=3)
    kw = dict(window=3, radius=1.5)
    got = (*tmcore.local_memory_scan(*args, **kw),
           tmcore.local_memory_scan_vjp(*args, *cotangents, **kw))
    assert taken["fwd"] == 2 and taken["bwd"] == 1
    with tmcore.options(native=False):
        want = (*tmcore.local_memory_scan(*args, **kw),
                tmcore.local_memory_scan_vjp(*args, *cotangents, **kw))
    _assert_agree(got, want, torch.float64)


def test_overwrite_state(taken):
    args, cotangents = _case((5, 6, 7), steps=4)
    ref = _generic(args, cotangents, 4)[0]
    h0, c0 = args[0].clone(), args[1].clone()
    out = _fwd(args, 4, overwrite_state=True)
    assert taken["fwd"] == 1
    assert out[1] is args[0] and out[2] is args[1]  # updated in place
    _assert_agree(out, ref, torch.float64)
    assert not torch.equal(args[0], h0) and not torch.equal(args[1], c0)
    # a strided state cannot be updated where it lies: a contiguous copy is
    args = [h0.clone().transpose(-1, -2).contiguous().transpose(-1, -2),
            c0.clone(), *args[2:]]
    strided = args[0].clone()
    out = _fwd(args, 4, overwrite_state=True)
    assert taken["fwd"] == 2 and torch.equal(args[0], strided)
    _assert_agree(out, ref, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mixed_paths_agree(taken, dtype):
    args, cotangents = _case((5, 4, 3), dtype, steps=4)
    ref, ref_grads = _generic(args, cotangents, 3)
    fused_fwd = _fwd(args, 3)
    assert taken["fwd"] == 1
    with tmcore.options(native=False):  # fused forward, generic backward
        grads = _bwd(fused_fwd[3], args, cotangents, 3)
    assert taken["bwd"] == 0
    _assert_agree(grads, ref_grads, dtype)
    grads = _bwd(ref[3], args, cotangents, 3)  # generic forward, fused backward
    assert taken["bwd"] == 1
    _assert_agree(grads, ref_grads, dtype)


class _OpCount:
    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops = 0
        self.mode = Mode()


def _ops(steps, native_on):
    args, cotangents = _case((8, 8, 8), torch.float32, batch=2, channels=4, steps=steps)
    with tmcore.options(native=native_on):
        for _ in range(2):  # the second counted: the buffer pool as in a steady loop
            fwd, bwd = _OpCount(), _OpCount()
            with fwd.mode:
                out = _fwd(args, 4)
            with bwd.mode:
                _bwd(out[3], args, cotangents, 4)
            del out
    return fwd.ops, bwd.ops


def test_op_count_per_step(taken):
    """The torch ops a step adds (T = 6 minus T = 2, over 4 steps): the fused scan
    dispatches one per forward step (the pointwise bmm) and three per backward step;
    its setup once per call stays small too (the geometry is one C call)."""
    fused = [b - a for a, b in zip(_ops(2, True), _ops(6, True), strict=True)]
    assert taken == {"fwd": 4, "bwd": 4}
    generic = [b - a for a, b in zip(_ops(2, False), _ops(6, False), strict=True)]
    assert fused[0] <= 4 * 2 and fused[1] <= 4 * 4  # 1 and 3 by construction
    assert max(_ops(2, True)) <= 100
    assert generic[0] >= 4 * 100 and generic[1] >= 4 * 100


def test_declines(taken):
    args, cotangents = _case((4, 5), steps=2)
    with tmcore.options(native=False):
        _fwd(args, 2)
    with tmcore.options(depthwise="shifts"):
        _fwd(args, 2)
    assert taken["fwd"] == 0
    options = tmcore.runtime.options.get_options()
    recorded = [a.clone().requires_grad_() if i == 0 else a for i, a in enumerate(args)]
    assert cpu_local.scan_fwd(XP, *recorded, 2, 1e-6, None, False, options=options) is None
    half = [a.half() if isinstance(a, torch.Tensor) else a for a in args]
    assert cpu_local.scan_fwd(XP, *half, 2, 1e-6, None, False, options=options) is None
    masked = LocalScanResiduals(args[0][None], args[1][None], None)
    assert cpu_local.scan_bwd(XP, masked, *args[2:], *cotangents, 2, 1e-6, None,
                              options=options) is None


def test_bad_shapes_raise():
    args, cotangents = _case((4, 5), steps=2)
    options = tmcore.runtime.options.get_options()
    out = cpu_local.scan_fwd(XP, *args, 2, 1e-6, None, False, options=options)
    h_boxes, c_boxes, read_boxes = out[3]
    bad = LocalScanResiduals(h_boxes[:, :, :, :-1], c_boxes, read_boxes)
    with pytest.raises(ValueError, match="residuals.h_boxes"):
        cpu_local.scan_bwd(XP, bad, *args[2:], *cotangents, 2, 1e-6, None, options=options)
    with pytest.raises(ValueError, match="write_sigma"):
        cpu_local.scan_fwd(XP, *args[:4], args[4][:, :1], *args[5:], 2, 1e-6, None, False,
                           options=options)
    with pytest.raises(ValueError, match="g_reads"):
        cpu_local.scan_bwd(XP, out[3], *args[2:], cotangents[0][:, :1], *cotangents[1:], 2,
                           1e-6, None, options=options)


def test_box_kernel_checks_its_starts():
    """A start outside the grid is refused by the kernel itself (nothing written)."""
    lib = native.library()
    src = torch.arange(2 * 5 * 4, dtype=torch.float64).reshape(1, 2, 5, 4)
    dst = torch.zeros(1, 2, 3, 3, dtype=torch.float64)

    def box_op(start):
        calls.call((lib, "f64"), "box_op", calls.ptr(src), calls.shape_arg((5, 4)),
                   calls.ptr(start), calls.ptr(dst), calls.shape_arg((3, 3)), None,
                   calls.shape_arg((3, 3)), None, None, 0, 1, 2, 2)

    box_op(torch.tensor([[2, 1]]))
    assert torch.equal(dst, src[:, :, 2:5, 1:4])
    dst.zero_()
    for start in ([[3, 0]], [[0, 2]], [[-1, 0]]):
        with pytest.raises(ValueError, match="outside its grid"):
            box_op(torch.tensor(start))
        assert not dst.any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("eps", "radius"), [(0.0, None), (0.0, 1.0), (1e-6, 0.7)])
def test_eps_radius_and_a_degenerate_write(taken, dtype, eps, radius):
    """The Gaussian's options in the C write and its VJP: truncation, ``eps = 0`` with a
    zero spread (the limit: weight 1 on a centre hit exactly, 0 elsewhere)."""
    args, cotangents = _case((5, 6, 7), dtype, steps=3)
    args[4][0, 1] = 0.0
    args[3][0, 1] = torch.tensor([0.0, 0.2, -1.0 / 3.0], dtype=dtype)
    kw = dict(eps=eps, radius=radius)
    out = local.local_scan_fwd(XP, *args, window=3, **kw)
    grads = local.local_scan_bwd(XP, out[3], *args[2:], *cotangents, window=3, **kw)
    assert taken == {"fwd": 1, "bwd": 1}
    with tmcore.options(native=False):
        ref = local.local_scan_fwd(XP, *args, window=3, **kw)
        ref_grads = local.local_scan_bwd(XP, ref[3], *args[2:], *cotangents, window=3, **kw)
    _assert_agree(out, ref, dtype)
    _assert_agree(grads, ref_grads, dtype)
