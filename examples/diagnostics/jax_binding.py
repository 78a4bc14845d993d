"""The Tensor Memory backbone in JAX (``--framework jax``), trained by the same recipe.

The same architecture as :class:`examples.diagnostics.models.Backbone` with a
Tensor Memory, written as pure functions over a parameter pytree; the memory
is ``tmcore.adapters.jax.residual_init`` / ``residual_apply`` (the gated
residual around the pure ``init`` / ``apply`` layer). AdamW (optax) with the
same warmup + cosine schedule, the same NumPy data stream and evaluation sets.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from examples.diagnostics.config import ModelConfig, TrainConfig
from examples.diagnostics.tasks import Batch, Task
from examples.diagnostics.train import RunResult
from tmcore.adapters import jax as tmjax

__all__ = ["init_params", "forward", "train_and_evaluate_jax"]


def _dense(key: jax.Array, n_in: int, n_out: int) -> dict:
    bound = 1.0 / math.sqrt(n_in)
    k1, k2 = jax.random.split(key)
    return {"weight": jax.random.uniform(k1, (n_out, n_in), minval=-bound, maxval=bound),
            "bias": jax.random.uniform(k2, (n_out,), minval=-bound, maxval=bound)}


def _ln(d: int) -> dict:
    return {"weight": jnp.ones((d,)), "bias": jnp.zeros((d,))}


def init_params(key: jax.Array, in_features: int, n_out: int, cfg: ModelConfig) -> dict:
    """Parameter pytree of the transformer + Tensor Memory backbone."""
    d = cfg.d_model
    keys = iter(jax.random.split(key, 8 + 6 * cfg.n_layers))
    blocks = []
    for i in range(cfg.n_layers):
        block = {"ln1": _ln(d), "qkv": _dense(next(keys), d, 3 * d),
                 "proj": _dense(next(keys), d, d), "ln2": _ln(d),
                 "fc1": _dense(next(keys), d, cfg.mlp_ratio * d),
                 "fc2": _dense(next(keys), cfg.mlp_ratio * d, d)}
        if i in cfg.memory_layers:
            block["memory"] = tmjax.residual_init(
                next(keys), d, cfg.memory_channels, cfg.memory_shape, cfg.chunk_size,
                cfg.sigma_scale, gate_init=cfg.gate_init, forget_bias=cfg.forget_bias)
            if cfg.write_init == "first_token":  # as examples.diagnostics.memory.init_write_proj
                proj = block["memory"]["memory"]["write_proj"]
                proj["weight"] = jnp.zeros_like(proj["weight"]).at[:, :d].set(jnp.eye(d))
                proj["bias"] = jnp.zeros_like(proj["bias"])
        blocks.append(block)
    return {"embed": _dense(next(keys), in_features, d),
            "pos": 0.02 * jax.random.normal(next(keys), (cfg.segment or cfg.max_len, d)),
            "blocks": blocks, "ln_f": _ln(d), "head": _dense(next(keys), d, n_out)}


def _linear(p: dict, x: jax.Array) -> jax.Array:
    return x @ p["weight"].T + p["bias"]


def _layer_norm(p: dict, x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p["weight"] + p["bias"]


def _segment(params: dict, h: jax.Array, states: list, cfg: ModelConfig
             ) -> tuple[jax.Array, list]:
    """The blocks on one attention window ``h (B, W, d)``; ``states``: one memory state per
    block (``None``: initial). Returns the final hidden ``(B, W, d)`` and the new states."""
    B, N, d = h.shape
    heads = cfg.n_heads
    causal = jnp.tril(jnp.ones((N, N), bool))
    new_states = []
    for block, state in zip(params["blocks"], states, strict=True):
        if "memory" in block and cfg.memory_first:
            h, state = tmjax.residual_apply(block["memory"], h, state)
        qkv = _linear(block["qkv"], _layer_norm(block["ln1"], h))
        q, k, v = jnp.moveaxis(qkv.reshape(B, N, 3, heads, d // heads), 2, 0)
        scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(d // heads)
        attn = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        h = h + _linear(block["proj"], jnp.einsum("bhqk,bkhe->bqhe", attn, v).reshape(B, N, d))
        if "memory" in block and not cfg.memory_first:
            h, state = tmjax.residual_apply(block["memory"], h, state)
        new_states.append(state)
        mlp = _linear(block["fc2"], jax.nn.gelu(_linear(block["fc1"],
                                                         _layer_norm(block["ln2"], h)),
                                                approximate=False))
        h = h + mlp
    return h, new_states


def forward(params: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``x (B, N, F)`` -> logits ``(B, N, n_out)``; segment by segment like the PyTorch
    backbone when ``cfg.segment`` is set (left padding, local attention and positions,
    memory state carried across segments)."""
    N = x.shape[1]
    W = cfg.segment or N
    pad = (-N) % W
    x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0)))
    states: list = [None] * len(params["blocks"])
    logits = []
    for start in range(0, N + pad, W):
        h = _linear(params["embed"], x[:, start:start + W]) + params["pos"][:W]
        h, states = _segment(params, h, states, cfg)
        logits.append(_linear(params["head"], _layer_norm(params["ln_f"], h)))
    return jnp.concatenate(logits, axis=1)[:, pad:]


