"""The benchmark suite on one GPU, in one call: ``python -m benchmarks.gpu``.

Prints a short table and writes ``gpu_results.json`` (to ``$OUT`` when set).
Per configuration: ms per chunk step (forward, forward+backward) of the torch
layer (``torch``: the default, i.e. the fused Triton scan on CUDA when Triton
imports; ``torch-per-step``: the same layer with ``tmcore.options(triton=False)``;
``torch-compile``: the fused layer under ``torch.compile``, LM configs), the
plain autograd baseline, the JAX layer (``jit``) and tmcore's scan on CuPy
(``cupy``: its fused kernels; ``cupy-generic``: the array-API path), each where
its framework imports; kernel launches per chunk step of a torch training step
(``torch.profiler``, CUDA only); the max |fused - per-step| of the layer's
outputs and gradients; peak GPU memory of a torch training step (fused,
per-step, plain);
the truncated write at 8^3..32^3; the local update (``update="local"``, w = 4) at
8^3..64^3, dense fused vs local generic vs local fused (:func:`local_scan`); a
short streaming run; a decode token, the Triton token launches against the layer's path
(:func:`decode`). The **floor** here is
the pointwise matmuls of one step on the GPU plus the bytes of state one step
must move (read ``h, c``, write ``h', c'``: ``4 B C prod(S)`` floats) over the
measured device-to-device copy bandwidth.

``--device cpu --tiny`` runs the same code on the CPU at a tiny size (smoke
test; ``--impls`` / ``--sections`` pick rows). Sections stop starting once
``--budget`` seconds have passed. The first fused call per shape compiles the
Triton kernels (tens of seconds each) outside the timings (warm-up calls).
Designed for <= 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
REPO = Path(__file__).resolve().parent.parent


def _bootstrap() -> None:
    """Make ``tmcore.backends`` / ``tmcore.adapters`` importable from a plain checkout
    (the GPU image has no editable install of this repository)."""
    sys.path.insert(0, str(REPO))
    import tmcore

    try:
        import tmcore.adapters  # noqa: F401
    except ImportError:
        tmcore.__path__.append(str(REPO))  # tmcore.backends -> backends/, tmcore.adapters -> ...


_bootstrap()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import CONFIGS, TINY, Config, machine_line  # noqa: E402
from benchmarks.layers import (  # noqa: E402
    floor_step,
    make_inputs,
    reference_params,
    scan_inputs,
    torch_layer,
)

__all__ = ["main"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    n = (1 << 28) if device.startswith("cuda") else (1 << 22)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    seconds = _time(lambda: b.copy_(a), device, reps=10)
    return 2 * a.numel() * 4 / seconds


def _torch_steps(cfg: Config, params, device: str, kind: str, compiled: bool = False,
                 triton: bool | str = "auto"):
    """``(forward, train step)`` closures of a torch layer; ``triton``: the
    ``tmcore.options(triton=...)`` value both run under."""
    import tmcore

    layer = torch_layer(cfg, params, kind).to(device)
    x, g = make_inputs(cfg)
    xt = torch.as_tensor(x, device=device)
    gt = torch.as_tensor(g, device=device)
    fn = torch.compile(layer) if compiled else layer

    def fwd():
        with torch.no_grad(), tmcore.options(triton=triton):
            return fn(xt)

    xg = xt.clone().requires_grad_(True)

    def train():
        layer.zero_grad(set_to_none=True)
        xg.grad = None
        with tmcore.options(triton=triton):
            out = fn(xg)
            (out[0] if isinstance(out, tuple) else out).backward(gt)
    train.layer, train.x = layer, xg  # for the agreement check
    return fwd, train


def launches_per_step(train, cfg: Config, device: str) -> float | None:
    """CUDA kernel launches of one training step per chunk step (``torch.profiler``);
    ``None`` off CUDA."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    train()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / cfg.steps


