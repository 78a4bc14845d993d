"""The torch backend's fused CPU scan: the whole chunk loop over the C kernels.

Entries ``scan_fwd`` / ``scan_bwd`` of the torch table, tried before the Triton ones, with
the arguments, results and checkpoints of :func:`tmcore.scan.memory_scan_fwd` /
``memory_scan_bwd`` (``None``: declined, the generic loop runs). Where the fused kernels
run (:func:`scan_kernels`), a forward step on a small grid is one ``step_fwd`` call
(:data:`FUSED_STEP_MAX`); otherwise a step is C kernels and two ``bmm``: the read and its VJP in C,
the depthwise passes reading the written volume and ``h`` in place (no ``concat``), the
pointwise bias added in the gate kernels, the new state written straight into its
checkpoint slot (in huge pages where Linux allows), the write volumes and their gradients in
reused block buffers (:class:`_BlockWrites`), the parameter gradients accumulated in place
(taps and biases in float64). The big buffers come from the pool of
:mod:`tmcore.backends.torch.memory`. It agrees with the generic loop to rounding.
:class:`Cell` is shared with the fused local scan.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from tmcore.backends.fused import check_scan_shapes
from tmcore.backends.native.calls import Kernels, call, kernels_for, offset, plain, ptr, shape_arg
from tmcore.backends.triton import dense as triton_dense
from tmcore.ops.addressing import axis_of_component
from tmcore.runtime.dispatch import Ops
from tmcore.runtime.options import Options
from tmcore.scan.base import Masks
from tmcore.types import ConvParams, ScanGrads

from . import memory

__all__ = ["Cell", "scan_bwd", "scan_fwd", "scan_kernels", "single_write"]

#: A kernel argument: the address of an array (``ptr`` / ``offset``).
Address = ctypes.c_void_p

#: Steps whose write volumes are made, and differentiated, in one splat call.
_WRITE_BLOCK = 16


def scan_kernels(options: Options, *tensors: torch.Tensor) -> Kernels | None:
    """The kernels when a fused CPU scan may run on ``tensors`` (plain untraced CPU float32 /
    float64, ``native`` on, ``depthwise="auto"``, Triton not forced), else ``None``."""
    if options.depthwise != "auto":
        return None
    if options.triton is True:
        return None
    kernels = kernels_for(*tensors)
    if kernels is None or not 3 <= tensors[0].ndim <= 6:
        return None
    return kernels


# --------------------------------------------------------------------------- writes

#: (shape, dtype, device) -> (the centres of every axis, concatenated ``(sum S,)``; the
#: coordinate component each centre is compared with ``(sum S,)``)
_CENTRES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _centres(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    key = (shape, dtype, device)
    cached = _CENTRES.get(key)
    if cached is None:
        n = len(shape)
        # the generic splat's linspace per axis (the same values), side by side
        centres = torch.cat([torch.linspace(-1.0, 1.0, s, dtype=dtype, device=device)
                             for s in shape])
        components = torch.tensor([axis_of_component(a, n) for a in range(n)
                                   for _ in range(shape[a])], device=device)
        cached = _CENTRES[key] = (centres, components)
    return cached


def single_write(content: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor,
                 shape: tuple[int, ...], eps: float, radius: float | None,
                 out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The write volume of one Gaussian per row, flat ``(B, C, prod(shape))`` (into ``out``
    when given): ``content (B, C)`` around ``mu (B, n)`` with ``sigma (B,)``, ``eps, radius``
    as in :func:`tmcore.gaussian_splat`. All axes' profiles at once over the concatenated cell
    centres, the generic splat's arithmetic in its order (the same bits); ``None`` where
    ``eps <= 0``."""
    if eps <= 0.0:
        return None
    batch, channels = content.shape
    centres, components = _centres(tuple(shape), mu.dtype, mu.device)
    # offsets of every axis' centres from the matching centre component: (B, sum S)
    offset = centres - torch.index_select(mu, 1, components)
    square = offset * offset
    denom = (2.0 * sigma * sigma + eps)[:, None]                      # (B, 1)
    profile = torch.exp(-square / denom)                              # (B, sum S)
    if radius is not None:  # zero outside the box, NaN stays NaN (as the generic splat)
        inside = torch.abs(offset) <= radius * sigma[:, None]
        profile = torch.where(inside, profile, profile * 0.0)
    n = len(shape)
    dense = None
    for axis, piece in enumerate(torch.split(profile, list(shape), dim=1)):
        view = [1] * n
        view[axis] = shape[axis]
        piece = piece.view(batch, *view)
        dense = piece if dense is None else dense * piece              # (p_0 p_1) p_2 ...
    dense = dense.view(batch, 1, math.prod(shape))
    if out is None:
        return content[:, :, None] * dense
    return torch.mul(content[:, :, None], dense, out=out)


