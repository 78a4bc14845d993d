"""JaxLM: a byte-level causal LM in Flax NNX whose blocks carry attention, an MLP and a
gated Tensor Memory residual, with a decoding cache that traces.

The cache of each block is data of fixed shapes, so one jitted function serves every
decode step: the attention's keys and values ``(B, H, K, d/H)`` for ``K = max_len``
positions (filled up to ``pos``) and the memory's :class:`tmcore.adapters.jax.StreamState`
(fixed size; its ``count`` is an int32 array). The memory streams exactly (any split
equals one call), so a prefill followed by one-token steps gives the logits of one
teacher-forced call over the whole text.

Shapes: ``tokens (B, N)`` int32 bytes; ``logits (B, N, 256)``; ``d`` = width.
No positional embedding (causal attention infers order), as in examples/lm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from tmcore.adapters import jax as tmj

VOCAB = 256


@dataclass(frozen=True)
class LMConfig:
    """The model's sizes; ``memory=False`` drops the memories (the baseline)."""

    width: int = 32
    layers: int = 2
    heads: int = 4
    memory: bool = True
    memory_channels: int = 4
    memory_shape: tuple[int, ...] = (3, 3, 3)
    chunk_size: int = 4
    forget_bias: float = 3.0


class LayerCache(NamedTuple):
    """One block's decoding cache: keys/values ``(B, H, K, d/H)`` and the memory's
    stream state (``None`` without memory)."""

    keys: jax.Array
    values: jax.Array
    memory: Any


class Cache(NamedTuple):
    """The model's cache: ``pos`` (int32 scalar, tokens seen) and one entry per block."""

    pos: jax.Array
    layers: tuple[LayerCache, ...]


class Block(nnx.Module):
    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs) -> None:
        d = config.width
        self.heads = config.heads
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)
        self.memory = (tmj.MemoryResidual(d, config.memory_channels, config.memory_shape,
                                          config.chunk_size, rngs=rngs,
                                          forget_bias=config.forget_bias)
                       if config.memory else None)

    def __call__(self, x: jax.Array, pos: jax.Array, cache: LayerCache
                 ) -> tuple[jax.Array, LayerCache]:
        """``x (B, N, d)`` at absolute positions ``pos .. pos + N - 1``."""
        batch, tokens, d = x.shape
        h = self.heads
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (jnp.moveaxis(jnp.reshape(a, (batch, tokens, h, d // h)), 2, 1)
                   for a in (q, k, v))
        keys = lax.dynamic_update_slice_in_dim(cache.keys, k, pos, axis=2)
        values = lax.dynamic_update_slice_in_dim(cache.values, v, pos, axis=2)
        span = keys.shape[2]
        seen = jnp.arange(span)[None, :] <= (pos + jnp.arange(tokens))[:, None]  # (N, K)
        scores = jnp.einsum("bhnd,bhkd->bhnk", q, keys) / jnp.sqrt(d // h)
        scores = jnp.where(seen, scores, -jnp.inf)
        att = jnp.einsum("bhnk,bhkd->bhnd", jax.nn.softmax(scores, axis=-1), values)
        x = x + self.proj(jnp.reshape(jnp.moveaxis(att, 1, 2), (batch, tokens, d)))
        x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
        memory = cache.memory
        if self.memory is not None:
            x, memory = self.memory(x, memory)
        return x, LayerCache(keys, values, memory)


class JaxLM(nnx.Module):
    """``model(tokens, cache) -> (logits, cache)``; :meth:`init_cache` makes an empty one."""

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed = nnx.Embed(VOCAB, config.width, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.layers)])
        self.norm = nnx.LayerNorm(config.width, rngs=rngs)
        self.head = nnx.Linear(config.width, VOCAB, rngs=rngs)

    def init_cache(self, batch: int, max_len: int) -> Cache:
        """An empty cache for ``max_len`` positions (its own arrays per block)."""
        c = self.config
        shape = (batch, c.heads, max_len, c.width // c.heads)
        dtype = self.head.kernel.value.dtype  # the parameters' (not the x64 default)

        def layer() -> LayerCache:
            memory = None
            if c.memory:
                pair = tmj.init_state(batch, c.memory_channels, c.memory_shape, dtype=dtype)
                memory = tmj.StreamState(pair.h, jnp.zeros_like(pair.c),
                                         jnp.zeros((batch, c.chunk_size, c.width), dtype),
                                         jnp.zeros((batch,), jnp.int32),
                                         jnp.zeros((batch, c.memory_channels), dtype))
            return LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), memory)

        return Cache(jnp.zeros((), jnp.int32), tuple(layer() for _ in range(c.layers)))

    def __call__(self, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        x = self.embed(tokens)
        layers = []
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            x, layer = block(x, cache.pos, layer)
            layers.append(layer)
        return self.head(self.norm(x)), Cache(cache.pos + tokens.shape[1], tuple(layers))


class Decoder:
    """The model as one jitted function of its parameters, ``decoder(tokens, cache) ->
    (logits, cache)``: a prefill ``(B, P)`` compiles once per prompt length, a decode step
    ``(B, 1)`` once for every token; :meth:`decode` runs ``steps`` greedy tokens as one
    ``lax.scan``. The model is split once (``nnx.split``) and its parameters kept as a
    flat list of arrays, so a call is a plain ``jax.jit`` dispatch (``nnx.jit``, or a
    ``GraphDef`` as a static argument, would walk or hash the module graph on every
    call: milliseconds per token here). The cache passed in is donated (consumed: use the
    returned one). Rebuild it after training changes the parameters."""

    def __init__(self, model: JaxLM) -> None:
        graph, self.state = nnx.split(model)
        self.leaves, treedef = jax.tree.flatten(self.state)
        self.init_cache = model.init_cache

        def merged(leaves: list) -> JaxLM:
            return nnx.merge(graph, jax.tree.unflatten(treedef, leaves))

        def call(leaves: list, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
            return merged(leaves)(tokens, cache)

        def decode(leaves: list, first: jax.Array, cache: Cache, steps: int) -> jax.Array:
            model = merged(leaves)

            def body(carry, _):
                token, cache = carry
                logits, cache = model(token[:, None], cache)
                return (jnp.argmax(logits[:, -1], axis=-1).astype(token.dtype), cache), token

            _, tokens = lax.scan(body, (first.astype(jnp.int32), cache), None, length=steps)
            return jnp.moveaxis(tokens, 0, 1)

        # the cache is donated: the step updates the KV cache in place instead of copying
        # all of it (K positions) for every token
        self._call = jax.jit(call, donate_argnums=(2,))
        self._decode = jax.jit(decode, static_argnums=(3,), donate_argnums=(2,))

    def __call__(self, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        return self._call(self.leaves, tokens, cache)

    def decode(self, first: jax.Array, cache: Cache, steps: int) -> jax.Array:
        """``steps`` greedy tokens ``(B, steps)`` from ``first (B,)`` as one ``lax.scan``."""
        return self._decode(self.leaves, first, cache, steps)


def generate(model: JaxLM, prompt: jax.Array, steps: int, max_len: int | None = None
             ) -> jax.Array:
    """Greedy decoding: the jitted prefill of ``prompt (B, P)``, then ``steps`` tokens by
    one ``lax.scan`` over the decode step (one compiled program); returns ``(B, steps)``."""
    decoder = Decoder(model)
    batch, length = prompt.shape
    logits, cache = decoder(prompt, model.init_cache(batch, max_len or length + steps))
    return decoder.decode(jnp.argmax(logits[:, -1], axis=-1), cache, steps)
