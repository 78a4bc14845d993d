"""The ops' autograd Functions run the op's own forward in plain eager calls.

Through the custom op, the first call of a process imported ``torch._dynamo`` (the custom
op's dispatcher does), which raised a fresh process's first training step's peak
resident set by ~165 MiB (issue 64). Under a dispatch mode the custom op still runs
(an op counter sees one op), and both paths give the same bits.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tmcore.adapters.torch import TensorMemory  # noqa: E402

_FRESH_STEP = """
import json, sys
import torch
from tmcore.adapters.torch import ConvLSTMCell, TensorMemory

torch.manual_seed(0)
layer = TensorMemory(16, 4, (4, 4, 4), 4)
x = torch.randn(2, 12, 16, requires_grad=True)
for stream in (True, False):
    out, state = layer(x, stream=stream)
    h = state.h if stream else state[0]
    (out.sum() + h.sum()).backward()
cell = ConvLSTMCell(4, 3)
h, c = cell(torch.randn(2, 4, 4, 4, 4, requires_grad=True))
(h.sum() + c.sum()).backward()
print(json.dumps(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules)))
"""


def test_a_training_step_imports_no_dynamo():
    done = subprocess.run([sys.executable, "-c", _FRESH_STEP], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stream", [True, False])
def test_direct_forward_gives_the_custom_ops_bits(stream):
    torch.manual_seed(0)
    layer = TensorMemory(16, 4, (4, 4, 4), 4)
    x = torch.randn(2, 14, 16)

    def step():
        layer.zero_grad()
        xs = x.clone().requires_grad_(True)
        out, state = layer(xs, stream=stream)
        h = state.h if stream else state[0]
        (out.square().sum() + h.sum()).backward()
        return [out, xs.grad, *(p.grad for p in layer.parameters())]

    direct = step()
    with _Ops() as ops:
        through_op = step()
    assert {"tmcore.memory_scan", "tmcore.memory_scan_backward"} <= ops.names
    for a, b in zip(direct, through_op, strict=True):
        assert torch.equal(a, b)
