"""Namespace inference, argument validation and size gates shared by every public function.

Errors name the argument, what was given and what was expected. The checks read shapes,
dtypes, namespaces, devices and Python scalars only, except validate mode's
:func:`check_values` and :func:`check_positive`, which read concrete values. The size
gates run before anything is allocated: element counts against int64
(:func:`check_count`: XLA aborts the process on a shape whose extent product overflows)
and the bytes a call certainly holds at its peak (lower bounds) against what the device
can ever hold (:func:`check_bytes`, a ``MemoryError``). What is checked where:
docs/guides/errors-and-cache.md.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import sys
from collections.abc import Sequence
from typing import Any

import array_api_compat

from tmcore.runtime.options import MEMORY_LIMIT_ENV_VAR, get_options, memory_limit
from tmcore.types import device_of, host_values, traced

__all__ = [
    "check_bool_mask",
    "namespace_of",
    "check_rank",
    "check_dim",
    "check_nonempty",
    "check_floating",
    "is_kind",
    "check_grid_shape",
    "check_int",
    "check_eps",
    "check_flag",
    "check_radius",
    "check_positive_scalar",
    "check_values",
    "check_positive",
    "require_array",
    "check_namespace",
    "OPTIONAL_ARRAYS",
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

MAX_SPATIAL_RANK = 4

#: Argument names :func:`namespace_of` lets be ``None``: the cotangents, which the
#: shared forward/VJP validators leave out for the forward. A public VJP whose
#: cotangent is required checks it with :func:`require_array`.
OPTIONAL_ARRAYS = frozenset({"g", "g_reads", "g_h", "g_c"})


# --------------------------------------------------------------------------- validate mode


def check_values(xp: Any, arrays: dict[str, Any]) -> None:
    """Validate mode only: raise ``ValueError`` naming the first array that holds NaN or inf."""
    if not get_options().validate:
        return
    for name, value in arrays.items():
        if value is None:
            continue
        finite = host_values(xp.all(xp.isfinite(value)))  # (None: abstract, unchecked)
        if finite is False:
            bad = int(xp.sum(xp.astype(~xp.isfinite(value), xp.int32)))
            raise ValueError(
                f"{name}: expected finite values (validate mode), got {bad} NaN or inf "
                f"of {math.prod(value.shape)} in an array of shape {tuple(value.shape)}"
            )


def check_positive(xp: Any, name: str, value: Any) -> None:
    """Validate mode only: raise ``ValueError`` unless every entry of ``value`` is > 0."""
    if not get_options().validate or math.prod(value.shape) == 0:
        return
    positive = host_values(xp.all(value > 0))
    if positive is False:
        smallest = float(xp.min(value))
        raise ValueError(f"{name}: expected every value > 0 (validate mode), got a minimum "
                         f"of {smallest!r} in an array of shape {tuple(value.shape)}")


# --------------------------------------------------------------------------- always


def _kind(xp: Any) -> Any:
    """The framework a namespace belongs to (``numpy`` and its compat wrapper are one)."""
    for kind, test in (("numpy", array_api_compat.is_numpy_namespace),
                       ("torch", array_api_compat.is_torch_namespace),
                       ("jax", array_api_compat.is_jax_namespace),
                       ("cupy", array_api_compat.is_cupy_namespace)):
        if test(xp):
            return kind
    return xp


def check_namespace(xp: Any, name: str, value: Any, what: str) -> None:
    """``TypeError`` naming ``name`` unless the array ``value`` belongs to namespace ``xp`` (a NumPy
    mask for the torch layer would otherwise read "expected bool, got bool")."""
    try:
        found = array_api_compat.array_namespace(value)
    except TypeError:
        found = None
    if array_api_compat.is_jax_namespace(xp) and array_api_compat.is_numpy_array(value):
        return  # JAX takes host (NumPy) arrays wherever it takes its own
    if found is None or _kind(found) != _kind(xp):
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise TypeError(f"{name}: expected {what} of the same kind as the other inputs "
                        f"({getattr(xp, '__name__', xp)}), got a {kind} (convert it first, "
                        f"e.g. with torch.as_tensor or jnp.asarray)")


def require_array(name: str, value: Any) -> None:
    """Raise ``TypeError`` if a required array argument is ``None``."""
    if value is None:
        raise TypeError(f"{name}: expected an array, got None")


def namespace_of(**arrays: Any) -> Any:
    """The one array-API namespace of ``arrays`` (name -> array): ``TypeError`` naming a
    non-array (``None`` only for :data:`OPTIONAL_ARRAYS`), another namespace or a non-floating
    dtype, ``ValueError`` another device; validate mode checks the values."""
    found = None
    first_name = None
    first_device = None
    present: dict[str, Any] = {}
    for name, value in arrays.items():
        if value is None:
            if name.rpartition(".")[2] in OPTIONAL_ARRAYS:
                continue
            raise TypeError(f"{name}: expected an array, got None")
        if not array_api_compat.is_array_api_obj(value):
            raise TypeError(f"{name}: expected an array, got {type(value).__name__}")
        ns = array_api_compat.array_namespace(value)
        device = _device_or_none(value)
        if found is None:
            found, first_name, first_device = ns, name, device
        elif ns is not found:
            raise TypeError(
                f"{name}: all arrays must come from one namespace; {first_name} is "
                f"{found.__name__}, {name} is {ns.__name__}"
            )
        elif device is not None and first_device is not None and device != first_device:
            raise ValueError(
                f"{name}: all arrays must be on one device; {first_name} is on "
                f"{first_device}, {name} is on {device}"
            )
        check_floating(ns, name, value)
        present[name] = value
    if found is None:
        raise TypeError("no array arguments were given")
    check_values(found, present)
    return found


def _device_or_none(x: Any) -> Any:
    """The array's device, or ``None`` where it has none to compare (a JAX tracer)."""
    try:
        device = device_of(x)
    except Exception:  # an abstract array without a device
        return None
    # a sharded JAX array's "device" is its sharding: arrays on the same devices are
    # together whatever their partition specs
    return getattr(device, "device_set", device)


