"""Train TinyLM for a few steps on Python's own docs, then decode token by token.

    python -m examples.lm.generate --steps 100 --prompt "The " --tokens 80   # ~2 min on a CPU

The text is CPython's ``pydoc_data.topics`` (ships with Python, no download), as
bytes. Training uses one teacher-forced call per batch; generation prefills the
prompt in one call and then feeds one token at a time, carrying each block's KV
cache and Tensor Memory ``StreamState`` (examples/lm/model.py). ``--window 64``
gives the attention a sliding window, so the whole decoding state is fixed-size.
"""

from __future__ import annotations

import argparse
import time

import torch

from examples.lm.model import LMConfig, TinyLM, cache_bytes, generate


def corpus() -> torch.Tensor:
    """CPython's help topics as a 1-D uint8 tensor (deterministic order)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def train(model: TinyLM, data: torch.Tensor, steps: int, *, batch: int = 16,
          length: int = 128, lr: float = 3e-3, seed: int = 0) -> float:
    """``steps`` AdamW steps of next-byte prediction on random windows; last loss."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        start = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
        window = torch.stack([data[s:s + length + 1] for s in start.tolist()])
        logits, _ = model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                                 window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="training steps (0: untrained)")
    p.add_argument("--prompt", default="The ")
    p.add_argument("--tokens", type=int, default=80, help="bytes to generate")
    p.add_argument("--window", type=int, default=None, help="sliding attention window")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TinyLM(LMConfig(window=args.window))
    if args.steps:
        start = time.perf_counter()
        loss = train(model, corpus(), args.steps)
        print(f"trained {args.steps} steps in {time.perf_counter() - start:.0f} s, "
              f"loss {loss:.3f} nats/byte")
    model.eval()
    prompt = torch.tensor([list(args.prompt.encode("utf-8"))], dtype=torch.long)
    start = time.perf_counter()
    tokens, _ = generate(model, prompt, args.tokens, temperature=args.temperature,
                         generator=torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - start
    text = bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
    _, cache = model(torch.cat([prompt, tokens], dim=1))
    print(f"{args.prompt}{text}")
    print(f"{args.tokens / seconds:.0f} tokens/s; cache {cache_bytes(cache) / 2**10:.0f} KiB")
    return text


if __name__ == "__main__":
    main()
