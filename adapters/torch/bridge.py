"""tmcore's hand-written VJPs registered with PyTorch as custom ops, made by one factory.

:func:`_make_op` turns an :class:`OpSpec` into a ``torch.library.custom_op`` with a fake
implementation, an autograd rule and a vmap rule (a loop over the mapped dimension); a
``<name>_backward`` op whose own autograd rule re-runs the backward on the generic path under
torch autograd (an exact second order); and an ``autograd.Function`` twin of each, which
:func:`call` runs in eager mode (``custom_op``'s autograd raises under ``torch.func.grad``).
Every forward and backward goes through :func:`tmcore.runtime.dispatch.ops_for`, the
backward under its forward's options. What works where: docs/guides/pytorch.md.

The ops (``*conv``: the four :class:`tmcore.ConvParams` tensors; one ``*_backward`` each)::

    tmcore::trilinear_sample(volume, coords) -> out
    tmcore::gaussian_splat(content, mu, sigma, shape, eps, radius) -> volume
    tmcore::convlstm_step(x, h, c, *conv) -> (h_new, c_new)
    tmcore::memory_scan(h0, c0, read_coords, write_coords, write_sigma, write_content,
        *conv, eps, radius, checkpoint_every, reset, active)
        -> (reads, h_T, c_T, h_checkpoints, c_checkpoints)
    tmcore::local_scan, warp_scan, warp_flow_scan (:func:`option_scan`)
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import array_api_compat
import torch
from torch import Tensor

from tmcore.backends.fused import window_boxes
from tmcore.ops.cell import convlstm_step, convlstm_step_vjp
from tmcore.ops.sample import validate_sample_inputs
from tmcore.ops.splat import validate_splat_inputs
from tmcore.runtime.dispatch import ops_for
from tmcore.runtime.options import get_options, options
from tmcore.runtime.validate import check_positive, check_scan, check_values
from tmcore.scan.base import scan_backward, scan_forward
from tmcore.scan.dense import memory_scan_bwd, memory_scan_fwd, validate_scan_inputs
from tmcore.scan.options import ScanOptions, check_options, check_scan_bytes, step_for
from tmcore.types import ConvParams, Residuals, StepInputs, WarpInputs, WarpParams

__all__ = [
    "ConvLSTMStepFunction",
    "GaussianSplatFunction",
    "MemoryScanFunction",
    "OpSpec",
    "TrilinearSampleFunction",
    "call",
    "convlstm_step_op",
    "dense_scan",
    "gaussian_splat_op",
    "memory_scan_op",
    "trilinear_sample_op",
]

#: The array-API namespace of torch tensors.
XP = array_api_compat.array_namespace(torch.empty(0))
_XP = XP

#: set while an adapter function that has just validated its arguments runs its op, so
#: that the op's eager forward (a public entry of its own: ``torch.ops.tmcore.*``, which
#: validates when called directly) does not validate them a second time
_VALIDATED: contextvars.ContextVar[bool] = contextvars.ContextVar("tmcore_validated",
                                                                  default=False)


# --------------------------------------------------------------------------- the factory


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """What :func:`_make_op` needs to know about one primitive.

    ``primals``: the differentiable tensor inputs; ``statics``: ``(name, schema type)`` of the
    others; ``outputs``: the last ``residuals`` of them are saved for the backward and carry no
    gradient. ``forward(primals, statics) -> outputs``, ``backward(primals, residuals,
    cotangents, statics) -> a gradient per primal``, ``fake(primals, statics) -> outputs``
    (``torch.compile``; may check shapes), all over tuples; ``validate(primals, statics,
    residuals=(), cotangents=())`` checks the arguments of an eager call of the op or its
    backward that no adapter function checked first (:data:`_VALIDATED`). A double backward
    recomputes the residuals with ``forward``.
    """

    name: str
    primals: tuple[str, ...]
    statics: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    forward: Callable[[tuple, tuple], tuple]
    backward: Callable[[tuple, tuple, tuple, tuple], tuple]
    fake: Callable[[tuple, tuple], tuple]
    residuals: int = 0
    validate: Callable[..., Any] = lambda primals, statics, residuals=(), cotangents=(): None
    #: whether a double backward is supported (the local / warp scans: first order only)
    second_order: bool = True


def _fresh(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``outputs`` contiguous and owning their storage: a custom op's outputs may not
    share storage with its inputs nor with each other (a copy where one would)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor)}
    fresh = []
    for t in outputs:
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in seen and t.numel():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        fresh.append(t)
    return tuple(fresh)


def _schema(spec: OpSpec, backward: bool) -> str:
    """The ``torch.library`` schema of the op (or of its backward)."""
    differentiable = len(spec.outputs) - spec.residuals
    tensors = (*spec.primals, *((*spec.outputs[differentiable:], *(
        f"g_{name}" for name in spec.outputs[:differentiable])) if backward else ()))
    args = [f"Tensor {name}" for name in tensors]
    args += [f"{kind} {name}" + ("=None" if kind == "Tensor?" else "")  # (the masks)
             for name, kind in spec.statics]
    count = len(spec.primals) if backward else len(spec.outputs)
    result = "Tensor" if count == 1 else "(" + ", ".join(["Tensor"] * count) + ")"
    return f"({', '.join(args)}) -> {result}"


def _pullback(fn: Callable[..., Sequence[Tensor]], primals: Sequence[Tensor],
              needs: Sequence[bool], cotangents: Sequence[Tensor | None]) -> list[Tensor | None]:
    """``sum_k <cotangents[k], d fn(primals)[k] / d primals[i]>`` for the ``i`` in ``needs``
    (others ``None``): ``fn``, a backward, re-run under torch autograd on the generic path."""
    with torch.enable_grad(), options(generic=True):
        leaves = [p.detach().requires_grad_(n) for p, n in zip(primals, needs, strict=True)]
        outs = fn(*leaves)
        pairs = [(o, c) for o, c in zip(outs, cotangents, strict=True)
                 if c is not None and o.requires_grad]
        wrt = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs],
                                         allow_unused=True, materialize_grads=True)
                     if pairs and wrt else [torch.zeros_like(leaf) for leaf in wrt])
    return [next(grads).detach().contiguous() if leaf.requires_grad else None
            for leaf in leaves]


def _loop_vmap(op: Callable[..., Any]) -> Callable[..., Any]:
    """A vmap rule that calls ``op`` once per mapped slice and stacks the results."""

    def rule(info, in_dims, *args):
        outs = [op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims,
                                                                       strict=True)))
                for i in range(info.batch_size)]
        if isinstance(outs[0], tuple):
            return tuple(map(torch.stack, zip(*outs, strict=True))), (0,) * len(outs[0])
        return torch.stack(outs), 0

    return rule


def _interpreter() -> Any:
    """The innermost ``torch.func`` transform's interpreter (``None``: no transform)."""
    if torch._C._functorch.peek_interpreter_stack() is None:  # (no transform: cheap)
        return None
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    return retrieve_current_functorch_interpreter()


