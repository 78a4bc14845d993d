"""PyTorch fast paths: ``grid_sample`` read, depthwise taps, native gate nonlinearities.

Imported only when torch tensors reach tmcore (torch is then in ``sys.modules``).

- Read (n = 1, 2, 3): ``F.grid_sample(mode="bilinear", padding_mode="border",
  align_corners=True)`` (n = 1 as a height-1 2-D sample); its VJP calls
  ``aten.grid_sampler_{2,3}d_backward`` directly (no autograd graph). n = 4 and
  mismatched dtypes use the generic path.
- Determinism: on CUDA the ``grid_sampler`` backward accumulates the volume
  gradient with ``atomicAdd``. By default the volume gradient on CUDA is
  therefore the generic dense contraction (deterministic), and only the
  coordinate gradient (one thread per query, no atomics) comes from
  ``grid_sampler``. ``tmcore.options(deterministic=False)`` uses the atomic
  kernel for the volume too; it is still refused while
  ``torch.are_deterministic_algorithms_enabled()``. On CPU the kernel is
  deterministic and always used.
- Factorized conv (option ``depthwise``): each depthwise 3-tap pass works on
  the free reshape ``(B, C, pre, S_a, post)`` (any n). On CUDA it is one
  grouped ``conv3d`` (``groups = C``, TF32 off so float32 matches the generic
  path); on CPU, where oneDNN's grouped conv measured slower, three fused
  ``addcmul`` over slices (no ``concat`` copies). The VJP is the same pass with
  flipped taps for the input and sliced products for the taps, so no
  ``convolution_backward`` (whose CUDA weight gradient may be nondeterministic).
- Gates: ``torch.sigmoid`` over the three sigmoid quarters at once (native, one
  pass; the generic overflow-free ``0.5 tanh(x/2) + 0.5`` is three, and this
  CPU build's ``tanh`` is ~4x slower than its ``sigmoid``) and ``addcmul`` for
  the cell update; the VJP shares one ``s (1 - s)`` pass for the three gates.
- Fused CPU cell (:mod:`tmcore.backends._native`): on the CPU, for float32 /
  float64 tensors outside autograd and functorch transforms, the depthwise
  passes (forward: all axes of a plane in one pass through the cache; VJP:
  stages recomputed per plane, taps and input gradient together) and the gates
  (forward and VJP, the gates recomputed from ``z``) are C kernels compiled on
  first use; the pointwise product stays a torch ``baddbmm``. Anything else,
  or a machine without a C compiler, takes the torch ops above (same results).
  ``tmcore.options(native=False)`` (or ``TMCORE_NATIVE=0``) turns them off, and a
  forced ``depthwise`` kernel skips the fused conv. Every call checks the
  shapes the kernels index by (``ValueError``, never an out-of-bounds access),
  hands them plain contiguous memory (negative / conjugate views resolved,
  ZeroTensors materialized) and turns a failed scratch allocation into
  ``MemoryError``.
- Fused CPU scan (``scan_fwd`` / ``scan_bwd`` of the table, tried before the Triton
  ones): where the fused kernels run (and ``depthwise`` is ``"auto"``), the whole
  chunk loop runs here over C kernels and two ``bmm`` per step: the read and its VJP
  in C, the depthwise passes reading the written volume and ``h`` in place (no
  ``concat([x, h])``), the pointwise bias added in the gate kernels, the new state
  written straight into its checkpoint slot (checkpoints in transparent huge pages
  where Linux allows), write volumes and their gradients in a few reused block
  buffers, and the parameter gradients accumulated in place (taps and biases in
  float64). Its big buffers (checkpoints, block buffers, states, scratch) come from a
  per-thread pool that hands a block out again once no tensor refers to it (no page
  faults on fresh memory each call, and no NaN fill under
  ``torch.use_deterministic_algorithms``; every buffer is written before it is read).
  Same arguments, results and checkpoint layout as
  :func:`tmcore.scan.memory_scan_fwd` / ``memory_scan_bwd``; it agrees with the
  generic loop to rounding.
- Read coordinates reach ``grid_sampler`` clamped to ``[-1, 1]`` with NaN as 0
  (its backward reads out of bounds on NaN, and on inf along a size-1 axis);
  the results are the same, and NaN queries are made NaN afterwards as on the
  generic path.
- float16 / bfloat16: computed in float32, returned in the input dtype
  (:mod:`tmcore.backends._mixed`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import sys
import threading
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tmcore.ops.conv import ConvParams
from tmcore.ops.sample import tent_profiles
from tmcore.ops.separable import outer_product
from tmcore.ops.splat import gaussian_profiles
from tmcore.runtime.dispatch import Ops
from tmcore.runtime.options import Options, get_options

from . import _native, _triton
from ._mixed import with_float32_compute

__all__ = ["make_ops"]

_BILINEAR, _BORDER = 0, 1
_NATIVE_DTYPES = {torch.float32: "f32", torch.float64: "f64"}
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not fake / functional / other subclasses
_is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                      lambda t: False)


class _NativeConvResiduals(NamedTuple):
    """Conv residuals of the fused path: the input and the depthwise output."""

    x: torch.Tensor
    y: torch.Tensor


class _NativeGateResiduals(NamedTuple):
    """Gate residuals of the fused path: the VJP recomputes the gates from ``z``."""

    z: torch.Tensor
    c: torch.Tensor


def _native_kernels(*tensors: torch.Tensor) -> tuple[ctypes.CDLL, str] | None:
    """``(library, dtype suffix)`` when the fused kernels may run on ``tensors``: plain
    strided CPU float32 / float64 tensors (or parameters) of one dtype that autograd is
    not recording and no functorch transform wraps (those need torch ops to see the
    computation; fake, nested, sparse and other subclass tensors have no plain memory
    to hand to C). Negative / conjugate views and ZeroTensors are materialized by
    :func:`_plain` at the call."""
    if not _native.enabled():
        return None
    suffix = _NATIVE_DTYPES.get(tensors[0].dtype)
    if suffix is None:
        return None
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if (type(t) not in _PLAIN or t.device.type != "cpu" or t.dtype != tensors[0].dtype
                or t.layout != torch.strided or t.is_nested
                or (grad_mode and t.requires_grad) or _is_wrapped(t)):
            return None
    lib = _native.library()
    return None if lib is None else (lib, suffix)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as dense, contiguous memory holding its values: a ZeroTensor (no memory,
    data pointer 0) becomes real zeros, a negative or conjugate view is resolved (its
    memory holds the un-negated values), and strided views are copied."""
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t.resolve_neg().resolve_conj().contiguous()