def check_floating(xp: Any, name: str, x: Any) -> None:
    """Raise ``TypeError`` unless ``x`` has a real floating dtype."""
    if not is_kind(xp, x.dtype, "real floating"):
        raise TypeError(f"{name}: expected a real floating dtype, got {x.dtype}")


#: (namespace, dtype, kind) -> ``isdtype``'s answer: a dict read, where ``isdtype`` runs a
#: namespace's Python code (several times per decode token)
_KINDS: dict[tuple[int, Any, str], bool] = {}


def is_kind(xp: Any, dtype: Any, kind: str) -> bool:
    """``xp.isdtype(dtype, kind)``, remembered per namespace, dtype and kind."""
    key = (id(xp), dtype, kind)
    try:
        known = _KINDS.get(key)
    except TypeError:  # (an unhashable dtype object)
        return bool(xp.isdtype(dtype, kind))
    if known is None:
        known = _KINDS[key] = bool(xp.isdtype(dtype, kind))
    return known


def check_rank(name: str, x: Any, rank: int | Sequence[int], layout: str) -> None:
    """Raise ``ValueError`` unless ``x.ndim`` is ``rank`` (or one of them)."""
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if x.ndim not in ranks:
        raise ValueError(
            f"{name}: expected shape {layout} ({' or '.join(map(str, ranks))} dims), "
            f"got shape {tuple(x.shape)}"
        )


def check_dim(name: str, x: Any, axis: int, expected: int, layout: str, what: str) -> None:
    """Raise ``ValueError`` unless ``x.shape[axis] == expected``."""
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name}: expected shape {layout} with {what} = {expected}, got shape {tuple(x.shape)}"
        )


def check_nonempty(name: str, x: Any, layout: str, axes: Sequence[int] | None = None) -> None:
    """Raise ``ValueError`` if any of ``axes`` (default: all) of ``x`` has length 0."""
    shape = tuple(x.shape)
    axes = range(len(shape)) if axes is None else axes
    if any(shape[a] == 0 for a in axes):
        raise ValueError(f"{name}: expected shape {layout} with no zero-size axis, "
                         f"got shape {shape}")


