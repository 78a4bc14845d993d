"""A hostile ``StreamState.count`` never mixes rows (issue 51, item 1; torch side).

Eagerly, a ``count`` outside ``[0, chunk_size)`` is a ``ValueError`` naming ``state.count``
and the range (the multi-token call, the one-token decode step, values that wrap int32);
under ``torch.compile`` (no host read) an out-of-range count is treated as 0 (the row's
unfinished chunk is dropped: it continues from its ``(h, c)`` at a chunk boundary), so a
row's outputs never depend on another row's data and never are NaN.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tmcore.adapters.torch import (  # noqa: E402
    StreamState,
    TensorMemory,
    state_from_dict,
    state_to_dict,
)

L = 4
HOSTILE = [(13, 2), (-1, 2), (L, 0), (-(2 ** 31), 1), (2 ** 32 + 1, 1), (2 ** 31 - 1, 3)]


def _memory(seed: int = 0) -> TensorMemory:
    torch.manual_seed(seed)
    return TensorMemory(8, 3, (3, 4), L, dtype=torch.float64)


def _state(memory: TensorMemory, count: tuple[int, int], seed: int = 1) -> StreamState:
    """A two-row mid-chunk state with ``count`` (int64: values may exceed int32)."""
    g = torch.Generator().manual_seed(seed)
    _, st = memory(torch.randn(2, 6, 8, dtype=torch.float64, generator=g))
    return st._replace(count=torch.tensor(count, dtype=torch.int64))


def _other_row_changed(st: StreamState, seed: int = 7) -> StreamState:
    """``st`` with row 1's data replaced (row 0 untouched)."""
    g = torch.Generator().manual_seed(seed)

    def swap(t):
        t = t.clone()
        t[1] = torch.randn(t[1].shape, dtype=t.dtype, generator=g) * 10
        return t

    return StreamState(swap(st.h), swap(st.c), swap(st.pending), st.count, swap(st.read))


@pytest.mark.parametrize("count", HOSTILE)
@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_eager_hostile_count_is_a_named_error(count, tokens):
    memory = _memory()
    st = _state(memory, count)
    x = torch.randn(2, tokens, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"state\.count.*\[0, 4\)"):
        memory(x, st)


def test_eager_decode_step_refuses_a_count_that_wraps_int32():
    memory = _memory()
    st = _state(memory, (2 ** 32 + 1, 1))  # int32 would wrap it to 1, a valid count
    with pytest.raises(ValueError, match=r"state\.count"):
        memory(torch.randn(2, 1, 8, dtype=torch.float64), st)


def test_state_from_dict_tensor_count_is_checked():
    memory = _memory()
    data = state_to_dict(_state(memory, (1, 2)))
    for bad in ((13, 2), (-1, 0), (2 ** 32 + 1, 1)):
        data["count"] = torch.tensor(bad, dtype=torch.int64)
        with pytest.raises(ValueError, match=r"count.*\[0, 4\)"):
            state_from_dict(data)


@pytest.mark.parametrize("count", HOSTILE)
@pytest.mark.parametrize("tokens", [1, 6])
def test_compiled_hostile_count_never_reads_another_row(count, tokens):
    memory = _memory()
    st = _state(memory, count)
    x = torch.randn(2, tokens, 8, dtype=torch.float64)
    run = torch.compile(lambda x, s: memory(x, s), backend="eager", fullgraph=False,
                        dynamic=False)
    out_a, st_a = run(x, st)
    x_b = x.clone()
    x_b[1] = torch.randn(tokens, 8, dtype=torch.float64) * 10
    out_b, st_b = run(x_b, _other_row_changed(st))
    assert torch.isfinite(out_a).all() and torch.isfinite(st_a.h).all()
    assert torch.equal(out_a[0], out_b[0])       # row 0 does not see row 1
    for a, b in zip(st_a, st_b, strict=True):
        assert torch.equal(a[0], b[0])
    # the defined behaviour: an out-of-range count is an empty unfinished chunk
    fixed = [k if 0 <= k < L else 0 for k in count]
    ref_out, ref_st = memory(x, st._replace(count=torch.tensor(fixed, dtype=torch.int32)))
    assert (out_a - ref_out).abs().max().item() <= 1e-12
    assert (st_a.h - ref_st.h).abs().max().item() <= 1e-12
    assert [int(k) for k in st_a.count] == [int(k) for k in ref_st.count]
    assert all(0 <= int(k) < L for k in st_a.count)
