"""Hugging Face ``generate`` with memory against its floors, side by side.

The models of ``python -m benchmarks.generation --hf`` (a tiny random Llama, 2 layers, the
memory at chunk 4 on a 4x4x4 grid of 16 channels; a batch of 4 prompts of 8 tokens, 64 new
tokens, greedy; one torch thread), generated in turn in every round, in four forms:

- ``base``: the model without memory;
- ``hooks``: the memory attached, every ``MemoryResidual`` returning its input and its state
  unchanged: what the attach and cache hooks' bookkeeping costs alone;
- ``library``: as shipped;
- ``floor``: every decode token of a memory the C kernel on the state the kernel made the
  token before, with no check at all (:func:`tmcore.backends.torch.token.run_token`; the
  first token after the prompt goes through the library): per token the allocations of its
  results and one ctypes call, the least any Python around this kernel can cost.

The tokens/s of each form over ``base``'s, per round; the answer is the median over the
rounds, with their range::

    python -m benchmarks.decode_floor --rounds 7

Writes ``--json`` (default ``benchmarks/results/decode_floor.json``: the command, the commit,
the config and every round's milliseconds per generated token) and ``--md`` (the table,
rendered from it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

FORMS = ("base", "hooks", "library", "floor")


def _floor_forward(library_forward: Any) -> Any:
    """``MemoryResidual.forward`` as the floor: the unchecked kernel call on a dense state
    whose memory's weights the library checked already, else the library's forward."""
    from tmcore.adapters.torch.modules import _TOKEN_WEIGHTS
    from tmcore.backends.native.calls import kernels_for
    from tmcore.backends.torch.token import run_token
    from tmcore.layer.state import StreamState

    def forward(self: Any, x: Any, state: Any = None, **kwargs: Any) -> Any:
        weights = _TOKEN_WEIGHTS.get(self.memory)
        if weights is None or type(state) is not StreamState or x.shape[1] != 1 \
                or not all(t.is_contiguous() for t in state):
            return library_forward(self, x, state, **kwargs)
        return run_token(x, state, state.count.tolist(), self.memory.config, weights,
                         kernels_for(x))

    return forward


def measure(widths: list[int], rounds: int, batch: int, new_tokens: int) -> list[dict]:
    """Per width, every round's milliseconds per generated token of each form (interleaved in
    this process), and whether the floor generated the library's tokens."""
    import torch

    from benchmarks.generation import _hf_models
    from tmcore.adapters.torch.modules import MemoryResidual

    torch.set_num_threads(1)
    library_forward = MemoryResidual.forward
    # (hooks: a state that is not None, or the next block's hook sees this one as not run)
    forwards = {"hooks": lambda self, x, state=None, **kwargs: (x, () if state is None else state),
                "library": library_forward, "floor": _floor_forward(library_forward)}
    runs = []
    try:
        for width in widths:
            models = {"base": _hf_models(width, False, 4).eval(),
                      "memory": _hf_models(width, True, 4).eval()}
            prompt = torch.randint(0, 256, (batch, 8), generator=torch.Generator().manual_seed(1))
            kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0)
            per_round, outputs = [], {}
            with torch.no_grad():
                for index in range(rounds + 1):  # (the first round warms up, not kept)
                    times = {}
                    for form in FORMS[index % 4:] + FORMS[:index % 4]:
                        MemoryResidual.forward = forwards.get(form, library_forward)
                        model = models["base" if form == "base" else "memory"]
                        start = time.perf_counter()
                        outputs[form] = model.generate(prompt, **kwargs)
                        times[form] = (time.perf_counter() - start) / new_tokens * 1e3
                    if index:
                        per_round.append(times)
                        print(f"d={width} round {index}: {times}", file=sys.stderr)
            runs.append({"d": width, "batch": batch, "rounds": per_round,
                         "floor_equals_library": bool(torch.equal(outputs["floor"],
                                                                  outputs["library"]))})
    finally:
        MemoryResidual.forward = library_forward
    return runs


def render(result: dict) -> str:
    """The Markdown page of a results dict."""
    config = result["config"]
    lines = ["# HF `generate` with memory against its floors, side by side", "",
             f"`{result['command']}` at `{result['commit']}`; {result['machine']}. A tiny "
             f"random Llama (2 layers, intermediate 2d), memory chunk 4 on a 4x4x4 grid of 16 "
             f"channels; batch {config['batch']}, prompts of 8 tokens, {config['new_tokens']} "
             f"new tokens, greedy, one torch thread; {config['rounds']} rounds after one of "
             "warm-up, the forms interleaved. Each form's ratio is base's milliseconds per token "
             "over its own, per round: the median over the rounds and their range. `hooks`: "
             "each MemoryResidual returns its input (the hooks' bookkeeping alone); `floor`: "
             "each decode token the unchecked kernel call (`run_token`). Every round's values: "
             "`decode_floor.json`.", "",
             "| d | form | ms per token (median) | tokens/s over base |",
             "|---:|---|---:|---|"]
    for run in result["runs"]:
        for form in FORMS:
            ms = [r[form] for r in run["rounds"]]
            ratios = [r["base"] / r[form] for r in run["rounds"]]
            lines.append(f"| {run['d']} | {form} | {statistics.median(ms):.3f} | "
                         f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-"
                         f"{max(ratios):.2f}x) |")
    same = all(run["floor_equals_library"] for run in result["runs"])
    lines += ["", f"The floor generated the library's tokens: {'yes' if same else 'NO'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import checkout_commit, machine_line, save_results

    argv = sys.argv[1:] if argv is None else argv
    results = Path(__file__).resolve().parent / "results"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=results / "decode_floor.json")
    parser.add_argument("--md", type=Path, default=results / "decode_floor.md")
    parser.add_argument("--render", action="store_true", help="only rewrite --md from --json")
    args = parser.parse_args(argv)
    if args.render:
        args.md.write_text(render(json.loads(args.json.read_text())))
        return 0
    runs = measure(args.widths, args.rounds, args.batch, args.new_tokens)
    result = {"command": "python -m benchmarks.decode_floor "
                         + " ".join(shlex.quote(a) for a in argv),
              "commit": checkout_commit(sys.executable).split(" ")[0],
              "machine": machine_line(),
              "config": {"rounds": args.rounds, "batch": args.batch,
                         "new_tokens": args.new_tokens, "widths": args.widths, "chunk": 4,
                         "channels": 16, "grid": [4, 4, 4], "prompt": 8, "torch_threads": 1},
              "runs": runs}
    save_results(args, result, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
