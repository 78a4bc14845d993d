"""attach_memory as users treat models (issue 13): the memories are part of the model
(parameters, state_dict, zero_grad, clip_grad_norm_, deepcopy, AveragedModel, pickle,
.double()), remove() restores it exactly, activation checkpointing gives exact
gradients (with streaming), and a threaded handle is safe to call from several threads."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import tmcore.adapters.torch as tmt  # noqa: E402

F64 = torch.float64


class Block(nn.Module):
    """A small token-wise block (a model we attach memory to without editing it)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Stack(nn.Module):
    def __init__(self, d=6, layers=2, ckpt=False, reentrant=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ckpt, self.reentrant = ckpt, reentrant

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.ckpt else block(x)
        return x


def _attached(mode="causal", streaming=False, seed=0, dtype=torch.float32, layers=2, **kw):
    torch.manual_seed(seed)
    model = Stack(layers=layers, **kw).to(dtype)
    handle = tmt.attach_memory(model.blocks, mode, embed_dim=6, memory_channels=2,
                               memory_shape=(3, 2, 3), chunk_size=2, streaming=streaming)
    return model, handle


def test_memories_are_part_of_the_model_and_remove_restores_it():
    torch.manual_seed(1)
    model = Stack()
    before_keys = list(model.state_dict())
    before_params = list(model.parameters())
    x = torch.randn(2, 6, 6)
    before_out = model(x)
    handle = tmt.attach_memory(model.blocks, "causal", embed_dim=6, memory_channels=2,
                               memory_shape=(3, 2, 3), chunk_size=2)
    memory_params = list(handle.parameters())
    model_params = {id(p) for p in model.parameters()}
    assert memory_params and all(id(p) in model_params for p in memory_params)
    keys = model.state_dict()
    assert "blocks.0.tensor_memory.memory.cell.pointwise_weight" in keys
    assert "blocks.1.tensor_memory.gate" in keys
    assert handle.memories[0] is model.blocks[0].tensor_memory
    # zero_grad and clip_grad_norm_ reach the memories
    model(x).square().sum().backward()
    gate = handle.memories[0].gate
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert total > 1e-3
    assert torch.sqrt(sum(p.grad.square().sum() for p in model.parameters())) < 1.01e-3
    model.zero_grad()
    assert all(p.grad is None for p in handle.parameters())
    # remove() restores the model exactly
    handle.remove()
    assert list(model.state_dict()) == before_keys
    assert list(model.parameters()) == before_params
    assert torch.equal(model(x), before_out)
    assert not hasattr(model.blocks[0], "tensor_memory")


def test_copies_pickles_and_dtype_changes_carry_the_memories(tmp_path):
    model, handle = _attached(seed=2)
    x = torch.randn(2, 6, 6)
    out = model(x)
    clone = copy.deepcopy(model)
    with torch.no_grad():  # a change to the original's memory must not reach the copy
        for p in handle.parameters():
            p.add_(1.0)
    assert not torch.equal(model(x), out)
    assert torch.equal(clone(x), out)
    assert clone.blocks[0].tensor_memory is not model.blocks[0].tensor_memory
    # AveragedModel deep-copies: its forward uses its own (averaged) memories
    averaged = torch.optim.swa_utils.AveragedModel(clone)
    averaged.update_parameters(clone)
    assert torch.equal(averaged(x), out)
    # pickle and torch.save of the whole model
    again = pickle.loads(pickle.dumps(clone))
    assert torch.equal(again(x), out)
    buffer = io.BytesIO()
    torch.save(clone, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), out)
    # .double() converts the memories too
    clone.double()
    assert clone(x.double()).dtype == F64


@pytest.mark.parametrize("mode", ["causal", "threaded"])
def test_activation_checkpointing_with_streaming_gives_exact_gradients(mode):
    """Two streamed calls, blocks under torch.utils.checkpoint: the recomputed blocks start
    from the states the forward used (old main: gradients off by ~5e-3 in float64)."""
    xs = [torch.randn(2, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(s))
          for s in (3, 4)]
    grads = {}
    for ckpt in (False, True):
        model, handle = _attached(mode, streaming=True, seed=5, dtype=F64, ckpt=ckpt)
        handle.reset_state(torch.tensor([False, False]))  # a reset mask is replayed too
        loss = sum(model(x).square().sum() for x in xs)
        loss.backward()
        grads[ckpt] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_reentrant_checkpointing_with_detached_streaming_is_exact():
    """use_reentrant=True differentiates only the checkpoint's inputs: with the streamed
    state detached between calls (as documented) the gradients are exact."""
    xs = [torch.randn(2, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(s))
          for s in (8, 9)]
    x0 = torch.zeros(2, 6, 6, dtype=F64, requires_grad=True)  # reentrant needs a grad input
    grads = {}
    for ckpt in (False, True):
        model, handle = _attached("causal", streaming=True, seed=10, dtype=F64, ckpt=ckpt,
                                  reentrant=True)
        for x in xs:
            model(x + x0).square().sum().backward()
            handle.detach_state()
        grads[ckpt] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_recomputing_an_unknown_call_is_a_clear_error():
    model, handle = _attached(streaming=True, seed=6, ckpt=True)
    x = torch.randn(2, 6, 6)
    loss = model(x).sum() + model(x).sum()  # the same tensor twice, from different states
    with pytest.raises(RuntimeError, match="same input tensor went through it twice"):
        loss.backward()


