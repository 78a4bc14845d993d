"""Streaming for any split, and packed documents (tmcore.layer.forward_stream, torch adapter).

Contract: feeding a sequence in pieces of ANY lengths (ragged, one token at a time),
carrying the :class:`tmcore.layer.StreamState`, gives the outputs, the state and the
gradients of one long call within rounding: <= 1e-12 in float64, <= 1e-5 in float32 (the
heads run once over all of a call's chunks, so pieces are not bit-identical). The state's
``count`` is an integer array ``(B,)``. Packed documents (a per-token
document-start mask): each document's outputs equal running it alone; a document that
ends mid-chunk does not leak into the next (its chunk grid restarts).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tmcore  # noqa: E402
from tmcore import layer as tl  # noqa: E402
from tmcore.adapters.torch import (  # noqa: E402
    MemoryResidual,
    StreamState,
    TensorMemory,
    attach_memory,
    detach_state,
    doc_starts_from_offsets,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
L = 4


def _memory(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    return TensorMemory(8, 3, (3, 4), L, dtype=dtype, **kw)


def _splits(rng: np.random.Generator, total: int) -> list[int]:
    cuts = sorted(rng.choice(np.arange(1, total), size=rng.integers(1, 6), replace=False))
    return [int(b - a) for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def _stream(memory, x, splits, state=None, doc_starts=None):
    outs, i = [], 0
    for n in splits:
        ds = None if doc_starts is None else doc_starts[:, i:i + n]
        out, state = memory(x[:, i:i + n], state, stream=True, doc_starts=ds)
        outs.append(out)
        i += n
    return torch.cat(outs, dim=1), state


def _ints(count):
    return [int(k) for k in count]


def _close(a, b, dtype):
    assert (a - b).abs().max().item() <= TOL[dtype]


def _same_state(s, ref, dtype):
    assert _ints(s.count) == _ints(ref.count)
    for name in ("h", "c", "pending", "read"):
        _close(getattr(s, name), getattr(ref, name), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("split", ["ones", "seed0", "seed1", "seed2", "chunks"])
def test_any_split_equals_one_call(dtype, split):
    memory = _memory(dtype)
    x = torch.randn(2, 23, 8, dtype=dtype)
    full, ref = memory(x, stream=True)
    old, _ = memory(x)                      # the non-streaming call: same outputs
    _close(full, old, dtype)
    splits = ([1] * 23 if split == "ones" else [L] * 5 + [3] if split == "chunks"
              else _splits(np.random.default_rng(int(split[-1])), 23))
    out, state = _stream(memory, x, splits)
    _close(out, full, dtype)
    _same_state(state, ref, dtype)
    assert isinstance(state, StreamState) and _ints(state.count) == [23 % L] * 2


def test_the_old_ragged_call_differs():
    """Why streaming needs the unfinished chunk: non-streaming ragged pieces differ."""
    memory = _memory()
    x = torch.randn(1, 12, 8, dtype=torch.float64)
    full, _ = memory(x)
    state, outs = None, []
    for i in range(12):
        out, state = memory(x[:, i:i + 1], state, stream=False)
        outs.append(out)
    assert (torch.cat(outs, 1) - full).abs().max() > 1e-3


def test_gradients_through_the_stream_equal_one_call():
    memory = _memory()
    x = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 13, 8, dtype=torch.float64)

    def grads(splits):
        out, state = _stream(memory, x, splits)
        loss = (out * weight).sum() + state.h.square().sum() + state.read.sum()
        return torch.autograd.grad(loss, [x, *memory.parameters()])

    for a, b in zip(grads([13]), grads([1, 2, 5, 1, 4]), strict=True):
        _close(a, b, torch.float64)


def test_pair_is_a_chunk_boundary_state():
    memory = _memory()
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    _, pair = memory(x[:, :8])                       # old-style (h, c) after 2 chunks
    out, state = memory(x[:, 8:], pair, stream=True)
    full, ref = memory(x, stream=True)
    _close(out, full[:, 8:], torch.float64)
    _same_state(state, ref, torch.float64)


def test_detach_state_keeps_the_count():
    memory = _memory()
    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    _, state = memory(x, stream=True)
    cut = detach_state(state)
    assert isinstance(cut, StreamState) and _ints(cut.count) == [2]
    assert not any(t.requires_grad for t in (cut.h, cut.c, cut.pending, cut.read))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_documents_equal_each_alone(dtype):
    memory = _memory(dtype)
    rng = np.random.default_rng(3)
    x = torch.randn(2, 29, 8, dtype=dtype)
    offsets = [[0, 6, 7, 15, 22], [0, 9, 10]]    # boundaries mid-chunk and 1-token documents
    starts = doc_starts_from_offsets(offsets, 29)
    out, state = memory(x, doc_starts=starts)
    for row, offs in enumerate(offsets):
        for a, b in zip(offs, [*offs[1:], 29], strict=True):
            alone, alone_state = memory(x[row:row + 1, a:b], stream=True)
            _close(out[row:row + 1, a:b], alone, dtype)
        for name in ("h", "c", "pending", "read"):   # the last document's state
            _close(getattr(state, name)[row], getattr(alone_state, name)[0], dtype)
    # packed and streamed in random pieces: the same as one packed call
    pieces, streamed = _stream(memory, x, _splits(rng, 29), doc_starts=starts)
    _close(pieces, out, dtype)
    _same_state(streamed, state, dtype)


def test_reset_mid_chunk_drops_the_unfinished_chunk():
    memory = _memory()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    _, state = memory(x[:, :6], stream=True)                 # both rows mid-chunk
    out, state = memory(x[:, 6:], state, reset=torch.tensor([True, False]))
    alone, alone_state = memory(x[:1, 6:], stream=True)
    _close(out[:1], alone, torch.float64)
    full, ref = memory(x[1:], stream=True)
    _close(out[1:], full[:, 6:], torch.float64)
    assert _ints(state.count) == [int(alone_state.count[0]), int(ref.count[0])] == [0, 2]
    # rows on different chunk grids keep streaming, each as it would alone
    more = torch.randn(2, 7, 8, dtype=torch.float64)
    out, state = memory(more, state)
    a, _ = memory(more[:1], alone_state)
    b, _ = memory(more[1:], ref)
    _close(out, torch.cat([a, b]), torch.float64)
    # a reset with no tokens forgets the row now
    _, empty = memory(more[:, :0], state, reset=torch.tensor([False, True]))
    assert _ints(empty.count) == [int(state.count[0]), 0] and not empty.h[1].any()


def test_packed_gradients_equal_each_document_alone():
    memory = _memory()
    x = torch.randn(1, 14, 8, dtype=torch.float64, requires_grad=True)
    starts = doc_starts_from_offsets([0, 5], 14)
    packed, _ = memory(x, doc_starts=starts)
    weight = torch.randn_like(packed)
    g_packed = torch.autograd.grad((packed * weight).sum(), [x, *memory.parameters()])
    alone = [memory(x[:, a:b], stream=True)[0] for a, b in ((0, 5), (5, 14))]
    g_alone = torch.autograd.grad((torch.cat(alone, 1) * weight).sum(),
                                  [x, *memory.parameters()])
    for a, b in zip(g_packed, g_alone, strict=True):
        _close(a, b, torch.float64)


def test_packed_outputs_are_causal():
    memory = _memory()
    x = torch.randn(1, 20, 8, dtype=torch.float64)
    starts = doc_starts_from_offsets([0, 7], 20)
    out, _ = memory(x, doc_starts=starts)
    for p in (3, 9, 13):
        y = x.clone()
        y[:, p:] += 1.0
        changed, _ = memory(y, doc_starts=starts)
        assert torch.equal(changed[:, :p], out[:, :p])


def test_numpy_layer_streams_exactly():
    """The framework-free layer with NumPy and tmcore's own scan."""
    config = tl.layer_config(6, 2, (3, 3), 3)
    rng = np.random.default_rng(0)
    params = tl.init_params(np, config, lambda s: rng.uniform(-s.bound, s.bound, s.shape))
    layer = tl.Layer(config)

    def scan(h, c, inputs, **masks):
        return tmcore.memory_scan(h, c, *inputs, tl.cell_params(params), **masks)

    x = rng.standard_normal((2, 14, 6))
    full, ref = layer.forward_stream(np, params, x, None, scan=scan)
    state, outs = None, []
    for i in range(14):
        out, state = layer.forward_stream(np, params, x[:, i:i + 1], state, scan=scan)
        outs.append(out)
    assert np.max(np.abs(np.concatenate(outs, axis=1) - full)) <= 1e-12
    assert np.max(np.abs(state.h - ref.h)) <= 1e-12
    assert _ints(state.count) == _ints(ref.count) == [2, 2]


