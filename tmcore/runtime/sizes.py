"""Sizes checked before anything is allocated, from shapes and dtypes only.

Element counts against int64 (:func:`check_count`: XLA aborts the process on a shape whose
extent product overflows) and the bytes a call certainly holds at its peak (lower bounds)
against what the device can ever hold (:func:`check_bytes`, a ``MemoryError``); what is
checked where: docs/guides/errors-and-cache.md.
"""

from __future__ import annotations

import math
import operator
import os
import sys
from collections.abc import Sequence
from typing import Any

from tmcore.runtime.options import MEMORY_LIMIT_ENV_VAR, memory_limit
from tmcore.types import device_of, traced

__all__ = [
    "INT64_MAX",
    "SMALL",
    "check_count",
    "check_bytes",
    "check_scan",
    "check_array",
    "memory_budget",
    "scan_bytes",
    "itemsize",
    "warp_states",
]

INT64_MAX = 2**63 - 1
#: the widest element any array here may have (float64 / int64), in bytes
_WIDEST = 8
#: below this estimate no budget is looked up (a call that small always fits)
SMALL = 64 << 20
#: the per-step working set of the scan, in states ``(B, C, *S)``: the written volume
#: (1), the gate pre-activations (4C: 4), the new ``h, c`` (2); a lower bound
_STEP_STATES = 7


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**27 else f"{nbytes / 2**20:,.1f} MiB"


def check_count(name: str, shape: Sequence[int], layout: str, what: str) -> int:
    """The number of elements of an array of ``shape`` (``layout`` names its axes, e.g.
    ``"(B, C, *S)"``); ``ValueError`` naming ``name`` when that many 8-byte elements
    would not fit in int64 bytes."""
    count = math.prod(int(s) for s in shape)
    if count > INT64_MAX // _WIDEST:
        raise ValueError(
            f"{name}: {what} {layout} = {tuple(int(s) for s in shape)} would have {count:.3e} "
            f"elements, more than int64 can address (at most 2**63 - 1 bytes, "
            f"{INT64_MAX // _WIDEST:.3e} elements of 8 bytes)")
    return count


# --------------------------------------------------------------------------- budgets


def _meminfo() -> int | None:
    """``MemTotal`` + ``SwapTotal`` of the host, in bytes (``None`` if unknown)."""
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        kib = sum(int(fields[k].split()[0]) for k in ("MemTotal", "SwapTotal") if k in fields)
        return kib * 1024 if kib else None
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


_STATIC: dict[str, int | None] = {}


def _address_space_left() -> int | None:
    """Bytes of address space left under ``RLIMIT_AS`` (``None``: unlimited or unknown)."""
    try:
        import resource  # POSIX only

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    try:
        with open("/proc/self/statm") as handle:
            used = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        used = 0
    return max(soft - used, 0)


def _host_budget() -> tuple[int, str] | None:
    if "host" not in _STATIC:
        limits = [v for v in (_meminfo(), _cgroup_limit()) if v]
        _STATIC["host"] = min(limits) if limits else None
    found = []
    if _STATIC["host"]:
        found.append((_STATIC["host"], "the host's memory (RAM + swap, or its cgroup limit)"))
    left = _address_space_left()
    if left is not None:
        found.append((left, "the address space left under RLIMIT_AS"))
    return min(found) if found else None


def memory_budget(xp: Any, device: Any = None) -> tuple[int, str] | None:
    """``(bytes, what it is)``: the most memory ``device`` of namespace ``xp`` can ever
    give one call, or the bound ``TMCORE_MEMORY_LIMIT`` sets when it is lower; ``None``
    where neither is known (then nothing is refused)."""
    device_budget = _device_budget(xp, device)
    limit = memory_limit()
    if limit is not None and (device_budget is None or limit < device_budget[0]):
        return limit, f"the bound {MEMORY_LIMIT_ENV_VAR} sets"
    return device_budget


def _device_budget(xp: Any, device: Any = None) -> tuple[int, str] | None:
    name = getattr(xp, "__name__", "")
    try:
        if "torch" in name and "torch" in sys.modules:
            torch = sys.modules["torch"]
            dev = torch.device(device) if device is not None else torch.get_default_device()
            if dev.type == "meta":
                return None
            if dev.type == "cuda":
                props = torch.cuda.get_device_properties(dev)
                return props.total_memory, f"the memory of {dev}"
            if dev.type != "cpu":
                return None
        elif "jax" in name and "jax" in sys.modules:
            jax = sys.modules["jax"]
            dev = device if device is not None and hasattr(device, "platform") \
                else jax.devices()[0]
            if dev.platform != "cpu":
                stats = dev.memory_stats() or {}
                limit = stats.get("bytes_limit")
                return (int(limit), f"the memory of {dev}") if limit else None
        elif "cupy" in name and "cupy" in sys.modules:
            cupy = sys.modules["cupy"]
            index = getattr(device, "id", None)
            with cupy.cuda.Device(index):
                return int(cupy.cuda.runtime.memGetInfo()[1]), f"the memory of GPU {index}"
    except Exception:  # an unusual device, or a framework without these calls
        return None
    return _host_budget()


