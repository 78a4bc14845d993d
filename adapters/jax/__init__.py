"""JAX adapter: tmcore's hand-written VJPs as ``jax.custom_vjp``, a pure layer, a Flax module.

Three levels, each a thin layer over the one below:

1. **Primitives** -- :func:`trilinear_sample`, :func:`gaussian_splat` and
   :func:`memory_scan` are ``jax.custom_vjp`` functions whose forward and
   backward are tmcore's own. The scan is ONE checkpointing ``lax.scan``
   (:mod:`tmcore.adapters.jax.bridge`) built from ``tmcore.scan.step_fwd`` /
   ``step_bwd``; its backward keeps every ``checkpoint_every``-th state and
   replays the segments in between. They work under ``jit``, ``vmap``,
   ``grad`` and ``shard_map`` (default ``check_vma=True``). Second order:
   reverse-over-reverse (``grad(grad(f))``) works; forward mode (``jvp``,
   ``jacfwd``, ``hessian``) is not available for ``custom_vjp`` functions and
   raises a ``TypeError`` saying so and what to use instead.
2. **Pure layer** -- :func:`init` / :func:`apply` over a nested-dict parameter
   pytree whose keys and layouts equal the PyTorch adapter's state dict
   (``weight`` is ``(out, in)``) and which carries its
   :class:`tmcore.layer.LayerConfig` (``params["config"]``), the gated residual
   :func:`residual_init` / :func:`residual_apply`, the multi-layer :func:`stack_apply` (modes
   ``"causal"`` and ``"threaded"``), streaming (state in, state out,
   :func:`detach_state`, a per-sequence bool ``reset`` mask), and
   :func:`params_from_state_dict` / :func:`state_dict_from_params`.
3. **Flax NNX** -- :class:`TensorMemory` and :class:`MemoryResidual`
   hold the same pytree as ``nnx.Param`` leaves and the config as ``config``;
   :func:`params_from_module` / :func:`load_params` convert.

The layer itself (configuration checks, parameter plan, heads, chunking,
reset, modes, stored-grid check, streaming) is :mod:`tmcore.layer` /
:class:`tmcore.layer.Layer`, shared with the PyTorch adapter: :func:`apply` calls
``Layer.forward`` (``stream=False``) or ``Layer.forward_stream`` (the default)
with :func:`memory_scan` as the scan, as the torch adapter does; the heads and
``out_proj`` run once over all chunks, so the compiled program does not grow
with the number of chunks. This package adds JAX's side: the scan registered
with ``custom_vjp``, pytrees, dtype promotion and sharding-friendly zero states.

Its modules, one job each (imports go one way, in this order):
:mod:`~tmcore.adapters.jax.bridge` (the ``custom_vjp`` registrations and the one
checkpointed ``lax.scan``), :mod:`~tmcore.adapters.jax.primitives` (the checked
primitives), :mod:`~tmcore.adapters.jax.checkpoints` (state dicts, the config node),
:mod:`~tmcore.adapters.jax.functional` (:func:`init`, :func:`apply`, the states,
streaming), :mod:`~tmcore.adapters.jax.stack` (the residual and the stack) and
:mod:`~tmcore.adapters.jax.nnx` (the Flax NNX modules).
"""

from tmcore import layer as tl
from tmcore.adapters.jax.checkpoints import params_from_state_dict, state_dict_from_params
from tmcore.adapters.jax.functional import (
    STREAM_CACHE_SIZE,
    MemoryState,
    StreamState,
    apply,
    config_of,
    conv_params,
    detach_state,
    doc_starts_from_offsets,
    empty_stream_state,
    init,
    init_state,
    reset_state,
)
from tmcore.adapters.jax.nnx import MemoryResidual, TensorMemory, load_params, params_from_module
from tmcore.adapters.jax.primitives import gaussian_splat, memory_scan, trilinear_sample
from tmcore.adapters.jax.stack import residual_apply, residual_init, stack_apply

__all__ = ["MODES", "STREAM_CACHE_SIZE", "MemoryState", "MemoryResidual", "StreamState",
           "TensorMemory", "apply", "config_of", "conv_params", "detach_state",
           "doc_starts_from_offsets", "empty_stream_state", "gaussian_splat", "init",
           "init_state", "load_params", "memory_scan", "params_from_module",
           "params_from_state_dict", "residual_apply", "reset_state", "residual_init",
           "stack_apply", "state_dict_from_params", "trilinear_sample"]

#: Multi-layer modes of :func:`stack_apply` (:data:`tmcore.layer.MODES`).
MODES = tl.MODES