def _loss(params, x, y, m, cfg):
    logits = forward(params, x, cfg)
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, y[..., None], -1)[..., 0]
    acc = (logits.argmax(-1) == y)
    return (nll * m).sum() / m.sum(), (acc * m).sum() / m.sum()


def _schedule(cfg: TrainConfig):
    def lr(step):
        warm = (step + 1) / cfg.warmup
        progress = jnp.clip((step - cfg.warmup) / max(1, cfg.steps - cfg.warmup), 0, 1)
        cosine = 0.1 + 0.9 * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return cfg.lr * jnp.where(step < cfg.warmup, warm, cosine)
    return lr


def _gates(params: dict) -> list[float]:
    # the adapter's gate is (1,) (older versions: a scalar); one value per memory
    return [float(jnp.reshape(jax.nn.sigmoid(b["memory"]["gate"]), (-1,))[0])
            for b in params["blocks"] if "memory" in b]


def _arrays(batch: Batch, length: int, segment: int | None):
    """Arrays padded to ``length`` tokens (masked out): one fixed shape, one compilation.

    In segment mode the stream is first left-padded to whole segments (as the
    PyTorch backbone does, so its last segment ends the stream), then padded on
    the right with whole segments; right padding never changes a causal model's
    earlier outputs. ``length`` is then a multiple of ``segment``.
    """
    n = batch.inputs.shape[1]
    left = (-n) % segment if segment else 0
    right = length - n - left
    pads = ((0, 0), (left, right))
    x = np.pad(batch.inputs, (*pads, (0, 0)))
    y = np.pad(batch.targets, pads)
    m = np.pad(batch.mask, pads)
    return jnp.asarray(x), jnp.asarray(y), jnp.asarray(m, jnp.float32)


def train_and_evaluate_jax(task: Task, cfg: TrainConfig, model_cfg: ModelConfig, seed: int,
                           name: str, eval_sets: dict[str, list[Batch]],
                           progress: bool = True) -> RunResult:
    """Train the JAX Tensor Memory backbone like ``train.train_and_evaluate`` and evaluate."""
    rng = np.random.default_rng(seed)
    length = task.max_len()
    if model_cfg.segment:  # whole segments: right padding then leaves the segments in place
        length = -(-length // model_cfg.segment) * model_cfg.segment
    params = init_params(jax.random.PRNGKey(seed), task.in_features, task.n_classes, model_cfg)
    opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                      optax.adamw(_schedule(cfg), weight_decay=cfg.weight_decay))
    opt_state = opt.init(params)

    @jax.jit
    def step_fn(params, opt_state, x, y, m):
        (loss, acc), grads = jax.value_and_grad(_loss, has_aux=True)(params, x, y, m, model_cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    predict = jax.jit(lambda p, x: forward(p, x, model_cfg).argmax(-1))
    n_params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
    result = RunResult(name, seed, n_params, 0.0, {})
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"{task.name}:{name}:s{seed}", disable=not progress,
               leave=False, dynamic_ncols=True)
    for step in bar:
        x, y, m = _arrays(task.batch(rng, cfg.batch_size, task.train_setting(rng)), length,
                          model_cfg.segment)
        params, opt_state, loss, acc = step_fn(params, opt_state, x, y, m)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            result.loss_curve.append((step, float(loss)))
            result.gate_curve.append((step, _gates(params)))
            bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc):.2f}")
    for label, parts in eval_sets.items():
        correct = total = 0
        for batch in parts:
            x, y, m = _arrays(batch, length, model_cfg.segment)
            pred = predict(params, x)
            correct += int(((pred == y) * m).sum())
            total += int(m.sum())
        result.accuracy[label] = correct / max(total, 1)
    result.seconds = time.perf_counter() - start
    return result