def fused_agreement(cfg: Config, params, device: str) -> dict:
    """Max |fused - per-step| over the layer's output and every gradient (one training
    step each way; 0 where the fused path does not run, e.g. on the CPU)."""
    import tmcore

    results = {}
    for triton in (True, False):
        _, train = _torch_steps(cfg, params, device, "torch", triton=triton)
        layer, x = train.layer, train.x
        layer.zero_grad(set_to_none=True)
        x.grad = None
        _, gt = make_inputs(cfg)
        with tmcore.options(triton=triton):
            out = layer(x)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.as_tensor(gt, device=device))
        results[triton] = [out.detach(), x.grad] + [p.grad for p in layer.parameters()]
    diffs = [(a - b).abs().max().item() for a, b in zip(results[True], results[False],
                                                         strict=True) if a is not None]
    return {"output": diffs[0], "grads": max(diffs[1:])}


def prewarm(configs: list[Config], device: str, log) -> dict:
    """Compile the fused kernels for every config's shape, one subprocess per shape, all at
    once: they fill Triton's on-disk cache, which the timed runs then hit (each kernel
    takes tens of seconds to compile, one after another in a single process)."""
    import subprocess

    if not device.startswith("cuda") or not fused_active(device):
        return {}
    start = time.perf_counter()
    procs = {}
    for channels, shape in sorted({(cfg.channels, cfg.shape) for cfg in configs}):
        code = f"import benchmarks.gpu as g; g.warm_one({channels}, {shape!r}, {device!r})"
        procs[f"C={channels} {shape}"] = subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
    results = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = "timed out"
        results[name] = {"returncode": proc.returncode, "tail": out[-300:]}
    log(f"prewarm (Triton kernels compiled in parallel): {time.perf_counter() - start:.0f} s, "
        f"{sum(r['returncode'] == 0 for r in results.values())}/{len(results)} shapes ok")
    return results


def warm_one(channels: int, shape: tuple[int, ...], device: str = "cuda") -> None:
    """One fused scan forward + backward at this state shape (compiles its kernels)."""
    import tmcore
    from tmcore.types import ConvParams

    g = torch.Generator(device="cpu").manual_seed(0)
    n, steps = len(shape), 2

    def r(*s, lo=-0.5, hi=0.5):
        return (torch.rand(*s, generator=g) * (hi - lo) + lo).to(device)

    h0 = r(1, channels, *shape)
    params = ConvParams(r(n, 2 * channels, 3), r(n, 2 * channels), r(4 * channels, 2 * channels),
                        r(4 * channels))
    args = (h0, h0, r(1, steps, n), r(1, steps, n), r(1, steps, lo=0.2, hi=0.6),
            r(1, steps, channels), params)
    tmcore.memory_scan_vjp(*args, r(1, steps, channels))
    _sync(device)


def fused_active(device: str) -> bool:
    """Whether tmcore's torch backend runs the fused Triton scan on ``device`` tensors."""
    from tmcore.backends import triton_kernels_active

    return triton_kernels_active(torch.zeros(1, 1, 2, device=device))


def _jax_steps(cfg: Config, params):
    import jax
    import jax.numpy as jnp

    from tmcore.adapters import jax as tmjax
    from tmcore.layer import layer_config

    tree = jax.device_put(tmjax.params_from_state_dict(
        params, config=layer_config(cfg.embed_dim, cfg.channels, cfg.shape, cfg.chunk)))
    x, g = (jnp.asarray(a) for a in make_inputs(cfg))

    def forward(p, x):
        return tmjax.apply(p, x)[0]

    fwd = jax.jit(forward)
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(forward(p, x) * g), argnums=(0, 1)))
    return (lambda: fwd(tree, x).block_until_ready(),
            lambda: jax.block_until_ready(grad(tree, x)))


