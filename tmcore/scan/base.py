"""The ONE scan loop: ``T`` chunk steps of any :class:`Step` forward, and their VJP backward.

A step says how one chunk reads, writes and updates the state ``(h, c)`` ``(B, C, *S)``; the
loop keeps what the backward needs by the step's ``policy``: ``"checkpoint"``, the state
entering every ``checkpoint_every``-th step, each segment replayed backward (the forward's
operations, so the same bits); ``"log"``, a per-step log stacked time-major (the local
undo log), nothing replayed. Writes do not depend on the state, so they are made
``WRITE_BLOCK`` steps at a time, folded into the batch. ``xs``: the steps' inputs, a
:class:`tmcore.StepInputs` or :class:`tmcore.scan.WarpInputs` of ``(B, T, ...)`` arrays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import array_api_compat

from tmcore.runtime.dispatch import ops_for
from tmcore.types import Residuals, device_of, host_values, traced

__all__ = ["WRITE_BLOCK", "Masks", "Step", "advance", "advance_vjp", "scan_backward",
           "scan_forward", "tree_add", "tree_map", "where_rows"]

#: Steps whose writes are made, and differentiated, in one call. Memory: two blocks of
#: written volumes at a time.
WRITE_BLOCK = 16


class Step(Protocol):
    """One chunk step, the protocol the loop drives. ``x``: one step's inputs (``(M, ...)``
    fields); ``W``: its write product, a function of ``x``'s write fields only (the written
    volume's cotangent ``g_W`` has its shape)."""

    #: ``"checkpoint"`` or ``"log"`` (see the module docstring)
    policy: str
    #: whether the backend's per-step scratch buffers may be reused from step to step
    #: (the step consumes each step's residuals before making the next one's)
    workspace: bool

    def write(self, xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
        """The write product of ``M`` rows of steps (``shape``: the grid)."""

    def write_vjp(self, xp: Any, x: Any, W: Any, g_W: Any) -> tuple[Any, Any, Any]:
        """``(d_write_coords (M, n), d_write_sigma (M,), d_write_content (M, C))``."""

    def advance(self, xp: Any, params: Any, h: Any, c: Any, x: Any, W: Any
                ) -> tuple[Any, Any, Any, Any]:
        """``(read (B, C), h', c', log)``: read the state before the write, then update."""

    def advance_vjp(self, xp: Any, params: Any, h: Any, c: Any, x: Any, W: Any, log: Any,
                    g_read: Any, g_h: Any, g_c: Any) -> tuple[Any, ...]:
        """``(g_h, g_c, d_read_coords (B, n), d_shift or None, g_W, d_params)`` from the state
        entering the step (``"checkpoint"``) or its log (``"log"``: ``h, c`` None)."""

    def own_state(self, xp: Any, h: Any, c: Any, overwrite: bool) -> tuple[Any, Any]:
        """The state the loop may update in place."""

    def own_cotangents(self, xp: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
        """The cotangents the backward may update in place."""

    def fused(self, xp: Any) -> tuple[Callable, Callable] | None:
        """A backend's fused ``(forward, backward)`` of the whole scan, or None."""


# --------------------------------------------------------------------------- pytrees


def tree_map(fn: Callable[..., Any], *trees: Any) -> Any:
    """``fn`` over the array leaves of tuples, lists and NamedTuples (``None`` stays)."""
    first = trees[0]
    if first is None:
        return None
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(tree_map(fn, *parts) for parts in zip(*trees, strict=True)))
    if isinstance(first, (tuple, list)):
        return type(first)(tree_map(fn, *parts) for parts in zip(*trees, strict=True))
    return fn(*trees)


def tree_add(a: Any, b: Any) -> Any:
    """The leaf-wise sum of two parameter trees (``a`` None: ``b``)."""
    return b if a is None else tree_map(lambda x, y: x + y, a, b)


def zero_if_none(xp: Any, h0: Any, c0: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
    """The final state's cotangents of a scan's VJP, ``None`` as zeros like ``h0, c0``."""
    return (xp.zeros_like(h0) if g_h is None else g_h,
            xp.zeros_like(c0) if g_c is None else g_c)


def read_point(xp: Any, h: Any, coords: Any) -> Any:
    """A step's read: ``h (B, C, *S)`` sampled at ``coords (B, n)``, ``(B, C)``."""
    return ops_for(xp).sample_fwd(xp, h, coords[:, None, :])[:, 0, :]


def read_point_vjp(xp: Any, h: Any, coords: Any, g: Any) -> tuple[Any, Any]:
    """VJP of :func:`read_point` for ``g (B, C)``: ``(d_h (B, C, *S), d_coords (B, n))``."""
    d_h, d_coords = ops_for(xp).sample_bwd(xp, h, coords[:, None, :], g[:, None, :])
    return d_h, d_coords[:, 0, :]


def read_then_update(step: Any, xp: Any, params: Any, h: Any, c: Any, x: Any, W: Any
                     ) -> tuple[Any, Any, Any, None]:
    """:meth:`Step.advance` of a step with ``update(xp, params, h, c, x, W) -> (h', c')``: read,
    then update (no log)."""
    return (read_point(xp, h, x.read_coords), *step.update(xp, params, h, c, x, W), None)


def read_then_update_vjp(step: Any, xp: Any, params: Any, h: Any, c: Any, x: Any, W: Any,
                         g_read: Any, g_h: Any, g_c: Any) -> tuple[Any, ...]:
    """:meth:`Step.advance_vjp` of :func:`read_then_update`, from the step's ``update_vjp(xp,
    params, h, c, x, W, g_h, g_c) -> (d_h, d_c, g_W, d_params)``."""
    d_h, d_c, g_W, d_params = step.update_vjp(xp, params, h, c, x, W, g_h, g_c)
    d_h_read, d_coords = read_point_vjp(xp, h, x.read_coords, g_read)
    return d_h + d_h_read, d_c, d_coords, None, g_W, d_params


def _step(xs: Any, t: int) -> Any:
    """Step ``t``'s inputs ``(B, ...)`` of batch-major ``xs (B, T, ...)``."""
    return tree_map(lambda a: a[:, t, ...], xs)


# --------------------------------------------------------------------------- writes


class _Writes:
    """The steps' write products, ``WRITE_BLOCK`` steps at a time folded into the batch, and their
    VJP once every step of a block has its cotangent; keeps the two latest blocks."""

    def __init__(self, xp: Any, step: Step, xs: Any, shape: tuple[int, ...]) -> None:
        self.xp, self.step, self.xs, self.shape = xp, step, xs, shape
        self.batch, self.steps = xs.read_coords.shape[:2]
        self.blocks: dict[int, Any] = {}
        self.pending: dict[int, dict[int, Any]] = {}
        self.done: dict[int, tuple[Any, Any, Any]] = {}

    def _span(self, index: int) -> tuple[int, int]:
        return index * WRITE_BLOCK, min((index + 1) * WRITE_BLOCK, self.steps)

    def _rows(self, index: int) -> Any:
        """The block's inputs with its steps folded into the batch: ``(B K, ...)``."""
        start, stop = self._span(index)
        xp, rows = self.xp, self.batch * (stop - start)
        return tree_map(lambda a: xp.reshape(a[:, start:stop, ...], (rows, *a.shape[2:])),
                        self.xs)

    def _block(self, index: int) -> Any:
        """The block's write product, folded: leading axis ``B K`` (row ``b K + k``)."""
        if index not in self.blocks:
            if len(self.blocks) >= 2:
                self.blocks.pop(next(iter(self.blocks)))
            self.blocks[index] = self.step.write(self.xp, self._rows(index), self.shape)
        return self.blocks[index]

    def __getitem__(self, t: int) -> Any:
        index = t // WRITE_BLOCK
        start, stop = self._span(index)
        k, length = t - start, stop - start
        return tree_map(lambda a: a[k::length, ...], self._block(index))

    def add_grad(self, t: int, g: Any) -> None:
        index = t // WRITE_BLOCK
        grads = self.pending.setdefault(index, {})
        grads[t] = g
        start, stop = self._span(index)
        if len(grads) < stop - start:
            return
        xp, batch, length = self.xp, self.batch, stop - start
        g_rows = xp.stack([grads[k] for k in range(start, stop)], axis=1)  # (B, K, ...)
        g_rows = xp.reshape(g_rows, (batch * length, *g_rows.shape[2:]))
        d_mu, d_sigma, d_content = self.step.write_vjp(xp, self._rows(index),
                                                       self._block(index), g_rows)
        self.done[index] = tuple(xp.reshape(d, (batch, length, *d.shape[1:]))
                                 for d in (d_mu, d_sigma, d_content))
        del self.pending[index]
        self.blocks.pop(index, None)

    def grads(self) -> tuple[Any, Any, Any]:
        blocks = [self.done[i] for i in sorted(self.done)]
        return tuple(self.xp.concat([b[k] for b in blocks], axis=1) for k in range(3))


class _Stacker:
    """``count`` arrays like ``like`` stacked along ``axis``, each copied into a preallocated array
    as it arrives (a list then ``stack`` holds every state twice at the peak); immutable arrays
    (JAX) or a transform refusing the assignment (vmap) fall back to ``stack``."""

    def __init__(self, xp: Any, like: Any, count: int, axis: int = 0) -> None:
        self.xp, self.index, self.pending, self.axis = xp, 0, [], axis
        self.buffer = None
        if not array_api_compat.is_jax_namespace(xp):
            shape = (*like.shape[:axis], count, *like.shape[axis:])
            self.buffer = xp.empty(shape, dtype=like.dtype, device=device_of(like))

    def _at(self, index: int) -> tuple:
        return (slice(None),) * self.axis + (index, ...)

    def append(self, value: Any) -> None:
        if self.buffer is not None and value.dtype == self.buffer.dtype:
            try:
                self.buffer[self._at(self.index)] = value
                self.index += 1
                return
            except (TypeError, RuntimeError):  # immutable, or a transform refusing it
                pass
        if self.buffer is not None:  # from here on: a list (dtypes promote as in stack)
            self.pending = [self.buffer[self._at(i)] for i in range(self.index)]
            self.buffer = None
        self.pending.append(value)

    def result(self) -> Any:
        return self.buffer if self.buffer is not None else self.xp.stack(self.pending,
                                                                         axis=self.axis)


def _workspace(xp: Any, step: Step) -> contextlib.AbstractContextManager:
    return ops_for(xp).workspace(xp) if step.workspace else contextlib.nullcontext()


# --------------------------------------------------------------------------- masks


def where_rows(xp: Any, mask: Any, a: Any, b: Any) -> Any:
    """``a`` in the rows where the bool array ``mask (B,)`` is True, else ``b``."""
    return xp.where(xp.reshape(mask, (mask.shape[0],) + (1,) * (a.ndim - 1)), a, b)


class Masks:
    """A scan's per-step row masks ``reset`` / ``active``, bool ``(B, T)`` or None (their meaning:
    :func:`tmcore.memory_scan`); the per-step flags are read on the host once (eager loops)."""

    def __init__(self, xp: Any, reset: Any, active: Any) -> None:
        self.reset, self.active = reset, active
        self._resets = self._some = self._every = None
        if traced(reset) or traced(active):  # (JAX's scan: every step applies its masks)
            return
        if reset is not None:
            self._resets = host_values(xp.any(reset, axis=0))
        if active is not None:
            self._some = host_values(xp.any(active, axis=0))
            self._every = host_values(xp.all(active, axis=0))

    def resets(self, t: int) -> bool:
        """Whether some row's state is zeroed entering step ``t``."""
        return self.reset is not None and (self._resets is None or bool(self._resets[t]))

    def some(self, t: int) -> bool:
        """Whether some row keeps step ``t``'s update (else the step only reads)."""
        return self.active is None or self._some is None or bool(self._some[t])

    def every(self, t: int) -> bool:
        """Whether every row keeps step ``t``'s update."""
        return self.active is None or (self._every is not None and bool(self._every[t]))

    def enter(self, xp: Any, t: int, h: Any, c: Any) -> tuple[Any, Any]:
        """The state step ``t`` runs on: ``h, c`` with the reset rows zeroed."""
        if not self.resets(t):
            return h, c
        keep = ~self.reset[:, t]
        return where_rows(xp, keep, h, xp.zeros_like(h)), where_rows(xp, keep, c, xp.zeros_like(c))


def advance(xp: Any, step: Step, params: Any, masks: Masks, t: int, h: Any, c: Any, x: Any,
             W: Any) -> tuple[Any, Any, Any, Any]:
    """Step ``t`` under the masks from its entering state: ``(read, h', c', log)``."""
    h, c = masks.enter(xp, t, h, c)
    if not masks.some(t) and step.policy == "checkpoint":  # no row keeps the update
        return read_point(xp, h, x.read_coords), h, c, None
    if masks.every(t):
        return step.advance(xp, params, h, c, x, W)
    run_h, run_c = step.own_state(xp, h, c, False)  # (a step updating in place: copies)
    read, new_h, new_c, log = step.advance(xp, params, run_h, run_c, x, W)
    keep = masks.active[:, t]
    return read, where_rows(xp, keep, new_h, h), where_rows(xp, keep, new_c, c), log


def advance_vjp(xp: Any, step: Step, params: Any, masks: Masks, t: int, h: Any, c: Any,
                 x: Any, W: Any, log: Any, g_read: Any, g_h: Any, g_c: Any
                 ) -> tuple[Any, ...]:
    """VJP of :func:`advance` from the state entering step ``t``, before its reset (None for a
    ``"log"`` step): an inactive row's cotangent goes past the update, a reset row's stops."""
    if h is not None:
        h, c = masks.enter(xp, t, h, c)
    if masks.every(t):
        out = step.advance_vjp(xp, params, h, c, x, W, log, g_read, g_h, g_c)
    else:
        keep = masks.active[:, t]
        out = step.advance_vjp(xp, params, h, c, x, W, log, g_read,
                               where_rows(xp, keep, g_h, xp.zeros_like(g_h)),
                               where_rows(xp, keep, g_c, xp.zeros_like(g_c)))
        out = (where_rows(xp, keep, out[0], out[0] + g_h),
               where_rows(xp, keep, out[1], out[1] + g_c), *out[2:])
    if masks.resets(t):
        keep = ~masks.reset[:, t]
        out = (where_rows(xp, keep, out[0], xp.zeros_like(out[0])),
               where_rows(xp, keep, out[1], xp.zeros_like(out[1])), *out[2:])
    return out


# --------------------------------------------------------------------------- the loop


def scan_forward(xp: Any, step: Step, params: Any, h0: Any, c0: Any, xs: Any, *,
                 checkpoint_every: int = 1, keep: bool = True, overwrite_state: bool = False,
                 reset: Any = None, active: Any = None
                 ) -> tuple[Any, Any, Any, Residuals | None]:
    """Run ``step`` over the ``T`` chunks of ``xs`` under the masks; no validation.

    ``h0, c0 (B, C, *S)`` are updated in place only with ``overwrite_state`` (by a step that
    can); ``keep=False`` keeps no residuals. Returns ``(reads (B, T, C), h_T, c_T,
    residuals)``; the checkpoints are the states entering steps ``0, k, 2k, ...``, before or
    after their resets (the replays reset them).
    """
    fused = step.fused(xp)
    if fused is not None:  # a backend's whole-scan kernels (may decline: None)
        out = fused[0](xp, params, h0, c0, xs, checkpoint_every, keep, overwrite_state,
                       reset, active)
        if out is not None:
            return out
    steps = xs.read_coords.shape[1]
    masks = Masks(xp, reset, active)
    writes = _Writes(xp, step, xs, tuple(h0.shape[2:]))
    checkpoint = keep and step.policy == "checkpoint"
    if checkpoint:
        saved = -(-steps // checkpoint_every)
        h_saved, c_saved = _Stacker(xp, h0, saved), _Stacker(xp, c0, saved)
    h, c = step.own_state(xp, h0, c0, overwrite_state)
    reads = logs = None
    with _workspace(xp, step):
        for t in range(steps):
            if checkpoint and t % checkpoint_every == 0:
                h_saved.append(h)
                c_saved.append(c)
            read, h, c, log = advance(xp, step, params, masks, t, h, c, _step(xs, t),
                                       writes[t])
            if reads is None:  # (B, T, C), preallocated once the reads' dtype is known
                reads = _Stacker(xp, read, steps, axis=1)
            reads.append(read)
            if keep and log is not None:
                logs = [[] for _ in log] if logs is None else logs
                for kept, part in zip(logs, log, strict=True):
                    kept.append(part)
    if not keep:
        return reads.result(), h, c, None
    if checkpoint:
        return reads.result(), h, c, Residuals(h_saved.result(), c_saved.result(), None)
    return reads.result(), h, c, Residuals(None, None, tuple(xp.stack(p) for p in logs))


def scan_backward(xp: Any, step: Step, params: Any, residuals: Residuals, xs: Any,
                  g_reads: Any, g_h: Any, g_c: Any, *, checkpoint_every: int = 1,
                  reset: Any = None, active: Any = None) -> tuple[Any, Any, Any, Any]:
    """VJP of :func:`scan_forward` (same ``step, params, xs, checkpoint_every``, masks) from its
    residuals; no validation. ``g_reads (B, T, C)``, ``g_h, g_c (B, C, *S)`` (not modified);
    returns ``(d_h0, d_c0, d_xs, d_params)``."""
    fused = step.fused(xp)
    if fused is not None:
        out = fused[1](xp, params, residuals, xs, g_reads, g_h, g_c, checkpoint_every, reset,
                       active)
        if out is not None:
            return out
    steps = xs.read_coords.shape[1]
    masks = Masks(xp, reset, active)
    writes = _Writes(xp, step, xs, tuple(g_h.shape[2:]))
    d_read: list[Any] = [None] * steps
    d_extra: list[Any] = [None] * steps
    d_params = None
    g_h, g_c = step.own_cotangents(xp, g_h, g_c)
    states: list[Any] = []
    with _workspace(xp, step):
        for t in reversed(range(steps)):
            x = _step(xs, t)
            if step.policy == "checkpoint":
                if not states:  # the segment of t: replay it from its checkpoint
                    start = t - t % checkpoint_every
                    states = [(residuals.h[start // checkpoint_every, ...],
                               residuals.c[start // checkpoint_every, ...])]
                    for u in range(start, t):
                        _, h, c, _ = advance(xp, step, params, masks, u, *states[-1],
                                              _step(xs, u), writes[u])
                        states.append((h, c))
                (h, c), log = states.pop(), None
            else:
                h = c = None
                log = tuple(part[t, ...] for part in residuals.log)
            g_h, g_c, d_read[t], d_extra[t], g_W, step_params = advance_vjp(
                xp, step, params, masks, t, h, c, x, writes[t], log, g_reads[:, t, ...], g_h,
                g_c)
            writes.add_grad(t, g_W)
            d_params = tree_add(d_params, step_params)
    d_fields = (xp.stack(d_read, axis=1), *writes.grads())
    if d_extra[0] is not None:  # a warp's shift
        d_fields += (xp.stack(d_extra, axis=1),)
    return g_h, g_c, type(xs)(*d_fields), d_params
