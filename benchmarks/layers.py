"""The implementations under test, built from one shared set of parameters.

- ``torch``: ``tmcore.adapters.torch.TensorMemory`` (tmcore's scan with its
  hand-written backward, torch fast paths from ``tmcore.backends``); while the
  adapter is not importable, :class:`TmcoreTorchLayer` below (the same tmcore
  scan behind a small ``autograd.Function``) stands in, and the results say so.
- ``plain``: :class:`benchmarks.plain_torch.PlainTensorMemory`, the baseline.
- ``jax``: ``tmcore.adapters.jax.apply`` under ``jax.jit``.
- ``numpy``: ``tmcore.scan.memory_scan_fwd`` / ``memory_scan_bwd`` on NumPy
  arrays (the scan only: NumPy has no layer).
- ``floor``: the pointwise-mixing matrix products alone, for the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.common import Config
from benchmarks.plain_torch import PlainTensorMemory

__all__ = [
    "TmcoreTorchLayer",
    "reference_params",
    "make_inputs",
    "torch_layer",
    "torch_layer_source",
    "torch_step",
    "jax_step",
    "numpy_step",
    "floor_step",
    "scan_inputs",
]


def _torch_xp():
    import array_api_compat

    return array_api_compat.array_namespace(torch.empty(0))


class _Scan(torch.autograd.Function):
    """tmcore.scan.memory_scan_fwd / memory_scan_bwd as one autograd node."""

    @staticmethod
    def forward(ctx, h0, c0, rc, wc, ws, content, dw, db, pw, pb, every):
        from tmcore.scan import memory_scan_fwd
        from tmcore.types import ConvParams

        params = ConvParams(dw, db, pw, pb)
        reads, h, c, hk, ck = memory_scan_fwd(_torch_xp(), h0, c0, rc, wc, ws, content, params,
                                              checkpoint_every=every)
        ctx.save_for_backward(rc, wc, ws, content, dw, db, pw, pb, hk, ck)
        ctx.every = every
        return reads, h, c

    @staticmethod
    def backward(ctx, g_reads, g_h, g_c):
        from tmcore.scan import memory_scan_bwd
        from tmcore.types import ConvParams

        rc, wc, ws, content, dw, db, pw, pb, hk, ck = ctx.saved_tensors
        g_h = torch.zeros_like(hk[0]) if g_h is None else g_h
        g_c = torch.zeros_like(ck[0]) if g_c is None else g_c
        if g_reads is None:
            g_reads = content.new_zeros(content.shape)
        grads = memory_scan_bwd(_torch_xp(), rc, wc, ws, content, ConvParams(dw, db, pw, pb),
                                hk, ck, g_reads, g_h, g_c, checkpoint_every=ctx.every)
        return (*grads[:6], *grads.params, None)


class TmcoreTorchLayer(PlainTensorMemory):
    """The plain layer's projections around tmcore's scan (stand-in for the adapter)."""

    def __init__(self, *args, checkpoint_every: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_every = checkpoint_every

    def scan(self, h, c, read_coords, write_coords, write_sigma, write_content):
        dw = torch.stack([conv.weight.reshape(-1, 3) for conv in self.convs])
        db = torch.stack([conv.bias for conv in self.convs])
        pw = self.pointwise.weight.flatten(1)
        return _Scan.apply(h, c, read_coords, write_coords, write_sigma, write_content, dw, db,
                           pw, self.pointwise.bias, self.checkpoint_every)


def reference_params(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """One parameter set (tmcore names, float32 NumPy) for every implementation."""
    torch.manual_seed(seed)
    plain = PlainTensorMemory(cfg.embed_dim, cfg.channels, cfg.shape, cfg.chunk)
    with torch.no_grad():  # a mildly non-trivial cell: taps near identity
        for conv in plain.convs:
            conv.weight.mul_(0.3).add_(_identity_taps(conv.weight))
            conv.bias.mul_(0.1)
    return {k: v.numpy().astype(np.float32) for k, v in plain.tm_state_dict().items()}


def _identity_taps(weight: torch.Tensor) -> torch.Tensor:
    taps = torch.zeros_like(weight).reshape(weight.shape[0], 3)
    taps[:, 1] = 1.0
    return taps.reshape(weight.shape)


def make_inputs(cfg: Config, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``x (B, N, d)`` and an output cotangent ``g (B, N, d)``."""
    rng = np.random.default_rng(seed)
    shape = (cfg.batch, cfg.tokens, cfg.embed_dim)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32) / np.sqrt(cfg.tokens))


def torch_layer_source() -> str:
    try:
        import tmcore.adapters.torch  # noqa: F401
    except ImportError:
        return "stand-in (benchmarks.layers.TmcoreTorchLayer: tmcore scan in an autograd.Function)"
    return "tmcore.adapters.torch.TensorMemory"


