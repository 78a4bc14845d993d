"""Optional fast paths per array namespace, and the public registry that finds them.

A backend is a name, a predicate on the namespace and a ``make_ops(generic, options) ->
Ops``, registered with :func:`register_backend` (the built-ins too) or through the
entry-point group :data:`ENTRY_POINT_GROUP` (docs/guides/adding-a-backend.md). Its module
is imported only when arrays of its namespace arrive, a built-in's only if its framework is
already imported, so ``import tmcore`` imports no framework. What each built-in one
accelerates, and how it is measured and tested: docs/guides/backends.md.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import array_api_compat

from tmcore.runtime import dispatch
from tmcore.runtime.dispatch import ENV_VAR, Ops, generic_ops, ops_for
from tmcore.runtime.options import Options, get_options

__all__ = ["Backend", "ENTRY_POINT_GROUP", "register_backend", "unregister_backend",
           "backend_for", "backend_name", "ops_for_namespace", "native_kernels_active",
           "triton_kernels_active", "triton_graph_cache_bytes", "release_scan_buffers",
           "ops_for", "generic_ops", "Ops", "ENV_VAR"]

#: The entry-point group an installed package registers its backends through: each entry
#: names a function of no arguments that calls :func:`register_backend`.
ENTRY_POINT_GROUP = "tmcore.backends"


class Backend(NamedTuple):
    """A registered backend.

    Parameters
    ----------
    name : str
        Its name (:func:`backend_name`; :func:`unregister_backend`'s key).
    is_namespace : callable
        ``(xp) -> bool`` on ``array_api_compat.array_namespace(x)``, importing nothing.
    make_ops : callable or str
        ``make_ops(generic, options) -> Ops``, or ``"module:function"`` naming it (imported
        when arrays of the namespace arrive).
    requires : str or None, default None
        A module that must already be imported for it to serve (its framework).
    """

    name: str
    is_namespace: Callable[[Any], bool]
    make_ops: Callable[[Ops, Options], Ops] | str
    requires: str | None = None

    @property
    def module(self) -> str:
        """The name of the module that holds ``make_ops``."""
        if isinstance(self.make_ops, str):
            return self.make_ops.partition(":")[0]
        return getattr(self.make_ops, "__module__", None) or repr(self.make_ops)


_BACKENDS: list[Backend] = []  # asked in this order: the latest registered first
_entry_points_unread = False  # True once the built-ins are registered (end of module)


def _read_entry_points() -> None:
    """Call each installed :data:`ENTRY_POINT_GROUP` entry point once (a broken one warns)."""
    global _entry_points_unread
    if not _entry_points_unread:
        return
    _entry_points_unread = False
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()()
        except Exception as exc:  # noqa: BLE001 - one broken package must not stop tmcore
            warnings.warn(f"the {ENTRY_POINT_GROUP} entry point {entry.name} = {entry.value} "
                          f"failed and is skipped: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=3)


def register_backend(name: str, is_namespace: Callable[[Any], bool],
                     make_ops: Callable[[Ops, Options], Ops] | str, *,
                     requires: str | None = None) -> Backend:
    """Register a backend: ``make_ops`` builds the table of the namespaces ``is_namespace`` takes.

    The latest registration is asked first; a name registered again is replaced; tables built
    before are forgotten.

    Parameters
    ----------
    name, is_namespace, make_ops, requires : see Backend
        The fields of the :class:`Backend` it makes.

    Returns
    -------
    Backend
        The registered entry.

    Raises
    ------
    TypeError
        If an argument has the wrong type.
    ValueError
        If ``name`` is empty or a ``make_ops`` string is not ``"module:function"``.
    """
    if not isinstance(name, str) or not name:
        raise (TypeError if not isinstance(name, str) else ValueError)(
            f"name: expected a non-empty string, got {name!r}")
    if not callable(is_namespace):
        raise TypeError(f"is_namespace: expected a callable (xp) -> bool, got {is_namespace!r}")
    if isinstance(make_ops, str):
        module, _, attr = make_ops.partition(":")
        if not module or not attr.isidentifier():
            raise ValueError(f"make_ops: expected 'module:function', got {make_ops!r}")
    elif not callable(make_ops):
        raise TypeError(f"make_ops: expected a callable or 'module:function', got {make_ops!r}")
    if requires is not None and not isinstance(requires, str):
        raise TypeError(f"requires: expected a module name or None, got {requires!r}")
    _read_entry_points()
    backend = Backend(name, is_namespace, make_ops, requires)
    _BACKENDS[:] = [backend, *(b for b in _BACKENDS if b.name != name)]
    dispatch.clear_cache()
    return backend


def unregister_backend(name: str) -> Backend:
    """Remove the backend registered as ``name``; its namespaces fall back to the next one.

    Parameters
    ----------
    name : str
        The name it was registered with (the built-ins: ``"torch"``, ``"jax"``,
        ``"numpy"``, ``"cupy"``).

    Returns
    -------
    Backend
        The removed entry (:func:`register_backend` of its fields restores it).

    Raises
    ------
    ValueError
        If no backend has that name.
    """
    _read_entry_points()
    for backend in _BACKENDS:
        if backend.name == name:
            _BACKENDS.remove(backend)
            dispatch.clear_cache()
            return backend
    raise ValueError(f"name: no backend {name!r} is registered; registered: "
                     f"{[b.name for b in _BACKENDS]}")


def backend_for(xp: Any) -> Backend | None:
    """Give the backend registered for a namespace (``tmcore.options(generic=True)`` bypasses it).

    Parameters
    ----------
    xp : namespace
        An array namespace (``array_api_compat.array_namespace(x)``).

    Returns
    -------
    Backend or None
        The first registered backend whose ``is_namespace`` takes ``xp``, if its
        ``requires`` is imported; None for the generic path.
    """
    _read_entry_points()
    for backend in _BACKENDS:
        if backend.is_namespace(xp):
            return backend if backend.requires is None or backend.requires in sys.modules \
                else None
    return None


def backend_name(xp: Any) -> str:
    """Name the backend registered for a namespace.

    Parameters
    ----------
    xp : namespace
        As in :func:`backend_for`.

    Returns
    -------
    str
        The ``name`` of :func:`backend_for`, ``"generic"`` for None.
    """
    backend = backend_for(xp)
    return "generic" if backend is None else backend.name


def ops_for_namespace(xp: Any, generic: Ops, options: Options | None = None) -> Ops:
    """Build the :class:`Ops` table for a namespace (uncached; :func:`ops_for` caches it).

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
        The table of the backend registered for ``xp``, or ``generic``.
    """
    backend = backend_for(xp)
    if backend is None:
        return generic
    make_ops = backend.make_ops
    if isinstance(make_ops, str):
        module, _, attr = make_ops.partition(":")
        make_ops = getattr(importlib.import_module(module), attr)
    return make_ops(generic, get_options() if options is None else options)


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


def release_scan_buffers() -> None:
    """Free the buffers the fused CPU scan of the torch backend keeps between calls.

    The calling thread's pool (docs/guides/backends.md, buffers kept between calls) is
    emptied, e.g. before evaluating on other shapes; a buffer a tensor still references is
    freed with that tensor. Nothing happens when torch was never used.
    """
    memory = sys.modules.get("tmcore.backends.torch.memory")
    if memory is not None:
        memory.release_scan_buffers()


for _name, _is_namespace in (("torch", array_api_compat.is_torch_namespace),
                             ("jax", array_api_compat.is_jax_namespace),
                             ("numpy", array_api_compat.is_numpy_namespace),
                             ("cupy", array_api_compat.is_cupy_namespace)):
    register_backend(_name, _is_namespace, f"tmcore.backends.{_name}:make_ops", requires=_name)
_entry_points_unread = True  # installed packages register above the built-ins, lazily
dispatch.register_resolver(ops_for_namespace)
