"""Token-by-token generation: tokens/s and memory vs context length, with and without
Tensor Memory, full attention vs a sliding window (examples/lm/model.py's TinyLM).

Each (model, context) runs in a fresh process (``benchmarks.common.run_isolated``,
one thread): the prompt of ``context`` random bytes is prefilled in pieces of
``--piece`` tokens (chunked prefill, through the same cache), then ``--decode``
tokens are decoded one at a time (greedy). Reported per row: decode tokens/s (the fastest
of ``--passes`` consecutive decode passes, each continuing the cache), the bytes
the decoding cache holds between steps (keys/values plus the memory's
``StreamState``; exact, from the tensors), and the growth of the process's peak
resident set during prefill + decode (``peak_rss_growth``).

    python -m benchmarks.generation            # CPU, ~1-2 minutes
    python -m benchmarks.generation --tiny     # seconds (smoke)

JAX rows (``--jax``, on by default; examples/jax_lm's NNX model: full attention with a
fixed-size KV cache, with and without memory) measure per-token decode latency three ways:
``eager`` (the model called op by op; the memory's stream step is one compiled call),
``jit step`` (one ``jax.jit`` step over the split model, compiled once for every token)
and ``scan`` (the whole decode as one ``lax.scan``, time / tokens); the prompt is one
jitted prefill.
``--jax-only`` runs only those rows and writes ``benchmarks/results/generation-jax.json``
(rendered in docs/guides/jax-generation.md).

``--hf`` measures what a Hugging Face user sees instead (issue 50, item 13), in ONE
process and thread, interleaved (with / without memory alternate, the best of
``--hf-reps`` rounds counts): ``generate`` tokens/s of a tiny random Llama (2 layers,
batch 4, 64 new tokens, greedy; d = 64 and d = 512) with memory (``hf.attach_memory``,
chunk 4) against the same model without, and a training step (forward + backward, d =
512, N = 1024) with against without; it writes ``benchmarks/results/generation-hf.json``
and ``generation-hf.md`` (the ratios; ``--tag`` names the run, so runs before and after a
change sit side by side in the file).

Writes ``benchmarks/results/generation.json`` (``command``, ``commit``, ``config``,
``machine``, ``rows``) and prints the Markdown table docs/guides/streaming.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

KINDS = {  # name -> (window, memory)
    "attention": (None, False),
    "attention+memory": (None, True),
    "window": (64, False),
    "window+memory": (64, True),
}
JAX_KINDS = {"jax attention": False, "jax attention+memory": True}  # name -> memory
JAX_MODES = ("eager", "jit step", "scan")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "generation.json")
RESULTS_JAX = os.path.join(os.path.dirname(RESULTS), "generation-jax.json")
RESULTS_HF = os.path.join(os.path.dirname(RESULTS), "generation-hf.json")


def _config(args: argparse.Namespace, kind: str):
    from examples.lm.model import LMConfig

    window, memory = KINDS[kind]
    return LMConfig(width=args.width, layers=args.layers, heads=args.heads, window=window,
                    memory=memory, memory_channels=args.channels,
                    memory_shape=tuple(args.grid), chunk_size=args.chunk)


def measure(args: argparse.Namespace, kind: str, context: int) -> dict:
    """One (model, context) row, in this process."""
    import torch

    from benchmarks.common import peak_rss_growth
    from examples.lm.model import TinyLM, cache_bytes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM(_config(args, kind)).eval()
    prompt = torch.randint(0, 256, (1, context), generator=torch.Generator().manual_seed(1))
    times: dict = {}
    with torch.no_grad():  # warm-up outside the measurement (kernel caches, allocator)
        model(prompt[:, :2 * args.chunk + 1])

    @torch.no_grad()
    def run():
        start = time.perf_counter()
        cache = None
        for i in range(0, context, args.piece):
            logits, cache = model(prompt[:, i:i + args.piece], cache)
        times["prefill_s"] = time.perf_counter() - start
        token = logits[:, -1:].argmax(-1)
        passes = []
        for _ in range(args.passes):  # the least disturbed pass (a shared machine)
            start = time.perf_counter()
            for _ in range(args.decode):
                logits, cache = model(token, cache)
                token = logits[:, -1:].argmax(-1)
            passes.append(time.perf_counter() - start)
        times["decode_s"] = min(passes)
        times["cache_bytes"] = cache_bytes(cache)
        return cache

    peak = peak_rss_growth(run)
    return {"model": kind, "context": context,
            "decode_tokens_per_s": args.decode / times["decode_s"],
            "prefill_tokens_per_s": context / times["prefill_s"],
            "cache_bytes": times["cache_bytes"], "peak_rss_growth_bytes": peak,
            "params": sum(p.numel() for p in model.parameters())}


def measure_jax(args: argparse.Namespace, kind: str, context: int) -> list[dict]:
    """The rows of one JAX (model, context), one per decode mode, in this process (one
    XLA thread)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1").strip()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.common import peak_rss_growth
    from examples.jax_lm.model import Decoder, JaxLM, LMConfig

    jax.config.update("jax_platforms", "cpu")
    config = LMConfig(width=args.width, layers=args.layers, heads=args.heads,
                      memory=JAX_KINDS[kind], memory_channels=args.channels,
                      memory_shape=tuple(args.grid), chunk_size=args.chunk)
    model = JaxLM(config, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(1), (1, context), 0, 256, jnp.int32)
    total = context + (args.passes + 1) * args.decode + 1
    decoder = Decoder(model)
    rows, times = [], {}

    def run():
        start = time.perf_counter()
        logits, cache = decoder(prompt, model.init_cache(1, total))
        token = jnp.argmax(logits[:, -1:], axis=-1).block_until_ready()
        times["prefill_s"] = time.perf_counter() - start   # includes compiling
        for mode in JAX_MODES:
            def run_mode(token, cache, mode=mode):
                if mode == "scan":
                    return decoder.decode(token[:, 0], cache, args.decode).block_until_ready()
                call = model if mode == "eager" else decoder
                for _ in range(args.decode):
                    logits, cache = call(token, cache)
                    token = jnp.argmax(logits[:, -1:], axis=-1)
                return token.block_until_ready()
            fresh = jax.tree.map(jnp.copy, cache)
            run_mode(token, fresh)                            # compile / warm up
            passes = []
            for _ in range(args.passes):
                fresh = jax.block_until_ready(jax.tree.map(jnp.copy, cache))  # (donated)
                start = time.perf_counter()
                run_mode(token, fresh)
                passes.append(time.perf_counter() - start)
            times[mode] = min(passes)
        times["cache_bytes"] = sum(a.nbytes for a in jax.tree.leaves(cache))
        return cache

    peak = peak_rss_growth(run)
    for mode in JAX_MODES:
        rows.append({"model": f"{kind} ({mode})", "context": context,
                     "decode_tokens_per_s": args.decode / times[mode],
                     "ms_per_token": 1e3 * times[mode] / args.decode,
                     "prefill_tokens_per_s": context / times["prefill_s"],
                     "cache_bytes": times["cache_bytes"], "peak_rss_growth_bytes": peak,
                     "params": sum(a.size for a in decoder.leaves)})
    return rows


