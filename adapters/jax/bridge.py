"""tmcore's primitives for JAX: ``custom_vjp`` wrappers and ONE checkpointed scan.

Everything the JAX adapter differentiates goes through here:

- :func:`sample` / :func:`splat` -- ``jax.custom_vjp`` around tmcore's forward
  and hand-written VJP (``ops_for(jnp)``: a backend fast path or the generic one).
- :func:`checkpoint_scan` -- the chunk recurrence of any
  :class:`tmcore.scan.Step` (dense, local, warped) as ONE ``lax.scan`` with a
  ``custom_vjp``: the JAX bridge of :mod:`tmcore.scan.base`. A ``"checkpoint"`` step
  keeps every ``checkpoint_every``-th state and replays each segment in the backward;
  a ``"log"`` step (the local update's undo log) keeps its per-step log. It compiles
  once whatever the number of chunks (nothing is unrolled). Optional per-step, per-row
  masks (packed documents under ``jit``): ``reset (T, B)`` zeroes a row's state entering
  a step, ``active (T, B)`` False leaves it as it was after the step; both are inputs of
  the same one scan, and their VJPs select the cotangents.

Compiled functions are keyed by :func:`tmcore.get_options` (``native``,
``generic``, ...), so an option changed after a first call, or set differently
in another thread, gets its own trace instead of reusing a cached one.

Sharding: every carry of both scans is cast to the union of the inputs'
varying manual axes (``shard_map`` with ``check_vma=True``); the cast happens
before the ``custom_vjp``, so JAX transposes it into the ``psum`` that
replicated inputs (parameters) need.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tmcore.backends.jax import explicit_batch_axes, match_vma
from tmcore.backends.jax import forward_mode_guard as _guard
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.options import Options, get_options
from tmcore.runtime.validate import check_int, check_positive, check_values
from tmcore.scan.base import Masks, Step, advance, advance_vjp
from tmcore.scan.options import check_scan_bytes

__all__ = ["LayerScan", "ScanStatic", "checkpoint_scan", "forward_mode_guard", "match_vma",
           "options_key", "sample", "splat"]


def options_key() -> Options:
    """The options a trace depends on (a static, hashable ``jit`` argument)."""
    return get_options()


def forward_mode_guard(what: str, call: Callable[[], Any]) -> Any:
    """``call()``, with JAX's bare custom_vjp forward-mode error turned into tmcore's,
    naming ``what`` (:func:`tmcore.backends.jax.forward_mode_guard`)."""
    return _guard(call, what)


# --------------------------------------------------------------------------- primitives


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _sample(volume, coords, options):
    return ops_for(jnp).sample_fwd(jnp, volume, coords)


def _sample_fwd(volume, coords, options):
    return _sample(volume, coords, options), (volume, coords)


def _sample_bwd(options, residuals, g):
    volume, coords = residuals
    return tuple(ops_for(jnp).sample_bwd(jnp, volume, coords, jnp.asarray(g)))


_sample.defvjp(_sample_fwd, _sample_bwd)
# jit: eager calls compile once per shape and options; under an outer jit they inline
_sample_jit = jax.jit(_sample, static_argnums=(2,))


def sample(volume: jax.Array, coords: jax.Array) -> jax.Array:
    """Trilinear read ``(B, C, *S), (B, Q, n) -> (B, Q, C)``; no validation."""
    return _sample_jit(volume, coords, options_key())


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _splat(content, mu, sigma, shape, eps, radius, options):
    return ops_for(jnp).splat_fwd(jnp, content, mu, sigma, shape, eps, radius)


def _splat_fwd(content, mu, sigma, shape, eps, radius, options):
    return _splat(content, mu, sigma, shape, eps, radius, options), (content, mu, sigma)


def _splat_bwd(shape, eps, radius, options, residuals, g):
    content, mu, sigma = residuals
    return tuple(ops_for(jnp).splat_bwd(jnp, content, mu, sigma, shape, jnp.asarray(g), eps,
                                        radius))


_splat.defvjp(_splat_fwd, _splat_bwd)
_splat_jit = jax.jit(_splat, static_argnums=(3, 4, 5, 6))


def splat(content: jax.Array, mu: jax.Array, sigma: jax.Array, shape: tuple[int, ...],
          eps: float, radius: float | None) -> jax.Array:
    """Gaussian write ``-> (B, C, *shape)``; no validation; ``shape, eps, radius`` static."""
    return _splat_jit(content, mu, sigma, shape, eps, radius, options_key())


# --------------------------------------------------------------------------- the scan


class ScanStatic(NamedTuple):
    """The scan's static configuration (hashable: a ``jit`` / ``nondiff`` argument)."""

    step: Step
    checkpoint_every: int
    options: Options


