"""JAX fast paths: fused C kernels through the XLA FFI on the CPU, a grouped
``lax.conv_general_dilated`` for the depthwise taps elsewhere (docs/guides/backends.md;
sharding: docs/guides/distributed.md).

``depthwise="auto"`` takes the grouped conv only off the CPU: XLA:CPU expands grouped convs,
~300x slower than the generic shifts there. On the CPU the depthwise passes and the gates,
forward and VJP, are calls of one primitive, ``tmcore_native`` (its rules below), each a
``custom_vjp`` whose backward is the fused VJP, itself differentiated through the generic
math (reverse mode to any order; forward mode needs ``native=False``). Everything traces
under ``jit``, x64 on or off; convs and products run at ``Precision.HIGHEST`` (no TF32);
float16 / bfloat16 compute in float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tmcore.ops.cell import gates_fwd as generic_gates_fwd
from tmcore.ops.conv import depthwise_axis
from tmcore.runtime.dispatch import Ops
from tmcore.runtime.options import Options
from tmcore.types import ConvParams

from . import native
from .mixed import with_float32_compute

__all__ = ["make_ops"]

_DIMS = ("NCDHW", "OIDHW", "NCDHW")


def _use_lax(kernel: str) -> bool:
    """Whether the depthwise taps use the grouped ``lax`` conv (the ``depthwise`` option)."""
    if kernel == "auto":
        return jax.default_backend() != "cpu"
    return kernel == "grouped"


def _view(x: Any, axis: int) -> tuple[int, ...]:
    shape = tuple(x.shape[2:])
    return (x.shape[0], x.shape[1], math.prod(shape[:axis]), shape[axis],
            math.prod(shape[axis + 1 :]))


def _depthwise(x: Any, taps: Any, bias: Any | None, axis: int) -> Any:
    """Depthwise 3-tap cross-correlation of ``x (B, C, *S)`` along spatial ``axis``: one grouped
    conv over the free reshape ``(B, C, pre, S_a, post)``."""
    channels = x.shape[1]
    y = lax.conv_general_dilated(
        jnp.reshape(x, _view(x, axis)), jnp.reshape(taps, (channels, 1, 1, 3, 1)),
        window_strides=(1, 1, 1), padding=((0, 0), (1, 1), (0, 0)),
        dimension_numbers=_DIMS, feature_group_count=channels,
        precision=lax.Precision.HIGHEST,
    )
    if bias is not None:
        y = y + jnp.reshape(bias, (1, channels, 1, 1, 1))
    return jnp.reshape(y, x.shape)


def _sum_over_batch(g_flat: Any, y_flat: Any) -> Any:
    """``sum_b g[b] @ y[b].T`` ``(O, I)`` for ``g (B, O, P)``, ``y (B, I, P)``: the batch sum last,
    since a product contracting a sharded batch is ambiguous on explicit meshes."""
    per_sample = jnp.einsum("bop,bip->boi", g_flat, y_flat, precision=lax.Precision.HIGHEST)
    return jnp.sum(per_sample, axis=0)


def conv_fwd(xp: Any, x: Any, params: ConvParams):
    """Forward; residuals are the generic stage inputs ``[x, after axis 0, ...]``."""
    stages = [x]
    for axis in range(x.ndim - 2):
        stages.append(_depthwise(stages[-1], params.depthwise_weight[axis],
                                 params.depthwise_bias[axis], axis))
    return _pointwise(stages[-1], params), stages


def _pointwise(y: Any, params: ConvParams) -> Any:
    """``z = W y + b`` per batch row: ``(B, C_out, *S)`` from ``y (B, C_in, *S)``."""
    batch = y.shape[0]
    z = jnp.matmul(params.pointwise_weight, jnp.reshape(y, (batch, y.shape[1], -1)),
                   precision=lax.Precision.HIGHEST)
    z = z + params.pointwise_bias[:, None]
    return jnp.reshape(z, (batch, z.shape[1], *y.shape[2:]))


def _pointwise_bwd(y: Any, params: ConvParams, g: Any) -> tuple[Any, Any, Any]:
    """``(d_y, d_pointwise_weight, d_pointwise_bias)`` of :func:`_pointwise` for ``g``."""
    batch, c_in = y.shape[:2]
    y_flat = jnp.reshape(y, (batch, c_in, -1))
    g_flat = jnp.reshape(g, (batch, g.shape[1], -1))
    d_y = jnp.matmul(params.pointwise_weight.T, g_flat, precision=lax.Precision.HIGHEST)
    return (jnp.reshape(d_y, y.shape), _sum_over_batch(g_flat, y_flat),
            jnp.sum(g_flat, axis=(0, 2)))


def conv_bwd(xp: Any, stages: list[Any], params: ConvParams, g: Any):
    """VJP: flipped-tap grouped conv for the input, sliced products for the taps."""
    n = len(stages) - 1
    y = stages[-1]
    d_y, d_pointwise, d_pointwise_bias = _pointwise_bwd(y, params, g)
    d_taps, d_biases = [None] * n, [None] * n
    dims = (0, 2, 3, 4)
    for axis in reversed(range(n)):
        x5 = jnp.reshape(stages[axis], _view(y, axis))
        d5 = jnp.reshape(d_y, _view(y, axis))
        d_taps[axis] = jnp.stack([
            jnp.sum(d5[:, :, :, 1:] * x5[:, :, :, :-1], axis=dims),
            jnp.sum(d5 * x5, axis=dims),
            jnp.sum(d5[:, :, :, :-1] * x5[:, :, :, 1:], axis=dims),
        ], axis=-1)
        d_biases[axis] = jnp.sum(d5, axis=dims)
        d_y = _depthwise(d_y, params.depthwise_weight[axis][:, ::-1], None, axis)
    return d_y, ConvParams(jnp.stack(d_taps), jnp.stack(d_biases), d_pointwise,
                           d_pointwise_bias)


# ----------------------------------------------------------------------------- CPU kernels


class _NativeConvResiduals(NamedTuple):
    x: Any
    y: Any  # the depthwise output


class _NativeGateResiduals(NamedTuple):
    z: Any
    c: Any


def _native_suffix(*arrays: Any) -> str | None:
    """The kernels' dtype suffix when they may run on ``arrays`` (CPU backend, one float32 /
    float64 dtype, the library built), else None."""
    if not native.enabled() or jax.default_backend() != "cpu":
        return None
    dtype = arrays[0].dtype
    suffix = {jnp.dtype("float32"): "f32", jnp.dtype("float64"): "f64"}.get(jnp.dtype(dtype))
    if suffix is None or any(a.dtype != dtype for a in arrays):
        return None
    return suffix if native.jax_library() is not None else None


def varying(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over (inside ``shard_map``), else empty."""
    try:
        aval = jax.typeof(x)
    except TypeError:  # not an array (e.g. None in a pytree)
        return frozenset()
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def match_vma(*trees: Any) -> tuple[Any, ...]:
    """``trees`` with every leaf cast to the union of their varying axes (an FFI call or a scan
    carry needs it explicitly); unchanged outside ``shard_map``."""
    leaves = jax.tree.leaves(trees)
    axes = frozenset().union(*map(varying, leaves)) if leaves else frozenset()
    if not axes:
        return trees

    def cast(leaf: Any) -> Any:
        missing = tuple(sorted(axes - varying(leaf)))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return tuple(jax.tree.map(cast, tree) for tree in trees)


