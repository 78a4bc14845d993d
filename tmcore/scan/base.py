"""The ONE scan loop: ``T`` chunk steps forward, and their VJP backward, for any :class:`Step`.

A step (:mod:`tmcore.scan.dense`, :mod:`tmcore.scan.local`, :mod:`tmcore.scan.warped`)
says how one chunk reads, writes and updates the state ``(h, c)`` of shape
``(B, C, *S)``, and how it is differentiated; this module runs it over the ``T`` chunks
and keeps what the backward needs, by the step's residual policy:

- ``"checkpoint"``: the state entering every ``checkpoint_every``-th step,
  ``ceil(T / k)`` states; the backward replays each segment from its checkpoint (the
  forward's operations, so the same bits) and then runs each step's VJP in reverse;
- ``"log"``: a per-step log the step returns (the local update's undo log: the boxes
  it overwrote), stacked time-major; the backward replays nothing.

Writes do not depend on the state, so they are made ``WRITE_BLOCK`` steps at a time,
with the steps folded into the batch (one call instead of one per step), and their VJP
likewise. A backend may run a step's whole scan in fused kernels (:meth:`Step.fused`:
the ``scan_fwd`` / ``local_scan_fwd`` entries of its :class:`~tmcore.runtime.dispatch.Ops`
table), with the same residuals; it declines with ``None``.

The framework bridges drive the same steps: ``tmcore.adapters.torch`` registers this
loop as one custom op per step kind, ``tmcore.adapters.jax`` runs the steps in one
checkpointed ``lax.scan``.

Sizes: ``B`` batch, ``C`` channels, ``S`` the grid, ``T`` steps; ``xs`` is the step's
inputs (a :class:`~tmcore.scan.dense.StepInputs` or
:class:`~tmcore.scan.warped.WarpInputs`) of ``(B, T, ...)`` arrays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import array_api_compat

from tmcore.runtime.dispatch import ops_for
from tmcore.types import Residuals, device_of

__all__ = ["WRITE_BLOCK", "Step", "scan_backward", "scan_forward", "tree_add",
           "tree_map"]

#: Steps whose writes are made, and differentiated, in one call. Memory: two blocks of
#: written volumes at a time.
WRITE_BLOCK = 16


class Step(Protocol):
    """One chunk step: the protocol :func:`scan_forward` / :func:`scan_backward` drive.

    ``x`` is one step's inputs (the ``xs`` type with ``(M, ...)`` fields); ``W`` its
    write product (a function of ``x``'s write fields only; the differentiable part is
    its written volume, whose cotangent ``g_W`` is an array of the volume's shape).
    """

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
        """``(g_h, g_c, d_read_coords (B, n), d_shift or None, g_W, d_params)`` from the
        state entering the step (``"checkpoint"``) or its log (``"log"``; ``h, c``
        None)."""

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
    """:meth:`Step.advance` of a step that reads, then runs its ``update(xp, params, h, c,
    x, W) -> (h', c')`` (no log)."""
    return (read_point(xp, h, x.read_coords), *step.update(xp, params, h, c, x, W), None)


def read_then_update_vjp(step: Any, xp: Any, params: Any, h: Any, c: Any, x: Any, W: Any,
                         g_read: Any, g_h: Any, g_c: Any) -> tuple[Any, ...]:
    """:meth:`Step.advance_vjp` of :func:`read_then_update`, from the step's
    ``update_vjp(xp, params, h, c, x, W, g_h, g_c) -> (d_h, d_c, g_W, d_params)``."""
    d_h, d_c, g_W, d_params = step.update_vjp(xp, params, h, c, x, W, g_h, g_c)
    d_h_read, d_coords = read_point_vjp(xp, h, x.read_coords, g_read)
    return d_h + d_h_read, d_c, d_coords, None, g_W, d_params


def _step(xs: Any, t: int) -> Any:
    """Step ``t``'s inputs ``(B, ...)`` of batch-major ``xs (B, T, ...)``."""
    return tree_map(lambda a: a[:, t, ...], xs)


# --------------------------------------------------------------------------- writes


class _Writes:
    """The steps' write products, made ``WRITE_BLOCK`` steps at a time (folded into the
    batch), and their VJP once every step of a block has its cotangent. Keeps the two
    most recent blocks."""

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
    """Collects ``count`` arrays shaped like ``like`` into one, stacked along ``axis``.

    Where arrays support item assignment (NumPy, PyTorch, CuPy, array-api-strict) each
    array is copied into a preallocated one as it arrives, so nothing is held twice (a
    list-then-``stack`` holds every state twice at the peak); immutable arrays (JAX),
    or a transform refusing the assignment (vmap), fall back to ``stack``.
    """

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


# --------------------------------------------------------------------------- the loop


def scan_forward(xp: Any, step: Step, params: Any, h0: Any, c0: Any, xs: Any, *,
                 checkpoint_every: int = 1, keep: bool = True, overwrite_state: bool = False
                 ) -> tuple[Any, Any, Any, Residuals | None]:
    """Run ``step`` over the ``T`` chunks of ``xs``; no validation.

    Parameters
    ----------
    xp : namespace
        The arrays' namespace.
    step : Step
        The chunk step.
    params : pytree of arrays
        The step's parameters (the gate conv's :class:`~tmcore.ConvParams`, ...).
    h0, c0 : array, shape ``(B, C, *S)``
        The state entering the first step (not modified unless ``overwrite_state``).
    xs : StepInputs or WarpInputs of ``(B, T, ...)`` arrays
        The steps' inputs.
    checkpoint_every : int, default 1
        ``"checkpoint"`` policy: keep the state entering every ``k``-th step.
    keep : bool, default True
        Keep the residuals (``False``: none, no gradient will be asked for).
    overwrite_state : bool, default False
        A step that updates in place may update ``h0, c0`` themselves.

    Returns
    -------
    reads : array, shape ``(B, T, C)``
        What each step read, from the state before its write.
    h_T, c_T : array, shape ``(B, C, *S)``
        The final state.
    residuals : Residuals or None
        What :func:`scan_backward` needs (``None`` without ``keep``).
    """
    fused = step.fused(xp)
    if fused is not None:  # a backend's whole-scan kernels (may decline: None)
        out = fused[0](xp, params, h0, c0, xs, checkpoint_every, keep, overwrite_state)
        if out is not None:
            return out
    steps = xs.read_coords.shape[1]
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
            read, h, c, log = step.advance(xp, params, h, c, _step(xs, t), writes[t])
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
                  g_reads: Any, g_h: Any, g_c: Any, *, checkpoint_every: int = 1
                  ) -> tuple[Any, Any, Any, Any]:
    """The VJP of :func:`scan_forward` from its residuals; no validation.

    Parameters
    ----------
    xp, step, params, xs, checkpoint_every : see scan_forward
        As in the forward that made ``residuals``.
    residuals : Residuals
        :func:`scan_forward`'s.
    g_reads : array, shape ``(B, T, C)``
        The cotangent of the reads.
    g_h, g_c : array, shape ``(B, C, *S)``
        The cotangents of the final state (not modified).

    Returns
    -------
    d_h0, d_c0 : array, shape ``(B, C, *S)``
        The gradients for the initial state.
    d_xs : the type of ``xs``, of ``(B, T, ...)`` arrays
        The gradients for the steps' inputs.
    d_params : the type of ``params``
        The gradients for the parameters.
    """
    fused = step.fused(xp)
    if fused is not None:
        out = fused[1](xp, params, residuals, xs, g_reads, g_h, g_c, checkpoint_every)
        if out is not None:
            return out
    steps = xs.read_coords.shape[1]
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
                        _, h, c, _ = step.advance(xp, params, *states[-1], _step(xs, u),
                                                  writes[u])
                        states.append((h, c))
                (h, c), log = states.pop(), None
            else:
                h = c = None
                log = tuple(part[t, ...] for part in residuals.log)
            g_h, g_c, d_read[t], d_extra[t], g_W, step_params = step.advance_vjp(
                xp, params, h, c, x, writes[t], log, g_reads[:, t, ...], g_h, g_c)
            writes.add_grad(t, g_W)
            d_params = tree_add(d_params, step_params)
    d_fields = (xp.stack(d_read, axis=1), *writes.grads())
    if d_extra[0] is not None:  # a warp's shift
        d_fields += (xp.stack(d_extra, axis=1),)
    return g_h, g_c, type(xs)(*d_fields), d_params