def _hf_models(width: int, memory: bool, chunk: int):
    """A tiny random Llama (2 layers, 4 heads, vocabulary 256), with or without memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tmcore.adapters import hf

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                         max_position_embeddings=4096)
    model = LlamaForCausalLM(config)
    if memory:
        hf.attach_memory(model, memory_channels=16, memory_shape=(4, 4, 4), chunk_size=chunk,
                         zero_init=False)
    return model


def measure_hf(args: argparse.Namespace) -> list[dict]:
    """The HF rows: generate tokens/s and a training step, with / without memory,
    interleaved in this process (one thread)."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for width in args.hf_widths:
        models = {m: _hf_models(width, m, args.hf_chunk).eval() for m in (False, True)}
        prompt = torch.randint(0, 256, (args.hf_batch, 8),
                               generator=torch.Generator().manual_seed(1))
        kwargs = dict(max_new_tokens=args.decode, min_new_tokens=args.decode,
                      do_sample=False, pad_token_id=0)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        with torch.no_grad():
            for m in (False, True):
                models[m].generate(prompt, **{**kwargs, "max_new_tokens": 4,
                                              "min_new_tokens": 4})
            for _ in range(args.hf_reps):
                for m in (False, True):
                    start = time.perf_counter()
                    models[m].generate(prompt, **kwargs)
                    seconds[m].append(time.perf_counter() - start)
        tokens = args.decode * args.hf_batch
        best = {m: min(v) for m, v in seconds.items()}
        rows.append({"what": "generate", "width": width, "batch": args.hf_batch,
                     "new_tokens": args.decode, "chunk": args.hf_chunk,
                     "tokens_per_s": tokens / best[False],
                     "tokens_per_s_memory": tokens / best[True],
                     "ratio": best[False] / best[True],
                     "median_ratio": statistics.median(a / b for a, b in zip(
                         seconds[False], seconds[True], strict=True)),
                     "seconds": seconds[False], "seconds_memory": seconds[True]})
        print(json.dumps(rows[-1]), file=sys.stderr)
    if args.hf_train:
        width, n = 512, args.hf_train_tokens
        models = {m: _hf_models(width, m, args.hf_chunk).train() for m in (False, True)}
        x = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(2))
        seconds = {False: [], True: []}

        def step(model):
            model.zero_grad(set_to_none=True)
            model(x, labels=x, use_cache=False).loss.backward()

        for m in (False, True):
            step(models[m])
        for _ in range(args.hf_reps):
            for m in (False, True):
                start = time.perf_counter()
                step(models[m])
                seconds[m].append(time.perf_counter() - start)
        best = {m: min(v) for m, v in seconds.items()}
        rows.append({"what": "training step", "width": width, "batch": 1, "tokens": n,
                     "chunk": args.hf_chunk, "step_s": best[False], "step_s_memory": best[True],
                     "ratio": best[True] / best[False],
                     "seconds": seconds[False], "seconds_memory": seconds[True]})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def hf_table(rows: list[dict]) -> str:
    """The Markdown table of the HF rows (generate: with/without tokens/s, higher is
    better; training: step time with/without, lower is better); ratio of the best rounds,
    then the per-round ratios' median and range."""
    lines = ["| what | d | shape | without memory | with memory | ratio | target |",
             "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        median = ""  # the per-round ratios' median and range (runs before 60 kept none)
        if "seconds" in r:
            per_round = sorted(a / b if r["what"] == "generate" else b / a for a, b in zip(
                r["seconds"], r["seconds_memory"], strict=True))
            median = (f" (rounds: median {statistics.median(per_round):.2f}x, "
                      f"{per_round[0]:.2f}-{per_round[-1]:.2f}x)")
        if r["what"] == "generate":
            # issue 60's targets
            target = ">= 0.9x" if r["width"] > 64 else ">= 0.7x" if r["batch"] == 1 \
                else ">= 0.8x"
            lines.append(f"| generate (tokens/s) | {r['width']} | B={r['batch']}, "
                         f"{r['new_tokens']} new, chunk {r['chunk']} | "
                         f"{r['tokens_per_s']:.0f} | {r['tokens_per_s_memory']:.0f} | "
                         f"{r['ratio']:.2f}x{median} | {target} |")
        else:
            lines.append(f"| training step (s) | {r['width']} | B=1, N={r['tokens']}, "
                         f"chunk {r['chunk']} | {r['step_s']:.3f} | {r['step_s_memory']:.3f} "
                         f"| {r['ratio']:.2f}x{median} | <= 1.8x |")
    return "\n".join(lines)


def main_hf(args: argparse.Namespace, argv: list[str]) -> dict:
    """``--hf``: measure, then add this run (by ``--tag``) to generation-hf.json / .md."""
    from benchmarks.common import machine_line

    run = {"tag": args.tag, "command": " ".join(["python -m benchmarks.generation", *argv]),
           "commit": _commit(), "machine": machine_line(), "rows": measure_hf(args)}
    result = {"runs": []}
    if os.path.exists(RESULTS_HF):
        with open(RESULTS_HF) as f:
            result = json.load(f)
    result["runs"] = [r for r in result["runs"] if r["tag"] != args.tag] + [run]
    if not args.tiny:
        with open(RESULTS_HF, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        write_hf_markdown(result)
    print(hf_table(run["rows"]))
    return run


def write_hf_markdown(result: dict) -> None:
    """generation-hf.md from the runs of generation-hf.json (``python -c "import json;
    from benchmarks import generation as g; g.write_hf_markdown(json.load(open(g.RESULTS_HF)))"``
    renders it again)."""
    with open(RESULTS_HF[:-len(".json")] + ".md", "w") as f:
        f.write("# Hugging Face generate and training with / without Tensor Memory\n\n"
                "Same process, one thread, interleaved; the ratio of the best rounds, then "
                "the median and range of the per-round ratios. Written by "
                "`python -m benchmarks.generation --hf`.\n")
        for r in result["runs"]:
            f.write(f"\n## {r['tag']}\n\n`{r['command']}` at commit `{r['commit']}`; "
                    f"{r['machine']}\n\n{hf_table(r['rows'])}\n")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(RESULTS)).stdout.strip()
    except OSError:
        return "unknown"


def table(result: dict) -> str:
    """The Markdown table of a results dict (docs/guides/streaming.md)."""
    lines = ["| model | context | decode tokens/s | prefill tokens/s | cache held | "
             "peak RSS growth |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if str(r.get("model", "")).startswith("jax"):
            continue
        if "error" in r:
            lines.append(f"| {r['model']} | {r['context']} | error | | | |")
            continue
        lines.append(f"| {r['model']} | {r['context']} | {r['decode_tokens_per_s']:.0f} | "
                     f"{r['prefill_tokens_per_s']:.0f} | {r['cache_bytes'] / 2**10:.0f} KiB | "
                     f"{r['peak_rss_growth_bytes'] / 2**20:.1f} MiB |")
    return "\n".join(lines)


def jax_table(result: dict) -> str:
    """The Markdown table of the JAX rows (per-token latency by decode mode)."""
    lines = ["| model (decode) | context | ms / token | decode tokens/s | prefill tokens/s "
             "(with compile) | cache held |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if not str(r.get("model", "")).startswith("jax"):
            continue
        if "error" in r:
            lines.append(f"| {r['model']} | {r['context']} | error | | | |")
            continue
        lines.append(f"| {r['model']} | {r['context']} | {r['ms_per_token']:.2f} | "
                     f"{r['decode_tokens_per_s']:.0f} | {r['prefill_tokens_per_s']:.0f} | "
                     f"{r['cache_bytes'] / 2**10:.0f} KiB |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--decode", type=int, default=64, help="tokens decoded one at a time")
    p.add_argument("--passes", type=int, default=3, help="decode passes; the fastest counts")
    p.add_argument("--piece", type=int, default=512, help="prefill piece length")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--grid", type=int, nargs="+", default=[8, 8, 8])
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="a few seconds: small sizes, no file")
    p.add_argument("--jax-only", action="store_true",
                   help=f"only the JAX rows, written to {os.path.basename(RESULTS_JAX)}")
    p.add_argument("--out", default=None, help="results file (default: by the rows run)")
    p.add_argument("--jax", action=argparse.BooleanOptionalAction, default=True,
                   help="add the JAX rows (examples/jax_lm; needs jax and flax)")
    p.add_argument("--hf", action="store_true",
                   help=f"the Hugging Face rows only ({os.path.basename(RESULTS_HF)})")
    p.add_argument("--hf-widths", type=int, nargs="+", default=[64, 512])
    p.add_argument("--hf-batch", type=int, default=4)
    p.add_argument("--hf-chunk", type=int, default=4)
    p.add_argument("--hf-reps", type=int, default=3, help="interleaved rounds; best counts")
    p.add_argument("--hf-train", action=argparse.BooleanOptionalAction, default=True,
                   help="add the training step row (d = 512)")
    p.add_argument("--hf-train-tokens", type=int, default=1024)
    p.add_argument("--tag", default="current", help="the name of this --hf run in the file")
    p.add_argument("--one", nargs=2, metavar=("KIND", "CONTEXT"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.tiny:
        args.contexts, args.decode, args.width, args.layers = [32, 64], 8, 32, 2
        args.passes = 1
        args.grid, args.channels, args.chunk, args.piece = [3, 3, 3], 4, 4, 16
    if args.hf:
        if args.tiny:
            args.hf_widths, args.decode, args.hf_reps, args.hf_train = [32], 8, 1, False
            args.chunk = 4
        return main_hf(args, argv)
    if args.one:
        if args.one[0] in JAX_KINDS:
            row = {"rows": measure_jax(args, args.one[0], int(args.one[1]))}
        else:
            row = measure(args, args.one[0], int(args.one[1]))
        print(json.dumps(row))
        return row
    from benchmarks.common import machine_line, run_isolated

    base = [a for a in argv if a != "--tiny"] if not args.tiny else argv
    rows = []
    for context in args.contexts:
        for kind in ([] if args.jax_only else args.kinds):
            row = run_isolated("benchmarks.generation", [*base, "--one", kind, str(context)])
            row.setdefault("model", kind)
            row.setdefault("context", context)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        for kind in (JAX_KINDS if (args.jax or args.jax_only) and _has_jax() else ()):
            got = run_isolated("benchmarks.generation", [*base, "--one", kind, str(context)])
            for row in got.get("rows", [{"model": kind, "context": context, **got}]):
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    config = {k: getattr(args, k) for k in ("contexts", "kinds", "decode", "passes", "piece",
                                            "width", "layers", "heads", "channels", "grid",
                                            "chunk")}
    config["window"] = 64
    config["batch"] = 1
    config["dtype"] = "float32"
    config["threads"] = 1
    config["jax"] = bool((args.jax or args.jax_only) and _has_jax())
    if args.jax_only:
        config["kinds"] = list(JAX_KINDS)
    result = {"command": " ".join(["python -m benchmarks.generation", *argv]),
              "commit": _commit(), "machine": machine_line(), "config": config, "rows": rows}
    out = args.out or (RESULTS_JAX if args.jax_only else RESULTS)
    if not args.tiny:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if not args.jax_only:
        print(table(result))
    if config["jax"]:
        print()
        print(jax_table(result))
    return result


def _has_jax() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("jax", "flax"))


if __name__ == "__main__":
    main()
