"""Memory of the torch backend's fused CPU paths: the per-step scratch (:func:`workspace`,
:func:`scratch`), the scan buffer pool (:func:`take`, :func:`begin`,
:func:`release_scan_buffers`) and unfilled memory (:func:`uninitialized`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import sys
import threading
from typing import Any

import torch

__all__ = ["workspace", "scratch", "uninitialized", "begin", "take", "release_scan_buffers"]

_WORKSPACE = threading.local()  # .buffers: dict while a scan's workspace is open


@contextlib.contextmanager
def workspace(xp: Any):
    """Reuse the fused path's per-step temporaries (depthwise output, ``z``, ``d_z``,
    ``d_y``) from one step to the next while the scan runs: the scan consumes each
    step's residuals first, and fresh multi-MB buffers every step cost page faults
    (measured: ~500 per LM step, 1-3 ms of system time)."""
    previous = getattr(_WORKSPACE, "buffers", None)
    _WORKSPACE.buffers = {}
    try:
        yield
    finally:
        _WORKSPACE.buffers = previous


def scratch(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A per-step temporary: the workspace's buffer ``name`` when one is open, else new."""
    buffers = getattr(_WORKSPACE, "buffers", None)
    if buffers is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    key = (name, shape, like.dtype)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
    return buffer



_HUGE = 1 << 21  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
#: Buffers below this many bytes are not pooled: a fresh one costs less than a search
_SMALL = 1 << 18
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise`` (Linux), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def uninitialized(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor on fresh, unfilled memory: ``torch.empty`` without the NaN
    fill that ``torch.use_deterministic_algorithms(True)`` adds to every ``empty`` (the
    diagnostics train so; at their paper sizes the fills of the scan's checkpoints and
    block buffers measured ~140 ms of a ~900 ms step). Only for buffers the scan writes
    whole before it reads them (every one below), so the fill never shows in a result."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _SMALL:  # a decode step's buffers: one op (a fill would cost little here)
        return torch.empty(shape, dtype=dtype)
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage(nbytes), 0, tuple(shape))


def _empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """:func:`uninitialized` memory marked for transparent huge pages: the
    scan writes its checkpoints (MBs per step) into fresh memory, and faulting that in
    4 KiB pages measured ~0.9 ms per lm-1024 step (~0.2 ms with 2 MiB pages). A hint
    only: where it is refused or unsupported nothing changes."""
    t = uninitialized(shape, dtype)
    madvise = _madvise()
    size = t.numel() * t.element_size()
    if madvise is not None and size >= 2 * _HUGE:
        start = -(-t.data_ptr() // _HUGE) * _HUGE
        stop = (t.data_ptr() + size) // _HUGE * _HUGE
        if stop > start:
            madvise(start, stop - start, _MADV_HUGEPAGE)
    return t


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)

#: A pooled block not handed out in this many scan calls is dropped from the pool.
_POOL_AGE = 16


class _Pool(threading.local):
    """The fused scan's big buffers, kept from one call to the next (per thread).

    Fresh memory faults in page by page (a diagnostics step at paper sizes touched ~200 MB:
    ~50,000 faults, 0 with the pool; ~750 -> ~600 CPU ms with the deterministic fill). A
    block (``torch.UntypedStorage``) is handed out again only when nothing else refers to it
    (storage use count 1) and is written whole before it is read. A block of ``n`` bytes
    serves ``[n/2, n]`` (``exact``: ``n``; a shared one never); blocks not taken in
    ``_POOL_AGE`` calls are dropped and the free ones trimmed, oldest first, to twice the most
    a recent call took. Without ``torch._C._storage_Use_Count`` nothing is pooled.
    """

    def __init__(self) -> None:
        self.blocks: list[list] = []  # [storage, nbytes, call that last took it]
        self.calls = 0
        self.taken: list[int] = []  # bytes taken by each of the recent calls

    def begin(self) -> None:
        """Start a scan call: age out old blocks, trim the free ones."""
        self.calls += 1
        self.taken = [*self.taken[-(_POOL_AGE - 1):], 0] if _POOL_AGE > 1 else [0]
        self.blocks = [b for b in self.blocks if b[2] > self.calls - _POOL_AGE]
        budget = 2 * max(self.taken)
        free = [b for b in self.blocks if self._free(b)]
        total = sum(b[1] for b in free)
        for block in sorted(free, key=lambda b: b[2]):
            if total <= budget:
                break
            self.blocks.remove(block)
            total -= block[1]

    @staticmethod
    def _free(block: list) -> bool:
        """Only the pool refers to it (and it was not moved to shared memory, which
        another process may still map)."""
        return _storage_use_count(block[0]._cdata) == 1 and not block[0].is_shared()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, huge: bool = False,
             exact: bool = False) -> torch.Tensor:
        """An uninitialized contiguous ``shape`` tensor on a free pooled block (the
        smallest that fits; ``exact``: of exactly its size, for a tensor the caller
        returns), else on a new one (marked for huge pages if ``huge``)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if _storage_use_count is None or nbytes < _SMALL:
            return _empty_huge(shape, dtype) if huge else uninitialized(shape, dtype)
        if self.taken:
            self.taken[-1] += nbytes
        top = nbytes if exact else 2 * nbytes
        fits = [b for b in self.blocks if nbytes <= b[1] <= top and self._free(b)]
        if fits:
            block = min(fits, key=lambda b: b[1])
        else:
            t = _empty_huge(shape, dtype) if huge else uninitialized(shape, dtype)
            block = [t.untyped_storage(), nbytes, 0]
            self.blocks.append(block)
        block[2] = self.calls
        return torch.empty(0, dtype=dtype).set_(block[0], 0, tuple(shape))

    def clear(self) -> None:
        self.blocks = []
        self.taken = []


_POOL = _Pool()


def begin() -> None:
    """Start a fused scan call: the pool ages out and trims its blocks."""
    _POOL.begin()


def take(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = False,
         exact: bool = False) -> torch.Tensor:
    """An uninitialized contiguous tensor from this thread's pool (:meth:`_Pool.take`):
    only for buffers written whole before they are read."""
    return _POOL.take(shape, dtype, huge=huge, exact=exact)


def release_scan_buffers() -> None:
    """Drop this thread's pooled scan buffers (their memory is freed once no tensor
    holds it)."""
    _POOL.clear()