def explicit_batch_axes(x: Any) -> tuple[str, ...] | None:
    """The explicit mesh axes ``x``'s leading (batch) axis is sharded over, if any."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if not spec or spec[0] is None:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return tuple(axes) or None


def _ffi(kernel: str, args: tuple[Any, ...], outputs: tuple[int, ...],
         summed: tuple[int, ...] = ()) -> tuple[Any, ...]:
    """Call ``kernel``; output ``i`` is shaped like ``args[outputs[i]]``, ``summed`` outputs are
    batch sums (``psum``-ed per shard: on an explicit batch-sharded mesh it runs per shard)."""
    batched, axes = _BATCHED[kernel], explicit_batch_axes(args[0])
    if axes is not None:
        def local(*shard):
            return _psum_summed(_ffi(kernel, shard, outputs, summed), axes, summed)

        in_specs = tuple(P(axes) if b else P() for b in batched)
        out_specs = tuple(P() if i in summed else P(axes) for i in range(len(outputs)))
        return jax.shard_map(local, mesh=jax.typeof(args[0]).sharding.mesh,
                             in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(axes))(*args)
    args = match_vma(*args)
    if jax.device_count() > 1 and not any(map(varying, args)):
        # several devices: jit may shard the batch (Auto axes, invisible while tracing)
        return tuple(_partitioned(kernel, _native_suffix(args[0]), batched, outputs,
                                  summed)(*args))
    return _plain_ffi(kernel, _native_suffix(args[0]), args, outputs)


def _psum_summed(outs: tuple[Any, ...], axes: Any, summed: tuple[int, ...]) -> tuple[Any, ...]:
    """A per-shard call's outputs, the ``summed`` ones ``psum``-ed over ``axes``."""
    return tuple(lax.psum(o, axes) if i in summed else o for i, o in enumerate(outs))


