"""One validation per call: the torch layer checks its tokens and state once per forward;
the scan's inputs are its own heads' (only the size gate runs); the backward checks
nothing again (autograd shapes the cotangents). Imports go one way between the torch
adapter's modules."""

from __future__ import annotations

import pytest
from _helpers import count_calls

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore.adapters.torch as tmt  # noqa: E402
import tmcore.adapters.torch.attach as torch_attach  # noqa: E402
import tmcore.adapters.torch.bridge as torch_ops  # noqa: E402
import tmcore.layer.layer as tl  # noqa: E402
import tmcore.layer.state as ts  # noqa: E402
import tmcore.scan.dense as dense  # noqa: E402

CHECKS = [(torch_ops, "validate_scan_inputs"), (dense, "validate_scan_inputs"),
          (torch_ops, "check_scan"), (tl, "check_tokens"), (tl, "check_state"),
          (ts, "check_state"), (tl, "stream_state")]


@pytest.fixture
def calls(monkeypatch):
    return count_calls(monkeypatch, CHECKS)


@pytest.mark.parametrize("stream, state", [(False, None), (True, None), (False, "pair"),
                                           (True, "pair"), (True, "stream")])
def test_each_check_runs_once_per_call(calls, stream, state):
    torch.manual_seed(0)
    memory = tmt.TensorMemory(8, 2, (3, 3), 4)
    x = torch.randn(2, 16, 8, requires_grad=True)  # 4 chunks
    given = {None: None, "pair": memory.init_state(2),  # (detached: one call's graph)
             "stream": tmt.detach_state(memory(torch.randn(2, 3, 8))[1])}[state]
    calls.clear()
    out, _ = memory(x, given, stream=stream)
    assert calls["check_tokens"] == 1
    assert calls["validate_scan_inputs"] == 0  # the layer's own heads: shapes known
    assert calls["check_scan"] == 1            # the one scan's size gate
    # the state: checked once (a StreamState's h and c inside its own check)
    assert (calls["check_state"], calls["stream_state"]) == {
        (False, None): (0, 0), (True, None): (0, 1), (False, "pair"): (1, 0),
        (True, "pair"): (1, 1), (True, "stream"): (1, 1)}[stream, state]
    calls.clear()
    out.sum().backward()
    assert calls["validate_scan_inputs"] == 0  # nothing again in the backward


def test_the_op_called_directly_still_validates():
    # torch.ops.tmcore.memory_scan is a public entry of its own: outside the adapter's
    # memory_scan (which validates first) its eager forward checks its inputs
    h0 = torch.zeros(1, 1, 2, 2)
    params = tmt.ConvLSTMCell(1, 2).params()
    coords = torch.zeros(1, 3, 2)
    with pytest.raises(ValueError, match="write_sigma"):
        torch.ops.tmcore.memory_scan(h0, h0, coords, coords, torch.ones(1, 4), torch.ones(1, 3, 1),
                                     *params, 1e-6, None, 1)


def test_the_package_reexports_its_modules_names():
    # tmcore.adapters.torch is a package of one-job modules (no import cycle among them:
    # tests/test_architecture.py); its public names are theirs
    assert tmt.attach_memory.__module__ == "tmcore.adapters.torch.attach"
    assert tmt.detach_state is torch_attach.detach_state