def torch_layer(cfg: Config, params: dict, kind: str = "torch") -> torch.nn.Module:
    """``kind``: ``"torch"`` (tmcore's layer) or ``"plain"`` (the autograd baseline)."""
    sd = {k: torch.as_tensor(v) for k, v in params.items()}
    args = (cfg.embed_dim, cfg.channels, cfg.shape, cfg.chunk)
    if kind == "plain":
        layer = PlainTensorMemory(*args)
        layer.load_tm_state_dict(sd)
        return layer
    try:
        from tmcore.adapters.torch import TensorMemory
    except ImportError:
        layer = TmcoreTorchLayer(*args)
        layer.load_tm_state_dict(sd)
        return layer
    layer = TensorMemory(*args)
    layer.load_state_dict(sd, strict=True)
    return layer


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def torch_step(layer: torch.nn.Module, x: np.ndarray, g: np.ndarray, train: bool,
               compiled: bool = False) -> Callable[[], Any]:
    """A callable running forward (``train=False``, no grad) or forward+backward."""
    xt = torch.as_tensor(x)
    gt = torch.as_tensor(g)
    fn = torch.compile(layer) if compiled else layer
    if not train:
        def forward():
            with torch.no_grad():
                return _first(fn(xt))
        return forward

    xt = xt.clone().requires_grad_(True)

    def train_step():
        layer.zero_grad(set_to_none=True)
        xt.grad = None
        out = _first(fn(xt))
        out.backward(gt)
        return xt.grad
    return train_step


def jax_step(cfg: Config, params: dict, x: np.ndarray, g: np.ndarray,
             train: bool) -> Callable[[], Any]:
    """``tmcore.adapters.jax.apply`` under ``jit`` (forward, or value-and-grad)."""
    import jax
    import jax.numpy as jnp

    from tmcore.adapters import jax as tmjax
    from tmcore.layer import layer_config

    tree = tmjax.params_from_state_dict(
        params, config=layer_config(cfg.embed_dim, cfg.channels, cfg.shape, cfg.chunk))
    xj, gj = jnp.asarray(x), jnp.asarray(g)

    def forward(p, x):
        return tmjax.apply(p, x)[0]

    if not train:
        fwd = jax.jit(forward)
        return lambda: fwd(tree, xj).block_until_ready()

    def loss(p, x):
        return jnp.sum(forward(p, x) * gj)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return lambda: jax.block_until_ready(grad(tree, xj))


def scan_inputs(cfg: Config, seed: int = 2) -> dict[str, np.ndarray]:
    """Random scan inputs (what the layer's projections would produce)."""
    rng = np.random.default_rng(seed)
    b, t, c, n = cfg.batch, cfg.steps, cfg.channels, len(cfg.shape)
    f32 = np.float32
    return {
        "read_coords": np.tanh(rng.standard_normal((b, t, n))).astype(f32),
        "write_coords": np.tanh(rng.standard_normal((b, t, n))).astype(f32),
        "write_sigma": rng.uniform(0.1, 0.5, (b, t)).astype(f32),
        "write_content": rng.standard_normal((b, t, c)).astype(f32),
        "g_reads": rng.standard_normal((b, t, c)).astype(f32),
    }


def numpy_step(cfg: Config, params: dict, train: bool,
               checkpoint_every: int = 1) -> Callable[[], Any]:
    """tmcore's scan on NumPy arrays: forward, or forward then backward."""
    from tmcore.scan import memory_scan_bwd, memory_scan_fwd
    from tmcore.types import ConvParams

    inputs = scan_inputs(cfg)
    cell = ConvParams(*(params[f"cell.{f}"] for f in ConvParams._fields))
    h0 = np.zeros((cfg.batch, cfg.channels, *cfg.shape), np.float32)
    args = (inputs["read_coords"], inputs["write_coords"], inputs["write_sigma"],
            inputs["write_content"], cell)

    if not train:
        return lambda: memory_scan_fwd(np, h0, h0, *args, checkpoint_every=cfg.steps)

    def train_step():
        reads, h, c, hk, ck = memory_scan_fwd(np, h0, h0, *args,
                                              checkpoint_every=checkpoint_every)
        return memory_scan_bwd(np, *args, hk, ck, inputs["g_reads"], np.zeros_like(h),
                               np.zeros_like(c), checkpoint_every=checkpoint_every)
    return train_step


def floor_step(cfg: Config, train: bool, xp: str = "torch", device: str = "cpu",
               dtype: Any = None) -> Callable[[], Any]:
    """The pointwise mixing of ONE chunk step: ``z = P @ y`` (forward) and, for
    training, also ``dP = sum_b g @ y^T`` and ``dy = P^T @ g`` (the two backward
    products), with ``P (4C, 2C)``, ``y (B, 2C, prod(S))``, ``g (B, 4C, prod(S))``."""
    b, c, p = cfg.batch, cfg.channels, cfg.cells
    if xp == "numpy":
        rng = np.random.default_rng(0)
        w = rng.standard_normal((4 * c, 2 * c), dtype=np.float32)
        y = rng.standard_normal((b, 2 * c, p), dtype=np.float32)
        gz = rng.standard_normal((b, 4 * c, p), dtype=np.float32)
        mm, t = np.matmul, (lambda a: np.swapaxes(a, -1, -2))
    else:
        gen = torch.Generator().manual_seed(0)
        kw = {"dtype": dtype or torch.float32}
        w = torch.randn(4 * c, 2 * c, generator=gen, **kw).to(device)
        y = torch.randn(b, 2 * c, p, generator=gen, **kw).to(device)
        gz = torch.randn(b, 4 * c, p, generator=gen, **kw).to(device)
        mm, t = torch.matmul, (lambda a: a.transpose(-1, -2))
    if not train:
        return lambda: mm(w, y)

    def products():
        z = mm(w, y)
        d_w = mm(gz, t(y)).sum(0)
        d_y = mm(t(w), gz)
        return z, d_w, d_y
    return products