def _zeros(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: x + y, a, b)


def _step_masks(item: Any) -> tuple[Any, Masks]:
    """A scan item's inputs and its step's masks (``(B, 1)``: step 0 of :class:`Masks`)."""
    if not isinstance(item, _Masked):
        return item, _NO_MASKS
    reset_t, active_t = item.masks
    return item.xs, Masks(jnp, reset_t[:, None], active_t[:, None])


def _forward_step(static: ScanStatic, params: Any, carry: tuple, item: Any):
    """One step of :func:`tmcore.scan.base.scan_forward` (the masks' semantics included)."""
    h, c = carry
    x_t, masks = _step_masks(item)
    W = static.step.write(jnp, x_t, tuple(h.shape[2:]))
    read, h, c, log = advance(jnp, static.step, params, masks, 0, h, c, x_t, W)
    return (h, c), (read, log)


def _vjp_step(static: ScanStatic, params: Any, carry: tuple, item: tuple):
    """One step's VJP: ``carry = (g_h, g_c, d_params)``; ``item = (h, c, inputs, log,
    g_read)`` (``h, c``: the state entering the step; None for a ``"log"`` step)."""
    g_h, g_c, d_params = carry
    h, c, inputs, log, g_read = item
    x_t, masks = _step_masks(inputs)
    step = static.step
    W = step.write(jnp, x_t, tuple(g_h.shape[2:]))
    g_h, g_c, d_read, d_extra, g_W, step_params = advance_vjp(
        jnp, step, params, masks, 0, h, c, x_t, W, log, g_read, g_h, g_c)
    d_x = type(x_t)(d_read, *step.write_vjp(jnp, x_t, W, g_W),
                    *(() if d_extra is None else (d_extra,)))
    return (g_h, g_c, _add(d_params, step_params)), d_x


def _segments(xs: Any, every: int) -> tuple[int, int, int]:
    """``(k, full segments, tail steps)`` of time-major ``xs``, a checkpoint every ``every``."""
    steps = jax.tree.leaves(xs)[0].shape[0]
    k = max(1, min(every, steps))
    return k, steps // k, steps % k


def _split(xs: Any, full: int, k: int) -> tuple[Any, Any]:
    """Time-major ``xs`` -> ``(xs of the full segments [full, k, ...], tail [r, ...])``."""
    head = jax.tree.map(lambda a: jnp.reshape(a[: full * k], (full, k, *a.shape[1:])), xs)
    tail = jax.tree.map(lambda a: a[full * k :], xs)
    return head, tail


def _join(head: Any, tail: Any, tail_steps: int) -> Any:
    """Inverse of :func:`_split` for per-step outputs ``[full, k, ...]`` and ``[r, ...]``."""
    def flat(a):
        return jnp.reshape(a, (a.shape[0] * a.shape[1], *a.shape[2:]))

    if not tail_steps:
        return jax.tree.map(flat, head)
    return jax.tree.map(lambda a, b: jnp.concatenate([flat(a), b], axis=0), head, tail)


_NO_MASKS = Masks(jnp, None, None)


class _Masked(NamedTuple):
    """What a masked scan steps through: its inputs and its masks ``(reset, active)``."""

    xs: Any
    masks: Any


def _items(xs: Any, masks: Any) -> Any:
    """What the scans step through: ``xs``, or ``(xs, masks)``; the residual keeps it,
    so the backward knows whether the forward was masked."""
    return xs if masks is None else _Masked(xs, masks)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(static: ScanStatic, params, xs, h0, c0, masks):
    (h, c), (reads, _) = lax.scan(partial(_forward_step, static, params), (h0, c0),
                                  _items(xs, masks))
    return reads, h, c