def check_grid_shape(name: str, shape: Any) -> tuple[int, ...]:
    """A grid shape of 1 to 4 ints >= 1, as a tuple: ``TypeError`` for a non-sequence, a string
    or a non-int entry (bools too), ``ValueError`` for the wrong length or a size < 1."""
    expected = f"{name}: expected a tuple of 1 to 4 positive ints"
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"{expected}, got {shape!r}")
    try:
        entries = tuple(shape)
    except TypeError:
        raise TypeError(f"{expected}, got {shape!r}") from None
    dims = []
    for s in entries:
        if isinstance(s, bool):
            raise TypeError(f"{expected}, got {shape!r} (entry {s!r} is a bool, not an int)")
        try:
            dims.append(operator.index(s))
        except TypeError:
            raise TypeError(f"{expected}, got {shape!r} (entry {s!r} is not an int)") from None
    if not 1 <= len(dims) <= MAX_SPATIAL_RANK or any(s < 1 for s in dims):
        raise ValueError(f"{expected}, got {shape!r}")
    return tuple(dims)


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """An integer (Python or NumPy, not bool) in ``[minimum, maximum]``; returned as int."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if minimum == 1 and maximum is None:
        bounds += " (a positive int)"
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int {bounds}, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int {bounds}, got {value!r}") from None
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"{name}: expected an int {bounds}, got {value!r}")
    return number


def _real(name: str, value: Any, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    return float(value)


def check_eps(eps: Any, name: str = "eps") -> float:
    """A finite real number >= 0 (the Gaussian's denominator offset)."""
    value = _real(name, eps, "a finite number >= 0")
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}: expected a finite number >= 0, got {eps!r}")
    return value


def check_finite(name: str, value: Any) -> float:
    """A finite real number (e.g. an initial bias)."""
    number = _real(name, value, "a finite number")
    if not math.isfinite(number):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return number


def check_radius(radius: Any, name: str = "radius") -> float | None:
    """``None`` or a real number > 0 (``inf`` allowed: no truncation)."""
    if radius is None:
        return None
    value = _real(name, radius, "a positive number of sigmas or None")
    if not value > 0.0:
        raise ValueError(f"{name}: expected a positive number of sigmas or None, got {radius!r}")
    return value


def check_positive_scalar(name: str, value: Any) -> None:
    """A finite real number > 0 (array-valued scales are left unchecked)."""
    if array_api_compat.is_array_api_obj(value) and not isinstance(value, numbers.Real):
        return
    number = _real(name, value, "a finite number > 0")
    if not (math.isfinite(number) and number > 0.0):
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")


def check_flag(name: str, value: Any) -> bool:
    """A Python or NumPy bool (an int or a string is a ``TypeError`` naming ``name``)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{name}: expected True or False, got {value!r}")


def check_bool_mask(xp: Any, value: Any, name: str, axes: str,
                    shape: tuple[int, ...] | None, hint: str = "") -> None:
    """Raise unless ``value`` is a bool array of ``shape`` (named ``axes``, e.g. ``"(B,)"``;
    ``None``: any): ``TypeError`` for a non-array or dtype, ``ValueError`` for a shape."""
    expected = f"of shape {axes}" + ("" if shape is None else
                                     f" = ({', '.join(map(str, shape))}"
                                     f"{',' if len(shape) == 1 else ''})")
    if not array_api_compat.is_array_api_obj(value):
        raise TypeError(f"{name}: expected a bool array {expected}, got {type(value).__name__}")
    check_namespace(xp, name, value, f"a bool array {expected}")
    if not xp.isdtype(value.dtype, "bool"):
        raise TypeError(f"{name}: expected a bool mask {expected}, got dtype {value.dtype}{hint}")
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected a bool mask {expected}, got {tuple(value.shape)}")


# --------------------------------------------------------------------------- sizes

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
