"""tmcore's primitives for JAX: ``custom_vjp`` wrappers and ONE checkpointing scan.

Everything the JAX adapter differentiates goes through here:

- :func:`sample` / :func:`splat` -- ``jax.custom_vjp`` around tmcore's forward
  and hand-written VJP (``ops_for(jnp)``: a backend fast path or the generic one).
- :func:`checkpoint_scan` -- the chunk recurrence as ``lax.scan`` with a
  ``custom_vjp`` whose backward keeps only every ``checkpoint_every``-th state
  and replays each segment, like :func:`tmcore.scan.memory_scan_bwd` (built from
  the same blocks, :func:`tmcore.scan.step_fwd` / :func:`tmcore.scan.step_bwd`).
  Its per-step inputs come from a ``prepare(theta, xs_t) -> StepInputs`` and its
  per-step output is ``finish(theta, read_t)``, two differentiable functions:
  :func:`tmcore.adapters.jax.memory_scan` passes identities (the layer computes
  its heads and ``out_proj`` over all chunks at once, outside the scan); a variant
  may run per-step maps inside the loop, differentiated with the step.

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

from tmcore.ops.conv import ConvParams
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.options import Options, get_options
from tmcore.scan.dense import StepInputs, add_params, step_bwd, step_fwd

__all__ = ["ScanStatic", "checkpoint_scan", "forward_mode_guard", "identity_finish",
           "identity_prepare", "match_vma", "options_key", "sample", "splat"]


def options_key() -> Options:
    """The options a trace depends on (a static, hashable ``jit`` argument)."""
    return get_options()


# --------------------------------------------------------------------------- varying axes


def _varying(leaf: Any) -> frozenset:
    """The manual mesh axes ``leaf`` varies over (inside ``shard_map``), else empty."""
    try:
        aval = jax.typeof(leaf)
    except TypeError:
        return frozenset()
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def match_vma(*trees: Any) -> tuple[Any, ...]:
    """``trees`` with every leaf cast to the union of their varying axes.

    Outside ``shard_map`` (no varying axes) the trees come back unchanged.
    """
    leaves = jax.tree.leaves(trees)
    axes = frozenset().union(*map(_varying, leaves)) if leaves else frozenset()
    if not axes:
        return trees

    def cast(leaf: Any) -> Any:
        missing = tuple(sorted(axes - _varying(leaf)))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return tuple(jax.tree.map(cast, tree) for tree in trees)


# --------------------------------------------------------------------------- forward mode

_FORWARD_MODE_HINT = (
    "{what}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian, "
    "jax.linearize) is not available: tmcore registers hand-written reverse-mode rules "
    "(jax.custom_vjp). Use jax.grad / jax.vjp / jax.jacrev (for second order "
    "jax.jacrev(jax.jacrev(f)) instead of jax.hessian), or, for forward mode, call the raw "
    "functions tmcore.trilinear_sample / tmcore.gaussian_splat / tmcore.memory_scan on "
    "jax arrays with the fused kernels off (tmcore.options(native=False) or "
    "TMCORE_NATIVE=0), which jax differentiates itself."
)


def forward_mode_guard(what: str, call: Callable[[], Any]) -> Any:
    """``call()``, turning JAX's bare custom_vjp forward-mode error into one naming tmcore."""
    try:
        return call()
    except TypeError as error:
        text = str(error)
        if "custom_vjp" in text and ("forward-mode" in text or "jvp" in text):
            raise TypeError(_FORWARD_MODE_HINT.format(what=what)) from error
        raise


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
    """The scan's static configuration (hashable: a ``jit`` / ``nondiff`` argument).

    ``prepare(theta, xs_t) -> StepInputs`` and ``finish(theta, read (B, C)) -> y_t``
    must hash by value (module-level functions, NamedTuples): they key the trace.
    """

    prepare: Callable[[Any, Any], StepInputs]
    finish: Callable[[Any, Any], Any]
    eps: float
    radius: float | None
    checkpoint_every: int
    options: Options


