"""The one-token decode step dispatches a small, constant number of operations (issue 50,
item 13): counted with a ``TorchDispatchMode`` (op counts, never timings). In generation
every row is at the same position of its chunk; a token that neither starts nor
completes a chunk runs no head, no read and no update; a start adds the heads and the
read (one custom op), a completion the heads and one scan step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

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
    """Ops of each decode step, by the count the step starts from."""
    torch.manual_seed(1)
    tokens = torch.randn(4, L * rounds, 64)
    counts: dict[int, list[int]] = {}
    with torch.set_grad_enabled(grad):
        _, st = memory(torch.randn(4, 5, 64))
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
    assert max(middle) <= 12, counts                 # no head, read or update
    assert counts[0][0] <= 46, counts                # + heads and the read
    # + heads and one scan step (its ~100 ops are the scan's own: no autograd wrapper
    # in inference, so its kernels are dispatched here rather than inside one op)
    assert counts[L - 1][0] <= 115, counts


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
