"""Calling the C kernels (``{name}_{f32|f64}``) from torch through ctypes. They trust what they
get: callers check the shapes first (:mod:`tmcore.backends.fused`) and pass plain memory.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import torch

from tmcore.backends.fused import untraced
from tmcore.runtime.options import get_options

from .build import ENV_VAR, library

__all__ = ["Kernels", "kernels_for", "plain", "ptr", "offset", "shape_arg", "call"]

#: ``(library, dtype suffix)``: what :func:`call` runs a kernel of.
Kernels = tuple[ctypes.CDLL, str]

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_EINDEX = 2  # a box kernel's status for a box outside its grid (other nonzero: no memory)


def kernels_for(*tensors: torch.Tensor) -> Kernels | None:
    """The kernels when they may run on ``tensors`` (plain strided CPU float32 / float64 tensors of
    one dtype, untraced, the ``native`` option on, the library built), else None."""
    if not get_options().native:
        return None
    suffix = _SUFFIX.get(tensors[0].dtype)
    if suffix is None or not untraced(tensors):
        return None
    for t in tensors:  # (a loop, not any(): a decode step checks 17 tensors)
        if not t.is_cpu or t.layout != torch.strided or t.is_nested:
            return None
    lib = library()
    return None if lib is None else (lib, suffix)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as dense contiguous memory holding its values (a ZeroTensor becomes zeros, negative
    and conjugate views are resolved, strided views copied)."""
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t.resolve_neg().resolve_conj().contiguous()


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    """The address of ``t``'s first element."""
    return ctypes.c_void_p(t.data_ptr())


def offset(t: torch.Tensor, elements: int) -> ctypes.c_void_p:
    """The address ``elements`` items into ``t``'s memory (``t`` contiguous)."""
    return ctypes.c_void_p(t.data_ptr() + elements * t.element_size())


def shape_arg(shape: Sequence[int]) -> ctypes.Array:
    """``shape`` as the ``int64_t *`` the kernels take (one array per shape, kept: the
    kernels only read it)."""
    return _shape_arg(tuple(shape))


@functools.lru_cache(maxsize=256)
def _shape_arg(shape: tuple[int, ...]) -> ctypes.Array:
    return (ctypes.c_int64 * len(shape))(*shape)


def call(kernels: Kernels, name: str, *args: Any) -> None:
    """Run kernel ``name``; a nonzero status raises (its outputs never returned): a box outside
    its grid a ``ValueError``, a failed scratch allocation a ``MemoryError``."""
    lib, suffix = kernels
    status = getattr(lib, f"{name}_{suffix}")(*args)
    if status == _EINDEX:
        raise ValueError(f"tmcore: the fused CPU kernel {name} was given a box outside its "
                         f"grid (a start index out of range)")
    if status != 0:
        raise MemoryError(f"tmcore: the fused CPU kernel {name} could not allocate its "
                          f"scratch memory (grid too large for the memory available; "
                          f"{ENV_VAR}=0 uses the torch ops instead)")