def _step(static: ScanStatic, theta: Any, cell: ConvParams, carry: tuple, x_t: Any):
    h, c = carry
    inputs = static.prepare(theta, x_t)
    read, h_new, c_new = step_fwd(jnp, h, c, inputs, cell, static.eps, static.radius)
    return (h_new, c_new), static.finish(theta, read)


def _segments(steps: int, every: int) -> tuple[int, int, int]:
    """``(k, full segments, tail steps)`` for ``steps`` steps, a checkpoint every ``every``."""
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


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(static: ScanStatic, theta, cell, xs, h0, c0):
    (h, c), ys = lax.scan(partial(_step, static, theta, cell), (h0, c0), xs)
    return ys, h, c


def _scan_fwd(static: ScanStatic, theta, cell, xs, h0, c0):
    steps = jax.tree.leaves(xs)[0].shape[0]
    k, full, tail = _segments(steps, static.checkpoint_every)
    step = partial(_step, static, theta, cell)

    if k == 1:  # every state is a checkpoint: one flat scan, no segments
        def keep(carry, x_t):
            end, y = step(carry, x_t)
            return end, (y, carry)

        carry, (ys, checkpoints) = lax.scan(keep, (h0, c0), xs)
        return (ys, *carry), (theta, cell, xs, checkpoints, None)

    def segment(carry, xs_segment):
        end, ys = lax.scan(step, carry, xs_segment)
        return end, (ys, carry)  # the checkpoint: the state entering the segment

    xs_head, xs_tail = _split(xs, full, k)
    carry, (ys_head, checkpoints) = lax.scan(segment, (h0, c0), xs_head)
    tail_start = carry
    ys_tail = None
    if tail:
        carry, ys_tail = lax.scan(step, carry, xs_tail)
    ys = _join(ys_head, ys_tail, tail)
    residuals = (theta, cell, xs, checkpoints, tail_start if tail else None)
    return (ys, *carry), residuals


def _segment_bwd(static: ScanStatic, theta, cell, start, xs_segment, g_ys, carry):
    """Replay one segment from its checkpoint ``start``, then differentiate it backwards.

    ``carry = (g_h, g_c, d_theta, d_cell)``; returns the updated carry and ``d_xs``.
    """
    length = jax.tree.leaves(xs_segment)[0].shape[0]
    step = partial(_step, static, theta, cell)
    h0, c0 = start
    if length > 1:  # the states entering steps 1 .. length-1 (step 0's is the checkpoint)
        _, (hs, cs) = lax.scan(lambda s, x: (step(s, x)[0],) * 2, start,
                               jax.tree.map(lambda a: a[: length - 1], xs_segment))
        hs = jnp.concatenate([h0[None], hs], axis=0)
        cs = jnp.concatenate([c0[None], cs], axis=0)
    else:
        hs, cs = h0[None], c0[None]
    return _steps_bwd(static, theta, cell, (hs, cs), xs_segment, g_ys, carry)


def _steps_bwd(static: ScanStatic, theta, cell, states, xs, g_ys, carry):
    """Reverse scan of the step VJP given the state entering every step ``states``."""

    def body(carry, item):
        g_h, g_c, d_theta, d_cell = carry
        h, c, x_t, g_y = item
        inputs, prepare_vjp = jax.vjp(static.prepare, theta, x_t)
        read = ops_for(jnp).sample_fwd(jnp, h, inputs.read_coords[:, None, :])[:, 0, :]
        _, finish_vjp = jax.vjp(static.finish, theta, read)
        d_theta_finish, g_read = finish_vjp(g_y)
        d_h, d_c, d_inputs, d_cell_step = step_bwd(jnp, h, c, inputs, cell, g_read, g_h, g_c,
                                                    static.eps, static.radius)
        d_theta_prepare, d_x = prepare_vjp(d_inputs)
        d_theta = jax.tree.map(lambda a, b, e: a + b + e, d_theta, d_theta_prepare,
                               d_theta_finish)
        return (d_h, d_c, d_theta, add_params(d_cell, d_cell_step)), d_x

    return lax.scan(body, carry, (*states, xs, g_ys), reverse=True)