def _cupy_steps(cfg: Config, params, generic: bool = False):
    """The scan on CuPy (its fused kernels by default; ``generic``: the array-API path)."""
    import array_api_compat
    import cupy as cp

    import tmcore
    from tmcore.scan import memory_scan_bwd, memory_scan_fwd
    from tmcore.types import ConvParams

    inp = {k: cp.asarray(v) for k, v in scan_inputs(cfg).items()}
    cell = ConvParams(*(cp.asarray(params[f"cell.{f}"]) for f in ConvParams._fields))
    h0 = cp.zeros((cfg.batch, cfg.channels, *cfg.shape), cp.float32)
    args = (inp["read_coords"], inp["write_coords"], inp["write_sigma"], inp["write_content"],
            cell)

    xp = array_api_compat.array_namespace(h0)

    def fwd():
        with tmcore.options(generic=generic):
            memory_scan_fwd(xp, h0, h0, *args, checkpoint_every=cfg.steps)
        cp.cuda.Device().synchronize()

    def train():
        with tmcore.options(generic=generic):
            _, h, c, hk, ck = memory_scan_fwd(xp, h0, h0, *args)
            memory_scan_bwd(xp, *args, hk, ck, inp["g_reads"], cp.zeros_like(h),
                            cp.zeros_like(c))
        cp.cuda.Device().synchronize()
    return fwd, train


def _peak_torch(cfg: Config, params, device: str, kind: str,
                triton: bool | str = "auto") -> int | None:
    if not device.startswith("cuda"):
        return None
    _, train = _torch_steps(cfg, params, device, kind, triton=triton)
    train()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    train()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run_config(cfg: Config, device: str, bw: float, reps: int, log,
               impls: list[str] | None = None) -> dict:
    params = reference_params(cfg)
    floor = {}
    for mode, train in (("fwd", False), ("train", True)):
        mm = _time(floor_step(cfg, train, device=device), device, reps=50) / 1.0
        state_bytes = 4 * cfg.batch * cfg.channels * cfg.cells * 4 * (2 if train else 1)
        floor[mode] = (mm + state_bytes / bw) * 1e3
    row = {"floor_ms": floor, "impls": {}}
    candidates = [("torch", lambda: _torch_steps(cfg, params, device, "torch")),
                  ("torch-per-step",
                   lambda: _torch_steps(cfg, params, device, "torch", triton=False)),
                  ("plain", lambda: _torch_steps(cfg, params, device, "plain"))]
    if cfg.name.startswith("lm-1024") or cfg.name == "tiny":
        candidates.append(("torch-compile",
                           lambda: _torch_steps(cfg, params, device, "torch", compiled=True)))
    candidates += [("jax", lambda: _jax_steps(cfg, params))]
    if device.startswith("cuda"):
        candidates += [("cupy", lambda: _cupy_steps(cfg, params)),
                       ("cupy-generic", lambda: _cupy_steps(cfg, params, generic=True))]
    for name, build in candidates:
        if impls is not None and name not in impls:
            continue
        try:
            fwd, train = build()
            cell = {m: _time(f, device, reps) / cfg.steps * 1e3
                    for m, f in (("fwd", fwd), ("train", train))}
            cell["ratio"] = {m: cell[m] / floor[m] for m in ("fwd", "train")}
            if name.startswith("torch") and name != "torch-compile":
                cell["launches_per_step"] = launches_per_step(train, cfg, device)
        except Exception as exc:  # a missing framework or a failing path is reported
            cell = {"error": f"{type(exc).__name__}: {exc}"[:160]}
        row["impls"][name] = cell
        launches = cell.get("launches_per_step")
        log(f"{cfg.name:8s} {name:14s} " + (
            f"fwd {cell['fwd']:8.3f} ms ({cell['ratio']['fwd']:6.1f}x)  "
            f"fwd+bwd {cell['train']:8.3f} ms ({cell['ratio']['train']:6.1f}x)"
            + (f"  {launches:6.1f} launches/step" if launches is not None else "")
            if "error" not in cell else cell["error"]))
    if impls is None or "torch" in impls:
        try:
            row["fused_vs_per_step"] = fused_agreement(cfg, params, device)
        except Exception as exc:
            row["fused_vs_per_step"] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
        log(f"{cfg.name:8s} max |fused - per-step|: {row['fused_vs_per_step']}")
    for key, kind, triton in (("torch", "torch", "auto"), ("torch_per_step", "torch", False),
                              ("plain", "plain", "auto")):
        try:
            row[f"peak_{key}"] = _peak_torch(cfg, params, device, kind, triton)
        except Exception as exc:
            row[f"peak_{key}"] = f"{type(exc).__name__}: {exc}"[:120]
    from tmcore.backends import triton_graph_cache_bytes

    row["graph_cache_bytes"] = triton_graph_cache_bytes()  # held between calls, not in peaks
    peaks = {k: row.get(f"peak_{k}") for k in ("torch", "torch_per_step", "plain")}
    if all(isinstance(v, int) for v in peaks.values()):
        log(f"{cfg.name:8s} peak train memory: tmcore {peaks['torch'] / 2**20:.1f} MiB "
            f"(per-step {peaks['torch_per_step'] / 2**20:.1f}), "
            f"plain {peaks['plain'] / 2**20:.1f} MiB ({peaks['torch'] / peaks['plain']:.1%}); "
            f"CUDA graphs hold {row['graph_cache_bytes'] / 2**20:.1f} MiB between calls")
    return row


