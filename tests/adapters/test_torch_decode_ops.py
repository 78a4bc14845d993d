"""The one-token decode step dispatches a small, constant number of operations: counted
with a ``TorchDispatchMode`` (op counts, never timings). In generation every row is at the
same position of its chunk; without autograd on the CPU the token is one native call
(``backends/torch/token.py``), else the layer's path: a token that neither starts nor
completes a chunk runs only its read-out, a start adds the read coordinates and the read, a
completion the heads and one scan step (its fused one-step kernels). Every state is
checked, every token."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import tmcore  # noqa: E402
from tmcore.adapters.torch import TensorMemory  # noqa: E402

L = 4


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _per_phase(memory: TensorMemory, rounds: int, grad: bool) -> dict[int, list[int]]:
    """Ops of each decode step, by the count the step starts from (from the second chunk
    of decode steps on: each takes the state the previous one made; the first step, from
    the prefill's state, checks it and reads the output out again, and the first write
    of a process caches its grid's cell centres, :mod:`tmcore.backends.torch.scan`)."""
    torch.manual_seed(1)
    tokens = torch.randn(4, L * rounds, 64)
    counts: dict[int, list[int]] = {}
    with torch.set_grad_enabled(grad):
        _, st = memory(torch.randn(4, 5, 64))
        for _ in range(L + 1):
            _, st = memory(torch.randn(4, 1, 64), st)
        for i in range(tokens.shape[1]):
            phase = int(st.count[0])
            with _Count() as mode:
                _, st = memory(tokens[:, i:i + 1], st)
            counts.setdefault(phase, []).append(len(mode.ops))
    return counts


def test_decode_step_op_count_is_small_and_constant():
    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    counts = _per_phase(memory, rounds=3, grad=False)
    assert sorted(counts) == list(range(L))
    for phase, seen in counts.items():
        assert len(set(seen)) == 1, (phase, seen)   # the same every chunk: constant
    # one native call (backends/torch/token.py), its ops the allocations of its results:
    # the output and the chunk so far (and the count), plus the read at a start and the
    # new state at a completion. Was 12 / 46 / 115 (middle / start / completion), 9 / 16 /
    # 32 with the fused read and scan step as separate kernel calls.
    middle = [counts[k][0] for k in range(1, L - 1)]
    assert max(middle) <= 4, counts
    assert counts[0][0] <= 5, counts
    assert counts[L - 1][0] <= 7, counts


def test_the_one_step_scan_dispatches_only_its_results():
    """A completing token's scan step (read, write, conv, gates: one native call) dispatches
    one op per result, the reads, ``h'``, ``c'`` and the two checkpoints, whatever the grid
    and the masks."""
    from tmcore.adapters.torch.bridge import XP

    torch.manual_seed(0)
    for shape in ((5,), (4, 4, 4), (2, 3, 2, 2)):
        memory = TensorMemory(64, 16, shape, L)
        with torch.no_grad():
            _, st = memory(torch.randn(4, 9, 64))
            inputs = memory.layer.heads(XP, memory.params(), torch.randn(4, 1, L, 64))
            active = torch.tensor([[True], [False], [True], [True]])
            for masks in ({}, {"active": active}, {"reset": ~active, "active": active}):
                with _Count() as mode:
                    memory._scan(st.h, st.c, inputs, **masks)
                assert mode.ops == ["aten.empty.memory_format"] * 5, (shape, masks, mode.ops)


def test_decode_step_ops_do_not_grow_with_the_context():
    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    short = _per_phase(memory, rounds=1, grad=False)
    long = _per_phase(memory, rounds=6, grad=False)
    assert {k: v[0] for k, v in short.items()} == {k: v[-1] for k, v in long.items()}


def test_inference_skips_the_autograd_wrapper_with_the_same_bits():
    """Without autograd the ops' forward runs directly (no Function, no dispatcher): the
    same outputs as the wrapped call, and fake tensors (``torch.export``) still take the
    op's registered fake rule."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    memory = TensorMemory(16, 4, (3, 3, 3), L)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        fast, st_fast = memory(x)
    wrapped, st_wrapped = memory(x)                  # parameters require grad: the op
    assert torch.equal(fast, wrapped.detach())
    assert torch.equal(st_fast.h, st_wrapped.h.detach())
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        out, _ = memory(torch.randn(2, 1, 16), st_fast)
    assert tuple(out.shape) == (2, 1, 16)


# --------------------------------------------------------------------------- the step


def test_every_state_is_checked():
    """A state a caller edits, builds or cuts is checked at every token (no fast path takes
    a state on trust)."""
    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    x = torch.randn(4, 1, 64)
    with torch.no_grad():
        _, st = memory(torch.randn(4, 5, 64))
        _, st = memory(x, st)                          # made by a decode step
        with pytest.raises(ValueError, match="state.count"):
            memory(x, st._replace(count=torch.full_like(st.count, L)))
        with pytest.raises(ValueError, match="state"):
            memory(x, st._replace(h=st.h[:, :8]))
        with pytest.raises(ValueError, match="state.h"):
            memory(x[:3], st)                          # another batch
        st.count.fill_(L + 3)                          # edited in place
        with pytest.raises(ValueError, match="state.count"):
            memory(x, st)


def test_the_one_step_scan_equals_the_generic_step():
    """A completing token's scan step (the fused one-step kernels on the CPU) equals the
    generic array-API step to rounding, with rows masked where they do not complete."""
    from tmcore.adapters.torch.bridge import XP

    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L).double()
    with torch.no_grad():
        _, st = memory(torch.randn(4, 9, 64, dtype=torch.float64))
        inputs = memory.layer.heads(XP, memory.params(),
                                    torch.randn(4, 1, L, 64, dtype=torch.float64))
        active = torch.tensor([[True], [False], [True], [True]])
        for masks in ({}, {"active": active}):
            fused = memory._scan(st.h, st.c, inputs, **masks)
            with tmcore.options(generic=True):
                generic = memory._scan(st.h, st.c, inputs, **masks)
            for a, b in zip(fused, generic, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert torch.equal(fused[1][1], st.h[1])       # the inactive row kept its state


def test_read_coordinates_alone_equal_the_heads_and_a_variant_overrides_both():
    """``Layer.read_coords`` is the heads' ``read_coords`` to rounding; a decode step that
    starts a chunk uses it (a variant overriding it is read there)."""
    from tmcore.adapters.torch.bridge import XP

    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    chunk = torch.randn(4, 1, L, 64)
    with torch.no_grad():
        params = memory.params()
        alone = memory.layer.read_coords(XP, params, chunk[:, 0, 0, :])
        full = memory.layer.heads(XP, params, chunk).read_coords[:, 0, :]
    torch.testing.assert_close(alone, full, rtol=1e-5, atol=1e-6)

    class Centred(type(memory.layer)):
        def read_coords(self, xp, params, first):
            return torch.zeros_like(super().read_coords(xp, params, first))

    memory.layer = Centred(memory.config)
    with torch.no_grad():
        _, st = memory(torch.randn(4, L, 64))            # a boundary: the next token starts
        out, st = memory(torch.randn(4, 1, 64), st)
        centre = memory.layer.sample(st.h, torch.zeros(4, 1, 3))[:, 0, :]
    torch.testing.assert_close(st.read, centre)


def test_an_output_edited_in_place_does_not_change_the_next():
    """A token that starts no chunk reads what the previous one read: an in-place edit of
    the previous output never reaches the next one."""
    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    x = torch.randn(4, 1, 64)
    with torch.no_grad():
        _, st = memory(torch.randn(4, 4, 64))
        first, st = memory(x, st)                       # starts a chunk: a fresh read-out
        expected = first.clone()
        first.zero_()                                   # the caller edits its output
        second, _ = memory(x, st)                       # a middle token
    assert torch.equal(second, expected)


def _middle_token_setup(memory: TensorMemory):
    """A state at count 2 (the next token is in the middle of its chunk) made by a decode
    step, that token, and the step's output (kept alive, as a caller may)."""
    torch.manual_seed(2)
    x = torch.randn(4, 6, 64, dtype=memory.out_proj.weight.dtype)
    with torch.no_grad():
        _, st = memory(x[:, :5])
        last, st = memory(x[:, 5:6], st)                # count 1 -> 2, recorded
    return x[:, 5:6], st, last


def _fresh(memory: TensorMemory, x, st, **kwargs):
    """The token's output from a copy of the state."""
    return memory(x, st._replace(h=st.h.clone()), **kwargs)[0]


def test_an_optimizer_step_between_tokens_reads_out_again():
    """An in-place update of ``out_proj`` (an optimizer step) between two tokens of one
    chunk reaches the second token's output."""
    memory = TensorMemory(64, 16, (4, 4, 4), L, zero_init=False).double()
    x, st, last = _middle_token_setup(memory)
    with torch.no_grad():
        memory.out_proj.weight.mul_(2.0)
        out, _ = memory(x, st)
        expected = _fresh(memory, x, st)
    assert torch.equal(out, expected) and not torch.equal(out, last)


def test_other_weights_through_functional_call_read_out_again():
    """``torch.func.functional_call`` with other read-out weights on a state the module's
    own weights made: the output is theirs."""
    from torch.func import functional_call

    memory = TensorMemory(64, 16, (4, 4, 4), L, zero_init=False).double()
    x, st, last = _middle_token_setup(memory)
    other = {k: v.detach() * 1.5 if k.startswith("out_proj") else v.detach()
             for k, v in memory.named_parameters()}
    with torch.no_grad():
        out, _ = functional_call(memory, other, (x, st))
        expected, _ = functional_call(memory, other, (x, st._replace(h=st.h.clone())))
    assert (out - last).abs().max() > 1e-3
    assert torch.equal(out, expected)


def test_a_token_under_grad_after_one_under_no_grad_has_its_graph():
    """A token under grad after one under ``no_grad``: the out_proj weight gets the same
    gradient as from a copy of the state."""
    memory = TensorMemory(64, 16, (4, 4, 4), L, zero_init=False).double()
    x, st, last = _middle_token_setup(memory)
    out, _ = memory(x, st)
    assert out.requires_grad and not last.requires_grad
    out.sum().backward()
    reused = memory.out_proj.weight.grad.clone()
    memory.zero_grad()
    _fresh(memory, x, st).sum().backward()
    assert reused.abs().max() > 0
    torch.testing.assert_close(reused, memory.out_proj.weight.grad, rtol=0, atol=0)


def test_a_token_under_autocast_after_one_without_gets_the_autocast_dtype():
    """A token under ``autocast`` after one without: the bfloat16 read-out."""
    memory = TensorMemory(64, 16, (4, 4, 4), L, zero_init=False)
    x, st, last = _middle_token_setup(memory)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = memory(x, st)
        expected = _fresh(memory, x, st)
    assert out.dtype == expected.dtype == torch.bfloat16 and last.dtype == torch.float32
    assert torch.equal(out, expected)


def _library_calls_per_phase(rounds: int) -> dict[int, list[int]]:
    """Python calls (every function and generator step) outside torch's own code of each
    decode token through an attached memory's hook, by the count the token starts from
    (counted with ``sys.setprofile``: calls, never timings). Not counted: torch's module
    call, which varies with what torch imported before (Dynamo), and generated methods
    (``<string>``: a config's ``__eq__`` runs where an equal config of another test
    shares a cache entry)."""
    import gc
    import os
    import sys

    from tmcore.adapters.torch import attach_memory

    calls = [0]
    torch_code = os.path.dirname(torch.__file__) + os.sep

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and not name.startswith((torch_code, "<")):
            calls[0] += 1

    torch.manual_seed(0)
    block = torch.nn.Linear(64, 64)
    handle = attach_memory([block], embed_dim=64, memory_channels=16, memory_shape=(4, 4, 4),
                           chunk_size=L, streaming=True, batch_first=True)
    counts: dict[int, list[int]] = {}
    collecting = gc.isenabled()
    gc.disable()  # (a collection may run Python callbacks inside a counted call)
    try:
        with torch.no_grad():
            block(torch.randn(4, 5, 64))
            for _ in range(L * (rounds + 2)):
                phase = int(handle.state[0].count[0])
                calls[0] = 0
                sys.setprofile(profile)
                try:
                    block(torch.randn(4, 1, 64))
                finally:
                    sys.setprofile(None)
                counts.setdefault(phase, []).append(calls[0])
    finally:
        if collecting:
            gc.enable()
    # (the first two chunks fill caches: a fresh process's first writes count a few more)
    return {phase: seen[2:] for phase, seen in counts.items()}


def test_decode_token_python_calls_are_few_and_constant():
    """Issue 60: the Python work of a decode token through the attach hook is a small
    constant, the same in every phase of its chunk: the hook, the checks of what the token
    kernel trusts and its one call (Python calls outside torch, not timings). At eac3a01 they
    were 79 (middle), 109 (start) and 240 (completion: the heads and the scan's dispatch); 68,
    107 and 164 with the fused read and scan step called from the layer's path; 41 with the
    token kernel checking its weights at every token."""
    counts = _library_calls_per_phase(rounds=3)
    assert sorted(counts) == list(range(L))
    for phase, seen in counts.items():
        assert len(set(seen)) == 1, (phase, seen)
    assert max(seen[0] for seen in counts.values()) <= 38, counts


def _chunk_one_memory() -> TensorMemory:
    torch.manual_seed(0)
    return TensorMemory(64, 16, (4, 4, 4), 1, zero_init=False).double()


def _completing_outputs(memory: TensorMemory, edit=None, grad: bool = False):
    """Chunk 1 (every token completes a chunk): a first token without gradients, then
    ``edit(memory)``, then two more tokens (the third reads what the second wrote with
    the edited heads); returns the third's output, the same from a copy of the module made
    after the edit, and the copy."""
    import copy

    torch.manual_seed(3)
    x = torch.randn(4, 3, 64, dtype=memory.out_proj.weight.dtype)
    with torch.no_grad():
        _, st = memory(x[:, :1])
        if edit is not None:
            edit(memory)
    fresh = copy.deepcopy(memory)
    with torch.set_grad_enabled(grad):
        outs = []
        for module in (memory, fresh):
            _, mid = module(x[:, 1:2], st)
            outs.append(module(x[:, 2:3], mid)[0])
    return outs[0], outs[1], fresh


@pytest.mark.parametrize("edit", [
    lambda m: m.coord_net.weight.mul_(1.5),                  # an optimizer step, in place
    lambda m: m.sigma_net.bias.add_(0.25),
    lambda m: setattr(m.content_net, "weight", torch.nn.Parameter(m.content_net.weight * 2)),
    lambda m: m.coord_net.weight.data.copy_(m.coord_net.weight.data * 0.5),  # no version
    lambda m: setattr(m.sigma_net.weight, "data", m.sigma_net.weight.data * 3),  # as .to()
])
def test_heads_follow_every_change_of_their_weights(edit):
    """Any change of the heads' weights between two decode tokens reaches the second
    token's write: an in-place update, new parameters, and edits through ``.data``, which
    no version counter sees (so no cache of the stacked heads could tell: the heads are
    stacked each call). The output equals a fresh copy's and differs from the unedited
    module's."""
    with torch.no_grad():
        second, expected, _ = _completing_outputs(_chunk_one_memory(), edit)
        unedited, _, _ = _completing_outputs(_chunk_one_memory())
    assert torch.equal(second, expected)
    assert not torch.equal(second, unedited)


def test_heads_keep_the_graph_under_grad_after_a_no_grad_call():
    """Under grad after a no-grad call, every head weight gets the gradient a fresh copy
    of the module gets."""
    memory = _chunk_one_memory()
    with torch.no_grad():
        memory(torch.randn(4, 1, 64, dtype=torch.float64))
    second, expected, fresh = _completing_outputs(memory, grad=True)
    (second.sum() + expected.sum()).backward()
    for name, p in memory.named_parameters():
        if name.startswith(("coord_net", "content_net", "sigma_net")):
            other = dict(fresh.named_parameters())[name].grad
            assert p.grad is not None and p.grad.abs().max() > 0, name
            torch.testing.assert_close(p.grad, other, rtol=0, atol=0)


def test_heads_follow_a_dtype_conversion():
    """``module.float()`` between tokens (it swaps each parameter's ``.data``): the next
    token computes in float32 with the converted heads, as a fresh float32 module does."""
    memory = _chunk_one_memory()
    x = torch.randn(4, 1, 64)
    with torch.no_grad():
        memory(torch.randn(4, 1, 64, dtype=torch.float64))
        memory.float()
        out, _ = memory(x)
        expected, _ = _chunk_one_memory().float()(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