def itemsize(xp: Any, dtype: Any) -> int:
    """Bytes per element of ``dtype`` (4 when it cannot be told, e.g. ``None``)."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int) and size > 0:
        return size
    if dtype is None:
        return 4
    try:
        return max(xp.finfo(dtype).bits // 8, 1)
    except Exception:  # not a floating dtype of xp
        return 4


def check_bytes(name: str, nbytes: int, what: str, xp: Any, device: Any = None) -> None:
    """``MemoryError`` naming ``name`` when ``nbytes`` (what ``what`` needs) exceeds
    :func:`memory_budget`; nothing is looked up for small requests."""
    if nbytes > INT64_MAX:
        raise ValueError(f"{name}: {what} would need {nbytes:.3e} bytes, more than int64 "
                         f"can address")
    if traced():  # (torch.compile: the checks ran eagerly, or run in the fake kernels)
        return
    limit = memory_limit()  # (small requests look nothing up, unless a bound is set below)
    if nbytes < SMALL and (limit is None or nbytes <= limit):
        return
    budget = memory_budget(xp, device)
    if budget is not None and nbytes > budget[0]:
        raise MemoryError(
            f"{name}: {what} would take at least {_gib(nbytes)}, more than {_gib(budget[0])} "
            f"({budget[1]}); nothing was allocated. Use a smaller grid, batch or "
            f"channel count (or a larger checkpoint_every for the backward); "
            f"{MEMORY_LIMIT_ENV_VAR} sets another bound")


# --------------------------------------------------------------------------- estimates


def scan_bytes(state: int, batch: int, channels: int, steps: int, checkpoints: int,
               item: int) -> int:
    """Bytes a scan over ``steps`` chunks certainly holds: the state in and out
    (``state`` elements each of ``h``, ``c``), one step's working set, ``checkpoints``
    saved ``(h, c)`` pairs, and the reads ``(B, T, C)``."""
    return item * (state * (4 + _STEP_STATES + 2 * checkpoints) + batch * steps * channels)


def warp_states(ndim: int, flow: bool) -> int:
    """A warped step's working set, in states: the warped state in and out, and with a
    flow its ``2^n`` corners."""
    return 4 + (2 * 2 ** ndim if flow else 0)


def check_scan(xp: Any, h0: Any, steps: int, checkpoint_every: int, backward: bool,
               log_elements: int = 0, working_states: int = 0) -> None:
    """Before a scan allocates: its saved states' count fits int64 and its bytes
    (:func:`scan_bytes` with ``ceil(T / k)`` checkpoints for a backward, one otherwise, plus
    ``log_elements`` per step and ``working_states`` states) fit the device, naming ``h0``."""
    try:
        shape = tuple(operator.index(s) for s in h0.shape)
    except TypeError:  # symbolic sizes (jax.export): nothing to measure
        return
    saved = -(-steps // checkpoint_every) if backward else 1
    state = check_count("h0", shape, "(B, C, *S)", "the state")
    check_count("checkpoint_every", (saved, *shape), "(ceil(T / k), B, C, *S)",
                "the saved states")
    item = itemsize(xp, h0.dtype)
    nbytes = scan_bytes(state, shape[0], shape[1], steps, saved, item) + item * (
        state * working_states + (steps * log_elements if backward else 0))
    kind = f"a backward over T = {steps} steps keeping {saved} states" if backward \
        else f"a scan over T = {steps} steps"
    check_bytes("h0", nbytes, f"{kind} of shape (B, C, *S) = {shape}", xp, device_of(h0))


def check_array(xp: Any, name: str, shape: Sequence[int], layout: str, what: str,
                like: Any) -> None:
    """Before an output of ``shape`` (``layout``) in ``like``'s dtype and device is made:
    its count fits int64 and its bytes fit the device (``ValueError`` /
    ``MemoryError`` naming ``name``)."""
    count = check_count(name, shape, layout, what)
    check_bytes(name, count * itemsize(xp, like.dtype),
                f"{what} {layout} = {tuple(int(s) for s in shape)}", xp, device_of(like))
