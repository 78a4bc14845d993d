"""The fused Triton scan for torch tensors: three launches per chunk step, no Python on replay.

Entries ``scan_fwd`` / ``scan_bwd`` of the torch backend's :class:`~tmcore.runtime.dispatch.Ops`
table (contract: :func:`tmcore.scan.memory_scan_fwd` / ``memory_scan_bwd``, same
checkpoint layout, so a forward on one path and a backward on the other agree).
They return ``None`` whenever the fused path does not apply, and tmcore's scan
then runs its per-primitive loop. The kernels are in
:mod:`tmcore.backends._triton_kernels`.

Per chunk step: forward 1 launch (write made on the fly, depthwise stencil over
``concat(x, h)`` without the concat, pointwise ``tl.dot``, gates, read);
backward 2 launches (gate + pointwise VJP; transposed stencil + read + write
partial sums), plus the forward replays of ``checkpoint_every > 1``. Tap,
bias, pointwise and write gradients are per-program partial sums reduced once
per scan (deterministic: no atomics).

When it runs (:func:`usable`):

- ``tmcore.options(triton=False)`` / ``TMCORE_TRITON=0``: never. ``"auto"``
  (the default): CUDA tensors only. ``True`` / ``TMCORE_TRITON=1``: CUDA
  tensors, and CPU tensors when ``TRITON_INTERPRET=1`` (Triton's interpreter; how CI tests the
  kernels). The C kernels stay the CPU default.
- plain tensors of one dtype, float32 or float64 (others: the per-primitive
  path, which computes halves in float32), not recorded by autograd, no
  functorch wrapper; ``n <= 3`` spatial axes (``n = 4``: the generic path);
  ``C <=`` :data:`MAX_CHANNELS`.
- float32 products use ``input_precision="ieee"`` (no TF32); the option
  ``triton_tf32`` (``TMCORE_TRITON_TF32=1``) opts in on CUDA.
- On CUDA each scan loop (forward; backward without the final reductions) is
  captured once per shape / dtype / options as a CUDA graph and replayed
  (the option ``cuda_graphs``, ``TMCORE_CUDA_GRAPHS=0`` turns it off); a capture
  that fails falls back to the eager launches for that key, silently.
- Transparent fallback: if the kernels fail to compile or launch for a shape
  (e.g. an older Triton), a ``RuntimeWarning`` says so once and the per-step
  path runs for that shape from then on.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import math
import threading
import warnings
from typing import Any

import torch

from tmcore.ops.conv import ConvParams
from tmcore.runtime.options import environment, get_options

__all__ = ["scan_fwd", "scan_bwd", "usable", "available", "ENV_VAR", "MAX_CHANNELS",
           "launches_per_step", "check_shapes",
           "graph_cache_bytes"]

ENV_VAR = "TMCORE_TRITON"
#: Widest memory the kernels take (register tiles are ``C x C``); wider: the generic loop.
MAX_CHANNELS = 128
#: Programs per batch row on CUDA at most (each loops over its cell tiles).
MAX_PROGRAMS_PER_ROW = 64

_DTYPES = (torch.float32, torch.float64)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                      lambda t: False)
_KERNELS: list[Any] = []  # the kernels module once imported, or None if triton is missing


def _kernels():
    if not _KERNELS:
        try:
            _KERNELS.append(importlib.import_module("tmcore.backends._triton_kernels"))
        except ImportError:
            _KERNELS.append(None)
    return _KERNELS[0]


def available() -> bool:
    """Whether ``triton`` imports (the kernels can be built)."""
    return _kernels() is not None


def _setting() -> bool | None:
    """The ``triton`` option: ``True`` / ``False``, or ``None`` for automatic (CUDA only)."""
    choice = get_options().triton
    return None if choice == "auto" else bool(choice)


def _interpreting() -> bool:
    return environment("TRITON_INTERPRET", "") not in ("", "0")


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused scan may run on ``tensors`` (see the module notes)."""
    setting = _setting()
    if setting is False:
        return False
    first = tensors[0]
    if first.device.type == "cuda":
        pass
    elif first.device.type == "cpu":
        if not (setting and _interpreting()):
            return False
    else:
        return False
    if first.dtype not in _DTYPES or not 3 <= first.ndim <= 5 or first.shape[1] > MAX_CHANNELS:
        return False
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if (type(t) not in _PLAIN or t.device != first.device or t.dtype != first.dtype
                or (grad_mode and t.requires_grad) or _is_wrapped(t)):
            return False
    return available()