class Meet(nn.Module):
    """A block that waits until every thread has reached it (when a barrier is set), so
    that the calls are all in the middle of the model at once."""

    barrier: threading.Barrier | None = None

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        if self.barrier is not None:
            self.barrier.wait(timeout=30)
        return self.lin(x)


@pytest.mark.parametrize("mode", ["causal", "threaded"])
def test_a_handle_is_safe_to_call_from_several_threads(mode):
    """Per-call state is local to the thread (old main: a threaded handle mixed the calls
    of concurrent threads, 41 of 120 calls wrong)."""
    torch.manual_seed(7)
    blocks = nn.ModuleList([Block(6), Meet(6), Block(6)])
    handle = tmt.attach_memory(blocks, mode, embed_dim=6, memory_channels=2,
                               memory_shape=(3, 2, 3), chunk_size=2)
    model = nn.Sequential(*blocks)
    inputs = [torch.randn(1, 8, 6, generator=torch.Generator().manual_seed(s))
              for s in range(4)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    results: dict[int, torch.Tensor] = {}

    def worker(index):
        with torch.no_grad():
            results[index] = model(inputs[index])

    Meet.barrier = threading.Barrier(len(inputs))
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        Meet.barrier = None
    assert sorted(results) == list(range(len(inputs)))
    wrong = [i for i in results if not torch.equal(results[i], expected[i])]
    assert not wrong
    handle.remove()


def test_attaching_twice_is_refused():
    model, handle = _attached(seed=8)
    with pytest.raises(ValueError, match="already has an attribute 'tensor_memory'"):
        tmt.attach_memory(model.blocks, embed_dim=6, memory_channels=2, memory_shape=(2,),
                          chunk_size=2)
    handle.remove()
    tmt.attach_memory(model.blocks, embed_dim=6, memory_channels=2, memory_shape=(2,),
                      chunk_size=2).remove()


def test_reentrant_checkpointing_of_a_streamed_state_in_the_graph_is_refused():
    """use_reentrant=True cannot differentiate a streamed-in state that is part of the graph
    (issue 22: gradients were silently off by up to 0.03): the backward refuses."""
    model, handle = _attached("causal", streaming=True, seed=11, dtype=F64, ckpt=True,
                              reentrant=True)
    x0 = torch.zeros(2, 6, 6, dtype=F64, requires_grad=True)
    xs = [torch.randn(2, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(s))
          for s in (12, 13)]
    loss = sum(model(x + x0).square().sum() for x in xs)  # the second call's state: in the graph
    with pytest.raises(RuntimeError, match="use_reentrant=True"):
        loss.backward()


def test_zero_init_attaches_an_exact_identity_that_trains():
    torch.manual_seed(14)
    model = Stack()
    x = torch.randn(2, 7, 6)
    before = model(x)
    handle = tmt.attach_memory(model.blocks, "causal", embed_dim=6, memory_channels=2,
                               memory_shape=(3, 2), chunk_size=2, zero_init=True, gate_init=2.0)
    out = model(x)
    assert torch.equal(out, before)
    out.square().sum().backward()
    assert all(m.memory.out_proj.weight.grad.abs().max() > 0 for m in handle.memories)
    assert all(m.memory.zero_init for m in handle.memories)
    # MemoryResidual(zero_init=True) zeroes an existing memory's read-out, and keeps it
    memory = tmt.TensorMemory(6, 2, (3,), 2)
    residual = tmt.MemoryResidual(memory, zero_init=True)
    memory.reset_parameters()
    assert not memory.out_proj.weight.any() and torch.equal(residual(x)[0], x)


def test_padding_mask_keeps_pads_out_of_every_layer():
    """set_valid: rows with padding equal the rows' valid tokens run alone (causal mode)."""
    model, handle = _attached("causal", seed=15, dtype=F64)
    x = torch.randn(2, 7, 6, dtype=F64)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[0, :3] = False
    valid[1, 5:] = False
    handle.set_valid(valid)
    out = model(x)
    for row in range(2):
        alone = model(x[row:row + 1, valid[row]])
        torch.testing.assert_close(out[row, valid[row]], alone[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="valid"):
        handle.set_valid(valid.long())
    threaded, th = _attached("threaded", seed=16)
    with pytest.raises(ValueError, match="valid"):
        th.set_valid(valid)


def test_compiled_model_with_attached_memory_has_no_graph_break():
    """The per-call bookkeeping (thread local, lock, recompute records) is skipped while
    torch.compile traces (issue 22: 9 graph breaks in the attach hooks)."""
    model, _ = _attached("causal", seed=17)
    x = torch.randn(2, 8, 6)
    expected = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-6)
