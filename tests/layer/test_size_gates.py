"""One size gate before any allocation: parameters, a call's activations and state, a
scan's residuals, masks and state files are checked against the device's memory, or the
bound TMCORE_MEMORY_LIMIT sets, before anything is made; the error names the field and
the bytes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tmcore
from tmcore.layer import doc_starts_from_offsets
from tmcore.runtime import options as runtime_options
from tmcore.runtime import validate

torch = pytest.importorskip("torch", reason="torch is not installed")

from tmcore.adapters import torch as tmt  # noqa: E402


@pytest.fixture
def limit(monkeypatch):
    """Set TMCORE_MEMORY_LIMIT for one test."""
    def set_limit(value: str) -> None:
        monkeypatch.setenv(runtime_options.MEMORY_LIMIT_ENV_VAR, value)
    return set_limit


def test_memory_limit_parses_sizes_and_warns_on_nonsense(monkeypatch):
    for raw, want in (("64M", 64 << 20), ("2g", 2 << 30), ("1.5KiB", 1536), ("4096", 4096)):
        monkeypatch.setenv(runtime_options.MEMORY_LIMIT_ENV_VAR, raw)
        assert runtime_options.memory_limit() == want
    monkeypatch.setenv(runtime_options.MEMORY_LIMIT_ENV_VAR, "lots")
    with pytest.warns(RuntimeWarning, match="TMCORE_MEMORY_LIMIT='lots'"):
        assert runtime_options.memory_limit() is None
    assert validate.memory_budget(np)[0] > 0  # the host's own bound applies again


def test_parameters_are_gated_by_field_before_any_is_made(limit):
    limit("64M")
    with pytest.raises(MemoryError, match="memory_channels: the parameters .* nothing was "
                                          "allocated.*TMCORE_MEMORY_LIMIT"):
        tmt.TensorMemory(64, 3000, (4, 4, 4), 4)
    with pytest.raises(MemoryError, match="embed_dim: the parameters"):
        tmt.TensorMemory(64, 4, (4, 4, 4), 10**5)
    with pytest.raises(MemoryError, match="memory_channels"):
        tmt.ConvLSTMCell(3000, 3)
    tmt.TensorMemory(64, 4, (4, 4, 4), 4)  # a small layer is untouched


def test_a_forget_bias_the_dtype_cannot_hold_is_named():
    with pytest.raises(ValueError, match="forget_bias: 1e\\+308 overflows .*float32"):
        tmt.TensorMemory(8, 2, (3, 3), 4, forget_bias=1e308)
    with pytest.raises(ValueError, match="forget_bias"):
        tmt.ConvLSTMCell(2, 2, forget_bias=-1e300)
    tmt.TensorMemory(8, 2, (3, 3), 4, forget_bias=1e308, dtype=torch.float64)


def test_a_layer_call_and_its_scans_are_gated(limit):
    memory = tmt.TensorMemory(8, 4, (8, 8, 8), 4)
    local = tmt.TensorMemory(8, 4, (8, 8, 8), 4, update="local", window=8)
    warp = tmt.TensorMemory(8, 4, (8, 8, 8), 4, dynamics="warp", flow=True)
    x = torch.randn(64, 256, 8, requires_grad=True)
    limit("4M")
    for module in (memory, local, warp):
        for stream in (True, False):
            with pytest.raises(MemoryError, match="memory_shape: a layer call on x"):
                module(x, stream=stream)
    # the scans' own gates count what a backward keeps (checkpoints, or the undo log)
    limit("32M")
    h0 = torch.zeros(64, 4, 8, 8, 8)
    coords = torch.zeros(64, 64, 3)
    args = (h0, h0, coords, coords, torch.ones(64, 64), torch.ones(64, 64, 4))
    params = memory.cell.params()
    with pytest.raises(MemoryError, match="h0: a backward over T = 64 steps keeping 64"):
        tmt.memory_scan(*(a.requires_grad_() for a in args), params)
    inputs = tmcore.StepInputs(*args[2:])
    options = tmcore.scan.scan_options(local.config)
    with pytest.raises(MemoryError, match="h0: a backward over T = 64"):
        tmt.option_scan(options, args[0], args[1], inputs, params)


def test_document_offsets_are_ints_and_the_mask_is_gated(limit):
    for bad in (2.7, "5", True, None):
        with pytest.raises(TypeError, match="offsets\\[0\\]"):
            doc_starts_from_offsets(np, [0, bad], 8)
    with pytest.raises(ValueError, match="offsets\\[0\\]: expected increasing"):
        doc_starts_from_offsets(np, [0, 4, 4], 8)
    with pytest.raises(TypeError, match="tokens"):
        doc_starts_from_offsets(np, [0], 8.0)
    got = doc_starts_from_offsets(np, [[0, 3, 8], [0, 5]], 8)
    want = np.zeros((2, 8), dtype=bool)
    want[0, [0, 3]] = want[1, [0, 5]] = True
    assert np.array_equal(got, want)
    assert np.array_equal(tmt.doc_starts_from_offsets([0, 3, 8], 8).numpy(), want[:1])
    limit("1M")
    with pytest.raises(MemoryError, match="tokens: the document-start mask"):
        doc_starts_from_offsets(np, [0, 5], 10**8)


def test_a_state_file_is_checked_before_its_values_are_read():
    _, state = tmt.TensorMemory(8, 2, (3, 3), 4)(torch.randn(2, 5, 8))
    saved = tmt.state_to_dict(state)
    huge = dict(saved, count=torch.zeros(1, dtype=torch.int32).expand(10**7))  # stride 0
    with pytest.raises(ValueError, match="one count per row of h"):
        tmt.state_from_dict(huge)
    for bad in ([13, 2], [-1, 0]):
        with pytest.raises(ValueError, match="ints in \\[0, 4\\)"):
            tmt.state_from_dict(dict(saved, count=torch.tensor(bad, dtype=torch.int32)))
    assert torch.equal(tmt.state_from_dict(saved).count, state.count)


def test_checkpoint_residuals_of_another_dtype_are_named():
    h0 = torch.zeros(1, 1, 2, 2)
    coords = torch.zeros(1, 3, 2)
    params = tmt.ConvLSTMCell(1, 2).params()
    primals = (h0, h0, coords, coords, torch.ones(1, 3), torch.ones(1, 3, 1), *params)
    _, _, _, hk, ck = torch.ops.tmcore.memory_scan(*primals, 1e-6, None, 1)
    cot = (torch.ones(1, 3, 1), torch.zeros_like(h0), torch.zeros_like(h0))
    expected = "h_checkpoints: expected a floating dtype, h0's torch.float32"
    with pytest.raises(TypeError, match=expected):
        torch.ops.tmcore.memory_scan_backward(*primals, hk.double(), ck, *cot, 1e-6, None, 1)


def test_hostile_sizes_allocate_nothing_under_an_address_space_limit():
    """Under RLIMIT_AS (how an attacker's harness bounds a process), sizes that could
    never fit are refused by name before allocating; the process grows < 100 MiB."""
    code = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import torch
        from tmcore.adapters.torch import TensorMemory
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for kw in ({"memory_channels": 20000}, {"chunk_size": 10**7},
                   {"embed_dim": 10**6}, {"memory_channels": 10**12}):
            args = {"embed_dim": 64, "memory_channels": 4, "memory_shape": (4, 4, 4),
                    "chunk_size": 4, **kw}
            try:
                TensorMemory(**args)
            except (MemoryError, ValueError) as error:
                print(type(error).__name__, str(error).split(":")[0])
        print("grew", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    lines = done.stdout.split("\n")
    assert lines[:4] == ["MemoryError memory_channels", "MemoryError embed_dim",
                         "MemoryError embed_dim", "ValueError memory_channels"], done.stdout
    assert int(lines[4].split()[1]) < 100, done.stdout