def test_bad_stream_inputs_are_named():
    memory = _memory()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    _, state = memory(x, stream=True)
    with pytest.raises(ValueError, match="state.count"):
        memory(x, state._replace(count=(1, L)))
    with pytest.raises(ValueError, match="state.pending"):
        memory(x, state._replace(pending=state.pending[:, :2]))
    with pytest.raises(TypeError, match="doc_starts"):
        memory(x, doc_starts=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="doc_starts"):
        memory(x, doc_starts=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="stream=True"):
        memory(x, state, stream=False)
    with pytest.raises(ValueError, match="offsets"):
        doc_starts_from_offsets([0, 3, 3], 5)


def test_residual_and_attach_memory_stream_any_split():
    """attach_memory(streaming=True) in causal mode: calls of any lengths equal one call
    (position-wise blocks, so only the memories carry context), and packed documents."""
    class Block(torch.nn.Module):  # not a Sequential: it would call its new submodule
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.linear(x))

    torch.manual_seed(1)
    blocks = torch.nn.ModuleList([Block() for _ in range(2)]).double()
    handle = attach_memory(blocks, "causal", streaming=True, embed_dim=8, memory_channels=3,
                           memory_shape=(3, 4), chunk_size=L)

    def model(x):
        for block in blocks:
            x = block(x)
        return x

    x = torch.randn(2, 15, 8, dtype=torch.float64)
    full = model(x)
    ref = handle.state
    handle.reset_state()
    out = torch.cat([model(x[:, i:i + n]) for i, n in ((0, 1), (1, 1), (2, 6), (8, 7))], 1)
    _close(out, full, torch.float64)
    for s, r in zip(handle.state, ref, strict=True):
        _same_state(s, r, torch.float64)
    handle.detach_state()
    assert all(isinstance(s, StreamState) for s in handle.state)
    # packed documents through the handle
    handle.reset_state()
    handle.start_documents(doc_starts_from_offsets([0, 5], 15).expand(2, 15))
    packed = model(x)
    handle.reset_state()
    alone = model(x[:, 5:])
    _close(packed[:, 5:], alone, torch.float64)
    handle.remove()
    residual = MemoryResidual(_memory())
    y, state = residual(x[:, :3], stream=True)
    assert _ints(state.count) == [3, 3]