def _scan_fwd(static: ScanStatic, params, xs, h0, c0, masks=None):
    step = partial(_forward_step, static, params)
    items = _items(xs, masks)
    if static.step.policy == "log":  # the per-step log is the residual
        (h, c), (reads, logs) = lax.scan(step, (h0, c0), items)
        return (reads, h, c), (params, items, logs, None)
    k, full, tail = _segments(xs, static.checkpoint_every)
    if k == 1:  # every state is a checkpoint: one flat scan, no segments
        def keep(carry, x_t):
            end, (read, _) = step(carry, x_t)
            return end, (read, carry)

        (h, c), (reads, states) = lax.scan(keep, (h0, c0), items)
        return (reads, h, c), (params, items, states, None)

    def segment(carry, xs_segment):
        end, (reads, _) = lax.scan(step, carry, xs_segment)
        return end, (reads, carry)  # the checkpoint: the state entering the segment

    items_head, items_tail = _split(items, full, k)
    carry, (reads_head, checkpoints) = lax.scan(segment, (h0, c0), items_head)
    tail_start, reads_tail = carry, None
    if tail:
        carry, (reads_tail, _) = lax.scan(step, carry, items_tail)
    reads = _join(reads_head, reads_tail, tail)
    return (reads, *carry), (params, items, checkpoints, tail_start if tail else None)


def _segment_bwd(static: ScanStatic, params, start, items_segment, g_segment, carry):
    """Replay one segment from its checkpoint ``start``, then differentiate it backwards
    (``items_segment``: the steps' inputs, with their masks when ``masked``)."""
    length = jax.tree.leaves(items_segment)[0].shape[0]
    h0, c0 = start
    if length > 1:  # the states entering steps 1 .. length-1 (step 0's is the checkpoint)
        _, (hs, cs) = lax.scan(lambda s, x: (_forward_step(static, params, s, x)[0],) * 2,
                               start, jax.tree.map(lambda a: a[: length - 1], items_segment))
        hs = jnp.concatenate([h0[None], hs], axis=0)
        cs = jnp.concatenate([c0[None], cs], axis=0)
    else:
        hs, cs = h0[None], c0[None]
    return lax.scan(partial(_vjp_step, static, params), carry,
                    (hs, cs, items_segment, None, g_segment), reverse=True)


def _scan_bwd(static: ScanStatic, residuals, cotangents):
    params, items, kept, tail_start = residuals
    xs = items.xs if isinstance(items, _Masked) else items
    g_reads, g_h, g_c = (jnp.asarray(g) for g in cotangents)
    carry = match_vma((g_h, g_c, _zeros(params)), xs)[0]  # cotangents may come in unvarying
    body = partial(_vjp_step, static, params)
    if static.step.policy == "log":
        (d_h0, d_c0, d_params), d_xs = lax.scan(body, carry, (None, None, items, kept, g_reads),
                                                reverse=True)
        return d_params, d_xs, d_h0, d_c0, None
    k, full, tail = _segments(xs, static.checkpoint_every)
    if k == 1:
        (d_h0, d_c0, d_params), d_xs = lax.scan(body, carry, (*kept, items, None, g_reads),
                                                reverse=True)
        return d_params, d_xs, d_h0, d_c0, None
    items_head, items_tail = _split(items, full, k)
    g_head, g_tail = _split(g_reads, full, k)
    d_tail = None
    if tail:
        carry, d_tail = _segment_bwd(static, params, tail_start, items_tail, g_tail, carry)

    def segment(carry, item):
        h, c, items_segment, g_segment = item
        return _segment_bwd(static, params, (h, c), items_segment, g_segment, carry)

    carry, d_head = lax.scan(segment, carry, (*kept, items_head, g_head), reverse=True)
    d_h0, d_c0, d_params = carry
    return d_params, _join(d_head, d_tail, tail), d_h0, d_c0, None


_scan.defvjp(_scan_fwd, _scan_bwd)
_scan_jit = jax.jit(_scan, static_argnums=(0,))


