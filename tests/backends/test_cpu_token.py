"""A decode token as one C call (``token_fwd``, ``backends/torch/token.py``) against the
layer's own path (the torch ops, ``native=False``) and against one call on the whole
sequence; and where it must step aside, so that the layer's path (its checks, autograd,
hooks, tuners) runs instead.

Every spatial rank (1 to 4), float32 and float64, chunk sizes 1 and 3 (a token that both
starts and completes its chunk; start, middle and completion), batch 1 and 3, a LayerNorm
(affine or not), no norm, the memory alone, a truncation radius and a sigma scale.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from _helpers import assert_all_close as _close  # noqa: E402
from _helpers import stream_tokens as _stream  # noqa: E402
from _helpers import token_module as _module  # noqa: E402

import tmcore  # noqa: E402
import tmcore.adapters.torch.modules as modules  # noqa: E402
import tmcore.backends.native as native  # noqa: E402
from tmcore.adapters.torch import MemoryResidual  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the fused kernels cannot be built here (no C compiler)")

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.fixture
def taken(monkeypatch):
    """``(residual, ran)`` of every token offered to the kernel: a MemoryResidual's own
    (``residual``) or its memory's, and whether the kernel ran it."""
    seen = []
    original = modules.decode_token

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append((args[3].residual, result is not None))
        return result

    monkeypatch.setattr(modules, "decode_token", recording)
    return seen