#: op -> ``direct(args, validated)``: its eager forward (what the custom op runs), for calls
#: that need no autograd (``validated``: the caller ran the op's checks)
_DIRECT: dict[Any, Callable[[tuple, bool], Any]] = {}


def _plain_inference(args: tuple) -> bool:
    """Whether a call may skip the op's wrappers: no gradient needed, every tensor a plain one
    with data (a fake, DTensor or meta tensor needs the op's registered rules)."""
    grad = torch.is_grad_enabled()
    for a in args:  # (a loop, not any(): a decode step passes 16 tensors)
        if isinstance(a, Tensor) and (type(a) not in (Tensor, torch.nn.Parameter) or a.is_meta
                                      or (grad and a.requires_grad)):
            return False
    return True


def call(function: type[torch.autograd.Function], op: Callable[..., Any], *args: Any,
         validated: bool = False) -> Any:
    """Run an op through its Function twin in eager mode (``torch.func``-safe), the custom op
    itself while ``torch.compile`` traces (Dynamo cannot trace the Function without grads).
    ``validated``: the caller ran the op's checks, which its eager forward then skips."""
    if torch.compiler.is_compiling():
        return op(*args)
    interpreter = _interpreter()
    if interpreter is None and _plain_inference(args):
        # no transform and no gradient (inference, a decode step): the op's own forward,
        # without the autograd Function and the dispatcher around it (the same
        # computation; a few hundred microseconds less per call on the CPU)
        return _DIRECT[op](args, validated)
    if interpreter is not None and interpreter.key().name == "Jvp":  # (no jvp rules)
        raise NotImplementedError(
            f"tmcore: {getattr(op, '_name', op)} has no forward-mode derivative (torch.func.jvp, "
            f"jacfwd, hessian via jacfwd): tmcore registers reverse-mode VJPs only. Use reverse "
            f"mode (torch.func.grad / vjp / jacrev, or torch.autograd.grad twice)")
    return _run(function.apply, args, validated)