def _plain_ffi(kernel: str, suffix: str, args: tuple[Any, ...],
               outputs: tuple[int, ...]) -> tuple[Any, ...]:
    """The kernel as one ``tmcore_native`` primitive call."""
    return tuple(_native_p.bind(*args, kernel=kernel, suffix=suffix, outputs=outputs))


# ----------------------------------------------------------------- the native primitive
#
# One JAX primitive for every kernel call, so that JAX's transformations see tmcore's
# rules rather than a bare ``ffi_call``:
# - lowering: the XLA custom call ``tmcore_{kernel}_{suffix}`` (jax.ffi), except under
#   ``jax.export``: an exported artifact may run where tmcore's targets are not
#   registered (another process, machine or platform) and export refuses custom calls
#   without compatibility guarantees, so it gets the generic math (same results);
# - batching: ``vmap`` folds the mapped axis into the kernels' own axes (one call,
#   not a loop): the gates into the batch (rows are independent), the depthwise passes
#   into the channels (each channel has its own taps, so per-example taps and their
#   per-example gradients stay apart).
# Output ``i`` has the type of input ``outputs[i]`` (shape, dtype, sharding, varying
# axes), which every kernel's outputs have.

_native_p = jax.extend.core.Primitive("tmcore_native")
_native_p.multiple_results = True


def _generic_kernel(kernel: str) -> Callable[..., tuple[Any, ...]]:
    """The kernel's math in jnp, with the kernel's argument and output order."""
    if kernel == "gates_fwd":
        return _generic_gates
    if kernel == "gates_bwd":
        return _generic_gates_vjp
    if kernel == "dw_fwd":
        return lambda x, taps, bias: (_generic_depthwise(x, taps, bias),)
    if kernel == "dw_bwd":
        return lambda x, g, taps, bias: _generic_depthwise_vjp(x, taps, bias, g)
    raise ValueError(f"kernel: expected one of gates_fwd, gates_bwd, dw_fwd, dw_bwd, "
                     f"got {kernel!r}")


@functools.cache
def _eager(kernel: str, suffix: str, outputs: tuple[int, ...]) -> Callable[..., Any]:
    return jax.jit(functools.partial(_native_p.bind, kernel=kernel, suffix=suffix,
                                     outputs=outputs))


_native_p.def_impl(lambda *args, kernel, suffix, outputs: _eager(kernel, suffix, outputs)(
    *args))
_native_p.def_abstract_eval(lambda *avals, kernel, suffix, outputs: [avals[i]
                                                                     for i in outputs])


def _native_lowering(ctx: Any, *args: Any, kernel: str, suffix: str,
                     outputs: tuple[int, ...]) -> Any:
    if ctx.module_context.lowering_parameters.for_export:
        return mlir.lower_fun(_generic_kernel(kernel), multiple_results=True)(ctx, *args)
    return jax.ffi.ffi_lowering(f"tmcore_{kernel}_{suffix}")(ctx, *args)


