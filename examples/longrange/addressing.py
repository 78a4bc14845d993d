"""Does a trained Tensor Memory row address by key? Measured with
:func:`tmcore.adapters.torch.probe.trace` on the key-value evaluation examples.

Per memory layer (chunks of one token, so a chunk is a position):

- ``eta2_write`` / ``eta2_read``: the key's share of the variance of the write coordinates
  at the facts / of the read coordinates at the questions (:func:`eta_squared`; 0: the
  address ignores the key, 1: it is a function of the key alone);
- ``nearest``: how often, among the ``n >= 2`` facts of an example, the asked fact's write
  is the one nearest the question's read (``nearest_chance``: the mean of ``1 / n``);
- ``sigma_facts`` / ``sigma_filler``: the mean write spread at facts / at filler tokens
  (the cell spacing of an axis of ``S_a`` cells is ``2 / (S_a - 1)``);
- ``read_ratio``: the mean over tokens of the gated read's RMS over the residual stream's;
- ``gate``: ``sigmoid(gate)``;
- ``c_rms``: the RMS of the cell state ``c`` per number when the question arrives (``h =
  o tanh(c)``: far above 1, every cell is saturated).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from examples.longrange.models import Built
from examples.longrange.task import PAD, QUERY, Batch, Vocab

__all__ = ["eta_squared", "measures"]


def eta_squared(points: Tensor, groups: Tensor) -> float:
    """The share of the variance of ``points (M, n)`` between the groups ``groups (M,)``:
    ``sum_g M_g |mean_g - mean|^2 / sum_i |p_i - mean|^2`` (summed over the ``n`` axes)."""
    points = points.double()
    mean = points.mean(0)
    total = (points - mean).square().sum()
    between = sum(int((groups == g).sum()) * (points[groups == g].mean(0) - mean).square().sum()
                  for g in groups.unique())
    return float(between / total) if total > 0 else 0.0


def measures(built: Built, batches: Iterable[Batch], vocab: Vocab) -> list[dict[str, Any]]:
    """The addressing measures (module docstring) of ``built``'s memories, one dict per
    layer, over the key-value examples of ``batches``."""
    from tmcore.adapters.torch.probe import trace

    if any(m.memory.chunk_size != 1 for m in built.handle.memories):
        raise ValueError("built: the measures read one position per chunk (chunk_size 1)")
    acc: list[dict[str, list[Tensor]]] = []
    gates: list[float] = []
    numbers = [m.memory.memory_channels * math.prod(m.memory.memory_shape)
               for m in built.handle.memories]
    for batch in batches:
        rows = [i for i, kind in enumerate(batch.kinds) if kind == "kv"]
        if not rows:
            continue
        tokens, tags = batch.tokens[rows], batch.tags[rows]
        keys = torch.tensor([batch.keys[i] for i in rows])
        _, traces = trace(built.model, lambda t=tokens, g=tags: built.forward(t, g))
        fact = (tags >= vocab.value0) & (tags < vocab.place0)                 # (b, T)
        filler = (tokens >= vocab.filler0) & (tags == PAD)
        question = tags == QUERY
        assert bool((question.sum(1) == 1).all()) and bool(question[:, -1].all())
        if not acc:
            acc = [{k: [] for k in ("write", "write_key", "read", "read_key", "hit", "chance",
                                    "sigma_facts", "sigma_filler", "ratio", "c_rms")}
                   for _ in traces]
            gates = [tr.gate for tr in traces]
        asked = tokens[:, -1]
        for tr, a, size in zip(traces, acc, numbers, strict=True):
            a["write"].append(tr.write_coords[fact])
            a["write_key"].append(tokens[fact])
            a["read"].append(tr.read_coords[:, -1])
            a["read_key"].append(asked)
            a["sigma_facts"].append(tr.sigma[fact])
            a["sigma_filler"].append(tr.sigma[filler])
            a["ratio"].append((tr.read_rms / tr.stream_rms).flatten())
            a["c_rms"].append(tr.c_norm[:, -2] / size ** 0.5)  # before the question
            for b in torch.nonzero(keys >= 2).flatten().tolist():
                where = torch.nonzero(fact[b]).flatten()
                dist = (tr.write_coords[b, where] - tr.read_coords[b, -1]).norm(dim=-1)
                a["hit"].append(torch.tensor([float(tokens[b, where[dist.argmin()]]
                                                    == asked[b])]))
                a["chance"].append(torch.tensor([1.0 / len(where)]))
    out = []
    for a, gate in zip(acc, gates, strict=True):
        cat = {k: torch.cat(v) for k, v in a.items()}
        out.append({
            "eta2_write": round(eta_squared(cat["write"], cat["write_key"]), 4),
            "eta2_read": round(eta_squared(cat["read"], cat["read_key"]), 4),
            "nearest": round(float(cat["hit"].mean()), 4),
            "nearest_chance": round(float(cat["chance"].mean()), 4),
            "sigma_facts": round(float(cat["sigma_facts"].mean()), 4),
            "sigma_filler": round(float(cat["sigma_filler"].mean()), 4),
            "read_ratio": round(float(cat["ratio"].mean()), 4),
            "gate": round(gate, 4),
            "c_rms": round(float(cat["c_rms"].mean()), 4),
        })
    return out