def launches_per_step(checkpoint_every: int = 1) -> float:
    """Kernel launches per chunk step, forward + backward (replays included)."""
    return 1 + 2 + (checkpoint_every - 1) / checkpoint_every


# --------------------------------------------------------------------------- geometry


class _Geometry:
    """Launch geometry of a state ``(B, C, *S)``: the grid padded to three axes."""

    def __init__(self, state: torch.Tensor) -> None:
        self.batch, self.channels = state.shape[:2]
        self.spatial = tuple(state.shape[2:])
        self.n = len(self.spatial)
        self.s3 = (1,) * (3 - self.n) + self.spatial
        self.cells = math.prod(self.spatial)
        self.cb = max(16, 1 << (self.channels - 1).bit_length())
        pow2_cells = 1 << (self.cells - 1).bit_length()
        # (CB, BP) register tiles kept small: ptxas -v of the sm_90 builds at C = 32 showed
        # 0.6-5.6 KB of spills with 32-cell tiles and 4 warps, 12-252 B with 16 and 8
        self.bp = max(16, min(32 if self.cb <= 16 else 16, pow2_cells))
        tiles = -(-self.cells // self.bp)
        # the interpreter runs programs one after another: two per row still tests the
        # slot logic and the tile loop
        cap = 2 if not state.is_cuda else MAX_PROGRAMS_PER_ROW
        self.programs = min(tiles, cap)
        self.grid = (self.batch, self.programs)
        self.num_warps = 4 if self.cb <= 16 else 8
        # the forward at C = 64 spilled 7.2 KB with 8 warps, 1.3 KB with 16; backward A
        # went the other way (4.8 -> 9.8 KB), so only the forward takes 16 there
        self.fwd_warps = 16 if self.cb >= 64 else self.num_warps

    def constexprs(self, has_radius: bool) -> dict:
        s0, s1, s2 = self.s3
        return {"N": self.n, "S0": s0, "S1": s1, "S2": s2, "CB": self.cb, "BP": self.bp,
                "HAS_RADIUS": has_radius}


def _precision(t: torch.Tensor) -> str:
    tf32 = get_options().triton_tf32 and t.is_cuda and t.dtype == torch.float32
    return "tf32" if tf32 else "ieee"


def _launch_kw(geo: _Geometry, forward: bool = False) -> dict:
    if _interpreting():
        return {}
    return {"num_warps": geo.fwd_warps if forward else geo.num_warps}


# --------------------------------------------------------------------------- forward


def _forward_loop(h0, c0, rc, wc, ws, wcont, dw, db, pw, pb, *, eps, radius, every, geo):
    """The forward launches: ``(reads, h_T, c_T, h_checkpoints, c_checkpoints)``."""
    k = _kernels()
    steps = rc.shape[1]
    saved = -(-steps // every)
    h_ck = torch.empty((saved, *h0.shape), dtype=h0.dtype, device=h0.device)
    c_ck = torch.empty_like(h_ck)
    h_ck[0].copy_(h0)
    c_ck[0].copy_(c0)
    reads = torch.empty((geo.batch, steps, geo.channels), dtype=h0.dtype, device=h0.device)
    # states that are neither checkpoints nor the result: two buffers, alternating by
    # step (consecutive such states land in different ones; one is enough for one state)
    between = sum(1 for t in range(steps - 1) if (t + 1) % every)
    scratch = [(torch.empty_like(h0), torch.empty_like(c0)) for _ in range(min(between, 2))]
    h_t, c_t = torch.empty_like(h0), torch.empty_like(c0)
    consts = geo.constexprs(radius is not None)
    r = 0.0 if radius is None else float(radius)
    cur = (h_ck[0], c_ck[0])
    for t in range(steps):
        if t + 1 == steps:
            out = (h_t, c_t)
        elif (t + 1) % every == 0:
            out = (h_ck[(t + 1) // every], c_ck[(t + 1) // every])
        else:
            out = scratch[t % len(scratch)]  # never the buffer it reads: see above
        k.step_fwd_kernel[geo.grid](
            cur[0], cur[1], out[0], out[1], reads, rc, wc, ws, wcont, dw, db, pw, pb,
            t, steps, geo.channels, eps, r, WRITE_READ=True, PRECISION=_precision(h0),
            **consts, **_launch_kw(geo, forward=True))
        cur = out
    return reads, h_t, c_t, h_ck, c_ck


def _prepare(state, rc, wc, ws, wcont, params, eps, radius):
    """The kernels' inputs made contiguous, after the entry checks; ``None`` to decline."""
    tensors = (state, rc, wc, ws, wcont, *params)
    if rc.ndim != 3 or rc.shape[2] != state.ndim - 2 or not usable(*tensors):
        return None
    check_shapes(state, rc, {"write_coords": wc, "write_sigma": ws, "write_content": wcont},
                 params)
    return tuple(t.contiguous() for t in (rc, wc, ws, wcont, *params))


def check_shapes(state: torch.Tensor, read_coords: torch.Tensor, arrays: dict,
                 params: ConvParams) -> None:
    """Every shape the kernels index by, against ``state (B, C, *S)`` and ``read_coords
    (B, T, n)``: a ``ValueError`` naming the argument instead of an out-of-bounds read."""
    batch, channels = state.shape[:2]
    n, steps = state.ndim - 2, read_coords.shape[1]
    expected = {
        "write_coords": (batch, steps, n), "write_sigma": (batch, steps),
        "write_content": (batch, steps, channels), "g_reads": (batch, steps, channels),
        "c0": tuple(state.shape), "g_c": tuple(state.shape),
        "h_checkpoints": (-1, *state.shape), "c_checkpoints": (-1, *state.shape),
        "params.depthwise_weight": (n, 2 * channels, 3),
        "params.depthwise_bias": (n, 2 * channels),
        "params.pointwise_weight": (4 * channels, 2 * channels),
        "params.pointwise_bias": (4 * channels,),
    }
    named = dict(arrays, **{f"params.{k}": v for k, v in params._asdict().items()})
    for name, value in named.items():
        want = expected[name]
        got = tuple(value.shape)
        if len(got) != len(want) or any(w not in (-1, g)
                                        for w, g in zip(want, got, strict=True)):
            raise ValueError(f"{name}: expected shape {want} (from the state "
                             f"{tuple(state.shape)} and read_coords "
                             f"{tuple(read_coords.shape)}), got {got}")
    if 2 * state.numel() * max(4, steps) >= 2**31:
        raise ValueError(f"h0: the Triton kernels index with 32-bit offsets; a state of "
                         f"{tuple(state.shape)} over {steps} steps is too large for them")


def scan_fwd(xp: Any, h0, c0, read_coords, write_coords, write_sigma, write_content,
             params: ConvParams, eps: float, radius: float | None, checkpoint_every: int):
    """Fused :func:`tmcore.scan.memory_scan_fwd`, or ``None`` where it does not apply."""
    prepared = _prepare(h0, read_coords, write_coords, write_sigma, write_content, params,
                        eps, radius)
    if prepared is None or not usable(h0, c0):
        return None
    check_shapes(h0, read_coords, {"c0": c0}, params)
    geo = _Geometry(h0)
    inputs = (h0.contiguous(), c0.contiguous(), *prepared)
    key = _key("fwd", h0, read_coords, eps, radius, checkpoint_every)
    if key in _BROKEN:
        return None
    try:
        with _on_device(h0):
            return _replay(key, functools.partial(_forward_loop, eps=float(eps), radius=radius,
                                                  every=checkpoint_every, geo=geo), inputs)
    except Exception as err:  # noqa: BLE001 - e.g. a Triton too old to compile them
        return _broken(key, err)


#: Keys whose kernels failed (compile or launch): the per-step path runs for them.
_BROKEN: set = set()


def _broken(key: tuple, err: Exception) -> None:
    """Remember a failing key, warn once, and decline (the per-step loop runs instead)."""
    _BROKEN.add(key)
    warnings.warn(f"tmcore: the fused Triton scan failed for {key[:4]} "
                  f"({type(err).__name__}: {str(err)[:300]}); using the per-step path",
                  RuntimeWarning, stacklevel=3)


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _key(kind: str, state, read_coords, eps, radius, every) -> tuple:
    """Cache key of a captured scan loop."""
    return (kind, tuple(state.shape), read_coords.shape[1], state.dtype, state.device,
            float(eps), radius, every, _precision(state))


# --------------------------------------------------------------------------- backward


def _backward_loop(rc, wc, ws, wcont, dw, db, pw, pb, h_ck, c_ck, g_reads, g_h, g_c, *, eps,
                   radius, every, geo):
    """The backward launches: ``(d_h0, d_c0, d_read_coords, write partials (B, T, G, C + 4),
    d_pointwise partials, d_pointwise_bias partials, bias-class sums, stencil sums)``."""
    k = _kernels()
    steps = rc.shape[1]
    batch, channels, cells = geo.batch, geo.channels, geo.cells
    like = {"dtype": g_h.dtype, "device": g_h.device}
    g_h, g_c = g_h.clone(), g_c.clone()  # updated in place, step by step
    d_y = torch.empty((batch, 2 * channels, cells), **like)
    slots = batch * geo.programs
    d_pw = torch.zeros((slots, 4 * channels, 2 * channels), **like)
    d_pb = torch.zeros((slots, 4 * channels), **like)
    e_sums = torch.zeros((slots, 2 * channels, 27), **like)
    corr = torch.zeros((slots, 2 * channels, 27), **like)
    write_part = torch.empty((batch, steps, geo.programs, channels + 4), **like)
    d_rc = torch.empty((batch, steps, geo.n), **like)
    replay = (torch.empty((every - 1, *g_h.shape), **like),
              torch.empty((every - 1, *g_h.shape), **like)) if every > 1 else None
    consts = geo.constexprs(radius is not None)
    r = 0.0 if radius is None else float(radius)
    precision = _precision(g_h)
    extra = _launch_kw(geo)
    for segment in reversed(range(h_ck.shape[0])):
        start = segment * every
        stop = min(start + every, steps)
        states = [(h_ck[segment], c_ck[segment])]
        for t in range(start, stop - 1):
            out = (replay[0][t - start], replay[1][t - start])
            k.step_fwd_kernel[geo.grid](
                *states[-1], out[0], out[1], d_rc, rc, wc, ws, wcont, dw, db, pw, pb, t, steps,
                channels, eps, r, WRITE_READ=False, PRECISION=precision, **consts,
                **_launch_kw(geo, forward=True))
            states.append(out)
        for t in reversed(range(start, stop)):
            h, c = states[t - start]
            k.step_bwd_a_kernel[geo.grid](
                h, c, g_h, g_c, d_y, wcont, wc, ws, dw, db, pw, pb, d_pw, d_pb, e_sums, t,
                steps, channels, eps, r, PRECISION=precision, **consts, **extra)
            k.step_bwd_b_kernel[geo.grid](
                h, g_h, d_y, g_reads, rc, wcont, wc, ws, dw, corr, write_part, d_rc, t, steps,
                channels, eps, r, **consts, **extra)
    return g_h, g_c, d_rc, write_part, d_pw, d_pb, e_sums, corr


def _depthwise_grads(taps: torch.Tensor, biases: torch.Tensor, corr: torch.Tensor,
                     e_sums: torch.Tensor, s3: tuple[int, int, int]):
    """Tap and bias gradients ``(n, 2C, 3), (n, 2C)`` from the scan's sums.

    ``y = sum_d K[d] u[p + d] + Bias(p)`` is linear in the stencil ``K`` (a product of
    one tap per axis) and in ``Bias`` (biases times per-axis tap sums, constant per
    cell class), so ``<corr, K> + <E, Bias>`` has the taps' and biases' gradients;
    they are taken by autograd on these few small tensors.
    """
    n, c2 = biases.shape
    with torch.inference_mode(False), torch.enable_grad():
        t = taps.detach().clone().requires_grad_(True)
        b = biases.detach().clone().requires_grad_(True)
        ident = t.new_tensor([0.0, 1.0, 0.0]).expand(c2, 3)
        padded = [ident] * (3 - n) + [t[a] for a in range(n)]
        stencil = (padded[0][:, :, None, None] * padded[1][:, None, :, None]
                   * padded[2][:, None, None, :])
        loss = (stencil.reshape(c2, 27) * corr.detach().clone()).sum()
        field = t.new_zeros((c2, 3, 3, 3))
        for axis in range(3 - n, 3):
            # class 0 = first cell, 1 = interior, 2 = last; a single cell is first and last
            not_first = t.new_tensor([0.0, 1.0, 1.0])
            not_last = t.new_tensor([1.0 if s3[axis] > 1 else 0.0, 1.0, 0.0])
            taps_a = padded[axis]
            sums = taps_a[:, :1] * not_first + taps_a[:, 1:2] + taps_a[:, 2:] * not_last
            view = [c2, 1, 1, 1]
            view[axis + 1] = 3
            field = field * sums.reshape(view) + b[axis - (3 - n)].reshape(c2, 1, 1, 1)
        loss = loss + (field.reshape(c2, 27) * e_sums.detach().clone()).sum()
        d_taps, d_biases = torch.autograd.grad(loss, (t, b))
    return d_taps.detach(), d_biases.detach()


def scan_bwd(xp: Any, read_coords, write_coords, write_sigma, write_content,
             params: ConvParams, h_checkpoints, c_checkpoints, g_reads, g_h, g_c, eps: float,
             radius: float | None, checkpoint_every: int):
    """Fused :func:`tmcore.scan.memory_scan_bwd`, or ``None`` where it does not apply."""
    from tmcore.scan.dense import ScanGrads

    prepared = _prepare(g_h, read_coords, write_coords, write_sigma, write_content, params,
                        eps, radius)
    if prepared is None or not usable(g_h, g_c, g_reads, h_checkpoints, c_checkpoints):
        return None
    check_shapes(g_h, read_coords, {"g_c": g_c, "g_reads": g_reads,
                                    "h_checkpoints": h_checkpoints,
                                    "c_checkpoints": c_checkpoints}, params)
    saved = -(-read_coords.shape[1] // checkpoint_every)
    if h_checkpoints.shape[0] != saved or c_checkpoints.shape[0] != saved:
        raise ValueError(f"h_checkpoints: expected {saved} = ceil(T / checkpoint_every) "
                         f"states, got {h_checkpoints.shape[0]} and {c_checkpoints.shape[0]}")
    geo = _Geometry(g_h)
    rc, wc, ws, wcont, dw, db, pw, pb = prepared
    inputs = (*prepared, h_checkpoints.contiguous(), c_checkpoints.contiguous(),
              g_reads.contiguous(), g_h.contiguous(), g_c.contiguous())
    key = _key("bwd", g_h, read_coords, eps, radius, checkpoint_every)
    if key in _BROKEN:
        return None
    try:
        with _on_device(g_h):
            d_h0, d_c0, d_rc, write_part, d_pw, d_pb, e_sums, corr = _replay(
                key, functools.partial(_backward_loop, eps=float(eps), radius=radius,
                                       every=checkpoint_every, geo=geo), inputs)
    except Exception as err:  # noqa: BLE001 - e.g. a Triton too old to compile them
        return _broken(key, err)
    channels, n = geo.channels, geo.n
    sums = write_part.sum(dim=2)  # (B, T, C + 4), a fixed-order reduction
    denom = 2.0 * ws * ws + eps
    d_content = sums[..., :channels]
    d_mu = torch.stack([sums[..., channels + 2 - comp] for comp in range(n)], dim=-1)
    d_mu = d_mu * (2.0 / denom)[..., None]
    d_sigma = sums[..., channels + 3] * (4.0 * ws / (denom * denom))
    d_taps, d_biases = _depthwise_grads(dw, db, corr.sum(0), e_sums.sum(0), geo.s3)
    d_params = ConvParams(d_taps, d_biases, d_pw.sum(0), d_pb.sum(0))
    return ScanGrads(d_h0, d_c0, d_rc, d_mu, d_sigma, d_content, d_params)


# --------------------------------------------------------------------------- CUDA graphs

_GRAPHS: collections.OrderedDict = collections.OrderedDict()
_FAILED: set = set()
_GRAPH_LOCK = threading.Lock()
#: Captured scan loops kept (each holds its static inputs, outputs and memory pool).
MAX_GRAPHS = 8


def _replay(key: tuple, fn, inputs: tuple[torch.Tensor, ...]) -> tuple:
    """``fn(*inputs)``; on CUDA through a CUDA graph captured once per ``key``.

    The first call per key runs ``fn`` once eagerly (it compiles the kernels), then
    captures it on static copies of ``inputs``; later calls copy the inputs in,
    replay, and return clones of the outputs. Any failure to capture makes the key
    eager for good. Not used while a stream is already capturing (the caller's own
    graph records the launches).
    """
    if (not get_options().cuda_graphs or not inputs[0].is_cuda or key in _FAILED
            or torch.cuda.is_current_stream_capturing()):
        return fn(*inputs)
    with _GRAPH_LOCK:
        entry = _GRAPHS.get(key)
        if entry is None:
            try:
                entry = _capture(fn, inputs)
            except Exception:  # noqa: BLE001 - any capture failure: eager from now on
                _FAILED.add(key)
                return fn(*inputs)
            _GRAPHS[key] = entry
            while len(_GRAPHS) > MAX_GRAPHS:
                _GRAPHS.popitem(last=False)
        _GRAPHS.move_to_end(key)
        graph, static, outs = entry
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value)
        graph.replay()
        return tuple(o.clone() for o in outs)


def graph_cache_bytes() -> int:
    """Bytes held by the cached graphs' static inputs and outputs (their memory pools'
    temporaries not included): memory a training step's peak does not show, since it
    stays allocated between calls."""
    total = 0
    for _, static, outs in _GRAPHS.values():
        total += sum(t.numel() * t.element_size() for t in (*static, *outs))
    return total


def _capture(fn, inputs):  # pragma: no cover - needs a CUDA device
    static = tuple(x.clone() for x in inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*static)  # compiles every kernel before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*static)
    return graph, static, tuple(outs)