class Cell:
    """One step of the cell on the fused kernels, forward and VJP, for a ``(B, C, *S)`` state on
    a grid (or a local scan's box) ``S``: the parameters as plain memory, the step's buffers
    and, after :meth:`start_backward`, the parameter gradients. Arrays are passed by address
    (no torch op per step), ``(B, C, *S)`` blocks with contiguous rows except ``x`` and
    ``d_x``, whose rows lie ``x_stride`` / ``d_x_stride`` elements apart."""

    def __init__(self, kernels: Kernels, batch: int, channels: int,
                 spatial: tuple[int, ...], dtype: torch.dtype, params: ConvParams) -> None:
        self.kernels = kernels
        self.batch, self.channels, self.spatial = batch, channels, tuple(spatial)
        self.cells = math.prod(self.spatial)
        self.dtype = dtype
        self.shape_arg = shape_arg(self.spatial)
        self.taps, self.biases, self.weight, self.zb = (plain(p) for p in ConvParams(*params))
        b, c, p = batch, channels, self.cells
        self.y = memory.take((b, 2 * c, p), dtype)
        self.z = memory.take((b, 4 * c, p), dtype)
        self.w_expanded = self.weight.expand(b, 4 * c, 2 * c)

    def new_state(self) -> torch.Tensor:
        """An uninitialized ``(B, C, *S)`` state from the pool, of exactly its size (the
        scan may return it)."""
        return memory.take((self.batch, self.channels, *self.spatial), self.dtype, exact=True)

    def pre_activations(self, x: Address, x_stride: int, h: Address) -> None:
        """``self.y = dw(concat([x, h]))`` and ``self.z = W y`` (no bias)."""
        c, p = self.channels, self.cells
        call(self.kernels, "dw2_fwd", x, x_stride, h, c * p, c, ptr(self.y), ptr(self.taps),
             ptr(self.biases), self.batch, 2 * c, len(self.spatial), self.shape_arg)
        torch.bmm(self.w_expanded, self.y, out=self.z)

    def step(self, x: Address, x_stride: int, h: Address, c: Address, h_out: Address,
             c_out: Address) -> None:
        """``(h_out, c_out)``: the cell on the written volume ``x`` and the state ``(h, c)``."""
        self.pre_activations(x, x_stride, h)
        call(self.kernels, "gates2_fwd", ptr(self.z), ptr(self.zb), c, h_out, c_out,
             self.batch, self.channels, self.cells)

    def start_backward(self) -> None:
        """The gradient accumulators (taps, biases, pointwise bias in float64; the
        pointwise weight per batch row) and the VJP's step buffers."""
        b, c, n, f64 = self.batch, self.channels, len(self.spatial), torch.float64
        self.acc_taps = torch.zeros((n, 2 * c, 3), dtype=f64)
        self.acc_biases = torch.zeros((n, 2 * c), dtype=f64)
        self.acc_zb = torch.zeros((4 * c,), dtype=f64)
        self.d_weight = memory.take((b, 4 * c, 2 * c), self.dtype).zero_()
        self.d_z = memory.take((b, 4 * c, self.cells), self.dtype)
        self.d_y = memory.take((b, 2 * c, self.cells), self.dtype)
        self.w_t = self.weight.T.expand(b, 2 * c, 4 * c)
        self.y_t = self.y.transpose(1, 2)

    def backward_step(self, x: Address, x_stride: int, h: Address, c: Address, g_h: Address,
                      g_c: Address, d_x: Address, d_x_stride: int, d_h: Address,
                      d_c: Address) -> None:
        """The VJP of :meth:`step` for the cotangents ``g_h, g_c`` of ``(h_out, c_out)``:
        ``d_x, d_h, d_c`` written, the parameter gradients added."""
        b, ch, p = self.batch, self.channels, self.cells
        self.pre_activations(x, x_stride, h)
        call(self.kernels, "gates2_bwd", ptr(self.z), ptr(self.zb), c, g_h, g_c, ptr(self.d_z),
             d_c, ptr(self.acc_zb), b, ch, p)
        self.d_weight.baddbmm_(self.d_z, self.y_t)
        torch.bmm(self.w_t, self.d_z, out=self.d_y)
        call(self.kernels, "dw2_bwd", x, x_stride, h, ch * p, ch, ptr(self.d_y), d_x,
             d_x_stride, d_h, ch * p, ptr(self.acc_taps), ptr(self.acc_biases), ptr(self.taps),
             ptr(self.biases), b, 2 * ch, len(self.spatial), self.shape_arg)

    def param_grads(self) -> ConvParams:
        """The parameter gradients added up by :meth:`backward_step`."""
        return ConvParams(self.acc_taps.to(self.dtype), self.acc_biases.to(self.dtype),
                          self.d_weight.sum(0), self.acc_zb.to(self.dtype))