def _run(fn: Callable[..., Any], args: tuple, validated: bool) -> Any:
    """``fn(*args)``, with :data:`_VALIDATED` set to ``validated`` while it runs."""
    token = _VALIDATED.set(validated)
    try:
        return fn(*args)
    finally:
        _VALIDATED.reset(token)


def _twin(name: str, op: Any, direct: Callable[..., Any], setup: Callable[..., Any],
          grad: Callable[..., Any]) -> type[torch.autograd.Function]:
    """The ``autograd.Function`` twin of ``op`` (see the module docstring): its forward, with
    the very rules registered on the op (``generate_vmap_rule`` composes the ops' vmap rules)."""
    def forward(*args):
        # op's own forward where _plain_inference allows (grad is off in a forward), eager,
        # no transform and no mode sees ops (a counter sees one op): the custom op's dispatcher
        # imports torch._dynamo on its first call (+165 MiB resident, 0.9 s in a first step)
        plain = not (torch._C._len_torch_function_stack()
                     or torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling()
                     or _interpreter() is not None) and _plain_inference(args)
        return (direct if plain else op)(*args)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup),
        "backward": staticmethod(grad), "generate_vmap_rule": True})


class MadeOp(NamedTuple):
    """What :func:`_make_op` returns: the op and its Function twin (its backward op is
    ``torch.ops.tmcore.<name>_backward``)."""

    op: Any
    function: type[torch.autograd.Function]