def _ran(taken, residual=True):
    return sum(ran for r, ran in taken if r == residual)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (3, 4, 2), (2, 3, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_token_kernel_equals_the_layers_path_and_one_call(shape, dtype, chunk, batch,
                                                              taken):
    module = _module(shape, dtype, chunk, sigma_scale=1.5, radius=2.0)
    torch.manual_seed(1)
    x = torch.randn(batch, 3 * chunk + 2, 8, dtype=dtype)
    with torch.no_grad():
        _, start = module(x[:, :2])  # a prefill, then one token per call
        out, state = _stream(module, x[:, 2:], start)
        assert taken == [(True, True)] * (x.shape[1] - 2)
        with tmcore.options(native=False):
            ref_out, ref_state = _stream(module, x[:, 2:], start)
            whole_out, whole_state = module(x)
    tolerance = TOLERANCE[dtype]
    _close([out, *state], [ref_out, *ref_state], tolerance)
    _close([out, *state], [whole_out[:, 2:], *whole_state], tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_rows_at_different_slots_of_their_chunks(dtype, chunk, taken):
    """A padded batch: its rows reach the decode at different slots (a prefill with a
    padding mask), so one token starts a chunk in one row, completes one in another."""
    module = _module((3, 4, 2), dtype, chunk)
    torch.manual_seed(4)
    x = torch.randn(4, 13, 8, dtype=dtype)
    valid = torch.ones(4, 5, dtype=torch.bool)
    for row, pad in enumerate((0, 1, 2, 3)):
        valid[row, :pad] = False  # left padding of 0..3 tokens
    with torch.no_grad():
        _, start = module(x[:, :5], valid=valid)
        assert len(set(start.count.tolist())) == min(chunk, 4)
        out, state = _stream(module, x[:, 5:], start)
        assert taken == [(True, True)] * 8
        with tmcore.options(native=False):
            ref_out, ref_state = _stream(module, x[:, 5:], start)
    _close([out, *state], [ref_out, *ref_state], TOLERANCE[dtype])
    # each row alone (its real tokens only) as one call
    for row, pad in enumerate((0, 1, 2, 3)):
        with torch.no_grad(), tmcore.options(native=False):
            alone, alone_state = module(x[row:row + 1, pad:])
        _close([out[row:row + 1], alone_state.h], [alone[:, 5 - pad:], state.h[row:row + 1]],
               TOLERANCE[dtype])


@pytest.mark.parametrize("norm", ["identity", "plain"])
def test_no_norm_a_plain_layernorm_and_the_memory_alone(norm, taken):
    for module in (_module((3, 4, 2), torch.float64, 3, norm=norm),
                   _module((3, 4, 2), torch.float64, 3, residual=False)):
        torch.manual_seed(2)
        x = torch.randn(2, 8, 8, dtype=torch.float64)
        with torch.no_grad():
            out, state = _stream(module, x)
            with tmcore.options(native=False):
                ref = _stream(module, x)
        _close([out, *state], [ref[0], *ref[1]], 1e-12)
    # (each stream's first token starts from no state)
    assert _ran(taken, True) == _ran(taken, False) == 7


def test_nan_and_infinite_tokens_read_as_the_layers_path():
    module = _module((3, 4, 2), torch.float64, 2)
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    x[0, 2, 1], x[1, 3, :] = float("nan"), float("inf")
    with torch.no_grad():
        out, state = _stream(module, x)
        with tmcore.options(native=False):
            ref = _stream(module, x)
    for u, v in zip([out, *state], [ref[0], *ref[1]], strict=True):
        assert torch.equal(u.isnan(), v.isnan())
        assert torch.allclose(u.nan_to_num(), v.nan_to_num(), rtol=1e-12, atol=1e-12)


def _declined(module, x, state, taken, memory_alone=False):
    """The call's output and state, asserting the kernel declined the residual's token (and
    ran its memory's, where ``memory_alone``), against native off."""
    before = (_ran(taken, True), _ran(taken, False))
    with torch.no_grad():
        out, new = module(x, state)
    assert (_ran(taken, True), _ran(taken, False)) == (before[0], before[1] + memory_alone)
    with torch.no_grad(), tmcore.options(native=False):
        ref, ref_new = module(x, state)
    _close([out, *new], [ref, *ref_new], 1e-12)


def test_it_steps_aside_where_the_layers_path_must_run(taken):
    module = _module((3, 4, 2), torch.float64, 3)
    torch.manual_seed(3)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        _, st = module(x[:, :2])
    token = x[:, 2:3]
    # another dtype's count
    _declined(module, token, st._replace(count=st.count.long()), taken)
    # a hook on the memory (the residual calls it: the memory alone may take the kernel),
    # on the norm, on every module; a norm of another kind
    calls = []
    handle = module.memory.register_forward_hook(lambda *a: calls.append(a))
    with torch.no_grad():
        out, _ = module(token, st)
        with tmcore.options(native=False):
            ref, _ = module(token, st)
    handle.remove()
    assert len(calls) == 2 and torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    handle = module.norm.register_forward_pre_hook(lambda *a: calls.append(a))
    _declined(module, token, st, taken, memory_alone=True)
    handle.remove()
    assert len(calls) == 4
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, *a: seen.append(type(m).__name__))
    _declined(module, token, st, taken, memory_alone=True)
    handle.remove()
    assert seen.count("LayerNorm") == seen.count("TensorMemory") == 2  # (native on, then off)
    rms = MemoryResidual(module.memory, norm=torch.nn.RMSNorm(8, dtype=torch.float64))
    _declined(rms.eval(), token, st, taken, memory_alone=True)
    # options that turn the native kernels off, a grid above the one-call step's bound
    with tmcore.options(depthwise="grouped"):
        _declined(module, token, st, taken)
    big = _module((20, 20, 20), torch.float64, 3)  # C * C * prod(S) = 72000
    with torch.no_grad():
        _, big_st = big(x[:, :2])
    _declined(big, token, big_st, taken)
    # autograd on: the layer's path, with its gradient
    with torch.enable_grad():
        out, _ = module(token, st)
    assert out.requires_grad and _ran(taken, True) == 0 and _ran(taken, False) == 4


def test_a_state_of_views_takes_the_kernel(taken):
    """A state whose tensors are views (a transposed copy's, a prefill's read column) is
    copied dense for the kernel, not sent down the layer's path."""
    module = _module((3, 4, 2), torch.float64, 3)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        _, st = module(x[:, :2])
    views = st._replace(h=st.h.transpose(-1, -2).contiguous().transpose(-1, -2),
                        read=torch.stack([st.read, st.read], dim=-1)[..., 0])
    assert not views.h.is_contiguous() and not views.read.is_contiguous()
    with torch.no_grad():
        out, new = module(x[:, 2:3], views)
        with tmcore.options(native=False):
            ref, ref_new = module(x[:, 2:3], st)
    _close([out, *new], [ref, *ref_new], 1e-12)
    assert _ran(taken) == 1 and all(t.is_contiguous() for t in new)


@pytest.mark.parametrize("name", ["norm", "coord_net", "content_net", "sigma_net",
                                  "write_proj", "out_proj"])
def test_weights_of_other_shapes_take_the_layers_path(name, taken):
    """The kernel indexes every weight by the config's shapes: a replaced module of other
    sizes (or a weight swapped through ``.data``) goes to the layer's path, which gives
    what the torch ops give, or their error."""
    module = _module((3, 4, 2), torch.float64, 3)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        _, st = module(x[:, :2])
        module(x[:, 2:3], st)  # (the weights checked once, then reused)
    assert _ran(taken) == 1
    memory = module.memory
    inner = getattr(memory, name, None) or module.norm
    out_features = inner.weight.shape[0]
    with torch.no_grad():
        inner.weight.data = inner.weight.data[: out_features - 1]  # same address, fewer rows
        inner.bias.data = inner.bias.data[: out_features - 1]
    with torch.no_grad(), pytest.raises(RuntimeError):
        module(x[:, 2:3], st)
    assert _ran(taken) == 1


def test_weights_changed_in_place_or_replaced_are_read_anew(taken):
    module = _module((3, 4, 2), torch.float64, 3)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        _, st = module(x[:, :2])
        module(x[:, 2:3], st)
        module.memory.out_proj.weight.mul_(2.0)  # in place: the same buffer, new values
        out, _ = module(x[:, 2:3], st)
        module.memory.content_net = torch.nn.Linear(8, 3, dtype=torch.float64)  # a new module
        module.gate = torch.nn.Parameter(torch.full((1,), -1.0, dtype=torch.float64))
        out2, new2 = module(x[:, 2:3], st)
        with tmcore.options(native=False):
            ref2, ref_new2 = module(x[:, 2:3], st)
        module.memory.content_net.weight.data = module.memory.content_net.weight.data * 3
        out3, _ = module(x[:, 2:3], st)
        with tmcore.options(native=False):
            ref3, _ = module(x[:, 2:3], st)
    assert _ran(taken) == 4
    _close([out2, *new2], [ref2, *ref_new2], 1e-12)
    _close([out3], [ref3], 1e-12)
    assert not torch.allclose(out, out2)


def test_functorch_transforms_of_the_weights_get_the_layers_path(taken):
    """Weights a transform wraps (no storage: their addresses cannot be read) go to the
    layer's path, which computes (vmap) or raises its own error (jvp: no forward mode)."""
    module = _module((3, 4, 2), torch.float64, 3)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        _, st = module(x[:, :2])
        ref, _ = module(x[:, 2:3], st)  # (the weights checked once: then wrapped below)
    params = {name: p.detach() for name, p in module.named_parameters()}

    def token(p):
        return torch.func.functional_call(module, p, (x[:, 2:3], st))[0]

    with torch.no_grad():
        out = torch.func.vmap(token)({k: torch.stack([v, v]) for k, v in params.items()})
        _close([out[0], out[1]], [ref, ref], 1e-12)
        tangents = {k: torch.ones_like(v) for k, v in params.items()}
        with pytest.raises(NotImplementedError, match="forward-mode"):
            torch.func.jvp(token, (params,), (tangents,))
    assert _ran(taken) == 1


def test_a_bad_state_gets_the_layers_error():
    module = _module((3, 4, 2), torch.float64, 3)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        _, st = module(x[:, :2])
        for bad, match in ((st._replace(h=st.h[:, :, :2]), "state.h"),
                           (st._replace(pending=st.pending[:, :2]), "state.pending"),
                           (st._replace(read=st.read.float()), "state: read"),
                           (st._replace(count=torch.tensor([3, 3], dtype=torch.int32)),
                            "state.count")):
            with pytest.raises((ValueError, TypeError), match=match):
                module(x[:, 2:3], bad)
        with pytest.raises(ValueError, match="x"):
            module.memory(torch.randn(2, 1, 9, dtype=torch.float64), st)