def _cell(kernels: Kernels, state: torch.Tensor, params: ConvParams) -> Cell:
    batch, channels, *spatial = state.shape
    return Cell(kernels, batch, channels, tuple(spatial), state.dtype, params)


def _pick(buffers: list[torch.Tensor], busy: torch.Tensor) -> torch.Tensor:
    return buffers[1] if buffers[0] is busy else buffers[0]


class _BlockWrites:
    """The scan's write volumes, a block of steps per splat call, and their VJP: :meth:`volume`
    is step ``t``'s ``(B, C, *S)`` view into its block (the two latest blocks are kept),
    :meth:`grad_slot` where its gradient goes; :meth:`grad_done` runs the block's splat VJP
    once its first step's gradient is in (the backward runs in reverse)."""

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
        return memory.take((full, self.content.shape[2], *self.shape), like.dtype, huge=True)

    def volume(self, t: int) -> torch.Tensor:
        index = t // _WRITE_BLOCK
        block = self.volumes.get(index)
        if block is None:
            if len(self.volumes) >= 2:
                self._free_volume(next(iter(self.volumes)))
            start, stop = self._span(index)
            content, mu, sigma = self._inputs(index)
            if content.dtype == mu.dtype == sigma.dtype and self.eps > 0:
                rows = content.shape[0]
                buffer = self.volume_buffers[index] = self._buffer(self.free_volumes, content)
                out = buffer[:rows]
                single_write(content[:, 0], mu[:, 0], sigma[:, 0], self.shape, self.eps,
                             self.radius, out=out.reshape(rows, content.shape[2], -1))
            else:
                out = plain(self.splat_fwd(self.xp, content, mu, sigma, self.shape, self.eps,
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
            self.d_coords = memory.uninitialized(tuple(self.coords.shape), self.coords.dtype)
            self.d_sigma = memory.uninitialized(tuple(self.sigma.shape), self.sigma.dtype)
            self.d_content = memory.uninitialized(tuple(self.content.shape), self.content.dtype)
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



def scan_fwd(xp: Any, h0, c0, read_coords, write_coords, write_sigma, write_content, params,
             eps: float, radius: float | None, checkpoint_every: int, *, generic: Ops,
             options: Options, reset: Any = None, active: Any = None):
    """The fused :func:`tmcore.scan.memory_scan_fwd` (``generic``: the table whose splat makes
    the volumes): the C kernels' on the CPU, else Triton's, or ``None`` to decline."""
    params = ConvParams(*params)
    kernels = scan_kernels(options, h0, c0, read_coords, write_coords, write_sigma,
                           write_content, *params)
    if kernels is None:
        return triton_dense.scan_fwd(xp, h0, c0, read_coords, write_coords, write_sigma,
                                     write_content, params, eps, radius, checkpoint_every,
                                     reset=reset, active=active)
    check_scan_shapes(h0, read_coords, {"c0": c0, "write_coords": write_coords,
                                        "write_sigma": write_sigma,
                                        "write_content": write_content}, params)
    if _small(h0):  # (scan_kernels took tensors of one dtype)
        return _fused_steps(kernels, h0, c0, read_coords, write_coords, write_sigma,
                            write_content, params, eps, radius, checkpoint_every, reset,
                            active)
    steps = read_coords.shape[1]
    masks = Masks(xp, reset, active)
    memory.begin()
    cell = _cell(kernels, h0, params)
    saved = -(-steps // checkpoint_every)
    h_ck = memory.take((saved, *h0.shape), h0.dtype, huge=True)
    c_ck = memory.take((saved, *h0.shape), h0.dtype, huge=True)
    h_ck[0], c_ck[0] = h0, c0
    reads = memory.uninitialized((cell.batch, steps, cell.channels), h0.dtype)
    writes = _BlockWrites(generic.splat_fwd, generic.splat_bwd, xp, write_coords,
                          write_sigma, write_content, cell.spatial, eps, radius)
    work_h = [cell.new_state(), cell.new_state()] if checkpoint_every > 1 else None
    work_c = [cell.new_state(), cell.new_state()] if checkpoint_every > 1 else None
    h, c = h_ck[0], c_ck[0]
    coords = plain(read_coords)
    n = len(cell.spatial)
    for t in range(steps):
        h, c = masks.enter(xp, t, h, c)  # (a reset: new tensors; the checkpoint keeps h)
        call(kernels, "read_fwd", ptr(h), offset(coords, t * n), steps * n,
             offset(reads, t * cell.channels), steps * cell.channels, cell.batch,
             cell.channels, n, cell.shape_arg)
        if t == steps - 1:
            h_new, c_new = cell.new_state(), cell.new_state()
        elif (t + 1) % checkpoint_every == 0:
            h_new, c_new = h_ck[(t + 1) // checkpoint_every], c_ck[(t + 1) // checkpoint_every]
        else:
            h_new, c_new = _pick(work_h, h), _pick(work_c, c)
        if masks.some(t):
            x = writes.volume(t)
            cell.step(ptr(x), x.stride(0), ptr(h), ptr(c), ptr(h_new), ptr(c_new))
            if not masks.every(t):  # the inactive rows keep the state they entered with
                keep = masks.active[:, t].reshape(-1, *(1,) * (h.ndim - 1))
                h_new.copy_(torch.where(keep, h_new, h))
                c_new.copy_(torch.where(keep, c_new, c))
        else:  # no row keeps the update: the step only reads
            h_new.copy_(h)
            c_new.copy_(c)
        h, c = h_new, c_new
    return reads, h, c, h_ck, c_ck


#: the most ``C * C * prod(S)`` at which a step runs as one ``step_fwd`` call (its pointwise
#: product in C): above it, BLAS's ``bmm`` is faster (measured: 3x faster at ``C = 4``, 4^3;
#: equal at ``C = 32``, 4^3; 2x slower at ``C = 32``, 8^3). Decided by the shapes alone,
#: so every split of a stream rounds alike.
FUSED_STEP_MAX = 1 << 16


def _small(h0: torch.Tensor) -> bool:
    return h0.shape[1] ** 2 * math.prod(h0.shape[2:]) <= FUSED_STEP_MAX


def _steps(t: torch.Tensor | None, mask: bool = False) -> tuple[torch.Tensor | None, int]:
    """A per-step input ``(B, T, ...)`` (a mask ``(B, T)``, or None) as the kernel reads it,
    each row's last axis contiguous (a mask: a byte per row), and its row stride."""
    if t is None:
        return None, 0
    if mask and t.dtype != torch.bool:
        t = t != 0
    if t.ndim > 2 and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0)


#: (shape, dtype, device) -> the kernel's shape argument and the cell centres (held)
_GRIDS: dict[tuple, tuple[ctypes.Array, torch.Tensor]] = {}


def _fused_steps(kernels: Kernels, h0, c0, read_coords, write_coords, write_sigma,
                 write_content, params: ConvParams, eps: float, radius: float | None,
                 checkpoint_every: int, reset, active):
    """:func:`scan_fwd` on a small grid: each step one ``step_fwd`` call (read, Gaussian
    write, depthwise passes, pointwise product, gates, masks), the new state written into
    its checkpoint slot."""
    h0, c0 = plain(h0), plain(c0)
    params = [plain(p) for p in params]
    batch, channels, *spatial = h0.shape
    steps = read_coords.shape[1]
    key = (tuple(spatial), h0.dtype, h0.device)
    grid = _GRIDS.get(key)
    if grid is None:
        grid = _GRIDS[key] = (shape_arg(key[0]), _centres(*key)[0])
    inputs = [*map(_steps, (read_coords, write_coords, write_sigma, write_content)),
              _steps(reset, mask=True), _steps(active, mask=True)]
    saved = -(-steps // checkpoint_every)
    h_ck, c_ck = (memory.uninitialized((saved, *h0.shape), h0.dtype) for _ in range(2))
    reads = memory.uninitialized((batch, steps, channels), h0.dtype)
    h_last, c_last = (memory.uninitialized(h0.shape, h0.dtype) for _ in range(2))
    work = [memory.uninitialized((2, *h0.shape), h0.dtype) for _ in range(2)] \
        if checkpoint_every > 1 and steps > 1 else None
    size = h0.numel()  # the states are passed by address: no torch op per step
    h, c = ptr(h0), ptr(c0)
    for t in range(steps):
        if t == steps - 1:
            h_new, c_new = ptr(h_last), ptr(c_last)
        elif (t + 1) % checkpoint_every == 0:
            k = (t + 1) // checkpoint_every * size
            h_new, c_new = offset(h_ck, k), offset(c_ck, k)
        else:
            h_new, c_new = offset(work[0], t % 2 * size), offset(work[1], t % 2 * size)
        rows = [a for x, stride in inputs for a in (
            None if x is None else offset(x, t * x.stride(1)), stride)]
        call(kernels, "step_fwd", h, c, *rows, grid[1].data_ptr(),
             *(p.data_ptr() for p in params), eps, -1.0 if radius is None else radius,
             offset(reads, t * channels), steps * channels, h_new, c_new,
             ptr(h_ck) if t == 0 else None, ptr(c_ck) if t == 0 else None,
             batch, channels, len(spatial), grid[0])
        h, c = h_new, c_new
    return reads, h_last, c_last, h_ck, c_ck


def scan_bwd(xp: Any, read_coords, write_coords, write_sigma, write_content, params,
             h_checkpoints, c_checkpoints, g_reads, g_h, g_c, eps: float,
             radius: float | None, checkpoint_every: int, *, generic: Ops, options: Options,
             reset: Any = None, active: Any = None):
    """The fused :func:`tmcore.scan.memory_scan_bwd` (a :class:`tmcore.types.ScanGrads`):
    the C kernels' on the CPU, else the Triton kernels', or ``None`` to decline."""
    params = ConvParams(*params)
    kernels = scan_kernels(options, g_h, g_c, g_reads, h_checkpoints, c_checkpoints,
                           read_coords, write_coords, write_sigma, write_content, *params)
    if kernels is None:
        return triton_dense.scan_bwd(xp, read_coords, write_coords, write_sigma, write_content,
                                     params, h_checkpoints, c_checkpoints, g_reads, g_h, g_c,
                                     eps, radius, checkpoint_every, reset=reset, active=active)
    steps = read_coords.shape[1]
    saved = -(-steps // checkpoint_every)
    check_scan_shapes(g_h, read_coords, {
        "g_c": g_c, "g_reads": g_reads, "h_checkpoints": h_checkpoints,
        "c_checkpoints": c_checkpoints, "write_coords": write_coords,
        "write_sigma": write_sigma, "write_content": write_content}, params, saved=saved)
    masks = Masks(xp, reset, active)
    memory.begin()
    cell = _cell(kernels, g_h, params)
    cell.start_backward()
    h_checkpoints, c_checkpoints = plain(h_checkpoints), plain(c_checkpoints)
    b, c_, n = cell.batch, cell.channels, len(cell.spatial)
    coords, g_reads = plain(read_coords), plain(g_reads)
    d_read_coords = memory.uninitialized(tuple(coords.shape), coords.dtype)
    writes = _BlockWrites(generic.splat_fwd, generic.splat_bwd, xp, write_coords,
                          write_sigma, write_content, cell.spatial, eps, radius)
    bufs_h = [cell.new_state(), cell.new_state()]
    bufs_c = [cell.new_state(), cell.new_state()]
    g_h, g_c = plain(g_h), plain(g_c)
    replay = [cell.new_state() for _ in range(2 * (min(checkpoint_every, steps) - 1))]
    for segment in reversed(range(saved)):
        start = segment * checkpoint_every
        stop = min(start + checkpoint_every, steps)
        states = [(h_checkpoints[segment], c_checkpoints[segment])]
        for t in range(start, stop - 1):  # replay the segment from its checkpoint
            k = 2 * (t - start)
            h, c = masks.enter(xp, t, *states[-1])
            if masks.some(t):
                x = writes.volume(t)
                cell.step(ptr(x), x.stride(0), ptr(h), ptr(c), ptr(replay[k]),
                          ptr(replay[k + 1]))
                if not masks.every(t):
                    keep = masks.active[:, t].reshape(-1, *(1,) * (h.ndim - 1))
                    replay[k].copy_(torch.where(keep, replay[k], h))
                    replay[k + 1].copy_(torch.where(keep, replay[k + 1], c))
            else:
                replay[k].copy_(h)
                replay[k + 1].copy_(c)
            states.append((replay[k], replay[k + 1]))
        for t in reversed(range(start, stop)):
            h, c = masks.enter(xp, t, *states[t - start])
            g_h_new, g_c_new = _pick(bufs_h, g_h), _pick(bufs_c, g_c)
            d_x = writes.grad_slot(t, g_h)
            inactive = None if masks.every(t) else ~masks.active[:, t].reshape(
                -1, *(1,) * (h.ndim - 1))
            if masks.some(t):
                x = writes.volume(t)
                g_h_in, g_c_in = ((g_h, g_c) if inactive is None else
                                  (g_h.masked_fill(inactive, 0), g_c.masked_fill(inactive, 0)))
                cell.backward_step(ptr(x), x.stride(0), ptr(h), ptr(c), ptr(g_h_in),
                                   ptr(g_c_in), ptr(d_x), d_x.stride(0), ptr(g_h_new),
                                   ptr(g_c_new))
                if inactive is not None:  # their cotangent went past the update
                    g_h_new.add_(g_h.masked_fill(~inactive, 0))
                    g_c_new.add_(g_c.masked_fill(~inactive, 0))
            else:  # a read-only step: the state's cotangent passes, the write's is 0
                d_x.zero_()
                g_h_new.copy_(g_h)
                g_c_new.copy_(g_c)
            call(kernels, "read_bwd", ptr(h), offset(coords, t * n), steps * n,
                 offset(g_reads, t * c_), steps * c_, ptr(g_h_new),
                 offset(d_read_coords, t * n), steps * n, b, c_, n, cell.shape_arg)
            if masks.resets(t):
                zeroed = masks.reset[:, t].reshape(-1, *(1,) * (h.ndim - 1))
                g_h_new.masked_fill_(zeroed, 0)
                g_c_new.masked_fill_(zeroed, 0)
            writes.grad_done(t)
            g_h, g_c = g_h_new, g_c_new
    return ScanGrads(g_h, g_c, d_read_coords, writes.d_coords, writes.d_sigma,
                     writes.d_content, cell.param_grads())
