"""Namespace inference and argument validation shared by every public function.

Errors name the argument, what was given and what was expected. The checks read shapes,
dtypes, namespaces, devices and Python scalars only, except validate mode's
:func:`check_values` and :func:`check_positive`, which read concrete values
(docs/guides/errors-and-cache.md).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import array_api_compat

from tmcore.runtime.options import get_options
from tmcore.types import device_of, host_values

__all__ = [
    "check_bool_mask",
    "namespace_of",
    "check_rank",
    "check_dim",
    "check_nonempty",
    "check_floating",
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
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name}: expected a real floating dtype, got {x.dtype}")


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
