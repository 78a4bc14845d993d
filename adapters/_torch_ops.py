"""tmcore's hand-written VJPs registered with PyTorch as custom ops.

Every op here is a ``torch.library.custom_op`` built once at import, with a
fake (meta) implementation for ``torch.compile``, an autograd rule that calls
a second custom op running tmcore's backward, and a vmap rule. The forward
and backward math is tmcore's, run on torch tensors through the array-API
namespace (and tmcore's torch fast paths where it has them); nothing is
re-derived here.

Each op also has an ``autograd.Function`` twin (``MemoryScanFunction``, ...)
with the same ``setup_context`` / ``backward``: ``custom_op``'s registered
autograd raises under ``torch.func.grad`` in torch 2.13, the Function does
not. The adapter's public functions call the Functions; ``torch.ops.tmcore.*``
called directly has autograd too (eager, compile, ``opcheck``).

Second-order gradients (``create_graph=True`` in eager mode): each backward op
has its own autograd rule, which re-runs tmcore's generic backward on torch
tensors under torch autograd and pulls the cotangents back through it (an
exact Hessian-vector product). Not supported: third order (the re-run is
detached from the outer graph), nested ``torch.func.grad`` (Hessians through
``torch.func``), double backward through a ``torch.compile``-d model.

vmap: the rules loop over the mapped dimension (correct for any ``in_dims``,
including batched parameters, e.g. per-sample gradients; one call per slice).

Op namespace ``tmcore``::

    torch.ops.tmcore.trilinear_sample(volume, coords) -> out
    torch.ops.tmcore.gaussian_splat(content, mu, sigma, shape, eps, radius) -> volume
    torch.ops.tmcore.memory_scan(h0, c0, read_coords, write_coords, write_sigma,
        write_content, depthwise_weight, depthwise_bias, pointwise_weight,
        pointwise_bias, eps, radius, checkpoint_every)
        -> (reads, h_T, c_T, h_checkpoints, c_checkpoints)

plus one ``*_backward`` op each.
"""

from collections.abc import Callable, Sequence

import array_api_compat
import torch
from torch import Tensor

from tmcore import validation
from tmcore.backends import use_generic
from tmcore.conv import ConvParams
from tmcore.sampling import sample_bwd, sample_fwd
from tmcore.scan import memory_scan_bwd, memory_scan_fwd, validate_scan_inputs
from tmcore.splat import splat_bwd, splat_fwd

__all__ = [
    "GaussianSplatFunction",
    "MemoryScanFunction",
    "TrilinearSampleFunction",
    "gaussian_splat_op",
    "memory_scan_op",
    "trilinear_sample_op",
]

_XP = array_api_compat.array_namespace(torch.empty(0))


def _contiguous(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.contiguous() for t in tensors)