def _make_op(spec: OpSpec) -> MadeOp:
    """Register ``tmcore::<name>`` and ``tmcore::<name>_backward`` from ``spec``."""
    n_primals, n_statics = len(spec.primals), len(spec.statics)
    differentiable = len(spec.outputs) - spec.residuals
    single = len(spec.outputs) == 1

    def split(args: tuple) -> tuple[tuple, tuple]:
        return tuple(args[:n_primals]), tuple(args[len(args) - n_statics:])

    def full(args: tuple, backward: bool = False) -> tuple:
        """``args`` with the trailing defaults (the masks' ``None``) the dispatcher drops."""
        total = n_primals + n_statics + (spec.residuals + differentiable if backward else 0)
        return (*args, *(None,) * (total - len(args)))

    def direct(args: tuple, validated: bool):
        primals, statics = split(full(args))
        if not validated:  # an eager call of the op itself: the public checks
            spec.validate(primals, statics)
        out = _fresh(spec.forward(primals, statics), primals)
        return out[0] if single else out

    def forward(*args):
        return direct(args, _VALIDATED.get())

    def fake(*args):
        primals, statics = split(full(args))
        out = tuple(spec.fake(primals, statics))
        return out[0] if single else out

    def backward(*args):
        args = full(args, backward=True)
        primals, statics = split(args)
        residuals = tuple(args[n_primals:n_primals + spec.residuals])
        cotangents = tuple(args[n_primals + spec.residuals:len(args) - n_statics])
        if not _VALIDATED.get():  # a direct call of the backward op (autograd's are checked)
            spec.validate(primals, statics, residuals, cotangents)
        return tuple(g.contiguous() for g in spec.backward(primals, residuals, cotangents,
                                                           statics))

    op = torch.library.custom_op(f"tmcore::{spec.name}", forward, mutates_args=(),
                                 schema=_schema(spec, backward=False))
    op.register_fake(fake)
    backward_op = torch.library.custom_op(f"tmcore::{spec.name}_backward", backward,
                                          mutates_args=(), schema=_schema(spec, backward=True))
    backward_op.register_fake(lambda *args: tuple(map(torch.empty_like, args[:n_primals])))

    def setup(ctx, inputs, output):
        primals, statics = split(full(tuple(inputs)))
        outputs = (output,) if single else tuple(output)
        residuals = outputs[differentiable:]
        if residuals:
            ctx.mark_non_differentiable(*residuals)
        # Unused outputs get None, not zeros: materialized zero cotangents for the
        # residuals would be a second copy of every saved state (as big as the saved
        # states themselves) at the start of the backward. grad() fills in zeros.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*primals, *residuals)
        ctx.statics = statics
        ctx.out_like = [(o.shape, o.dtype, o.device) for o in outputs[:differentiable]]
        ctx.tm_options = get_options()

    def grad(ctx, *cotangents):
        saved = ctx.saved_tensors
        primals, residuals = saved[:n_primals], saved[n_primals:]
        # unused outputs (a scan's h_T and c_T when the loss reads only the reads) get zeros;
        # outputs of one shape share one zero tensor (the backward only reads its inputs)
        # (eager only: traced shapes are symbolic, compared by guards)
        zeros: dict[Any, Tensor] = {}
        filled = []
        for i, (g, like) in enumerate(zip(cotangents[:differentiable], ctx.out_like,
                                          strict=True)):
            key = i if torch.compiler.is_compiling() else like
            if g is None and key not in zeros:
                zeros[key] = torch.zeros(like[0], dtype=like[1], device=like[2])
            filled.append(zeros[key] if g is None else g.contiguous())
        # the forward checked the primals, autograd shapes the cotangents like the outputs:
        # the backward checks nothing again
        with options(**dataclasses.asdict(ctx.tm_options)):
            if torch.compiler.is_compiling():
                grads = backward_op(*primals, *residuals, *filled, *ctx.statics)
            else:
                grads = _run(backward_function.apply,
                             (*primals, *residuals, *filled, *ctx.statics), True)
        return (*grads, *([None] * n_statics))

    def backward_setup(ctx, inputs, output):
        inputs = full(tuple(inputs), backward=True)
        ctx.save_for_backward(*inputs[:len(inputs) - n_statics])
        ctx.statics = tuple(inputs[len(inputs) - n_statics:])
        ctx.tm_options = get_options()

    def backward_grad(ctx, *g_grads):
        if not spec.second_order:
            raise RuntimeError(DOUBLE_BACKWARD)
        saved, statics, needs = ctx.saved_tensors, ctx.statics, ctx.needs_input_grad
        primals, cotangents = saved[:n_primals], saved[n_primals + spec.residuals:]

        # Differentiate "recompute the residuals, then the backward" from the primals, so
        # the residual inputs (functions of the primals) need no gradient of their own.
        def fn(*leaves):
            prim, cot = tuple(leaves[:n_primals]), tuple(leaves[n_primals:])
            return spec.backward(prim, spec.forward(prim, statics)[differentiable:], cot,
                                 statics)

        with options(**dataclasses.asdict(ctx.tm_options)):
            grads = _pullback(fn, (*primals, *cotangents), (
                *needs[:n_primals], *needs[n_primals + spec.residuals:len(needs) - n_statics]),
                g_grads)
        return (*grads[:n_primals], *([None] * spec.residuals), *grads[n_primals:],
                *([None] * n_statics))

    op.register_autograd(grad, setup_context=setup)
    backward_op.register_autograd(backward_grad, setup_context=backward_setup)
    op.register_vmap(_loop_vmap(op))
    backward_op.register_vmap(_loop_vmap(backward_op))

    title = "".join(part.title() for part in spec.name.split("_"))
    backward_function = _twin(f"_{title}BackwardFunction", backward_op, backward,
                              backward_setup, backward_grad)
    function = _twin(f"{title}Function", op, forward, setup, grad)
    _DIRECT[op] = direct
    return MadeOp(op, function)


