"""Operations one torch training step dispatches, against the sequence length.

On a GPU every dispatched operation is (at least) one kernel launch and one trip
through Python, so a layer whose operation count grows with the number of chunks
is launch-bound however fast its kernels are. This script counts the ATen and
custom operations one training step of :class:`tmcore.adapters.torch.TensorMemory`
dispatches (forward + backward, a ``TorchDispatchMode``), split into the scan's
own ops (``tmcore::memory_scan`` and its backward, each one op) and everything
around them, at several sequence lengths. The count is a property of the code,
not of the machine: a test asserts it does not grow with ``N``.

On a CUDA device (``--device cuda``) it also counts the CUDA kernels one step
launches, with ``torch.profiler``.

    python -m benchmarks.launches                  # B=8, d=128, C=32, 8^3, chunk 16
    python -m benchmarks.launches --tokens 256 1024 4096 --out benchmarks/results/launches.json
    python -m benchmarks.launches --decode --out benchmarks/results/launches_decode.json

``--decode`` counts one-token decode steps instead (``no_grad``, B=4, d=64, C=16, 4^3,
chunk 4), by the position in its chunk the token takes: a token that starts a chunk reads,
one in the middle only reads out, one that completes a chunk runs the heads and one scan
step.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_step_ops", "count_decode_ops", "count_cuda_kernels", "main"]

_SCAN_OPS = ("tmcore.memory_scan", "tmcore.memory_scan_backward")
#: operations that only make a view or a detached alias: dispatched (Python and C++
#: overhead) but launching no kernel on a GPU
_VIEW_OPS = frozenset(f"aten.{name}" for name in (
    "view", "_unsafe_view", "t", "detach", "alias", "select", "slice", "expand", "unsqueeze",
    "squeeze", "permute", "transpose", "as_strided", "lift_fresh", "unbind", "split",
    "narrow"))


class _Counter(TorchDispatchMode):
    """Counts every operation dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence = (), kwargs: Any = None):
        self.ops[str(func.overloadpacket._qualified_op_name).replace("::", ".")] += 1
        return func(*args, **(kwargs or {}))


def _layer_and_input(batch: int, embed_dim: int, channels: int, shape: Sequence[int],
                     chunk: int, tokens: int, device: str) -> tuple[Any, torch.Tensor]:
    from tmcore.adapters.torch import TensorMemory

    torch.manual_seed(0)
    layer = TensorMemory(embed_dim, channels, tuple(shape), chunk, device=device)
    x = torch.randn(batch, tokens, embed_dim, device=device, requires_grad=True)
    return layer, x


def _step(layer: Any, x: torch.Tensor, grad: torch.Tensor, stream: bool = True) -> None:
    out, _ = layer(x, stream=stream)
    # backward from a given output gradient (made before counting): no loss ops are
    # counted, only the layer's
    out.backward(grad)


def count_step_ops(tokens: int, *, batch: int = 8, embed_dim: int = 128, channels: int = 32,
                   shape: Sequence[int] = (8, 8, 8), chunk: int = 16, device: str = "cpu",
                   stream: bool = True) -> dict[str, Any]:
    """One training step's dispatched operations: ``{"total", "scan", "outside_scan",
    "by_op"}`` (the step runs once first, so lazy initialization is not counted).
    ``stream``: the layer's default streaming call (it returns a state that continues
    at any token), or ``stream=False`` (the ragged last chunk padded and written)."""
    layer, x = _layer_and_input(batch, embed_dim, channels, shape, chunk, tokens, device)
    grad = torch.ones_like(x)
    _step(layer, x, grad, stream)  # warm-up: kernel builds, caches
    layer.zero_grad(set_to_none=True)
    x.grad = None
    counter = _Counter()
    with counter:
        _step(layer, x, grad, stream)
    total = sum(counter.ops.values())
    scan = sum(n for name, n in counter.ops.items() if name in _SCAN_OPS)
    views = sum(n for name, n in counter.ops.items() if name in _VIEW_OPS)
    return {"tokens": tokens, "chunks": -(-tokens // chunk), "stream": stream,
            "total": total, "scan": scan, "outside_scan": total - scan,
            "kernel_ops_outside_scan": total - scan - views,
            "by_op": dict(counter.ops.most_common())}


def count_decode_ops(*, batch: int = 4, embed_dim: int = 64, channels: int = 16,
                     shape: Sequence[int] = (4, 4, 4), chunk: int = 4,
                     rounds: int = 3) -> list[dict[str, Any]]:
    """Ops of each one-token decode step over ``rounds`` chunks after a warm-up, one row
    per position in the chunk: ``{"position", "ops", "by_op"}`` (``ops``: each chunk's
    count; ``by_op``: the last chunk's)."""
    from tmcore.adapters.torch import TensorMemory

    torch.manual_seed(0)
    layer = TensorMemory(embed_dim, channels, tuple(shape), chunk)
    tokens = torch.randn(batch, chunk * (rounds + 1) + 1, embed_dim)
    rows: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        _, state = layer(tokens[:, :1])
        for t in range(1, tokens.shape[1]):
            position = int(state.count[0])
            counter = _Counter()
            with counter:
                _, state = layer(tokens[:, t:t + 1], state)
            if t > chunk:  # the first chunk of steps warms caches (the first write's grid)
                row = rows.setdefault(position, {"position": position, "ops": []})
                row["ops"].append(sum(counter.ops.values()))
                row["by_op"] = dict(counter.ops.most_common())
    return [rows[k] for k in sorted(rows)]


def count_cuda_kernels(tokens: int, **sizes: Any) -> int:
    """CUDA kernels one training step launches (``torch.profiler``; needs a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    layer, x = _layer_and_input(tokens=tokens, device="cuda", **{
        "batch": 8, "embed_dim": 128, "channels": 32, "shape": (8, 8, 8), "chunk": 16, **sizes})
    grad = torch.ones_like(x)
    _step(layer, x, grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(layer, x, grad)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def render(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of :func:`count_step_ops` rows."""
    lines = ["| call | N (chunks) | ops per step | scan ops | outside the scan "
             "| of which launch a kernel | per chunk |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        call = "default (streaming state)" if r["stream"] else "`stream=False`"
        lines.append(f"| {call} | {r['tokens']} ({r['chunks']}) | {r['total']} | {r['scan']} | "
                     f"{r['outside_scan']} | {r['kernel_ops_outside_scan']} | "
                     f"{r['total'] / r['chunks']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--decode", action="store_true", help="count one-token decode steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m benchmarks.launches " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.decode:
        from benchmarks.common import checkout_commit

        rows = count_decode_ops()
        result = {"command": command, "commit": checkout_commit(sys.executable),
                  "config": {"batch": 4, "embed_dim": 64, "channels": 16, "shape": [4, 4, 4],
                             "chunk": 4, "grad": False}, "rows": rows}
        for row in rows:
            print(f"position {row['position']} in its chunk: {row['ops']} ops")
    else:
        result = _train_counts(args, command)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


def _train_counts(args: argparse.Namespace, command: str) -> dict[str, Any]:
    rows = [count_step_ops(n, device=args.device, stream=stream)
            for stream in (True, False) for n in args.tokens]
    if args.device == "cuda":
        for row in rows:
            row["cuda_kernels"] = count_cuda_kernels(row["tokens"])
    result = {"command": command,
              "config": {"batch": 8, "embed_dim": 128, "channels": 32, "shape": [8, 8, 8],
                         "chunk": 16, "device": args.device},
              "rows": rows}
    print(render(rows))
    return result


if __name__ == "__main__":
    main()
