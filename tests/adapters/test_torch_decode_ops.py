"""The one-token decode step dispatches a small, constant number of operations (issue 50,
item 13): counted with a ``TorchDispatchMode`` (op counts, never timings). In generation
every row is at the same position of its chunk; a token that neither starts nor
completes a chunk runs no head, no read and no update, only its read-out; a start adds the read
coordinates (``coord_net`` of the token alone, no write head) and the read, a completion
the heads and the update without the scan's read (``scan.write``). The state a decode
step made is taken as it is by the next token (no check, no host read of its counts);
any other state is checked."""

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
    middle = [counts[k][0] for k in range(1, L - 1)]
    # no head, no read: the read-out alone (was 12, 10; 6 while the previous token's
    # output was reused, which no cheap check keeps exact)
    assert max(middle) <= 9, counts
    assert counts[0][0] <= 25, counts                # + read coordinates and the read (was 46, 31)
    # + heads and one update (its ops are the fused write step's own: no autograd
    # wrapper in inference, so its kernels are dispatched here; was 115 with the scan,
    # 81 before the single-write splat)
    assert counts[L - 1][0] <= 62, counts


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


# --------------------------------------------------------------------------- fast paths


def _chain(memory, tokens, st, fresh_count=False):
    """Decode ``tokens (B, N, d)`` one by one from ``st``; ``fresh_count``: pass each
    state with a copy of its count (a state the caller made: checked)."""
    outs = []
    for i in range(tokens.shape[1]):
        if fresh_count:
            st = st._replace(count=st.count.clone())
        out, st = memory(tokens[:, i:i + 1], st)
        outs.append(out)
    return torch.cat(outs, 1), st


def test_a_produced_state_is_taken_as_it_is_with_the_same_bits(monkeypatch):
    """The state the previous token made skips the state checks and the host read of its
    counts (complete_state runs once, for the prefill's state); a state the caller made
    is checked every token; the outputs and states are the same bits either way."""
    import tmcore.layer.layer as layer_module

    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    tokens = torch.randn(4, 3 * L, 64)
    calls = []
    real = layer_module.complete_state
    monkeypatch.setattr(layer_module, "complete_state",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        _, st = memory(torch.randn(4, 5, 64))
        calls.clear()
        fast, st_fast = _chain(memory, tokens, st)
        assert len(calls) == 1                       # the prefill's state only
        calls.clear()
        slow, st_slow = _chain(memory, tokens, st, fresh_count=True)
        assert len(calls) == tokens.shape[1]         # every token's
    assert torch.equal(fast, slow)
    for a, b in zip(st_fast, st_slow, strict=True):
        assert torch.equal(a, b)


def test_a_user_state_is_still_refused():
    """A state the caller built from a produced one, or a produced one edited in place,
    is checked (the fast path is keyed on the arrays' identity and version counters)."""
    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    x = torch.randn(4, 1, 64)
    with torch.no_grad():
        _, st = memory(torch.randn(4, 5, 64))
        _, st = memory(x, st)                          # produced by a decode step
        with pytest.raises(ValueError, match="state.count"):
            memory(x, st._replace(count=torch.full_like(st.count, L)))
        with pytest.raises(ValueError, match="state"):
            memory(x, st._replace(h=st.h[:, :8]))
        with pytest.raises(ValueError, match="state.h"):
            memory(x[:3], st)                          # another batch: checked
        st.count.fill_(L + 3)                          # edited in place: checked
        with pytest.raises(ValueError, match="state.count"):
            memory(x, st)


def _python_calls(memory, x, st) -> int:
    import sys

    seen = [0]

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            seen[0] += 1

    sys.setprofile(count)
    try:
        memory(x, st)
    finally:
        sys.setprofile(None)
    return seen[0]


def test_a_produced_state_saves_python_calls_per_token():
    """Python calls of a token in the middle of a chunk, from the state the previous token
    made vs the same state with a copied count (checked): at least 50 fewer (129 vs 207
    when written; counts, not timings)."""
    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    x = torch.randn(4, 1, 64)
    with torch.no_grad():
        _, st = memory(torch.randn(4, 4, 64))
        for _ in range(L + 1):                         # (warm: first-call imports)
            _, st = memory(x, st)                      # ends at count 1: a middle token next
        # (only the last produced state is recorded: count this one first)
        trusted = _python_calls(memory, x, st)
        checked = _python_calls(memory, x, st._replace(count=st.count.clone()))
    assert trusted <= checked - 50, (trusted, checked)


def test_the_update_without_the_read_equals_the_scan_step():
    """``scan.write`` (the fused write step on the CPU) gives the scan's state bit for bit;
    the generic step (no fused kernels) equals it to rounding."""
    from tmcore.adapters.torch.bridge import _XP
    from tmcore.adapters.torch.modules import _Scan
    from tmcore.scan.dense import write_step
    from tmcore.types import StepInputs

    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    with torch.no_grad():
        _, st = memory(torch.randn(4, 9, 64))
        inputs = memory.layer.heads(_XP, memory.params(), torch.randn(4, 1, L, 64))
        _, h, c = memory._scan(st.h, st.c, inputs)
        h_w, c_w = _Scan(memory).write(st.h, st.c, inputs)
        with tmcore.options(generic=True):
            h_g, c_g = write_step(_XP, st.h, st.c, StepInputs(*(v[:, 0] for v in inputs)),
                                  memory.cell.params(), memory.config.eps,
                                  memory.config.radius)
    assert torch.equal(h_w, h) and torch.equal(c_w, c)
    torch.testing.assert_close(h_g, h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_g, c, rtol=1e-5, atol=1e-6)


def test_read_coordinates_alone_equal_the_heads_and_a_variant_runs_its_heads():
    """``Layer.read_coords`` is the heads' ``read_coords`` to rounding; a subclass that
    replaces the heads gets ``None`` (its decode runs its own heads)."""
    from tmcore import layer as tl
    from tmcore.adapters.torch.bridge import _XP

    torch.manual_seed(0)
    memory = TensorMemory(64, 16, (4, 4, 4), L)
    chunk = torch.randn(4, 1, L, 64)
    with torch.no_grad():
        params = memory.params()
        alone = memory.layer.read_coords(_XP, params, chunk[:, 0, 0, :])
        full = memory.layer.heads(_XP, params, chunk).read_coords[:, 0, :]
    torch.testing.assert_close(alone, full, rtol=1e-5, atol=1e-6)

    class Untied(tl.Layer):
        def heads(self, xp, params, chunk):
            return super().heads(xp, params, chunk)

    assert Untied(memory.config).read_coords(_XP, params, chunk[:, 0, 0, :]) is None
    assert tl.Layer(memory.config).read_coords(_XP, params, chunk[:, 0, 0, :]) is not None


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
    """The token's output from a copy of the state (checked, not the fast path)."""
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
    gradient as from the checked path."""
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
