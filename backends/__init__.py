"""Optional fast paths per array namespace, chosen at call time from the arrays.

tmcore's public functions (and the scan step) call ``tmcore.runtime.dispatch.ops_for(xp)``,
which asks :func:`ops_for_namespace` once per namespace and caches the answer.
A backend module is imported only when arrays of its namespace arrive, and only
if its framework is already in ``sys.modules`` (holding its array means it was
imported), so ``import tmcore`` and ``import tmcore.backends`` import no framework.

=================  ==========================================================
namespace          fast paths (everything else: the generic array-API path)
=================  ==========================================================
PyTorch            ``grid_sample`` read and its ``grid_sampler`` backward
                   (n = 1, 2, 3), grouped ``conv3d`` depthwise taps (CUDA);
                   on the CPU fused C kernels for the depthwise passes and
                   the gates (:mod:`tmcore.backends.native`, built on
                   first use; ``tmcore.options(native=False)`` or
                   ``TMCORE_NATIVE=0`` turns them off) and the whole scan,
                   dense and local, on them (:mod:`tmcore.backends.torch`);
                   on CUDA the whole scan as fused Triton kernels, the
                   local one too (:mod:`tmcore.backends.triton`);
                   float16 / bfloat16 computed in float32
JAX                on the CPU the fused C kernels as XLA custom calls
                   (``jax.ffi``); off-CPU ``lax.conv_general_dilated``
                   depthwise taps (jit-safe, x64 on or off); float16 /
                   bfloat16 computed in float32
CuPy               the whole scan through the same Triton kernels (zero-copy
                   DLPack bridge) when torch and triton are installed;
                   float16 computed in float32
NumPy              float16 computed in float32 (no faster kernel measured)
any other          the generic path
=================  ==========================================================

Each fast path is measured against the generic one by
``benchmarks/backend_fastpaths.py`` and tested against it (and the float64
reference) by ``tests/test_backends.py``. Gradients are deterministic by
default everywhere (see :mod:`tmcore.backends.torch.sample` for CUDA).

Forcing the generic path, for comparison and debugging::

    with tmcore.options(generic=True):
        tmcore.trilinear_sample(volume, coords)

or set the environment variable ``TMCORE_GENERIC=1`` (it sets the option's
default). :func:`use_generic` is the same switch under its older name. Every
switch (``native``, ``triton``, ``deterministic``, ``depthwise``, ...) is an
option of :func:`tmcore.options`; a backend's ``make_ops(generic, options)`` may
read them, since tables are cached per namespace and options value (backend
modules hold no switches of their own).
Under ``jax.jit`` the choice is made while tracing.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import array_api_compat

from tmcore.runtime.dispatch import ENV_VAR, Ops, generic_ops, ops_for
from tmcore.runtime.options import Options, get_options, options

__all__ = ["use_generic", "ops_for_namespace", "backend_name", "native_kernels_active",
           "triton_kernels_active", "triton_graph_cache_bytes", "release_scan_buffers",
           "ops_for", "generic_ops",
           "Ops", "ENV_VAR"]

# (predicate on the namespace, framework that must already be imported, backend module)
_REGISTRY: list[tuple[Callable[[Any], bool], str, str]] = [
    (array_api_compat.is_torch_namespace, "torch", "tmcore.backends.torch"),
    (array_api_compat.is_jax_namespace, "jax", "tmcore.backends.jax"),
    (array_api_compat.is_numpy_namespace, "numpy", "tmcore.backends.numpy"),
    (array_api_compat.is_cupy_namespace, "cupy", "tmcore.backends.cupy"),
]


def backend_name(xp: Any) -> str:
    """Name the backend that serves a namespace.

    Parameters
    ----------
    xp : namespace
        An array namespace (``array_api_compat.array_namespace(x)``).

    Returns
    -------
    str
        ``"torch"``, ``"jax"``, ``"numpy"``, ``"cupy"`` or ``"generic"``.
    """
    for is_namespace, framework, _ in _REGISTRY:
        if is_namespace(xp):
            return framework
    return "generic"


def ops_for_namespace(xp: Any, generic: Ops, options: Options | None = None) -> Ops:
    """Build the :class:`Ops` table for a namespace (uncached; tmcore caches it).

    Each backend module exposes ``make_ops(generic)`` or ``make_ops(generic,
    options) -> Ops`` and may reuse any of ``generic``'s entries. A backend is
    imported only when its framework is already in ``sys.modules``.

    Parameters
    ----------
    xp : namespace
        The array namespace.
    generic : Ops
        The generic array-API table (:func:`generic_ops`).
    options : tmcore.Options, optional
        The options to build for (default: :func:`tmcore.get_options`).

    Returns
    -------
    Ops
        The backend's table, or ``generic`` for a namespace without one.
    """
    options = get_options() if options is None else options
    for is_namespace, framework, module in _REGISTRY:
        if is_namespace(xp):
            if framework not in sys.modules:
                return generic
            make_ops = importlib.import_module(module).make_ops
            if len(inspect.signature(make_ops).parameters) >= 2:
                return make_ops(generic, options)
            return make_ops(generic)
    return generic


def native_kernels_active() -> bool:
    """Tell whether the fused C kernels for the CPU run here.

    Returns
    -------
    bool
        True when the ``native`` option is on and the kernels are built (they are
        compiled on the first call that needs them, which this call may be).
    """
    from tmcore.backends import native

    return bool(native.enabled() and native.library() is not None)


def triton_kernels_active(x: Any) -> bool:
    """Tell whether the fused Triton scan of the torch backend runs on tensors like ``x``.

    Parameters
    ----------
    x : torch.Tensor
        A state-like tensor ``(B, C, *S)`` on the device in question (its device,
        dtype and channels decide), not requiring grad.

    Returns
    -------
    bool
        True when the ``triton`` option allows the kernels, Triton imports and
        the kernels support ``x``'s device, dtype and size.
    """
    from tmcore.backends.triton import launch

    return bool(launch.usable(x))


def triton_graph_cache_bytes() -> int:
    """Count the bytes the fused Triton scan's cached CUDA graphs hold between calls.

    Returns
    -------
    int
        The bytes of the graphs' static inputs and outputs (memory a training
        step's peak does not show); 0 when nothing is cached.
    """
    from tmcore.backends.triton import launch

    return launch.graph_cache_bytes()


@contextlib.contextmanager
def use_generic(enabled: bool = True) -> Iterator[None]:
    """Force (or, with ``enabled=False``, un-force) the generic path in a ``with`` block.

    The older name of ``tmcore.options(generic=enabled)``: local to the current
    thread / asyncio task; ``TMCORE_GENERIC=1`` makes forcing the default.

    Parameters
    ----------
    enabled : bool, default True
        Whether the generic path is forced inside the block.

    Yields
    ------
    None
        Inside the block the option is set; it is restored on exit.

    Raises
    ------
    TypeError
        If ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected True or False, got {enabled!r}")
    with options(generic=enabled):
        yield


def release_scan_buffers() -> None:
    """Free the buffers the fused CPU scan of the torch backend keeps between calls.

    The fused scan keeps its big buffers (checkpoints, per-step blocks, states) in a
    per-thread pool, so that a training loop does not page-fault fresh memory every
    step; the pool holds about one call's buffers and drops blocks unused for 16
    calls. Call this after the last scan of a phase (e.g. before evaluation on other
    shapes) to return them; a buffer still referenced by a tensor is freed once that
    tensor goes. It does nothing when torch was never used.

    Returns
    -------
    None
        The calling thread's pool is emptied.
    """
    memory = sys.modules.get("tmcore.backends.torch.memory")
    if memory is not None:
        memory.release_scan_buffers()