def _pullback(
    fn: Callable[..., Sequence[Tensor]], primals: Sequence[Tensor], needs: Sequence[bool],
    cotangents: Sequence[Tensor | None],
) -> list[Tensor | None]:
    """``sum_k <cotangents[k], d fn(primals)[k] / d primals[i]>`` for every ``i`` in ``needs``.

    ``fn`` is a tmcore backward re-run on detached copies under torch autograd,
    forced onto the generic array-API path (plain differentiable torch ops);
    ``None`` cotangents count as zero; entries not needed are ``None``.
    """
    with torch.enable_grad(), use_generic():
        leaves = [p.detach().requires_grad_(n) for p, n in zip(primals, needs, strict=True)]
        outs = fn(*leaves)
        pairs = [(o, c) for o, c in zip(outs, cotangents, strict=True)
                 if c is not None and o.requires_grad]
        wrt = [leaf for leaf in leaves if leaf.requires_grad]
        if not pairs or not wrt:
            grads = [None] * len(wrt)
        else:
            grads = list(torch.autograd.grad(
                [o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True,
            ))
    result, it = [], iter(grads)
    for leaf in leaves:
        g = next(it) if leaf.requires_grad else None
        if g is None and leaf.requires_grad:
            g = torch.zeros_like(leaf)
        result.append(None if g is None else g.detach().contiguous())
    return result


def _loop_vmap(op: Callable[..., object]) -> Callable[..., object]:
    """A vmap rule that calls ``op`` once per mapped slice and stacks the results."""

    def rule(info, in_dims, *args):
        outs = []
        for i in range(info.batch_size):
            sliced = [a.select(d, i) if d is not None else a
                      for a, d in zip(args, in_dims, strict=True)]
            outs.append(op(*sliced))
        if isinstance(outs[0], tuple):
            stacked = tuple(torch.stack(parts) for parts in zip(*outs, strict=True))
            return stacked, (0,) * len(stacked)
        return torch.stack(outs), 0

    return rule


class _Function(torch.autograd.Function):
    """Base of the autograd.Function twins of the ops below.

    ``custom_op``'s registered autograd is not usable under ``torch.func.grad``
    (torch 2.13 raises), so the adapter's public functions call these thin
    Functions instead: the forward calls the custom op, ``setup_context`` and
    ``backward`` are the very rules registered on the ops (the backward calls
    the ``*_backward`` op's own Function twin, which gives second order),
    and ``generate_vmap_rule`` composes the ops' vmap rules. They trace under
    ``torch.compile`` like the ops themselves.
    """

    generate_vmap_rule = True


def call(function: type[_Function], op: Callable[..., object], *args):
    """Run an op through its Function twin in eager mode (``torch.func``-safe), or call
    the custom op itself while ``torch.compile`` traces: the op carries the same
    registered autograd, and Dynamo cannot trace the Function when no input
    requires grad (``no_grad`` inference of a compiled model)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return function.apply(*args)


def _register_rules(op: object, grad: Callable, setup: Callable, backward_op: object,
                    backward_grad: Callable, backward_setup: Callable) -> None:
    """Register autograd (``grad``/``setup``) and the looping vmap rule on a forward op and
    on its ``*_backward`` op (whose own autograd gives second order)."""
    op.register_autograd(grad, setup_context=setup)
    backward_op.register_autograd(backward_grad, setup_context=backward_setup)
    op.register_vmap(_loop_vmap(op))
    backward_op.register_vmap(_loop_vmap(backward_op))


def _backward(function: type[_Function], op: Callable[..., object], *args):
    """Run a backward op through its Function twin (``torch.func``-safe), or call the
    op itself while ``torch.compile`` traces (Dynamo cannot nest a Function in a
    Function's backward; the op's registered autograd then gives second order)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return function.apply(*args)


# --------------------------------------------------------------------------- sample


@torch.library.custom_op("tmcore::trilinear_sample", mutates_args=())
def trilinear_sample_op(volume: Tensor, coords: Tensor) -> Tensor:
    """``volume (B, C, *S)``, ``coords (B, Q, n)`` -> ``(B, Q, C)`` (tmcore.trilinear_sample)."""
    return sample_fwd(_XP, volume, coords).contiguous()


@trilinear_sample_op.register_fake
def _(volume, coords):
    return volume.new_empty((volume.shape[0], coords.shape[1], volume.shape[1]))


@torch.library.custom_op("tmcore::trilinear_sample_backward", mutates_args=())
def _trilinear_sample_backward(volume: Tensor, coords: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    return _contiguous(*sample_bwd(_XP, volume, coords, g))


@_trilinear_sample_backward.register_fake
def _(volume, coords, g):
    return torch.empty_like(volume), torch.empty_like(coords)


def _sample_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _sample_grad(ctx, g):
    volume, coords = ctx.saved_tensors
    return tuple(_backward(_SampleBackwardFunction, _trilinear_sample_backward, volume, coords,
                           g.contiguous()))


def _sample_bwd_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _sample_bwd_grad(ctx, g_volume, g_coords):
    primals = ctx.saved_tensors
    return tuple(_pullback(lambda v, c, g: sample_bwd(_XP, v, c, g), primals,
                           ctx.needs_input_grad, (g_volume, g_coords)))


class _SampleBackwardFunction(_Function):
    @staticmethod
    def forward(volume, coords, g):
        return _trilinear_sample_backward(volume, coords, g)

    setup_context = staticmethod(_sample_bwd_setup)
    backward = staticmethod(_sample_bwd_grad)


_register_rules(trilinear_sample_op, _sample_grad, _sample_setup,
                _trilinear_sample_backward, _sample_bwd_grad, _sample_bwd_setup)


# --------------------------------------------------------------------------- splat


@torch.library.custom_op("tmcore::gaussian_splat", mutates_args=())
def gaussian_splat_op(
    content: Tensor, mu: Tensor, sigma: Tensor, shape: Sequence[int], eps: float,
    radius: float | None,
) -> Tensor:
    """``content (B, K, C)``, ``mu (B, K, n)``, ``sigma (B, K)`` -> ``(B, C, *shape)``."""
    return splat_fwd(_XP, content, mu, sigma, tuple(shape), eps, radius).contiguous()


@gaussian_splat_op.register_fake
def _(content, mu, sigma, shape, eps, radius):
    return content.new_empty((content.shape[0], content.shape[2], *shape))


@torch.library.custom_op("tmcore::gaussian_splat_backward", mutates_args=())
def _gaussian_splat_backward(
    content: Tensor, mu: Tensor, sigma: Tensor, g: Tensor, eps: float, radius: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    shape = tuple(g.shape[2:])
    return _contiguous(*splat_bwd(_XP, content, mu, sigma, shape, g, eps, radius))


@_gaussian_splat_backward.register_fake
def _(content, mu, sigma, g, eps, radius):
    return torch.empty_like(content), torch.empty_like(mu), torch.empty_like(sigma)


def _splat_setup(ctx, inputs, output):
    content, mu, sigma, _, eps, radius = inputs
    ctx.save_for_backward(content, mu, sigma)
    ctx.eps, ctx.radius = eps, radius


def _splat_grad(ctx, g):
    content, mu, sigma = ctx.saved_tensors
    grads = _backward(_SplatBackwardFunction, _gaussian_splat_backward, content, mu, sigma,
                      g.contiguous(), ctx.eps, ctx.radius)
    return (*grads, None, None, None)


def _splat_bwd_setup(ctx, inputs, output):
    content, mu, sigma, g, eps, radius = inputs
    ctx.save_for_backward(content, mu, sigma, g)
    ctx.eps, ctx.radius = eps, radius


def _splat_bwd_grad(ctx, g_content, g_mu, g_sigma):
    eps, radius = ctx.eps, ctx.radius

    def fn(content, mu, sigma, g):
        return splat_bwd(_XP, content, mu, sigma, tuple(g.shape[2:]), g, eps, radius)

    grads = _pullback(fn, ctx.saved_tensors, ctx.needs_input_grad[:4], (g_content, g_mu, g_sigma))
    return (*grads, None, None)


class _SplatBackwardFunction(_Function):
    @staticmethod
    def forward(content, mu, sigma, g, eps, radius):
        return _gaussian_splat_backward(content, mu, sigma, g, eps, radius)

    setup_context = staticmethod(_splat_bwd_setup)
    backward = staticmethod(_splat_bwd_grad)


_register_rules(gaussian_splat_op, _splat_grad, _splat_setup,
                _gaussian_splat_backward, _splat_bwd_grad, _splat_bwd_setup)


# --------------------------------------------------------------------------- scan


@torch.library.custom_op("tmcore::memory_scan", mutates_args=())
def memory_scan_op(
    h0: Tensor, c0: Tensor, read_coords: Tensor, write_coords: Tensor, write_sigma: Tensor,
    write_content: Tensor, depthwise_weight: Tensor, depthwise_bias: Tensor,
    pointwise_weight: Tensor, pointwise_bias: Tensor, eps: float, radius: float | None,
    checkpoint_every: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """tmcore.scan.memory_scan_fwd on torch tensors.

    ``h0, c0 (B, C, *S)``, ``read_coords, write_coords (B, T, n)``,
    ``write_sigma (B, T)``, ``write_content (B, T, C)``, ConvParams as four
    tensors. Returns ``(reads (B, T, C), h_T, c_T, h_checkpoints,
    c_checkpoints)``; the checkpoints ``(ceil(T / checkpoint_every), B, C, *S)``
    are what the backward needs and carry no gradient.
    """
    params = ConvParams(depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias)
    out = memory_scan_fwd(_XP, h0, c0, read_coords, write_coords, write_sigma, write_content,
                          params, eps=eps, radius=radius, checkpoint_every=checkpoint_every)
    return _contiguous(*out)


@memory_scan_op.register_fake
def _(h0, c0, read_coords, write_coords, write_sigma, write_content, depthwise_weight,
      depthwise_bias, pointwise_weight, pointwise_bias, eps, radius, checkpoint_every):
    # The adapter's memory_scan validates eagerly; under torch.compile Dynamo cannot trace
    # the validator, so its shape checks run here, once per trace, in plain Python (fake
    # tensors have no values: validate mode's value checks are off).
    params = ConvParams(depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias)
    with validation(False):
        validate_scan_inputs(h0, c0, read_coords, write_coords, write_sigma, write_content,
                             params, checkpoint_every, radius, eps=eps)
    batch, channels = h0.shape[:2]
    steps = read_coords.shape[1]
    saved = (steps + checkpoint_every - 1) // checkpoint_every
    return (
        h0.new_empty((batch, steps, channels)),
        torch.empty_like(h0),
        torch.empty_like(c0),
        h0.new_empty((saved, *h0.shape)),
        c0.new_empty((saved, *c0.shape)),
    )


@torch.library.custom_op("tmcore::memory_scan_backward", mutates_args=())
def _memory_scan_backward(
    h0: Tensor, c0: Tensor, read_coords: Tensor, write_coords: Tensor, write_sigma: Tensor,
    write_content: Tensor, depthwise_weight: Tensor, depthwise_bias: Tensor,
    pointwise_weight: Tensor, pointwise_bias: Tensor, h_checkpoints: Tensor,
    c_checkpoints: Tensor, g_reads: Tensor, g_h: Tensor, g_c: Tensor, eps: float,
    radius: float | None, checkpoint_every: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    params = ConvParams(depthwise_weight, depthwise_bias, pointwise_weight, pointwise_bias)
    grads = memory_scan_bwd(_XP, read_coords, write_coords, write_sigma, write_content, params,
                            h_checkpoints, c_checkpoints, g_reads, g_h, g_c, eps=eps,
                            radius=radius, checkpoint_every=checkpoint_every)
    return _contiguous(*grads[:6], *grads.params)


@_memory_scan_backward.register_fake
def _(h0, c0, read_coords, write_coords, write_sigma, write_content, depthwise_weight,
      depthwise_bias, pointwise_weight, pointwise_bias, *rest):
    primals = (h0, c0, read_coords, write_coords, write_sigma, write_content, depthwise_weight,
               depthwise_bias, pointwise_weight, pointwise_bias)
    return tuple(torch.empty_like(p) for p in primals)


def _scan_setup(ctx, inputs, output):
    *primals, eps, radius, checkpoint_every = inputs
    _, _, _, h_ckpt, c_ckpt = output
    ctx.mark_non_differentiable(h_ckpt, c_ckpt)
    # Unused outputs get None, not zeros: materialized zero cotangents for the
    # checkpoints would be a second copy of every saved state (as big as the saved
    # states themselves) at the start of the backward. _scan_grad handles None.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*primals, h_ckpt, c_ckpt)
    ctx.options = (eps, radius, checkpoint_every)


def _scan_grad(ctx, g_reads, g_h, g_c, _g_hk, _g_ck):
    *primals, h_ckpt, c_ckpt = ctx.saved_tensors
    h0, c0, read_coords = primals[:3]
    batch, steps, channels = read_coords.shape[0], read_coords.shape[1], h0.shape[1]
    g_reads = (read_coords.new_zeros((batch, steps, channels)) if g_reads is None
               else g_reads.contiguous())
    g_h = torch.zeros_like(h0) if g_h is None else g_h.contiguous()
    g_c = torch.zeros_like(c0) if g_c is None else g_c.contiguous()
    grads = _backward(_ScanBackwardFunction, _memory_scan_backward, *primals, h_ckpt, c_ckpt,
                      g_reads, g_h, g_c, *ctx.options)
    return (*grads, None, None, None)


def _scan_bwd_setup(ctx, inputs, output):
    *tensors, eps, radius, checkpoint_every = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = (eps, radius, checkpoint_every)


def _scan_bwd_grad(ctx, *cotangents):
    eps, radius, checkpoint_every = ctx.options
    saved = ctx.saved_tensors
    # Differentiate "forward to the checkpoints, then backward" from h0, c0, so
    # the checkpoint inputs (functions of the primals) need no gradient of their own.
    primals = saved[:10] + saved[12:15]
    needs = ctx.needs_input_grad[:10] + ctx.needs_input_grad[12:15]

    def fn(h0, c0, rc, wc, ws, wcont, dw, db, pw, pb, g_reads, g_h, g_c):
        params = ConvParams(dw, db, pw, pb)
        *_, h_ckpt, c_ckpt = memory_scan_fwd(_XP, h0, c0, rc, wc, ws, wcont, params, eps=eps,
                                             radius=radius, checkpoint_every=checkpoint_every)
        grads = memory_scan_bwd(_XP, rc, wc, ws, wcont, params, h_ckpt, c_ckpt, g_reads, g_h,
                                g_c, eps=eps, radius=radius, checkpoint_every=checkpoint_every)
        return (*grads[:6], *grads.params)

    grads = _pullback(fn, primals, needs, cotangents)
    return (*grads[:10], None, None, *grads[10:], None, None, None)


class _ScanBackwardFunction(_Function):
    @staticmethod
    def forward(*args):
        return _memory_scan_backward(*args)

    setup_context = staticmethod(_scan_bwd_setup)
    backward = staticmethod(_scan_bwd_grad)


_register_rules(memory_scan_op, _scan_grad, _scan_setup,
                _memory_scan_backward, _scan_bwd_grad, _scan_bwd_setup)


class MemoryScanFunction(_Function):
    @staticmethod
    def forward(*args):
        return memory_scan_op(*args)

    setup_context = staticmethod(_scan_setup)
    backward = staticmethod(_scan_grad)


class TrilinearSampleFunction(_Function):
    @staticmethod
    def forward(volume, coords):
        return trilinear_sample_op(volume, coords)

    setup_context = staticmethod(_sample_setup)
    backward = staticmethod(_sample_grad)


class GaussianSplatFunction(_Function):
    @staticmethod
    def forward(content, mu, sigma, shape, eps, radius):
        return gaussian_splat_op(content, mu, sigma, shape, eps, radius)

    setup_context = staticmethod(_splat_setup)
    backward = staticmethod(_splat_grad)