# --------------------------------------------------------------------------- JAX adapter


def _jax():
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    import jax
    import jax.numpy as jnp

    from tmcore.adapters import jax as tmj

    return jax, jnp, tmj


def _jax_split(tmj, params, x, splits, state=None, **kw):
    outs, i = [], 0
    for n in splits:
        out, state = tmj.apply(params, x[:, i:i + n], state, stream=True, **kw)
        outs.append(out)
        i += n
    import jax.numpy as jnp

    return jnp.concatenate(outs, axis=1), state


def _jmax(a, b):
    import jax.numpy as jnp

    return float(jnp.max(jnp.abs(a - b)))


def test_jax_apply_streams_any_split_and_packs():
    jax, jnp, tmj = _jax()
    params = tmj.init(jax.random.key(0), 8, 3, (3, 4), L)
    x = jax.random.normal(jax.random.key(1), (2, 13, 8), jax.numpy.float32)
    full, ref = tmj.apply(params, x, stream=True)
    old, _ = tmj.apply(params, x)
    assert _jmax(full, old) <= 1e-5
    for splits in ([1] * 13, [3, 1, 9]):
        out, state = _jax_split(tmj, params, x, splits)
        assert isinstance(state, tmj.StreamState)
        assert _ints(state.count) == _ints(ref.count) == [1, 1]
        assert _jmax(out, full) <= 1e-5 and _jmax(state.h, ref.h) <= 1e-5
        assert _jmax(state.read, ref.read) <= 1e-5
    cut = tmj.detach_state(state)
    assert _ints(cut.count) == [1, 1]
    # packed documents: each equals running it alone
    starts = tmj.doc_starts_from_offsets([0, 5, 6], 13)
    packed, _ = tmj.apply(params, x[:1], doc_starts=starts)
    for a, b in ((0, 5), (5, 6), (6, 13)):
        alone, _ = tmj.apply(params, x[:1, a:b], stream=True)
        assert _jmax(packed[:, a:b], alone) <= 1e-5
    # the state is data: a jitted call continues it like an eager one
    eager, _ = tmj.apply(params, x, state)
    jitted = jax.jit(lambda s: tmj.apply(params, x, s)[0])(state)
    assert _jmax(eager, jitted) <= 1e-5
    # a traced doc_starts cannot bound the grid: tmcore's TypeError naming max_documents
    with pytest.raises(TypeError, match="doc_starts: traced.*max_documents"):
        jax.jit(lambda m: tmj.apply(params, x[:1], doc_starts=m)[0])(
            starts)


def test_jax_causal_stack_and_modules_stream():
    jax, jnp, tmj = _jax()
    from flax import nnx

    layers = [tmj.residual_init(jax.random.key(k), 8, 3, (3, 4), L) for k in range(2)]
    x = jax.random.normal(jax.random.key(2), (1, 11, 8), jax.numpy.float32)
    full, ref = tmj.stack_apply(layers, x, mode="causal", stream=True)
    state, outs, i = None, [], 0
    for n in (1, 5, 1, 4):
        out, state = tmj.stack_apply(layers, x[:, i:i + n], state, mode="causal",
                                     stream=True)
        outs.append(out)
        i += n
    assert _jmax(jnp.concatenate(outs, axis=1), full) <= 1e-5
    assert [_ints(s.count) for s in state] == [_ints(s.count) for s in ref] == [[3], [3]]
    with pytest.raises(ValueError, match="causal"):
        tmj.stack_apply(layers, x, mode="threaded", stream=True)
    module = tmj.MemoryResidual(8, 3, (3, 4), L, rngs=nnx.Rngs(0))
    y, s = module(x[:, :3], stream=True)
    y2, s = module(x[:, 3:], s)
    whole, _ = module(x, stream=True)
    assert _ints(s.count) == [3] and _jmax(jnp.concatenate([y, y2], axis=1), whole) <= 1e-5
