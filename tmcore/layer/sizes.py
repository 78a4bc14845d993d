"""The layer's size gates: the checks a layer makes from its config before it allocates.

Built on :mod:`tmcore.runtime.sizes` (element counts against int64, bytes against what
the device can hold); each gate names the argument and the bytes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from tmcore.runtime import sizes
from tmcore.runtime.options import memory_limit
from tmcore.types import device_of

__all__ = ["check_config", "check_state", "check_forward", "forward_bytes"]


def check_config(config: Any) -> Any:
    """``config`` (a :class:`tmcore.layer.LayerConfig`) if one row of its state ``(C, *S)``
    and its largest parameter ``write_proj (d, L*d)`` have int64-addressable sizes;
    else ``ValueError`` naming the argument."""
    sizes.check_count("memory_shape", (config.memory_channels, *config.memory_shape), "(C, *S)",
                "the state of one sequence")
    sizes.check_count("embed_dim", (config.embed_dim, config.chunk_size * config.embed_dim),
                "(d, L*d)", "write_proj.weight")
    return config


def forward_bytes(config: Any, batch: int, tokens: int, item: int) -> int:
    """Bytes one layer call on ``(B, N, d)`` tokens certainly holds (no checkpoints):
    :func:`scan_bytes` plus the output ``(B, N, d)`` and the padded chunks."""
    state = math.prod(config.state_shape(batch))
    steps = -(-tokens // config.chunk_size)
    working = (sizes.warp_states(len(config.memory_shape), config.flow)
               if config.dynamics == "warp" else 0)
    padded = batch * steps * config.chunk_size * config.embed_dim
    return sizes.scan_bytes(state, batch, config.memory_channels, steps, 0, item) \
        + item * (batch * tokens * config.embed_dim + padded + working * state)


def check_state(xp: Any, config: Any, batch: int, dtype: Any = None, device: Any = None
                ) -> None:
    """Before a zero state ``(h, c)`` of ``(B, C, *S)`` is made: its count fits int64, and
    the state with one scan step over it (the least any layer call on it needs:
    :func:`scan_bytes` for one step) fits the device (``ValueError`` / ``MemoryError``
    naming ``memory_shape``). Both layer paths (plain and streaming) and both
    adapters' ``init_state`` make their zero state here."""
    if sizes.compiling():
        return
    shape = config.state_shape(int(batch))
    count = sizes.check_count("memory_shape", shape, "(B, C, *S)", "the state h (and c)")
    nbytes = sizes.scan_bytes(count, shape[0], shape[1], 1, 0, sizes.itemsize(xp, dtype))
    sizes.check_bytes("memory_shape", nbytes,
                f"the state (h, c) of shape (B, C, *S) = {shape} and one scan step over it",
                xp, device)


def check_forward(xp: Any, config: Any, x: Any, dtype: Any = None) -> None:
    """Before a layer call on ``x (B, N, d)`` allocates: the state and the call's
    working set fit (``ValueError`` / ``MemoryError`` naming ``memory_shape``), in
    ``dtype`` (default ``x``'s; an adapter passes the dtype it will compute in, e.g.
    float32 for bfloat16 tokens into a float32 layer)."""
    if sizes.compiling():
        return
    batch, tokens = int(x.shape[0]), int(x.shape[1])
    item = sizes.itemsize(xp, x.dtype if dtype is None else dtype)
    nbytes = _call_bytes(config, batch, tokens, item)
    limit = memory_limit()  # (read each call: the bound may change between calls)
    if nbytes < sizes.SMALL and (limit is None or nbytes <= limit):
        return  # what check_bytes would decide, without building its message per token
    shape = config.state_shape(batch)
    sizes.check_bytes("memory_shape", nbytes,
                      f"a layer call on x {tuple(x.shape)} with a state (B, C, *S) = {shape}",
                      xp, device_of(x))


@functools.lru_cache(maxsize=256)
def _call_bytes(config: Any, batch: int, tokens: int, item: int) -> int:
    """:func:`forward_bytes` once the state's element count is checked (once per call
    shape: a decode step makes the same call every token; a refusal is not cached)."""
    sizes.check_count("memory_shape", config.state_shape(batch), "(B, C, *S)",
                      "the state h (and c)")
    return forward_bytes(config, batch, tokens, item)