mlir.register_lowering(_native_p, _native_lowering)

#: per kernel: which inputs have the leading batch axis
_BATCHED = {"gates_fwd": (True,) * 2, "gates_bwd": (True,) * 4,
            "dw_fwd": (True, False, False), "dw_bwd": (True, True, False, False)}


def _native_batch(args: tuple[Any, ...], dims: tuple[Any, ...], *, kernel: str, suffix: str,
                  outputs: tuple[int, ...]) -> tuple[Any, tuple[int, ...]]:
    """``vmap`` of one kernel call as one call: the mapped axis folded into the batch (gates,
    shared taps) or the channels (per-example taps, and every depthwise VJP)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True)
                if d is not None)
    mapped = [jnp.moveaxis(a, d, 0) if d is not None
              else jnp.broadcast_to(a, (size, *a.shape)) for a, d in zip(args, dims,
                                                                         strict=True)]
    batched = _BATCHED[kernel]
    params_mapped = any(d is not None
                        for d, b in zip(dims, batched, strict=True) if not b)
    if kernel.startswith("gates") or (kernel == "dw_fwd" and not params_mapped):
        # (V, B, ...) -> (V B, ...): a free reshape; unmapped taps are the broadcast rows
        flat = [a.reshape(size * a.shape[1], *a.shape[2:]) if b else a[0]
                for a, b in zip(mapped, batched, strict=True)]
        outs = _native_p.bind(*flat, kernel=kernel, suffix=suffix, outputs=outputs)
        return [o.reshape(size, -1, *o.shape[1:]) for o in outs], (0,) * len(outs)
    # depthwise: x (V, B, C, *S) -> (B, V C, *S); taps (V, n, C, 3) -> (n, V C, 3)
    # (bias (V, n, C) -> (n, V C) alike: every operand has its channels third)
    flat = [jnp.moveaxis(a, 0, 1).reshape(a.shape[1], size * a.shape[2], *a.shape[3:])
            for a in mapped]
    outs = _native_p.bind(*flat, kernel=kernel, suffix=suffix, outputs=outputs)
    # each output (like an input: (B | n, V C, ...)) -> (V, B | n, C, ...)
    return ([jnp.moveaxis(o.reshape(o.shape[0], size, -1, *o.shape[2:]), 1, 0)
             for o in outs], (0,) * len(outs))


batching.primitive_batchers[_native_p] = _native_batch


def _letters(shapes: tuple[tuple[int, ...], ...], batched: tuple[bool, ...]) -> list[list[str]]:
    """Einsum-like factor names per operand: ``b`` for a batch axis; operands of equal shape share
    names (aligned elementwise)."""
    names: dict[tuple[int, ...], list[str]] = {}
    pool = iter("acdefghijklmnopqrstuvwxyz")
    out = []
    for shape, has_batch in zip(shapes, batched, strict=True):
        key = (has_batch, *shape)
        if key not in names:
            rest = [next(pool) for _ in shape[1 if has_batch else 0:]]
            names[key] = (["b"] if has_batch else []) + rest
        out.append(names[key])
    return out


@functools.cache
def _partitioned(kernel: str, suffix: str, batched: tuple[bool, ...], outputs: tuple[int, ...],
                 summed: tuple[int, ...]) -> Callable[..., Any]:
    """The kernel as a ``custom_partitioning`` function XLA splits along the batch (``summed``
    outputs ``psum``-ed), never gathering it; a ``custom_vmap`` loops over a vmapped axis
    (``custom_partitioning`` has no ``vmap`` rule)."""

    def batch_axes(arg_shapes: Any) -> Any:
        spec = getattr(getattr(arg_shapes[0], "sharding", None), "spec", None)
        return spec[0] if spec else None

    def out_shardings(mesh: Any, axes: Any) -> tuple[Any, ...]:
        return tuple(NamedSharding(mesh, P() if i in summed else P(axes))
                     for i in range(len(outputs)))

    def infer(mesh, arg_shapes, result_shape):
        return out_shardings(mesh, batch_axes(arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        axes = batch_axes(arg_shapes)
        arg_shardings = tuple(NamedSharding(mesh, P(axes) if b else P()) for b in batched)

        def lower(*args):
            outs = _plain_ffi(kernel, suffix, args, outputs)
            return outs if axes is None else _psum_summed(outs, axes, summed)

        return mesh, lower, out_shardings(mesh, axes), arg_shardings

    def rule(mesh, value_types, result_types):
        names = _letters(tuple(tuple(v.shape) for v in value_types), batched)
        results = [names[i] for i in outputs]
        return (", ".join(" ".join(n) for n in names) + " -> "
                + ", ".join(" ".join(n) for n in results))

    @custom_partitioning
    def call(*args):
        return _plain_ffi(kernel, suffix, args, outputs)

    call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                       sharding_rule=rule)

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return call(*args)

    @batchable.def_vmap
    def _vmap(axis_size, in_batched, *args):
        mapped = [a for a, b in zip(args, in_batched, strict=True) if b]

        def one(rows):
            rows = iter(rows)
            return batchable(*(next(rows) if b else a
                               for a, b in zip(args, in_batched, strict=True)))

        return lax.map(one, mapped), (True,) * len(outputs)

    return batchable


def _generic_depthwise(x: Any, taps: Any, bias: Any) -> Any:
    for axis in range(x.ndim - 2):
        x = depthwise_axis(jnp, x, taps[axis], bias[axis], axis)
    return x


def _generic_depthwise_vjp(x: Any, taps: Any, bias: Any, g: Any) -> tuple[Any, Any, Any]:
    return jax.vjp(_generic_depthwise, x, taps, bias)[1](g)


def _generic_gates(z: Any, c: Any) -> tuple[Any, Any]:
    return generic_gates_fwd(jnp, z, c)[:2]


def _generic_gates_vjp(z: Any, c: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
    return jax.vjp(_generic_gates, z, c)[1]((g_h, g_c))


def _fused(generic: Any):
    """A ``custom_vjp`` of the decorated kernel call, differentiated through ``generic`` (the same
    function in jnp), so the fused VJPs stay differentiable."""
    def wrap(kernel):
        fn = jax.custom_vjp(kernel)
        fn.defvjp(lambda *args: (kernel(*args), args),
                  lambda args, cotangent: jax.vjp(generic, *args)[1](cotangent))
        return fn
    return wrap


@_fused(_generic_depthwise_vjp)
def _native_depthwise_vjp(x: Any, taps: Any, bias: Any, g: Any) -> tuple[Any, Any, Any]:
    """``(d_x, d_taps, d_bias)`` of :func:`_native_depthwise` for the cotangent ``g``."""
    return _ffi("dw_bwd", (x, g, taps, bias), (0, 2, 3), summed=(1, 2))


@jax.custom_vjp
def _native_depthwise(x: Any, taps: Any, bias: Any) -> Any:
    """All depthwise passes of ``x (B, C, *S)``, taps ``(n, C, 3)``, bias ``(n, C)``."""
    return _ffi("dw_fwd", (x, taps, bias), (0,))[0]


_native_depthwise.defvjp(lambda x, taps, bias: (_native_depthwise(x, taps, bias), (x, taps, bias)),
                         lambda args, g: _native_depthwise_vjp(*args, g))


@_fused(_generic_gates_vjp)
def _native_gates_vjp(z: Any, c: Any, g_h: Any, g_c: Any) -> tuple[Any, Any]:
    """``(d_z, d_c)`` of :func:`_native_gates` (the gates recomputed from ``z``)."""
    return _ffi("gates_bwd", (z, c, g_h, g_c), (0, 1))


@jax.custom_vjp
def _native_gates(z: Any, c: Any) -> tuple[Any, Any]:
    """``(h', c')`` from ``z (B, 4C, *S)`` and ``c (B, C, *S)``."""
    return _ffi("gates_fwd", (z, c), (1, 1))


_native_gates.defvjp(lambda z, c: (_native_gates(z, c), (z, c)),
                     lambda args, g: _native_gates_vjp(*args, *g))


def native_conv_fwd(xp: Any, x: Any, params: ConvParams):
    """Fused depthwise passes, then the pointwise ``matmul``."""
    y = _native_depthwise(x, params.depthwise_weight, params.depthwise_bias)
    return _pointwise(y, params), _NativeConvResiduals(x, y)


def native_conv_bwd(xp: Any, residuals: _NativeConvResiduals, params: ConvParams, g: Any):
    """VJP of :func:`native_conv_fwd`: the pointwise one, then the fused depthwise one."""
    x, y = residuals
    d_y, d_pointwise, d_pointwise_bias = _pointwise_bwd(y, params, g)
    d_x, d_taps, d_biases = _native_depthwise_vjp(x, params.depthwise_weight,
                                                  params.depthwise_bias, d_y)
    return d_x, ConvParams(d_taps, d_biases, d_pointwise, d_pointwise_bias)


_FORWARD_MODE = (
    "{what}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian, "
    "jax.linearize) is not available: tmcore registers hand-written reverse-mode rules "
    "(jax.custom_vjp). Use jax.grad / jax.vjp / jax.jacrev (for second order "
    "jax.jacrev(jax.jacrev(f)) instead of jax.hessian), or, for forward mode through "
    "tmcore's functions, turn the fused kernels off (tmcore.options(native=False) or "
    "TMCORE_NATIVE=0): JAX then differentiates the generic math itself.")


def forward_mode_guard(call: Callable[[], Any], what: str = "tmcore on JAX arrays") -> Any:
    """``call()`` (a fused kernel, or an adapter's custom_vjp), with JAX's bare
    custom_vjp forward-mode error turned into tmcore's, naming ``what``."""
    try:
        return call()
    except TypeError as error:
        text = str(error)
        if "custom_vjp" in text and ("forward-mode" in text or "jvp" in text):
            raise TypeError(_FORWARD_MODE.format(what=what)) from error
        raise


def scatter_add(xp: Any, out: Any, index: Any, values: Any) -> Any:
    """``out (N,)`` with ``values (M,)`` summed in at ``index (M,)`` (``.at[].add``)."""
    return out.at[index].add(values)


def make_ops(generic: Ops, options: Options) -> Ops:
    """The JAX table: lax conv or C kernels, generic read and write, float32 for halves."""
    kernel = options.depthwise

    def conv_fwd_auto(xp, x, params):
        if kernel == "auto" and _native_suffix(x, *params) is not None:
            return forward_mode_guard(lambda: native_conv_fwd(xp, x, params))
        return (conv_fwd if _use_lax(kernel) else generic.conv_fwd)(xp, x, params)

    def conv_bwd_auto(xp, residuals, params, g):
        if isinstance(residuals, _NativeConvResiduals):
            return native_conv_bwd(xp, residuals, params, g)
        # both other conv_fwd variants return the generic stage list: either bwd consumes it
        return (conv_bwd if _use_lax(kernel) else generic.conv_bwd)(xp, residuals, params, g)

    def gates_fwd(xp, z, c):
        if _native_suffix(z, c) is not None:
            h_new, c_new = forward_mode_guard(lambda: _native_gates(z, c))
            return h_new, c_new, _NativeGateResiduals(z, c)
        return generic.gates_fwd(xp, z, c)

    def gates_bwd(xp, residuals, g_h, g_c):
        if isinstance(residuals, _NativeGateResiduals):
            return _native_gates_vjp(*residuals, g_h, g_c)
        return generic.gates_bwd(xp, residuals, g_h, g_c)

    def gates_residuals(xp, z, c):
        if _native_suffix(z, c) is not None:
            return _NativeGateResiduals(z, c)
        return generic.gates_residuals(xp, z, c)

    fast = generic._replace(conv_fwd=conv_fwd_auto, conv_bwd=conv_bwd_auto, gates_fwd=gates_fwd,
                            gates_bwd=gates_bwd, gates_residuals=gates_residuals,
                            # XLA:CPU scatters in order; elsewhere it adds atomically
                            scatter_add=scatter_add if jax.default_backend() == "cpu"
                            or not options.deterministic else None)
    return with_float32_compute(fast)
