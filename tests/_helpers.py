"""Test-suite helpers: the kit's strategies (tmcore.testing.strategies), re-exported, and a
random state dict in the paper's reference layout."""

import os as _os

from tmcore.testing.strategies import *  # noqa: F403
from tmcore.testing.strategies import __all__ as _strategies

__all__ = [*_strategies, "reference_state_dict", "torch_scan_inputs", "EDGE_COORDS",
           "count_calls", "INTERPRETING_KERNELS", "run_interpreter_suite", "token_module",
           "stream_tokens", "assert_all_close"]


def reference_state_dict(torch, d: int, c: int, length: int, grid=(3, 4, 5), seed: int = 0,
                         scale: float = 0.3) -> dict:
    """A random state dict in the paper's reference layout (docs/LAYER.md): ``write_proj``,
    ``writer.*``, ``coord_net``, ``gate_conv.*`` (Conv3d weights), ``out_proj`` and the
    ``grid_cache`` (1, 3, D, H, W) of cell centres in (x, y, z) order for ``grid``.
    ``torch`` is passed in so importing this module needs no framework."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale

    sd = {
        "write_proj.weight": rand(d, length * d), "write_proj.bias": rand(d),
        "writer.content_net.weight": rand(c, d), "writer.content_net.bias": rand(c),
        "writer.sigma_net.weight": rand(1, d), "writer.sigma_net.bias": rand(1),
        "coord_net.weight": rand(3, d), "coord_net.bias": rand(3),
        "gate_conv.conv_d.weight": rand(2 * c, 1, 3, 1, 1), "gate_conv.conv_d.bias": rand(2 * c),
        "gate_conv.conv_h.weight": rand(2 * c, 1, 1, 3, 1), "gate_conv.conv_h.bias": rand(2 * c),
        "gate_conv.conv_w.weight": rand(2 * c, 1, 1, 1, 3), "gate_conv.conv_w.bias": rand(2 * c),
        "gate_conv.pointwise.weight": rand(4 * c, 2 * c, 1, 1, 1),
        "gate_conv.pointwise.bias": rand(4 * c),
        "out_proj.weight": rand(d, c), "out_proj.bias": rand(d),
    }
    axes = [torch.linspace(-1, 1, s) for s in grid]
    zz, yy, xx = torch.meshgrid(*axes, indexing="ij")
    sd["grid_cache"] = torch.stack([xx, yy, zz])[None]
    return sd


#: Read coordinates at cell centres (size-5 axes), the borders, beyond them and +-inf.
EDGE_COORDS = [-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, -2.0, float("inf"), -float("inf"), 0.25]


def torch_scan_inputs(torch, shape, dtype, batch=2, channels=3, steps=7, edges=False, seed=0):
    """Random torch scan inputs and cotangents: ``((h0, c0, read_coords, write_coords,
    write_sigma, write_content, ConvParams), (g_reads, g_h, g_c))`` for a ``(B, C, *shape)``
    state; ``edges``: read coordinates drawn from :data:`EDGE_COORDS`."""
    from tmcore.types import ConvParams

    n = len(shape)
    gen = torch.Generator().manual_seed(seed)

    def rand(*s):
        return torch.randn(*s, generator=gen, dtype=dtype)

    h0, c0 = rand(batch, channels, *shape) * 0.5, rand(batch, channels, *shape) * 0.5
    if edges:
        pick = torch.randint(0, len(EDGE_COORDS), (batch, steps, n), generator=gen)
        read_coords = torch.tensor(EDGE_COORDS, dtype=dtype)[pick]
    else:
        read_coords = torch.tanh(rand(batch, steps, n))
    write_coords = torch.tanh(rand(batch, steps, n))
    write_sigma = torch.rand(batch, steps, generator=gen, dtype=dtype) * 0.4 + 0.1
    content = rand(batch, steps, channels)
    params = ConvParams(rand(n, 2 * channels, 3) * 0.4, rand(n, 2 * channels) * 0.1,
                        rand(4 * channels, 2 * channels) * 0.3, rand(4 * channels) * 0.1)
    cotangents = (rand(batch, steps, channels), rand(batch, channels, *shape),
                  rand(batch, channels, *shape))
    return (h0, c0, read_coords, write_coords, write_sigma, content, params), cotangents


def count_calls(monkeypatch, targets, key=None):
    """Wrap every ``(module, name)`` function of ``targets`` to count its calls; returns the
    ``collections.Counter`` they fill. ``key(name, args)`` names the counter of one call
    (default: the function's name)."""
    import collections

    counts: collections.Counter[str] = collections.Counter()
    for module, name in targets:
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name if key is None else key(_name, args)] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


# --------------------------------------------------------------------------- Triton's interpreter

#: Whether this process runs the kernel tests (``TRITON_INTERPRET=1 TMCORE_TRITON=1``, set by
#: :func:`run_interpreter_suite`: triton reads them when it is imported).
INTERPRETING_KERNELS = (_os.environ.get("TRITON_INTERPRET") == "1"
                        and _os.environ.get("TMCORE_TRITON") == "1")


def run_interpreter_suite(test_file: str, **env: str) -> None:
    """Run the ``test_kernel_*`` tests of ``test_file`` in a subprocess under Triton's
    interpreter (with ``env`` added) and assert that they ran and passed."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file,
         "-k", "kernel_"],
        env=dict(os.environ, TRITON_INTERPRET="1", TMCORE_TRITON="1", **env),
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], \
        done.stdout[-3000:]


# --------------------------------------------------------------------------- decode tokens


def token_module(shape, dtype, chunk, norm="layernorm", residual=True, width=8, **kw):
    """A ``MemoryResidual(TensorMemory(width, 3, shape, chunk))`` (``norm``: ``"layernorm"``,
    ``"identity"`` or ``"plain"``, a LayerNorm without affine) or the memory alone, every
    parameter moved away from its initial value (the read-outs start at zero), in eval mode."""
    import torch

    from tmcore.adapters.torch import MemoryResidual, TensorMemory

    torch.manual_seed(0)
    memory = TensorMemory(width, 3, shape, chunk, dtype=dtype, **kw)
    if not residual:
        module = memory
    else:
        made = {"layernorm": None, "identity": torch.nn.Identity(),
                "plain": torch.nn.LayerNorm(width, elementwise_affine=False, dtype=dtype)}
        module = MemoryResidual(memory, norm=made[norm], gate_init=0.4)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return module.eval()


def stream_tokens(module, x, state=None):
    """``module`` over ``x (B, N, d)`` one token per call: the outputs and the last state."""
    import torch

    outs = []
    for t in range(x.shape[1]):
        out, state = module(x[:, t:t + 1], state)
        outs.append(out)
    return torch.cat(outs, dim=1), state


def assert_all_close(got, want, tolerance):
    """Every tensor of ``got`` has the dtype and shape of ``want``'s and its values within
    ``tolerance`` (relative and absolute)."""
    import torch

    for u, v in zip(got, want, strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.allclose(u.double(), v.double(), rtol=tolerance, atol=tolerance), \
            (u - v).abs().max()