def checkpoint_scan(static: ScanStatic, params: Any, xs: Any, h0: jax.Array, c0: jax.Array,
                    masks: tuple[jax.Array, jax.Array] | None = None
                    ) -> tuple[Any, jax.Array, jax.Array]:
    """Run ``static.step`` over the leading (time) axis of ``xs``; no validation.

    ``h0, c0 (B, C, *S)``; ``params`` the step's parameters (the gates'
    :class:`tmcore.ConvParams`, or a :class:`tmcore.scan.WarpParams`); ``xs`` the step
    inputs, time-major ``(T, B, ...)``. ``masks``: optional bool ``(reset, active)``,
    each ``(T, B)``: before step ``t`` the rows ``reset[t]`` are zeroed; after it the rows
    not ``active[t]`` get back the state they entered it with (their read is made).
    Returns ``(reads (T, B, C), h_T, c_T)``.
    """
    check_int("checkpoint_every", static.checkpoint_every, 1)
    axes = explicit_batch_axes(h0)
    if axes is not None:
        return _per_shard(static, axes, params, xs, h0, c0, masks)
    params, xs, h0, c0, masks = match_vma(params, xs, h0, c0, masks)
    return _scan_jit(static, params, xs, h0, c0, masks)


def _per_shard(static: ScanStatic, axes: tuple[str, ...], params, xs, h0, c0, masks=None):
    """The scan on an explicit mesh whose ``axes`` shard the batch: each device scans its
    rows (an internal ``shard_map``); the parameters are replicated and their
    gradients summed over ``axes`` (the transpose of the replication). Without it,
    the parameter gradients' products over the sharded batch are ambiguous there."""
    mesh = jax.typeof(h0).sharding.mesh
    replicated = P()

    def replicate(leaf):
        spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
        return jax.reshard(leaf, replicated) if spec and any(s is not None for s in spec) \
            else leaf

    params = jax.tree.map(replicate, params)
    batch, steps_batch = P(axes), P(None, axes)

    def local(params_, xs_, h_, c_, *masks_):
        return checkpoint_scan(static, params_, xs_, h_, c_, *masks_)

    # the masks (T, B) each, sharded like the inputs (a grid's masks may be made replicated)
    steps_rows = jax.sharding.NamedSharding(mesh, steps_batch)
    extra = () if masks is None else (jax.tree.map(lambda m: jax.reshard(m, steps_rows),
                                                   masks),)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(replicated, steps_batch, batch, batch,
                                   *((steps_batch,) * len(extra))),
                         out_specs=(steps_batch, batch, batch),
                         axis_names=set(axes))(params, xs, h0, c0, *extra)


class LayerScan(NamedTuple):
    """The layer's :class:`tmcore.layer.Scan` over :func:`checkpoint_scan`: any step, its
    parameters and checkpoint interval; ``inputs`` and the masks batch-major."""

    step: Step
    params: Any
    checkpoint_every: int = 1

    def __call__(self, h: jax.Array, c: jax.Array, inputs: Any, *, reset: Any = None,
                 active: Any = None) -> tuple[Any, Any, Any]:
        # validate mode: the heads' outputs, where concrete (a NaN token or head weight is
        # reported as the output it poisons, as the torch layer's scan reports it)
        check_values(jnp, inputs._asdict())
        check_positive(jnp, "write_sigma", inputs.write_sigma)
        # before anything is allocated: what a backward keeps and the step's working set
        # fit (a jitted function cannot know whether it will be differentiated)
        flow = getattr(self.params, "flow", None) is not None
        every = check_int("checkpoint_every", self.checkpoint_every, 1)
        check_scan_bytes(jnp, self.step, h, int(jax.tree.leaves(inputs)[0].shape[1]),
                         every, True, flow)
        xs = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), inputs)
        static = ScanStatic(self.step, self.checkpoint_every, options_key())
        masks = None
        if reset is not None or active is not None:  # per-step masks, time-major (T, B)
            grid = jax.tree.leaves(inputs)[0].shape[:2]  # (B, T)
            masks = (jnp.moveaxis(jnp.zeros(grid, bool) if reset is None else reset, 1, 0),
                     jnp.moveaxis(jnp.ones(grid, bool) if active is None else active, 1, 0))
        reads, h, c = checkpoint_scan(static, self.params, xs, h, c, masks)
        return jnp.moveaxis(reads, 0, 1), h, c