def _scan_bwd(static: ScanStatic, residuals, cotangents):
    theta, cell, xs, checkpoints, tail_start = residuals
    g_ys, g_h, g_c = cotangents
    g_ys = jax.tree.map(jnp.asarray, g_ys)
    steps = jax.tree.leaves(xs)[0].shape[0]
    k, full, tail = _segments(steps, static.checkpoint_every)
    zeros = partial(jax.tree.map, jnp.zeros_like)
    carry = (jnp.asarray(g_h), jnp.asarray(g_c), zeros(theta), zeros(cell))
    carry = match_vma(carry, xs)[0]  # cotangents may come in unvarying
    if k == 1:
        (d_h0, d_c0, d_theta, d_cell), d_xs = _steps_bwd(static, theta, cell, checkpoints, xs,
                                                         g_ys, carry)
        return d_theta, d_cell, d_xs, d_h0, d_c0
    xs_head, xs_tail = _split(xs, full, k)
    g_head, g_tail = _split(g_ys, full, k)
    d_tail = None
    if tail:
        carry, d_tail = _segment_bwd(static, theta, cell, tail_start, xs_tail, g_tail, carry)

    def segment(carry, item):
        h, c, xs_segment, g_segment = item
        return _segment_bwd(static, theta, cell, (h, c), xs_segment, g_segment, carry)

    carry, d_head = lax.scan(segment, carry, (*checkpoints, xs_head, g_head), reverse=True)
    d_h0, d_c0, d_theta, d_cell = carry
    return d_theta, d_cell, _join(d_head, d_tail, tail), d_h0, d_c0


_scan.defvjp(_scan_fwd, _scan_bwd)
_scan_jit = jax.jit(_scan, static_argnums=(0,))


def checkpoint_scan(static: ScanStatic, theta: Any, cell: ConvParams, xs: Any,
                    h0: jax.Array, c0: jax.Array) -> tuple[Any, jax.Array, jax.Array]:
    """Run the recurrence over the leading (time) axis of ``xs``; no validation.

    ``h0, c0 (B, C, *S)``; ``theta`` the parameters of ``prepare`` / ``finish``;
    ``cell`` the ConvLSTM's :class:`tmcore.ConvParams`. Returns ``(ys [T, ...],
    h_T, c_T)``. The backward stores ``ceil(T / checkpoint_every)`` states and
    replays each segment (``checkpoint_every = 1``: every state, no replay).
    """
    axes = _explicit_batch_axes(h0)
    if axes is not None:
        return _per_shard(static, axes, theta, cell, xs, h0, c0)
    theta, cell, xs, h0, c0 = match_vma(theta, cell, xs, h0, c0)
    return _scan_jit(static, theta, cell, xs, h0, c0)


def _explicit_batch_axes(state: jax.Array) -> tuple[str, ...] | None:
    """The explicit mesh axes the state's batch axis is sharded over, if any."""
    spec = getattr(getattr(jax.typeof(state), "sharding", None), "spec", None)
    if not spec or spec[0] is None:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return tuple(axes) or None


def _per_shard(static: ScanStatic, axes: tuple[str, ...], theta, cell, xs, h0, c0):
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

    theta, cell = jax.tree.map(replicate, (theta, cell))
    batch, steps_batch = P(axes), P(None, axes)

    def local(theta_, cell_, xs_, h_, c_):
        return checkpoint_scan(static, theta_, cell_, xs_, h_, c_)

    return jax.shard_map(local, mesh=mesh,
                         in_specs=(replicated, replicated, steps_batch, batch, batch),
                         out_specs=(steps_batch, batch, batch),
                         axis_names=set(axes))(theta, cell, xs, h0, c0)


def identity_prepare(theta: Any, x_t: StepInputs) -> StepInputs:
    """``prepare`` of the bare scan: the step inputs are given."""
    return x_t


def identity_finish(theta: Any, read: jax.Array) -> jax.Array:
    """``finish`` of the bare scan: the read itself."""
    return read