def _expect_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    """``ValueError`` unless ``t.shape == shape``: the C kernels index every buffer from
    the shapes of ``x`` / ``c``, so a wrong one would be read or written out of bounds."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {layout} = {tuple(shape)} for the fused "
                         f"CPU kernel, got {tuple(t.shape)}")


def _check_state(name: str, t: torch.Tensor) -> None:
    if not 3 <= t.ndim <= 6:
        raise ValueError(f"{name}: expected shape (B, C, *S) with 1 to 4 spatial axes, got "
                         f"{tuple(t.shape)}")


def _check_conv(x: torch.Tensor, params: ConvParams) -> None:
    """Shapes the depthwise kernels rely on: ``x (B, C_in, *S)``, taps ``(n, C_in, 3)``,
    biases ``(n, C_in)``."""
    _check_state("x", x)
    n, c_in = x.ndim - 2, x.shape[1]
    _expect_shape("params.depthwise_weight", params.depthwise_weight, (n, c_in, 3),
                  "(n, C_in, 3)")
    _expect_shape("params.depthwise_bias", params.depthwise_bias, (n, c_in), "(n, C_in)")


def _check_gates(z: torch.Tensor, c: torch.Tensor, *cotangents: torch.Tensor) -> None:
    """Shapes the gate kernels rely on: ``c (B, C, *S)``, ``z (B, 4C, *S)``, cotangents
    shaped like ``c``."""
    _check_state("c", c)
    batch, channels, *spatial = c.shape
    _expect_shape("z", z, (batch, 4 * channels, *spatial), "(B, 4C, *S)")
    for name, g in zip(("g_h", "g_c"), cotangents, strict=False):
        _expect_shape(name, g, tuple(c.shape), "(B, C, *S) like c")


def _call(lib: ctypes.CDLL, kernel: str, suffix: str, *args: Any) -> None:
    """Run one C kernel; its nonzero return (a scratch allocation failed) becomes a
    ``MemoryError`` (its outputs are then undefined and are not returned)."""
    if getattr(lib, f"{kernel}_{suffix}")(*args) != 0:
        raise MemoryError(f"tmcore: the fused CPU kernel {kernel} could not allocate its "
                          f"scratch memory (grid too large for the memory available; "
                          f"{_native.ENV_VAR}=0 uses the torch ops instead)")


_WORKSPACE = threading.local()  # .buffers: dict while a scan's workspace is open


@contextlib.contextmanager
def workspace(xp: Any):
    """Reuse the fused path's per-step temporaries (depthwise output, ``z``, ``d_z``,
    ``d_y``) from one step to the next while the scan runs: the scan consumes each
    step's residuals first, and fresh multi-MB buffers every step cost page faults
    (measured: ~500 per LM step, 1-3 ms of system time)."""
    previous = getattr(_WORKSPACE, "buffers", None)
    _WORKSPACE.buffers = {}
    try:
        yield
    finally:
        _WORKSPACE.buffers = previous


def _scratch(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A per-step temporary: the workspace's buffer ``name`` when one is open, else new."""
    buffers = getattr(_WORKSPACE, "buffers", None)
    if buffers is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    key = (name, shape, like.dtype)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
    return buffer


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _offset(t: torch.Tensor, elements: int) -> ctypes.c_void_p:
    """The address ``elements`` items into ``t``'s memory (``t`` contiguous)."""
    return ctypes.c_void_p(t.data_ptr() + elements * t.element_size())


def _shape_arg(shape: tuple[int, ...]):
    return (ctypes.c_int64 * len(shape))(*shape)