# --------------------------------------------------------------------------- the four ops


_SAMPLE = _make_op(OpSpec(
    name="trilinear_sample", primals=("volume", "coords"), statics=(), outputs=("out",),
    forward=lambda p, s: (ops_for(_XP).sample_fwd(_XP, *p),),
    backward=lambda p, r, g, s: ops_for(_XP).sample_bwd(_XP, *p, *g),
    fake=lambda p, s: (p[0].new_empty((p[0].shape[0], p[1].shape[1], p[0].shape[1])),),
    validate=lambda p, s, r=(), g=(): validate_sample_inputs(*p, *g)))

_SPLAT = _make_op(OpSpec(
    name="gaussian_splat", primals=("content", "mu", "sigma"),
    statics=(("shape", "SymInt[]"), ("eps", "float"), ("radius", "float?")),
    outputs=("volume",),
    forward=lambda p, s: (ops_for(_XP).splat_fwd(_XP, *p, tuple(s[0]), *s[1:]),),
    backward=lambda p, r, g, s: ops_for(_XP).splat_bwd(_XP, *p, tuple(s[0]), *g, *s[1:]),
    fake=lambda p, s: (p[0].new_empty((p[0].shape[0], p[0].shape[2], *s[0])),),
    validate=lambda p, s, r=(), g=(): validate_splat_inputs(*p, s[0], *g, radius=s[2],
                                                             eps=s[1])))

_SCAN_PRIMALS = ("h0", "c0", "read_coords", "write_coords", "write_sigma", "write_content",
                 *ConvParams._fields)


def _scan_forward(primals, statics):
    eps, radius, checkpoint_every, reset, active = statics
    return memory_scan_fwd(_XP, *primals[:6], ConvParams(*primals[6:]), eps=eps, radius=radius,
                           checkpoint_every=checkpoint_every, reset=reset, active=active)


def _scan_validate(primals, statics, residuals=(), cotangents=()):
    eps, radius, checkpoint_every, reset, active = statics
    validate_scan_inputs(*primals[:6], ConvParams(*primals[6:]), checkpoint_every, radius,
                         *cotangents, eps=eps, reset=reset, active=active)
    if residuals:
        _check_residuals(primals, residuals, checkpoint_every)


