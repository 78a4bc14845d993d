"""The torch layer's training step dispatches a number of operations that does not
grow with the sequence: the heads and the read-out run once over all chunks, only the
scan op steps through them (each dispatched op is a kernel launch on a GPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from benchmarks.launches import count_step_ops, render  # noqa: E402

SIZES = {"batch": 2, "embed_dim": 16, "channels": 4, "shape": (4, 4, 4), "chunk": 4}


@pytest.mark.parametrize("stream", [False, True], ids=["stream=False", "streaming"])
def test_ops_per_step_do_not_grow_with_the_sequence(stream):
    short, long = (count_step_ops(tokens, stream=stream, **SIZES) for tokens in (32, 256))
    assert short["chunks"] == 8 and long["chunks"] == 64
    assert long["scan"] == short["scan"] == 2  # memory_scan and its backward, once each
    assert long["outside_scan"] == short["outside_scan"], (short["by_op"], long["by_op"])


@pytest.mark.parametrize("stream", [False, True], ids=["stream=False", "streaming"])
def test_ops_per_step_within_budget(stream):
    # the budget of benchmarks/launches.py's table: every op outside the scan (views and
    # AccumulateGrad's detaches included: 114 / 130 today) and those that launch a kernel
    # on a GPU (40 / 47); a regression that loops over chunks again shows here too
    row = count_step_ops(64, stream=stream, **SIZES)
    assert row["outside_scan"] <= 140, row["by_op"]
    assert row["kernel_ops_outside_scan"] <= 60, row["by_op"]
    assert "| 64 (16) |" in render([row])