def _grid_args(volume: torch.Tensor, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``volume (B,C,*S)``, ``coords (B,Q,n)`` -> grid_sample's input and grid (n <= 3)."""
    batch, queries, n = coords.shape
    if n == 1:
        zeros = torch.zeros_like(coords)
        return volume[:, :, None, :], torch.cat([coords, zeros], dim=-1)[:, None, :, :]
    if n == 2:
        return volume, coords[:, None, :, :]
    return volume, coords[:, None, None, :, :]


def _atomic_ok(volume: torch.Tensor) -> bool:
    """Whether ``grid_sampler``'s volume gradient may be used (deterministic or allowed)."""
    return not volume.is_cuda or (
        not get_options().deterministic
        and not torch.are_deterministic_algorithms_enabled()
    )


def _kernel_coords(coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coords fit for grid_sampler, NaN mask (B, Q, 1))``.

    ``grid_sampler``'s backward crashes (reads out of bounds) on NaN coordinates and
    on infinite ones along a size-1 axis, so the kernels see NaN as 0 and every
    coordinate clamped to ``[-1, 1]``; clamping changes neither the value (border
    padding clamps there anyway) nor the gradient (zero at and beyond the border).
    NaN queries are then made NaN in the results, as on the generic path."""
    is_nan = torch.isnan(coords).any(dim=-1, keepdim=True)
    safe = torch.where(torch.isnan(coords), 0.0, coords).clamp(-1.0, 1.0)
    return safe, is_nan


def _may_hold_true(mask: torch.Tensor) -> bool:
    """``mask.any()`` where asking is free (a plain CPU tensor), else ``True``: on CUDA
    it would synchronize, and transformed or fake tensors cannot answer."""
    if mask.device.type != "cpu" or type(mask) not in _PLAIN or _is_wrapped(mask):
        return True
    try:
        return bool(mask.any())
    except RuntimeError:  # e.g. data-dependent control flow under a transform
        return True


def scatter_add(xp: Any, out: torch.Tensor, index: torch.Tensor,
                values: torch.Tensor) -> torch.Tensor:
    """``out (N,)`` with ``values (M,)`` summed in at ``index (M,)``, in place (no
    autograd graph). ``index_add_`` on the CPU (sequential); on CUDA it adds atomically,
    so there the deterministic default takes ``index_put_(accumulate=True)`` (sorted)."""
    if out.is_cuda and (get_options().deterministic
                        or torch.are_deterministic_algorithms_enabled()):
        return out.index_put_((index,), values, accumulate=True)
    return out.index_add_(0, index, values)


def _make_sample(generic: Ops) -> tuple[Any, Any]:
    def sample_fwd(xp, volume, coords):
        if volume.ndim > 5 or volume.dtype != coords.dtype:
            return generic.sample_fwd(xp, volume, coords)
        batch, channels = volume.shape[:2]
        safe, is_nan = _kernel_coords(coords)
        inp, grid = _grid_args(volume, safe)
        out = F.grid_sample(inp, grid, mode="bilinear", padding_mode="border",
                            align_corners=True)
        out = out.reshape(batch, channels, coords.shape[1]).transpose(1, 2)
        # A NaN coordinate reads NaN (as on the generic path): a bad coordinate is not
        # silently read as data.
        return torch.where(is_nan, torch.nan, out).contiguous()

    def sample_bwd(xp, volume, coords, g):
        if volume.ndim > 5 or not volume.dtype == coords.dtype == g.dtype:
            return generic.sample_bwd(xp, volume, coords, g)
        batch, queries, n = coords.shape
        safe, is_nan = _kernel_coords(coords)
        inp, grid = _grid_args(volume, safe)
        grad_out = g.transpose(1, 2).reshape(batch, g.shape[2], *grid.shape[1:-1])
        atomic_ok = _atomic_ok(volume)
        backward = (torch.ops.aten.grid_sampler_3d_backward if n == 3
                    else torch.ops.aten.grid_sampler_2d_backward)
        d_inp, d_grid = backward(grad_out, inp, grid, _BILINEAR, _BORDER, True, [atomic_ok, True])
        if atomic_ok:
            d_volume = d_inp.reshape(volume.shape)
        else:
            weights, _ = tent_profiles(xp, safe, tuple(volume.shape[2:]))
            dense = outer_product(xp, weights)  # (B, Q, P)
            d_volume = torch.matmul(g.transpose(1, 2), dense).reshape(volume.shape)
        d_coords = d_grid.reshape(batch, queries, -1)[..., :n]
        if _may_hold_true(is_nan):
            # NaN as on the generic path: the NaN query's coordinate gradient, and the
            # volume gradient of its batch element (every cell's weight for it is NaN).
            d_coords = torch.where(is_nan, torch.nan, d_coords)
            batch_nan = is_nan.reshape(batch, -1).any(dim=1)
            d_volume = torch.where(batch_nan.reshape(batch, *[1] * (volume.ndim - 1)),
                                   torch.nan, d_volume)
        return d_volume, d_coords.contiguous()

    return sample_fwd, sample_bwd


def _no_tf32(x: torch.Tensor):
    if x.is_cuda:
        return torch.backends.cudnn.flags(enabled=True, allow_tf32=False)
    return contextlib.nullcontext()


def _view5(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """Spatial ``shape`` seen as ``(prod before axis, S_axis, prod after axis)``."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def _grouped(x: torch.Tensor, kernel: str) -> bool:
    """Whether the depthwise passes over ``x`` use grouped ``conv3d`` (``kernel``, the
    option ``depthwise``: ``"auto"`` on CUDA, ``"grouped"`` everywhere, ``"shifts"``
    nowhere)."""
    return kernel == "grouped" or (kernel == "auto" and x.is_cuda)


def _depthwise(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
               axis: int, grouped: bool) -> torch.Tensor:
    """Depthwise 3-tap cross-correlation of ``x (B,C,*S)`` along spatial ``axis``:
    ``y[i] = t0 x[i-1] + t1 x[i] + t2 x[i+1] (+ bias)``, zero padded; ``grouped``:
    one grouped ``conv3d``, else three products over shifted slices."""
    batch, channels = x.shape[:2]
    x5 = x.reshape(batch, channels, *_view5(tuple(x.shape[2:]), axis))
    if grouped:
        with _no_tf32(x):
            y = F.conv3d(x5, taps.reshape(channels, 1, 1, 3, 1), bias, padding=(0, 1, 0),
                         groups=channels)
        return y.reshape(x.shape)
    w = taps.reshape(1, channels, 1, 1, 1, 3)
    if bias is None:
        y = x5 * w[..., 1]
    else:
        y = torch.addcmul(bias.reshape(1, channels, 1, 1, 1), x5, w[..., 1])
    # y is a fresh tensor: updating its slices in place is safe (and autograd-aware)
    y[:, :, :, 1:].addcmul_(x5[:, :, :, :-1], w[..., 0])
    y[:, :, :, :-1].addcmul_(x5[:, :, :, 1:], w[..., 2])
    return y.reshape(x.shape)


def _depthwise_stages(x: torch.Tensor, params: ConvParams,
                      kernel: str = "auto") -> list[torch.Tensor]:
    """``[x, after axis 0, ..., after the last axis]`` with the torch ops."""
    stages = [x]
    grouped = _grouped(x, kernel)
    for axis in range(x.ndim - 2):
        stages.append(_depthwise(stages[-1], params.depthwise_weight[axis],
                                 params.depthwise_bias[axis], axis, grouped))
    return stages


def _native_depthwise(kernels, x: torch.Tensor, params: ConvParams) -> torch.Tensor:
    """All depthwise passes of ``x (B, C_in, *S)`` in one fused kernel call."""
    lib, suffix = kernels
    _check_conv(x, params)
    x = _plain(x)
    taps = _plain(params.depthwise_weight)
    biases = _plain(params.depthwise_bias)
    y = _scratch("depthwise", tuple(x.shape), x)
    spatial = tuple(x.shape[2:])
    _call(lib, "dw_fwd", suffix, _ptr(x), _ptr(y), _ptr(taps), _ptr(biases), x.shape[0],
          x.shape[1], len(spatial), _shape_arg(spatial))
    return y


def _pointwise(y: torch.Tensor, params: ConvParams, scratch: bool = False) -> torch.Tensor:
    """``z = W y + b`` per batch; ``scratch``: into the workspace's buffer (fused path)."""
    batch = y.shape[0]
    y_flat = y.reshape(batch, y.shape[1], -1)
    c_out = params.pointwise_weight.shape[0]
    # One baddbmm over an expanded (stride-0) weight: no transposed copies of y or z,
    # which a broadcast 2-D @ 3-D matmul makes, and the bias add fused in.
    args = (params.pointwise_bias[None, :, None].expand(batch, c_out, y_flat.shape[2]),
            params.pointwise_weight.expand(batch, *params.pointwise_weight.shape), y_flat)
    if scratch:
        z = torch.baddbmm(*args, out=_scratch("z", (batch, c_out, y_flat.shape[2]), y))
    else:
        z = torch.baddbmm(*args)
    return z.reshape(batch, c_out, *y.shape[2:])


def conv_fwd(xp: Any, x: torch.Tensor, params: ConvParams, kernel: str = "auto"):
    """Factorized conv forward. Residuals: the generic stage inputs ``[x, ...]``, or
    :class:`_NativeConvResiduals` on the fused path (``kernel="auto"`` only)."""
    kernels = _native_kernels(x, *params) if kernel == "auto" else None
    if kernels is not None and x.ndim <= 6:
        y = _native_depthwise(kernels, x, params)
        return _pointwise(y, params, scratch=True), _NativeConvResiduals(x, y)
    stages = _depthwise_stages(x, params, kernel)
    return _pointwise(stages[-1], params), stages


def conv_bwd(xp: Any, stages, params: ConvParams, g: torch.Tensor, kernel: str = "auto"):
    """VJP: flipped-tap grouped conv for the input, sliced products for the taps (or
    the fused kernel, for residuals of the fused forward)."""
    if isinstance(stages, _NativeConvResiduals):
        kernels = _native_kernels(stages.x, g, *params)
        if kernels is not None:
            return _native_conv_bwd(kernels, stages, params, g)
        stages = _depthwise_stages(stages.x, params, kernel)  # e.g. g now recorded by autograd
    n = len(stages) - 1
    y = stages[-1]
    batch, c_in = y.shape[:2]
    d_y, d_pointwise, d_pointwise_bias = _pointwise_bwd(y, params, g)
    d_taps, d_biases = [None] * n, [None] * n
    dims = (0, 2, 3, 4)
    grouped = _grouped(y, kernel)
    for axis in reversed(range(n)):
        view = (batch, c_in, *_view5(tuple(y.shape[2:]), axis))
        x5 = stages[axis].reshape(view)
        d5 = d_y.reshape(view)
        d_taps[axis] = torch.stack([
            (d5[:, :, :, 1:] * x5[:, :, :, :-1]).sum(dims),
            (d5 * x5).sum(dims),
            (d5[:, :, :, :-1] * x5[:, :, :, 1:]).sum(dims),
        ], dim=-1)
        d_biases[axis] = d5.sum(dims)
        d_y = _depthwise(d_y, params.depthwise_weight[axis].flip(-1), None, axis, grouped)
    return d_y, ConvParams(torch.stack(d_taps), torch.stack(d_biases), d_pointwise,
                           d_pointwise_bias)


def _pointwise_bwd(y: torch.Tensor, params: ConvParams, g: torch.Tensor, scratch: bool = False):
    """``(d_y, d_pointwise_weight, d_pointwise_bias)`` of :func:`_pointwise`;
    ``scratch``: ``d_y`` into the workspace's buffer (fused path)."""
    batch, c_in = y.shape[:2]
    y_flat = y.reshape(batch, c_in, -1)
    g_flat = g.reshape(batch, g.shape[1], -1)
    d_pointwise = torch.matmul(g_flat, y_flat.transpose(1, 2)).sum(0)
    d_pointwise_bias = g_flat.sum((0, 2))
    weight_t = params.pointwise_weight.T.expand(batch, c_in, g.shape[1])
    if scratch:
        d_y = torch.bmm(weight_t, g_flat, out=_scratch("d_y", tuple(y_flat.shape), y))
    else:
        d_y = torch.bmm(weight_t, g_flat)
    return d_y.reshape(y.shape), d_pointwise, d_pointwise_bias


def _native_conv_bwd(kernels, residuals: _NativeConvResiduals, params: ConvParams,
                     g: torch.Tensor):
    lib, suffix = kernels
    x, y = residuals
    _check_conv(x, params)
    _expect_shape("y", y, tuple(x.shape), "(B, C_in, *S) like x")
    g = _plain(g)
    if g.ndim != x.ndim or g.shape[0] != x.shape[0] or tuple(g.shape[2:]) != tuple(x.shape[2:]):
        raise ValueError(f"g: expected shape (B, C_out, *S) with B, *S of x {tuple(x.shape)}, "
                         f"got {tuple(g.shape)}")
    d_y, d_pointwise, d_pointwise_bias = _pointwise_bwd(y, params, g, scratch=True)
    d_y = _plain(d_y)
    _expect_shape("d_y", d_y, tuple(x.shape), "(B, C_in, *S) like x")
    x = _plain(x)
    taps = _plain(params.depthwise_weight)
    biases = _plain(params.depthwise_bias)
    d_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    d_taps = torch.empty_like(taps, memory_format=torch.contiguous_format)
    d_biases = torch.empty_like(biases, memory_format=torch.contiguous_format)
    spatial = tuple(x.shape[2:])
    _call(lib, "dw_bwd", suffix, _ptr(x), _ptr(d_y), _ptr(d_x), _ptr(d_taps), _ptr(d_biases),
          _ptr(taps), _ptr(biases), x.shape[0], x.shape[1], len(spatial), _shape_arg(spatial))
    return d_x, ConvParams(d_taps, d_biases, d_pointwise, d_pointwise_bias)


def gates_fwd(xp: Any, z: torch.Tensor, c: torch.Tensor):
    """LSTM gates with torch's own kernels: one ``sigmoid`` over the three sigmoid
    quarters (this CPU build's ``sigmoid`` is ~4x faster than ``tanh``, and the
    generic ``0.5 tanh(x/2) + 0.5`` is three passes). Residuals: ``(c, sigmoids
    (B,3C,*S), tanh(g), tanh(c'))``; on the fused path :class:`_NativeGateResiduals`."""
    kernels = _native_kernels(z, c)
    if kernels is not None:
        lib, suffix = kernels
        _check_gates(z, c)
        z, c = _plain(z), _plain(c)
        h_new = torch.empty_like(c, memory_format=torch.contiguous_format)
        c_new = torch.empty_like(c, memory_format=torch.contiguous_format)
        batch, channels = c.shape[:2]
        _call(lib, "gates_fwd", suffix, _ptr(z), _ptr(c), _ptr(h_new), _ptr(c_new), batch,
              channels, math.prod(c.shape[2:]))
        return h_new, c_new, _NativeGateResiduals(z, c)
    return _torch_gates(z, c)


def _torch_gates(z: torch.Tensor, c: torch.Tensor):
    channels = c.shape[1]
    sig = torch.sigmoid(z[:, : 3 * channels])
    i, f, o = sig[:, :channels], sig[:, channels : 2 * channels], sig[:, 2 * channels :]
    g = torch.tanh(z[:, 3 * channels :])
    c_new = torch.addcmul(f * c, i, g)
    tanh_c_new = torch.tanh(c_new)
    return o * tanh_c_new, c_new, (c, sig, g, tanh_c_new)


def gates_residuals(xp: Any, z: torch.Tensor, c: torch.Tensor):
    """Residuals for :func:`gates_bwd`: ``(z, c)`` on the fused path (its VJP recomputes
    the gates, so nothing is computed here), else those of :func:`gates_fwd`."""
    if _native_kernels(z, c) is not None:
        _check_gates(z, c)
        return _NativeGateResiduals(_plain(z), _plain(c))
    return _torch_gates(z, c)[2]


def gates_bwd(xp: Any, residuals: tuple, g_h: torch.Tensor, g_c: torch.Tensor):
    """VJP of :func:`gates_fwd`: the three sigmoid derivatives in one pass."""
    if isinstance(residuals, _NativeGateResiduals):
        z, c = residuals
        kernels = _native_kernels(z, c, g_h, g_c)
        if kernels is not None:
            lib, suffix = kernels
            _check_gates(z, c, g_h, g_c)
            z, c, g_h, g_c = _plain(z), _plain(c), _plain(g_h), _plain(g_c)
            d_z = _scratch("d_z", tuple(z.shape), z)
            d_c = torch.empty_like(c, memory_format=torch.contiguous_format)
            batch, channels = c.shape[:2]
            _call(lib, "gates_bwd", suffix, _ptr(z), _ptr(c), _ptr(g_h), _ptr(g_c), _ptr(d_z),
                  _ptr(d_c), batch, channels, math.prod(c.shape[2:]))
            return d_z, d_c
        residuals = _torch_gates(z, c)[2]  # e.g. the cotangents now recorded by autograd
    c, sig, g, tanh_c_new = residuals
    channels = c.shape[1]
    i, f, o = sig[:, :channels], sig[:, channels : 2 * channels], sig[:, 2 * channels :]
    d_c_new = torch.addcmul(g_c, g_h * o, 1.0 - tanh_c_new.square())
    d_sig = sig - sig.square()  # s (1 - s)
    d_z = torch.cat([
        d_c_new * g * d_sig[:, :channels],
        d_c_new * c * d_sig[:, channels : 2 * channels],
        g_h * tanh_c_new * d_sig[:, 2 * channels :],
        d_c_new * i * (1.0 - g.square()),
    ], dim=1)
    return d_z, d_c_new * f


# ------------------------------------------------------------- the fused CPU scan --
#
# On the CPU, where the fused kernels run, the whole scan loop lives here instead of in
# tmcore.scan's generic loop (same arguments, results and checkpoint layout; it declines
# with None elsewhere). Per step it makes no concatenated copy of [x, h] (the kernels
# read the written volume and h where they lie), no bias copy (the gate kernels add the
# pointwise bias), writes the new state straight into its checkpoint slot, and adds the
# parameter gradients into float64 accumulators (the pointwise weight's into a (B, 4C,
# 2C) buffer by an in-place baddbmm) instead of allocating and summing them per step.

#: Steps whose write volumes are made, and differentiated, in one splat call.
_WRITE_BLOCK = 16

_HUGE = 1 << 21  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise`` (Linux), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _uninitialized(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor on fresh, unfilled memory: ``torch.empty`` without the NaN
    fill that ``torch.use_deterministic_algorithms(True)`` adds to every ``empty`` (the
    diagnostics train so; at their paper sizes the fills of the scan's checkpoints and
    block buffers measured ~140 ms of a ~900 ms step). Only for buffers the scan writes
    whole before it reads them (every one below), so the fill never shows in a result."""
    storage = torch.UntypedStorage(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def _empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """:func:`_uninitialized` memory marked for transparent huge pages: the
    scan writes its checkpoints (MBs per step) into fresh memory, and faulting that in
    4 KiB pages measured ~0.9 ms per lm-1024 step (~0.2 ms with 2 MiB pages). A hint
    only: where it is refused or unsupported nothing changes."""
    t = _uninitialized(shape, dtype)
    madvise = _madvise()
    size = t.numel() * t.element_size()
    if madvise is not None and size >= 2 * _HUGE:
        start = -(-t.data_ptr() // _HUGE) * _HUGE
        stop = (t.data_ptr() + size) // _HUGE * _HUGE
        if stop > start:
            madvise(start, stop - start, _MADV_HUGEPAGE)
    return t


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)

#: A pooled block not handed out in this many scan calls is dropped from the pool.
_POOL_AGE = 16


class _Pool(threading.local):
    """The fused scan's big buffers, kept from one call to the next (per thread).

    Fresh memory is faulted in page by page on first touch, and a training step of the
    diagnostics at their paper sizes (B = 128, C = 16, 6^3, T = 24) touched ~200 MB of
    it per step (checkpoints, block buffers: ~50,000 page faults, measured 0 with the
    pool; with the deterministic fill the step went from ~750 to ~600 CPU ms). The pool
    keeps those blocks (``torch.UntypedStorage``) and hands one
    out again only once nothing but the pool refers to it (its storage use count is 1:
    every tensor or view of it, autograd's saved checkpoints included, holds one), so a
    block is never shared with a live tensor. Every pooled buffer is written whole by
    the scan before it is read, so what a previous call left in it never shows.

    Bounds: a block of ``n`` bytes serves requests of ``[n/2, n]`` bytes (states, which
    the scan may return, only of ``n``: a returned tensor's storage is its own size;
    a tensor moved to shared memory is never handed out again); blocks not handed out
    in the last ``_POOL_AGE`` calls are dropped, and the free blocks are trimmed (oldest
    first) to twice the most any recent call took. Without ``torch._C._storage_Use_Count``
    (another torch) nothing is pooled.
    """

    def __init__(self) -> None:
        self.blocks: list[list] = []  # [storage, nbytes, call that last took it]
        self.calls = 0
        self.taken: list[int] = []  # bytes taken by each of the recent calls

    def begin(self) -> None:
        """Start a scan call: age out old blocks, trim the free ones."""
        self.calls += 1
        self.taken = [*self.taken[-(_POOL_AGE - 1):], 0] if _POOL_AGE > 1 else [0]
        self.blocks = [b for b in self.blocks if b[2] > self.calls - _POOL_AGE]
        budget = 2 * max(self.taken)
        free = [b for b in self.blocks if self._free(b)]
        total = sum(b[1] for b in free)
        for block in sorted(free, key=lambda b: b[2]):
            if total <= budget:
                break
            self.blocks.remove(block)
            total -= block[1]

    @staticmethod
    def _free(block: list) -> bool:
        """Only the pool refers to it (and it was not moved to shared memory, which
        another process may still map)."""
        return _storage_use_count(block[0]._cdata) == 1 and not block[0].is_shared()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, huge: bool = False,
             exact: bool = False) -> torch.Tensor:
        """An uninitialized contiguous ``shape`` tensor on a free pooled block (the
        smallest that fits; ``exact``: of exactly its size, for a tensor the caller
        returns), else on a new one (marked for huge pages if ``huge``)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if _storage_use_count is None or nbytes == 0:
            return _empty_huge(shape, dtype) if huge else _uninitialized(shape, dtype)
        if self.taken:
            self.taken[-1] += nbytes
        top = nbytes if exact else 2 * nbytes
        fits = [b for b in self.blocks if nbytes <= b[1] <= top and self._free(b)]
        if fits:
            block = min(fits, key=lambda b: b[1])
        else:
            t = _empty_huge(shape, dtype) if huge else _uninitialized(shape, dtype)
            block = [t.untyped_storage(), nbytes, 0]
            self.blocks.append(block)
        block[2] = self.calls
        return torch.empty(0, dtype=dtype).set_(block[0], 0, tuple(shape))

    def clear(self) -> None:
        self.blocks = []
        self.taken = []


_POOL = _Pool()


def release_scan_buffers() -> None:
    """Drop this thread's pooled scan buffers (their memory is freed once no tensor
    holds it)."""
    _POOL.clear()


def _check_scan_shapes(h: torch.Tensor, read_coords: torch.Tensor, params: ConvParams,
                       arrays: dict[str, tuple[torch.Tensor, tuple[int, ...], str]]) -> None:
    """The shapes the fused scan's kernels index by (``ValueError`` naming the argument)."""
    _check_state("h0", h)
    batch, channels, *spatial = h.shape
    n = len(spatial)
    if read_coords.ndim != 3 or tuple(read_coords.shape[::2]) != (batch, n):
        raise ValueError(f"read_coords: expected shape (B, T, n) = ({batch}, T, {n}), got "
                         f"{tuple(read_coords.shape)}")
    steps = read_coords.shape[1]
    for name, (t, shape, layout) in arrays.items():
        shape = tuple(steps if d == -1 else d for d in shape)
        _expect_shape(name, t, shape, layout)
    for name, t, shape, layout in (
            ("params.depthwise_weight", params.depthwise_weight, (n, 2 * channels, 3),
             "(n, 2C, 3)"),
            ("params.depthwise_bias", params.depthwise_bias, (n, 2 * channels), "(n, 2C)"),
            ("params.pointwise_weight", params.pointwise_weight, (4 * channels, 2 * channels),
             "(4C, 2C)"),
            ("params.pointwise_bias", params.pointwise_bias, (4 * channels,), "(4C,)")):
        _expect_shape(name, t, shape, layout)


def _scan_shapes(h: torch.Tensor) -> dict[str, tuple[tuple[int, ...], str]]:
    batch, channels = h.shape[:2]
    n = h.ndim - 2
    return {"write_coords": ((batch, -1, n), "(B, T, n)"),
            "write_sigma": ((batch, -1), "(B, T)"),
            "write_content": ((batch, -1, channels), "(B, T, C)")}


class _BlockWrites:
    """The scan's write volumes, a block of steps per splat call, and their VJP.

    :meth:`volume` gives step ``t``'s volume ``(B, C, *S)`` as a view into its block
    ``(B, L, C, *S)`` with the block's batch stride (the two most recent blocks are
    kept). :meth:`grad_slot` gives where step ``t``'s volume gradient goes (a view of
    the block's gradient buffer); :meth:`grad_done` runs the block's splat VJP once
    its first step's gradient is in (the backward runs in reverse).
    """

    def __init__(self, splat_fwd, splat_bwd, xp: Any, write_coords: torch.Tensor,
                 write_sigma: torch.Tensor, write_content: torch.Tensor,
                 shape: tuple[int, ...], eps: float, radius: float | None) -> None:
        self.splat_fwd, self.splat_bwd, self.xp = splat_fwd, splat_bwd, xp
        self.coords, self.sigma, self.content = write_coords, write_sigma, write_content
        self.shape, self.eps, self.radius = shape, eps, radius
        self.batch, self.steps = write_coords.shape[:2]
        self.volumes: dict[int, torch.Tensor] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.volume_buffers: dict[int, torch.Tensor] = {}  # block -> its pool buffer
        self.grad_buffers: dict[int, torch.Tensor] = {}
        self.free_volumes: list[torch.Tensor] = []
        self.free_grads: list[torch.Tensor] = []
        self.d_coords = self.d_sigma = self.d_content = None

    def _span(self, index: int) -> tuple[int, int]:
        return index * _WRITE_BLOCK, min((index + 1) * _WRITE_BLOCK, self.steps)

    def _inputs(self, index: int):
        start, stop = self._span(index)
        rows = self.batch * (stop - start)
        return (self.content[:, start:stop].reshape(rows, 1, self.content.shape[2]),
                self.coords[:, start:stop].reshape(rows, 1, self.coords.shape[2]),
                self.sigma[:, start:stop].reshape(rows, 1))

    def _buffer(self, pool: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """A full block's ``(B L, C, *S)`` buffer from ``pool`` (or a new one): the scan
        reuses its few block buffers instead of faulting in MBs per block."""
        if pool:
            return pool.pop()
        full = self.batch * min(_WRITE_BLOCK, self.steps)
        return _POOL.take((full, self.content.shape[2], *self.shape), like.dtype, huge=True)

    def volume(self, t: int) -> torch.Tensor:
        index = t // _WRITE_BLOCK
        block = self.volumes.get(index)
        if block is None:
            if len(self.volumes) >= 2:
                self._free_volume(next(iter(self.volumes)))
            start, stop = self._span(index)
            content, mu, sigma = self._inputs(index)
            if content.dtype == mu.dtype == sigma.dtype:
                # the generic splat of one write per row (splat_fwd's K = 1 case: the
                # outer product content x weights), into a reused buffer
                profiles, _, _ = gaussian_profiles(self.xp, mu, sigma, self.shape, self.eps,
                                                   self.radius)
                dense = outer_product(self.xp, profiles)  # (rows, 1, P)
                rows = content.shape[0]
                buffer = self.volume_buffers[index] = self._buffer(self.free_volumes, content)
                out = buffer[:rows]
                torch.mul(content[:, 0, :, None], dense,
                          out=out.reshape(rows, content.shape[2], -1))
            else:
                out = _plain(self.splat_fwd(self.xp, content, mu, sigma, self.shape, self.eps,
                                            self.radius))
            block = self.volumes[index] = out.reshape(self.batch, stop - start, *out.shape[1:])
        return block[:, t - index * _WRITE_BLOCK]

    def _free_volume(self, index: int) -> None:
        self.volumes.pop(index, None)
        buffer = self.volume_buffers.pop(index, None)
        if buffer is not None:
            self.free_volumes.append(buffer)

    def grad_slot(self, t: int, like: torch.Tensor) -> torch.Tensor:
        index = t // _WRITE_BLOCK
        block = self.grads.get(index)
        if block is None:
            start, stop = self._span(index)
            buffer = self.grad_buffers[index] = self._buffer(self.free_grads, like)
            block = self.grads[index] = buffer[: self.batch * (stop - start)].reshape(
                self.batch, stop - start, *like.shape[1:])
        return block[:, t - index * _WRITE_BLOCK]

    def grad_done(self, t: int) -> None:
        index = t // _WRITE_BLOCK
        start, stop = self._span(index)
        if t != start:
            return
        if self.d_coords is None:
            self.d_coords = _uninitialized(tuple(self.coords.shape), self.coords.dtype)
            self.d_sigma = _uninitialized(tuple(self.sigma.shape), self.sigma.dtype)
            self.d_content = _uninitialized(tuple(self.content.shape), self.content.dtype)
        block = self.grads.pop(index)
        g_rows = block.reshape(self.batch * (stop - start), *block.shape[2:])
        d_content, d_mu, d_sigma = self.splat_bwd(self.xp, *self._inputs(index), self.shape,
                                                  g_rows, self.eps, self.radius)
        length = stop - start
        self.d_coords[:, start:stop] = d_mu.reshape(self.batch, length, -1)
        self.d_sigma[:, start:stop] = d_sigma.reshape(self.batch, length)
        self.d_content[:, start:stop] = d_content.reshape(self.batch, length, -1)
        self.free_grads.append(self.grad_buffers.pop(index))
        self._free_volume(index)


class _CpuCell:
    """The fused kernels of one scan: shapes, parameters as plain memory, scratch."""

    def __init__(self, kernels, state: torch.Tensor, params: ConvParams) -> None:
        self.lib, self.suffix = kernels
        self.batch, self.channels, *spatial = state.shape
        self.spatial = tuple(spatial)
        self.cells = math.prod(self.spatial)
        self.dtype = state.dtype
        self.shape_arg = _shape_arg(self.spatial)
        self.taps = _plain(params.depthwise_weight)
        self.biases = _plain(params.depthwise_bias)
        self.weight = _plain(params.pointwise_weight)
        self.zb = _plain(params.pointwise_bias)
        b, c, p = self.batch, self.channels, self.cells
        self.y = _POOL.take((b, 2 * c, p), self.dtype)
        self.z = _POOL.take((b, 4 * c, p), self.dtype)
        self.w_expanded = self.weight.expand(b, 4 * c, 2 * c)

    def new_state(self) -> torch.Tensor:
        """An uninitialized ``(B, C, *S)`` state from the pool, of exactly its size (the
        scan may return it)."""
        return _POOL.take((self.batch, self.channels, *self.spatial), self.dtype, exact=True)

    def pre_activations(self, x: torch.Tensor, h: torch.Tensor) -> None:
        """``self.z = W dw(concat([x, h]))`` (no bias) and ``self.y = dw(...)``; ``x`` may
        be a batch-strided view, ``h`` is contiguous."""
        c, p = self.channels, self.cells
        _call(self.lib, "dw2_fwd", self.suffix, _ptr(x), x.stride(0), _ptr(h), c * p, c,
              _ptr(self.y), _ptr(self.taps), _ptr(self.biases), self.batch, 2 * c,
              len(self.spatial), self.shape_arg)
        torch.bmm(self.w_expanded, self.y, out=self.z)

    def step(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, h_out: torch.Tensor,
             c_out: torch.Tensor) -> None:
        self.pre_activations(x, h)
        _call(self.lib, "gates2_fwd", self.suffix, _ptr(self.z), _ptr(self.zb), _ptr(c),
              _ptr(h_out), _ptr(c_out), self.batch, self.channels, self.cells)


def _pick(buffers: list[torch.Tensor], busy: torch.Tensor) -> torch.Tensor:
    return buffers[1] if buffers[0] is busy else buffers[0]


def _cpu_scan_kernels(options: Options, *tensors: torch.Tensor):
    if options.depthwise != "auto":  # a forced depthwise kernel: the per-step ops
        return None
    if options.triton is True:  # Triton forced (CPU tensors under TRITON_INTERPRET=1)
        return None
    kernels = _native_kernels(*tensors)
    if kernels is None or not 3 <= tensors[0].ndim <= 6:
        return None
    return kernels


def _make_cpu_scan(generic: Ops, options: Options):
    """``(scan_fwd, scan_bwd)``: the fused CPU scan, else the Triton one (each may
    decline with ``None``; the generic loop of :mod:`tmcore.scan` then runs)."""

    def scan_fwd(xp, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
                 eps, radius, checkpoint_every):
        params = ConvParams(*params)
        kernels = _cpu_scan_kernels(options, h0, c0, read_coords, write_coords, write_sigma,
                                    write_content, *params)
        if kernels is None:
            return _triton.scan_fwd(xp, h0, c0, read_coords, write_coords, write_sigma,
                                    write_content, params, eps, radius, checkpoint_every)
        shapes = _scan_shapes(h0)
        _check_scan_shapes(h0, read_coords, params, {
            "c0": (c0, tuple(h0.shape), "(B, C, *S) like h0"),
            **{k: (v, *shapes[k]) for k, v in (("write_coords", write_coords),
                                               ("write_sigma", write_sigma),
                                               ("write_content", write_content))}})
        _POOL.begin()
        cell = _CpuCell(kernels, h0, params)
        steps = read_coords.shape[1]
        saved = -(-steps // checkpoint_every)
        h_ck = _POOL.take((saved, *h0.shape), h0.dtype, huge=True)
        c_ck = _POOL.take((saved, *h0.shape), h0.dtype, huge=True)
        h_ck[0], c_ck[0] = h0, c0
        reads = _uninitialized((cell.batch, steps, cell.channels), h0.dtype)
        writes = _BlockWrites(generic.splat_fwd, generic.splat_bwd, xp, write_coords,
                              write_sigma, write_content, cell.spatial, eps, radius)
        work_h = [cell.new_state(), cell.new_state()] if checkpoint_every > 1 else None
        work_c = [cell.new_state(), cell.new_state()] if checkpoint_every > 1 else None
        h, c = h_ck[0], c_ck[0]
        coords = _plain(read_coords)
        n = len(cell.spatial)
        for t in range(steps):
            _call(cell.lib, "read_fwd", cell.suffix, _ptr(h), _offset(coords, t * n), steps * n,
                  _offset(reads, t * cell.channels), steps * cell.channels, cell.batch,
                  cell.channels, n, cell.shape_arg)
            if t == steps - 1:
                h_new, c_new = cell.new_state(), cell.new_state()
            elif (t + 1) % checkpoint_every == 0:
                h_new, c_new = h_ck[(t + 1) // checkpoint_every], c_ck[(t + 1) // checkpoint_every]
            else:
                h_new, c_new = _pick(work_h, h), _pick(work_c, c)
            cell.step(writes.volume(t), h, c, h_new, c_new)
            h, c = h_new, c_new
        return reads, h, c, h_ck, c_ck

    def scan_bwd(xp, read_coords, write_coords, write_sigma, write_content, params,
                 h_checkpoints, c_checkpoints, g_reads, g_h, g_c, eps, radius,
                 checkpoint_every):
        from tmcore.scan.dense import ScanGrads

        params = ConvParams(*params)
        kernels = _cpu_scan_kernels(options, g_h, g_c, g_reads, h_checkpoints, c_checkpoints,
                                    read_coords, write_coords, write_sigma, write_content,
                                    *params)
        if kernels is None:
            return _triton.scan_bwd(xp, read_coords, write_coords, write_sigma, write_content,
                                    params, h_checkpoints, c_checkpoints, g_reads, g_h, g_c,
                                    eps, radius, checkpoint_every)
        steps = read_coords.shape[1]
        saved = -(-steps // checkpoint_every)
        shapes = _scan_shapes(g_h)
        batch, channels = g_h.shape[:2]
        _check_scan_shapes(g_h, read_coords, params, {
            "g_c": (g_c, tuple(g_h.shape), "(B, C, *S) like g_h"),
            "g_reads": (g_reads, (batch, steps, channels), "(B, T, C)"),
            "h_checkpoints": (h_checkpoints, (saved, *g_h.shape),
                              "(ceil(T / checkpoint_every), B, C, *S)"),
            "c_checkpoints": (c_checkpoints, (saved, *g_h.shape),
                              "(ceil(T / checkpoint_every), B, C, *S)"),
            **{k: (v, *shapes[k]) for k, v in (("write_coords", write_coords),
                                               ("write_sigma", write_sigma),
                                               ("write_content", write_content))}})
        _POOL.begin()
        cell = _CpuCell(kernels, g_h, params)
        h_checkpoints, c_checkpoints = _plain(h_checkpoints), _plain(c_checkpoints)
        b, c_, p, n = cell.batch, cell.channels, cell.cells, len(cell.spatial)
        f64 = torch.float64
        acc_taps = torch.zeros((n, 2 * c_, 3), dtype=f64)
        acc_biases = torch.zeros((n, 2 * c_), dtype=f64)
        acc_zb = torch.zeros((4 * c_,), dtype=f64)
        d_weight = _POOL.take((b, 4 * c_, 2 * c_), cell.dtype).zero_()
        d_z = _POOL.take((b, 4 * c_, p), cell.dtype)
        d_y = _POOL.take((b, 2 * c_, p), cell.dtype)
        w_t = cell.weight.T.expand(b, 2 * c_, 4 * c_)
        coords, g_reads = _plain(read_coords), _plain(g_reads)
        d_read_coords = _uninitialized(tuple(coords.shape), coords.dtype)
        writes = _BlockWrites(generic.splat_fwd, generic.splat_bwd, xp, write_coords,
                              write_sigma, write_content, cell.spatial, eps, radius)
        bufs_h = [cell.new_state(), cell.new_state()]
        bufs_c = [cell.new_state(), cell.new_state()]
        g_h, g_c = _plain(g_h), _plain(g_c)
        replay = [cell.new_state() for _ in range(2 * (min(checkpoint_every, steps) - 1))]
        lib, suffix = kernels
        for segment in reversed(range(saved)):
            start = segment * checkpoint_every
            stop = min(start + checkpoint_every, steps)
            states = [(h_checkpoints[segment], c_checkpoints[segment])]
            for t in range(start, stop - 1):  # replay the segment from its checkpoint
                k = 2 * (t - start)
                cell.step(writes.volume(t), *states[-1], replay[k], replay[k + 1])
                states.append((replay[k], replay[k + 1]))
            for t in reversed(range(start, stop)):
                h, c = states[t - start]
                x = writes.volume(t)
                cell.pre_activations(x, h)
                g_c_new = _pick(bufs_c, g_c)
                _call(lib, "gates2_bwd", suffix, _ptr(cell.z), _ptr(cell.zb), _ptr(c),
                      _ptr(g_h), _ptr(g_c), _ptr(d_z), _ptr(g_c_new), _ptr(acc_zb), b, c_, p)
                d_weight.baddbmm_(d_z, cell.y.transpose(1, 2))
                torch.bmm(w_t, d_z, out=d_y)
                g_h_new = _pick(bufs_h, g_h)
                d_x = writes.grad_slot(t, g_h)
                _call(lib, "dw2_bwd", suffix, _ptr(x), x.stride(0), _ptr(h), c_ * p, c_,
                      _ptr(d_y), _ptr(d_x), d_x.stride(0), _ptr(g_h_new), c_ * p,
                      _ptr(acc_taps), _ptr(acc_biases), _ptr(cell.taps), _ptr(cell.biases), b,
                      2 * c_, n, cell.shape_arg)
                _call(lib, "read_bwd", suffix, _ptr(h), _offset(coords, t * n), steps * n,
                      _offset(g_reads, t * c_), steps * c_, _ptr(g_h_new),
                      _offset(d_read_coords, t * n), steps * n, b, c_, n, cell.shape_arg)
                writes.grad_done(t)
                g_h, g_c = g_h_new, g_c_new
        d_params = ConvParams(acc_taps.to(cell.dtype), acc_biases.to(cell.dtype),
                              d_weight.sum(0), acc_zb.to(cell.dtype))
        return ScanGrads(g_h, g_c, d_read_coords, writes.d_coords, writes.d_sigma,
                         writes.d_content, d_params)

    return scan_fwd, scan_bwd


def _make_local_scan(options: Options):
    """``(local_scan_fwd, local_scan_bwd)``: the fused CPU local scan, else the Triton one
    (each may decline with ``None``; tmcore's local loop then runs)."""

    def local_scan_fwd(xp, *args):
        from . import _cpu_local, _triton_local

        out = _cpu_local.scan_fwd(xp, *args, options=options)
        return _triton_local.scan_fwd(xp, *args, options=options) if out is None else out

    def local_scan_bwd(xp, *args):
        from . import _cpu_local, _triton_local

        out = _cpu_local.scan_bwd(xp, *args, options=options)
        return _triton_local.scan_bwd(xp, *args, options=options) if out is None else out

    return local_scan_fwd, local_scan_bwd


def make_ops(generic: Ops, options: Options) -> Ops:
    """The torch table: fast read, conv and gates, generic splat, float32 compute for
    halves; the depthwise kernel is ``options.depthwise`` (tables are cached per options)."""
    sample_fwd, sample_bwd = _make_sample(generic)
    conv = functools.partial(conv_fwd, kernel=options.depthwise)
    conv_vjp = functools.partial(conv_bwd, kernel=options.depthwise)
    scan_fwd, scan_bwd = _make_cpu_scan(generic, options)
    fast = Ops(sample_fwd, sample_bwd, generic.splat_fwd, generic.splat_bwd, conv, conv_vjp,
               gates_fwd, gates_bwd, gates_residuals, workspace,
               scan_fwd, scan_bwd,  # fused scans: CPU kernels or Triton (each may decline)
               scatter_add, *_make_local_scan(options))
    return with_float32_compute(fast)