def _check_residuals(primals: Sequence[Tensor], residuals: Sequence[Tensor],
                     checkpoint_every: int) -> None:
    """``TypeError`` / ``ValueError`` naming the residual unless ``h_checkpoints`` /
    ``c_checkpoints`` are what the forward returned: contiguous ``(ceil(T / k), B, C, *S)``
    tensors in ``h0``'s dtype and device (else the replay gives wrong gradients)."""
    h0, steps = primals[0], primals[2].shape[1]
    saved = -(-steps // checkpoint_every)
    want = (saved, *h0.shape)
    for name, value in zip(("h_checkpoints", "c_checkpoints"), residuals, strict=True):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != want:
            raise ValueError(
                f"{name}: expected shape (ceil(T / k), B, C, *S) = {want} (T = {steps} from "
                f"read_coords, k = checkpoint_every = {checkpoint_every}, B, C, *S from h0: "
                f"the {name} the forward returned), got {tuple(value.shape)}")
        if value.dtype != h0.dtype:
            raise TypeError(f"{name}: expected a floating dtype, h0's {h0.dtype} (the "
                            f"forward's checkpoints), got {value.dtype}")
        if value.device != h0.device:
            raise ValueError(f"{name}: expected a tensor on h0's device {h0.device}, "
                             f"got one on {value.device}")
        if not value.is_contiguous():
            raise ValueError(f"{name}: expected the contiguous tensor the forward returned, "
                             f"got strides {tuple(value.stride())} for shape "
                             f"{tuple(value.shape)} (a transposed or expanded view)")


def _scan_backward(primals, residuals, cotangents, statics):
    eps, radius, checkpoint_every, reset, active = statics
    grads = memory_scan_bwd(_XP, *primals[2:6], ConvParams(*primals[6:]), *residuals,
                            *cotangents, eps=eps, radius=radius,
                            checkpoint_every=checkpoint_every, reset=reset, active=active)
    return (*grads[:6], *grads.params)


def _scan_fake(primals, statics):
    # The adapter's memory_scan validates eagerly; under torch.compile Dynamo cannot trace
    # the validator, so its shape checks run here, once per trace, in plain Python (fake
    # tensors have no values: validate mode's value checks are off).
    with options(validate=False):
        _scan_validate(primals, statics)
    h0, c0, read_coords = primals[:3]
    saved = -(-read_coords.shape[1] // statics[2])
    return (h0.new_empty((h0.shape[0], read_coords.shape[1], h0.shape[1])), torch.empty_like(h0),
            torch.empty_like(c0), h0.new_empty((saved, *h0.shape)),
            c0.new_empty((saved, *c0.shape)))


_SCAN = _make_op(OpSpec(
    name="memory_scan", primals=_SCAN_PRIMALS,
    statics=(("eps", "float"), ("radius", "float?"), ("checkpoint_every", "int"),
             ("reset", "Tensor?"), ("active", "Tensor?")),
    outputs=("reads", "h", "c", "h_checkpoints", "c_checkpoints"), residuals=2,
    forward=_scan_forward, backward=_scan_backward, fake=_scan_fake, validate=_scan_validate))



def _cell_backward(primals, residuals, cotangents, statics):
    *grads, d_conv = convlstm_step_vjp(*primals[:3], ConvParams(*primals[3:]), *cotangents)
    return (*grads, *d_conv)


_CELL = _make_op(OpSpec(
    name="convlstm_step", primals=("x", "h", "c", *ConvParams._fields), statics=(),
    outputs=("h_new", "c_new"),
    # convlstm_step checks its inputs (a public entry), also in a compiled graph
    forward=lambda p, s: convlstm_step(*p[:3], ConvParams(*p[3:])),
    backward=_cell_backward, fake=lambda p, s: (torch.empty_like(p[1]), torch.empty_like(p[1]))))

trilinear_sample_op = _SAMPLE.op
gaussian_splat_op = _SPLAT.op
memory_scan_op = _SCAN.op
TrilinearSampleFunction = _SAMPLE.function
GaussianSplatFunction = _SPLAT.function
MemoryScanFunction = _SCAN.function
convlstm_step_op = _CELL.op
ConvLSTMStepFunction = _CELL.function


# --------------------------------------------------------------------------- option scans

#: The error of a double backward (``create_graph=True``) through the local / warp scan.
DOUBLE_BACKWARD = (
    "tmcore: double backward (create_graph=True) through the local / warp scan "
    "(update='local' or dynamics='warp') is not supported: its backward is first order "
    "only. Use the default layer for second-order gradients")

#: The statics of the option scans: the :class:`tmcore.scan.ScanOptions` fields, whether
#: the residuals are kept (no backward will be asked for: none are made), the masks
_OPTION_STATICS = (("update", "str"), ("window", "int?"), ("eps", "float"),
                   ("radius", "float?"), ("method", "str"), ("checkpoint_every", "int"),
                   ("keep", "bool"), ("reset", "Tensor?"), ("active", "Tensor?"))


def _option_parts(primals: tuple, statics: tuple, warp: bool, flow: bool):
    """``(step, params, xs, h0, c0, every, keep)`` of an option scan's arguments."""
    options, keep = ScanOptions(*statics[:6]), statics[6]  # (statics[7:]: the masks)
    h0, c0 = primals[:2]
    xs = (WarpInputs(*primals[2:7]) if warp else StepInputs(*primals[2:6]))
    cell = ConvParams(*primals[len(xs) + 2:len(xs) + 6])
    params = WarpParams(cell, ConvParams(*primals[-4:]) if flow else None) if warp else cell
    return step_for(options, warp), params, xs, h0, c0, options.checkpoint_every, keep


def _make_option_scan(name: str, warp: bool, flow: bool) -> MadeOp:
    """One option scan (``update="local"`` and / or ``dynamics="warp"``) as a custom op:
    :func:`tmcore.scan.base.scan_forward` / ``scan_backward`` over the options' step."""
    primals = ("h0", "c0", "read_coords", "write_coords", "write_sigma", "write_content",
               *(("shift",) if warp else ()), *ConvParams._fields,
               *(tuple(f"flow_{f}" for f in ConvParams._fields) if flow else ()))

    def forward(primals, statics):
        step, params, xs, h0, c0, every, keep = _option_parts(primals, statics, warp, flow)
        reads, h, c, residuals = scan_forward(_XP, step, params, h0, c0, xs,
                                              checkpoint_every=every, keep=keep,
                                              reset=statics[7], active=statics[8])
        # the loop's Residuals as three tensors (empty where unused)
        parts = () if residuals is None else (
            residuals.log if residuals.log is not None else (residuals.h, residuals.c))
        return (reads, h, c, *parts, *(h.new_empty((0,)) for _ in range(3 - len(parts))))

    def backward(primals, residuals, cotangents, statics):
        step, params, xs, h0, c0, every, keep = _option_parts(primals, statics, warp, flow)
        if not keep:
            raise RuntimeError("tmcore: this local / warp scan ran without residuals "
                               "(no input required grad when it ran)")
        residuals = (Residuals(None, None, tuple(residuals)) if step.policy == "log"
                     else Residuals(*residuals[:2], None))
        d_h, d_c, d_xs, d_params = scan_backward(_XP, step, params, residuals, xs, *cotangents,
                                                 checkpoint_every=every, reset=statics[7],
                                                 active=statics[8])
        cell, flows = (d_params.cell, d_params.flow or ()) if warp else (d_params, ())
        return (d_h, d_c, *d_xs, *cell, *flows)

    def fake(primals, statics):
        step, _, xs, h0, c0, every, keep = _option_parts(primals, statics, warp, flow)
        (batch, channels, *grid), steps = h0.shape, xs.read_coords.shape[1]
        shapes = [(0,)] * 3  # the residuals'
        if keep and step.policy == "checkpoint":
            shapes = [(-(-steps // every), *h0.shape)] * 2 + [(0,)]
        elif keep:
            _, box, corner = window_boxes(tuple(grid), step.window)
            shapes = [(steps, batch, channels, *box)] * 2 + [(steps, batch, channels, *corner)]
        return (h0.new_empty((batch, steps, channels)), torch.empty_like(h0),
                torch.empty_like(c0), *map(h0.new_empty, shapes))

    return _make_op(OpSpec(name=name, primals=primals, statics=_OPTION_STATICS,
                           outputs=("reads", "h", "c", "residual_0", "residual_1", "residual_2"),
                           residuals=3, forward=forward, backward=backward, fake=fake,
                           second_order=False))


_OPTION_SCANS = {(False, False): _make_option_scan("local_scan", False, False),
                 (True, False): _make_option_scan("warp_scan", True, False),
                 (True, True): _make_option_scan("warp_flow_scan", True, True)}


def option_scan(options: ScanOptions, h0: Tensor, c0: Tensor, inputs: Any,
                params: ConvParams, flow_params: ConvParams | None = None, *,
                reset: Tensor | None = None, active: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Run the layer's scan with its options beyond the paper, with tmcore's VJP.

    One custom op per kind (``tmcore::local_scan``, ``warp_scan`` or ``warp_flow_scan``): the
    local and warped steps of :mod:`tmcore.scan` in the one scan loop; first order only.

    Parameters
    ----------
    options : ScanOptions
        :func:`tmcore.scan.scan_options` of the layer's config.
    h0, c0 : Tensor, shape ``(B, C, *S)``
        The state entering the first chunk.
    inputs : StepInputs or WarpInputs of ``(B, T, ...)`` tensors
        The heads' outputs (a warp when they carry a ``shift``).
    params, flow_params : ConvParams, ConvParams or None
        The gates' conv and the per-cell flow's (``flow=True``).
    reset, active : Tensor, shape ``(B, T)``, bool, optional
        The per-step row masks (:func:`tmcore.memory_scan`).

    Returns
    -------
    reads : Tensor, shape ``(B, T, C)``
        What each chunk read, before its write.
    h_T, c_T : Tensor, shape ``(B, C, *S)``
        The final state.

    Raises
    ------
    ValueError
        If ``options.checkpoint_every`` is not an int >= 1.
    """
    options = check_options(options)
    shift = getattr(inputs, "shift", None)
    made = _OPTION_SCANS[(shift is not None, flow_params is not None)]
    tensors = (h0, c0, *inputs, *params, *(flow_params or ()))
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not torch.compiler.is_compiling():  # before anything is allocated
        check_scan_bytes(XP, step_for(options, shift is not None), h0,
                         inputs.read_coords.shape[1], options.checkpoint_every, keep,
                         flow_params is not None)
    out = call(made.function, made.op, *tensors, *options, keep, reset, active)
    return out[0], out[1], out[2]


#: ``checkpoint_every`` of a scan that needs no backward: larger than any ``T``, so only
#: the initial state is kept (``ceil(T / k) = 1``)
NO_GRAD_CHECKPOINT_EVERY = 2**31 - 1


def dense_scan(h0: Tensor, c0: Tensor, inputs: Any, params: ConvParams, *, eps: float,
               radius: float | None, checkpoint_every: int, reset: Tensor | None = None,
               active: Tensor | None = None, validated: bool = False
               ) -> tuple[Tensor, Tensor, Tensor]:
    """The paper's scan with autograd: ``(reads (B, T, C), h_T, c_T)``. ``validated``: the
    inputs are a layer's heads, so only the size gate (a backward's: the layer's call
    counted the rest) and validate mode's value checks run; else
    :func:`validate_scan_inputs`."""
    tensors = (h0, c0, *inputs, *params)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not torch.compiler.is_compiling():  # (Dynamo cannot trace the checks)
        if validated:
            if get_options().validate:  # validate mode: the values the scan receives
                check_values(XP, {"h0": h0, "c0": c0, **inputs._asdict(),
                                  **{f"params.{k}": v for k, v in params._asdict().items()}})
                check_positive(XP, "write_sigma", inputs.write_sigma)
            if grad:  # (without, the layer's size gate counted this scan: check_forward)
                check_scan(XP, h0, inputs.read_coords.shape[1], checkpoint_every, grad)
        else:
            validate_scan_inputs(h0, c0, *inputs, params, checkpoint_every, radius, eps=eps,
                                 backward=grad, reset=reset, active=active)
    # one checkpoint whatever T without a backward: a constant, so that a compiled no_grad
    # call does not specialize on (and recompile for) each length
    every = int(checkpoint_every) if grad else NO_GRAD_CHECKPOINT_EVERY
    out = call(MemoryScanFunction, memory_scan_op, *tensors, float(eps),
               None if radius is None else float(radius), every, reset, active, validated=True)
    return out[0], out[1], out[2]
