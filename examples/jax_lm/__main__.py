"""``python -m examples.jax_lm [--steps N] [--prompt TEXT]``: greedy generation with the
untrained JaxLM three ways (eager steps, a jitted step, one ``lax.scan``), checked against
teacher forcing, with the per-token time of each. Runs in seconds on a CPU."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .model import Decoder, JaxLM, LMConfig, generate


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt", default="Tensor Memory!")   # 14 bytes: not a chunk multiple
    args = p.parse_args(argv)
    model = JaxLM(LMConfig(), rngs=nnx.Rngs(0))
    prompt = jnp.asarray([list(args.prompt.encode())], jnp.int32)
    total = prompt.shape[1] + args.steps

    start = time.perf_counter()
    scanned = np.asarray(generate(model, prompt, args.steps, total))
    scan_s = time.perf_counter() - start            # includes compiling prefill and decode

    decoder = Decoder(model)

    def loop(call):
        logits, cache = decoder(prompt, model.init_cache(1, total))
        token = jnp.argmax(logits[:, -1:], axis=-1)
        out, times = [], []
        for _ in range(args.steps):
            out.append(int(token[0, 0]))
            t = time.perf_counter()
            logits, cache = call(token, cache)
            token = jnp.argmax(logits[:, -1:], axis=-1).block_until_ready()
            times.append(time.perf_counter() - t)
        return out, times

    stepped, step_times = loop(decoder)
    eager, eager_times = loop(model)
    # teacher forcing: one call over prompt + generated tokens predicts the same tokens
    text = jnp.concatenate([prompt, jnp.asarray(scanned, jnp.int32)], axis=1)
    logits, _ = model(text, model.init_cache(1, total))
    forced = np.asarray(jnp.argmax(logits[0, prompt.shape[1] - 1:-1], axis=-1))
    result = {"scan": scanned[0].tolist(), "jit_step": stepped, "eager": eager,
              "teacher_forced": forced.tolist(),
              "jit_step_ms": 1e3 * float(np.median(step_times[1:] or step_times)),
              "eager_ms": 1e3 * float(np.median(eager_times[1:] or eager_times)),
              "scan_total_s": scan_s}
    same = result["scan"] == result["jit_step"] == result["eager"] == result["teacher_forced"]
    print(f"generated {bytes(result['scan'])!r}; the three decoders and teacher forcing "
          f"agree: {same}")
    print(f"per token: jit step {result['jit_step_ms']:.2f} ms, eager "
          f"{result['eager_ms']:.2f} ms; scan (with compiling) {scan_s:.1f} s in all")
    result["agree"] = same
    return result


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