def truncated_write(device: str, tiny: bool) -> dict:
    import array_api_compat

    import tmcore
    from benchmarks import truncated as tw

    xp = array_api_compat.array_namespace(torch.empty(0, device=device))
    out = {}
    for grid in ((8, 12) if tiny else tw.GRIDS):
        content, mu, sigma = (t.to(device) for t in tw._inputs(grid))
        shape = (grid,) * 3
        size = tw.footprint(tw.SIGMA_CELLS, tw.RADIUS)
        dense = _time(lambda: tmcore.gaussian_splat(content, mu, sigma, shape,  # noqa: B023
                                                    radius=tw.RADIUS), device, 20)
        window = _time(lambda: tw.window_write(xp, content, mu, sigma, shape,  # noqa: B023
                                               tw.RADIUS, size), device, 20)  # noqa: B023
        out[grid] = {"dense_ms": dense * 1e3, "window_ms": window * 1e3}
    return out


#: Grids (per axis, 3-D) of the local-update section, and its sizes.
LOCAL_GRIDS = (8, 16, 32, 64)
LOCAL_SIZES = {"batch": 4, "channels": 16, "window": 4, "steps": 16}
LOCAL_TINY = {"batch": 1, "channels": 2, "window": 2, "steps": 2}


def _kernels_per_step(fn, steps: int, device: str) -> float | None:
    """CUDA kernels one call of ``fn`` launches, per chunk step; ``None`` off CUDA."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / steps


def _local_inputs(grid: int, sizes: dict, device: str):
    """``(scan args, (g_reads, g_h, g_c))`` of a 3-D grid, float32."""
    from tmcore.types import ConvParams

    g = torch.Generator().manual_seed(0)
    batch, channels, steps = sizes["batch"], sizes["channels"], sizes["steps"]

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device)

    def u(*s, lo, hi):
        return (torch.rand(*s, generator=g) * (hi - lo) + lo).to(device)

    state = (batch, channels, grid, grid, grid)
    params = ConvParams(r(3, 2 * channels, 3, scale=0.5), r(3, 2 * channels, scale=0.1),
                        r(4 * channels, 2 * channels, scale=0.2), r(4 * channels, scale=0.1))
    args = (r(*state, scale=0.5), r(*state, scale=0.5), u(batch, steps, 3, lo=-0.9, hi=0.9),
            u(batch, steps, 3, lo=-0.9, hi=0.9),
            torch.full((batch, steps), 2.0 / (grid - 1), device=device),  # one cell
            r(batch, steps, channels), params)
    return args, (r(batch, steps, channels), r(*state), r(*state))


def local_scan(device: str, tiny: bool, reps: int = 3) -> dict:
    """ms per chunk step of ``update="local"`` scans vs the dense fused scan, 8^3..64^3.

    Rows per grid: ``dense`` (``tmcore.memory_scan`` / ``memory_scan_vjp``: the fused
    Triton scan on CUDA), ``local-generic`` (``tmcore.local_memory_scan`` under
    ``tmcore.options(generic=True)``: the array-API fast path, ~740 ops per step
    forward + backward), ``local-fused`` (the same call with the default options: the
    fused Triton local scan on CUDA, the C kernels on the CPU); ``fwd`` and ``train``
    (forward + backward, the VJP's own forward included) per chunk step, CUDA kernels
    per chunk step of ``train`` (``torch.profiler``), and the max |local-fused -
    local-generic| of the reads and every gradient.
    """
    import tmcore
    from tmcore.backends.triton import local as _triton_local

    sizes = LOCAL_TINY if tiny else LOCAL_SIZES
    window, steps = sizes["window"], sizes["steps"]
    out = {"sizes": sizes, "launches_per_step_fused": _triton_local.launches_per_step(),
           "grids": {}}
    for grid in ((4, 6) if tiny else LOCAL_GRIDS):
        args, cot = _local_inputs(grid, sizes, device)
        rows: dict = {}
        calls = {"dense": ({}, tmcore.memory_scan, tmcore.memory_scan_vjp, {}),
                 "local-generic": ({"generic": True}, tmcore.local_memory_scan,
                                   tmcore.local_memory_scan_vjp, {"window": window}),
                 "local-fused": ({}, tmcore.local_memory_scan, tmcore.local_memory_scan_vjp,
                                 {"window": window})}
        results = {}
        for name, (opts, fwd, vjp, kw) in calls.items():
            def run(fn, extra=(), opts=opts, kw=kw, args=args):
                with tmcore.options(**opts):
                    return fn(*args, *extra, **kw)

            def forward(run=run, fwd=fwd):
                return run(fwd)

            def train(run=run, vjp=vjp, cot=cot):
                return run(vjp, cot)
            try:
                rows[name] = {"fwd_ms": _time(forward, device, reps) / steps * 1e3,
                              "train_ms": _time(train, device, reps) / steps * 1e3,
                              "kernels_per_step": _kernels_per_step(train, steps, device)}
                if name != "dense":
                    grads = train()
                    results[name] = [*forward(), *grads[:6], *grads.params]
            except Exception as exc:  # a failing path is reported, the others still run
                rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
        if len(results) == 2:
            rows["fused_vs_generic"] = max(
                (a - b).abs().max().item()
                for a, b in zip(results["local-fused"], results["local-generic"], strict=True))
        log = ", ".join(f"{k} {v['fwd_ms']:.3f} / {v['train_ms']:.3f} ms"
                        for k, v in rows.items() if isinstance(v, dict) and "fwd_ms" in v)
        print(f"local {grid}^3 (fwd / fwd+bwd per step): {log}", flush=True)
        out["grids"][grid] = rows
    return out


def streaming(device: str, tokens: int) -> dict:
    from benchmarks.streaming import SEGMENT, _MemoryModel

    model = _MemoryModel().to(device).eval()
    state, done, peaks = None, 0, []
    with torch.no_grad():
        batch = torch.randint(0, 256, (1, SEGMENT), device=device)
        model(batch, None)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        while done < tokens:
            _, state = model(batch, state)
            done += SEGMENT
            if device.startswith("cuda"):
                peaks.append((done, torch.cuda.max_memory_allocated()))
        _sync(device)
    return {"tokens": done, "tokens_per_s": done / (time.perf_counter() - start),
            "peak_first_last": [peaks[0], peaks[-1]] if peaks else None}


def decode(device: str, tiny: bool, reps: int = 3) -> dict:
    """A decode token through ``MemoryResidual`` (B=4, d=512, C=16 on 4^3, chunk 4, no_grad):
    microseconds per token and CUDA kernels per chunk of 4 tokens of the default (on CUDA the
    Triton token launches) against the layer's path (``triton=False``), and the max
    |difference| of their outputs."""
    import tmcore
    from tmcore.adapters.torch import MemoryResidual, TensorMemory

    d, tokens = (16, 8) if tiny else (512, 256)
    torch.manual_seed(0)
    module = MemoryResidual(TensorMemory(d, 16, (4, 4, 4), 4)).to(device).eval()
    x = torch.randn(tokens, 4, 1, d, device=device)

    def stream(choice):
        def run():
            state, outs = None, []
            with torch.no_grad(), tmcore.options(triton=choice):
                for t in range(tokens):
                    out, state = module(x[t], state)
                    outs.append(out)
            return torch.cat(outs, dim=1)
        return run

    result = {"tokens": tokens, "d": d}
    for name, choice in (("default", "auto"), ("layer", False)):
        result[f"{name}_us_per_token"] = _time(stream(choice), device, reps) / tokens * 1e6
        result[f"{name}_kernels_per_chunk"] = _kernels_per_step(stream(choice), tokens // 4,
                                                                device)
    result["max_abs_diff"] = float((stream("auto")() - stream(False)()).abs().max())
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds")
    parser.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks"
                                                                     / "results")))
    parser.add_argument("--impls", nargs="+", default=None,
                        help="rows to time (default: all), e.g. torch torch-per-step")
    parser.add_argument("--sections", nargs="*",
                        default=["truncated", "local", "streaming", "decode"],
                        help="extra sections to run (default: truncated local streaming "
                             "decode)")
    parser.add_argument("--no-prewarm", action="store_true",
                        help="do not compile the Triton kernels in parallel first")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    device = args.device
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        log(f"device: {torch.cuda.get_device_name()}")
    log(f"machine: {machine_line()}")
    bw = bandwidth(device)
    log(f"copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)")
    results = {"device": device, "bandwidth_Bps": bw, "configs": {},
               "fused_torch": fused_active(device)}
    log(f"fused Triton scan for torch on {device}: "
        f"{'on' if results['fused_torch'] else 'off (the per-step path runs)'}")
    configs = [TINY] if args.tiny else CONFIGS
    if not args.no_prewarm:
        results["prewarm"] = prewarm(configs, device, log)
    for cfg in configs:
        if time.perf_counter() - start > args.budget:
            log(f"{cfg.name}: skipped (budget)")
            continue
        reps = 1 if args.tiny else (2 if cfg.steps >= 256 else 3)
        results["configs"][cfg.name] = run_config(cfg, device, bw, reps, log, args.impls)
    for name, fn in (("truncated", lambda: truncated_write(device, args.tiny)),
                     ("local", lambda: local_scan(device, args.tiny, 1 if args.tiny else 3)),
                     ("streaming", lambda: streaming(device, 3 * 8192 if args.tiny
                                                     else 1_000_000)),
                     ("decode", lambda: decode(device, args.tiny, 1 if args.tiny else 3))):
        if name not in args.sections:
            continue
        if time.perf_counter() - start > args.budget:
            log(f"{name}: skipped (budget)")
            continue
        try:
            results[name] = fn()
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
        log(f"{name}: {results[name]}")
    results["wall_s"] = time.perf_counter() - start
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / ("gpu_results_tiny.json" if args.tiny else "gpu_results.json")
    path.write_text(json.dumps(results, indent=1, default=str))
    log(f"wrote {path} ({results['wall_s']:.0f} s)")
    return results


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
