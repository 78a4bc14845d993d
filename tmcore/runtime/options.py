"""One configuration surface for every tmcore switch, and the one reader of the environment.

:class:`Options` lists the switches and their environment variables; :func:`options` sets
them for the current thread / asyncio task (a context variable), :func:`get_options` reads
them. The settings that are not switches are read here when used: :func:`cache_dir`,
:func:`compile_timeout`, :func:`memory_limit` and :func:`environment` (other tools'
variables). No other module of tmcore reads the environment (every variable: the README).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import os
import warnings
from pathlib import Path
from typing import Any, Literal, NamedTuple

__all__ = ["Options", "options", "get_options", "ENV_VARS", "TIMEOUT_ENV_VAR",
           "DEFAULT_TIMEOUT", "MEMORY_LIMIT_ENV_VAR", "cache_dir", "compile_timeout",
           "environment", "memory_limit", "reload_environment"]

TritonMode = bool | Literal["auto"]
DepthwiseKernel = Literal["auto", "grouped", "shifts"]
_DEPTHWISE = ("auto", "grouped", "shifts")


@dataclasses.dataclass(frozen=True)
class Options:
    """The effective value of every switch (hashable: usable as a cache key).

    Each field's default is its environment variable, read once at import
    (:func:`reload_environment`; ``0``, ``false``, ``no``, ``off`` mean False, other values
    True, unset or empty the default below). The guide: docs/guides/backends.md.

    Parameters
    ----------
    native : bool, default True
        ``TMCORE_NATIVE``: the fused C kernels for the CPU cell (torch, JAX).
    triton : bool or ``"auto"``, default ``"auto"``
        ``TMCORE_TRITON``: Triton kernels for torch; ``"auto"`` lets the backend decide (CUDA
        tensors, Triton installed), True forces them wherever they can run (CPU under
        ``TRITON_INTERPRET=1``).
    generic : bool, default False
        ``TMCORE_GENERIC``: force the generic array-API path (no backend fast path).
    deterministic : bool, default True
        ``TMCORE_DETERMINISTIC``: no kernel whose result depends on thread timing (CUDA
        atomic adds).
    validate : bool, default False
        ``TMCORE_VALIDATE``: validate mode, the INPUTS of every public function finite and
        every ``sigma`` > 0 (in a layer call the state, the scan's weights and the heads'
        outputs; not ``out_proj`` or another linear weight, no output), read on the host
        (docs/guides/errors-and-cache.md).
    depthwise : {"auto", "grouped", "shifts"}, default ``"auto"``
        ``TMCORE_DEPTHWISE``: the depthwise-tap kernel of the torch and JAX backends
        (``"auto"``: the backend's choice; the forced ones skip the fused C conv).
    triton_tf32 : bool, default False
        ``TMCORE_TRITON_TF32``: TF32 products for float32 in the Triton kernels on CUDA
        (about 1e-3 relative error).
    cuda_graphs : bool, default True
        ``TMCORE_CUDA_GRAPHS``: capture the Triton scan loops as CUDA graphs (a failed
        capture runs the launches eagerly).
    """

    native: bool = True
    triton: TritonMode = "auto"
    generic: bool = False
    deterministic: bool = True
    validate: bool = False
    depthwise: DepthwiseKernel = "auto"
    triton_tf32: bool = False
    cuda_graphs: bool = True


_FIELDS = tuple(f.name for f in dataclasses.fields(Options))

#: field -> environment variable that sets its default
ENV_VARS: dict[str, str] = {name: f"TMCORE_{name.upper()}" for name in _FIELDS}

_FALSE = ("0", "false", "no", "off")

Changes = tuple[tuple[str, Any], ...]


class _Local(NamedTuple):
    """What :func:`options` set in this context: ``entries`` ``(block or None for a setter,
    changes)`` in order, and ``overrides``, them folded into one sorted tuple (the cache key)."""

    entries: tuple[tuple[Any, Changes], ...]
    overrides: Changes


def _local(entries: tuple[tuple[Any, Changes], ...]) -> _Local:
    folded: dict[str, Any] = {}
    for _, changes in entries:
        for name, value in changes:
            if value is None:
                folded.pop(name, None)
            else:
                folded[name] = value
    return _Local(entries, tuple(sorted(folded.items())))


_EMPTY = _Local((), ())

_LOCAL: contextvars.ContextVar[_Local] = contextvars.ContextVar("tmcore_options",
                                                                default=_EMPTY)
# (environment values, local overrides) -> Options
_CACHE: dict[tuple, Options] = {}
_WARNED: set[tuple[str, str]] = set()
# (environment values, local state, Options) of the last answer
_LAST: list[tuple] = [(None, None, None)]


def _parse_env(name: str, raw: str | None) -> Any:
    """The value an environment variable gives field ``name`` (``None``: unset)."""
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip().lower()
    if name == "depthwise":
        return text if text in _DEPTHWISE else None  # _warn_bad_env names a bad value
    if name == "triton" and text == "auto":
        return "auto"
    return text not in _FALSE


def _check(name: Any, value: Any) -> Any:
    """``value`` if it is a valid setting of field ``name``, else ``TypeError`` (``ValueError``
    for an unknown kernel); exact types: a NumPy ``bool_`` would poison every later call."""
    if name not in _FIELDS:
        raise TypeError(f"options: unknown option {name!r}; expected one of {', '.join(_FIELDS)}")
    if name == "depthwise" and value is not None:
        if type(value) is not str:
            raise TypeError(f"depthwise: expected 'auto', 'grouped', 'shifts' or None, got "
                            f"{value!r} (of type {type(value).__module__}."
                            f"{type(value).__qualname__})")
        if value not in _DEPTHWISE:
            raise ValueError(f"depthwise: expected 'auto', 'grouped', 'shifts' or None, "
                             f"got {value!r}")
        return value
    if value is None or type(value) is bool or (
            name == "triton" and type(value) is str and value == "auto"):
        return value
    expected = "True, False, 'auto' or None" if name == "triton" else "True, False or None"
    raise TypeError(f"{name}: expected {expected}, got {value!r} "
                    f"(of type {type(value).__module__}.{type(value).__qualname__})")


# Read at import and by reload_environment(): get_options() runs at every dispatch, and
# reading os.environ costs about 0.7 us per UNSET variable (20x this function).
_ENV: list[tuple] = [()]


def reload_environment() -> Options:
    """Read the switches' environment variables again (after changing one in a running process).

    Returns
    -------
    Options
        The options now in effect in this thread / task.
    """
    _ENV[0] = tuple(os.environ.get(ENV_VARS[name]) for name in _FIELDS)
    _warn_bad_env()
    return get_options()


def get_options() -> Options:
    """Give the options in effect in the current thread / asyncio task.

    Returns
    -------
    Options
        Each field's innermost :func:`options` override, else its default.
    """
    local = _LOCAL.get()
    env = _ENV[0]
    last = _LAST[0]  # the previous answer: most calls ask again under the same settings
    if last[0] == env and last[1] is local:
        return last[2]
    key = (env, local.overrides)
    found = _CACHE.get(key)
    if found is None:
        values: dict[str, Any] = {}
        for name, raw in zip(_FIELDS, env, strict=True):
            parsed = _parse_env(name, raw)
            if parsed is not None:
                values[name] = parsed
        values.update(local.overrides)
        found = Options(**values)
        if len(_CACHE) > 256:  # keys are few in practice; never let the cache grow unbounded
            _CACHE.clear()
        _CACHE[key] = found
    _LAST[0] = (env, local, found)
    return found


class _Block:
    """One open ``with`` block of an :class:`options` object (its entry's owner)."""

    __slots__ = ("owner",)

    def __init__(self, owner: options) -> None:
        self.owner = owner


class options:  # noqa: N801  (a function-like name: it is called, rarely instantiated)
    """Set tmcore options for the current thread / task; also a context manager.

    ``tmcore.options(native=False)`` applies at once, for the rest of the current context;
    ``with tmcore.options(native=False): ...`` inside the block only (``as opts`` binds the
    effective :class:`Options`). A keyword left out keeps its value; ``None`` returns it to its
    default. How blocks exit, in any order: docs/guides/errors-and-cache.md.

    Parameters
    ----------
    **changes : bool, str or None
        Fields of :class:`Options` and their new values: exactly ``True``, ``False`` or
        ``None`` (``triton`` also ``"auto"``; ``depthwise`` one of its kernels), all checked
        before anything changes.

    Raises
    ------
    TypeError
        If a keyword is not a field of :class:`Options`, or a value is not of an accepted
        type (``1``, ``"yes"``, a NumPy ``bool_`` or array).
    ValueError
        If ``depthwise`` is a string other than its three kernels.
    RuntimeError
        On exiting a block that is not open in this thread / task.

    Notes
    -----
    Reusing one object: creating it applies its changes (the setter form), and a ``with``
    entered right after takes that application over, so ``with tmcore.options(...):`` leaves
    nothing behind. A later ``with obj:`` (nested, repeated, in another thread) applies the
    same changes on top of what is in effect, and its exit removes exactly that entry. To keep
    a setting without applying it now, keep the keywords: ``quiet =
    functools.partial(tmcore.options, validate=False)``, then ``with quiet(): ...``.
    """

    def __init__(self, **changes: Any) -> None:
        self._changes: Changes = tuple((name, _check(name, value))
                                       for name, value in changes.items())
        before = _LOCAL.get()
        entries = before.entries
        if entries and entries[-1][0] is None:  # merge consecutive setter calls
            merged = dict(entries[-1][1])
            merged.update(self._changes)
            entries = (*entries[:-1], (None, tuple(merged.items())))
        else:
            entries = (*entries, (None, self._changes))
        after = _local(entries)
        _LOCAL.set(after)
        self._applied: tuple[_Local, _Local] | None = (before, after)

    def __enter__(self) -> Options:
        state = _LOCAL.get()
        applied, self._applied = self._applied, None
        if applied is not None and state is applied[1]:
            state = applied[0]  # the block applies the call's changes instead
        _LOCAL.set(_local((*state.entries, (_Block(self), self._changes))))
        try:
            return get_options()
        except BaseException:
            _LOCAL.set(state)
            raise

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        entries = _LOCAL.get().entries
        index = next((i for i in reversed(range(len(entries)))
                      if isinstance(entries[i][0], _Block) and entries[i][0].owner is self),
                     None)
        if index is None:
            if exc_type is None:
                raise RuntimeError(
                    "tmcore.options: exiting a block that is not open in this thread / task "
                    "(exited twice, or entered in another thread)")
            return  # do not hide the exception in flight
        stop = index + 1
        while stop < len(entries) and entries[stop][0] is None:  # setters made inside it
            stop += 1
        _LOCAL.set(_local((*entries[:index], *entries[stop:])))

    def __repr__(self) -> str:
        return f"tmcore.options -> {get_options()!r}"


def _warn_bad_env() -> None:
    """Warn once per variable about a value that will be read as True by accident."""
    for name, raw in zip(_FIELDS, _ENV[0], strict=True):
        if raw is None or raw.strip() == "":
            continue
        text = raw.strip().lower()
        known = _FALSE + ("1", "true", "yes", "on") + (("auto",) if name == "triton" else ())
        if name == "depthwise":
            known = _DEPTHWISE
        if text not in known and (name, text) not in _WARNED:
            _WARNED.add((name, text))
            hint = ("is ignored; use auto, grouped or shifts" if name == "depthwise"
                    else "is read as True; use 1 or 0")
            warnings.warn(f"tmcore: {ENV_VARS[name]}={raw!r} {hint}", RuntimeWarning,
                          stacklevel=2)


reload_environment()


# --------------------------------------------------------------------------- settings

#: The variable bounding one compiler run (seconds; ``inf`` or ``none``: no bound).
TIMEOUT_ENV_VAR = "TMCORE_COMPILE_TIMEOUT"
#: Seconds one compiler run may take by default.
DEFAULT_TIMEOUT = 120.0
_WARNED_TIMEOUTS: set[str] = set()


def environment(name: str, default: str | None = None) -> str | None:
    """Another tool's environment variable (``CC``, ``TRITON_INTERPRET``, ...), read now."""
    return os.environ.get(name, default)


#: The variable bounding the bytes one call may need (``memory_limit``).
MEMORY_LIMIT_ENV_VAR = "TMCORE_MEMORY_LIMIT"
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def memory_limit() -> int | None:
    """The bound in bytes every size gate checks against: ``TMCORE_MEMORY_LIMIT`` (bytes, or
    with a ``K``, ``M``, ``G``, ``T`` suffix, powers of 1024; read now); ``None`` if unset (the
    device's own memory bounds it) or not a size (with a warning, once per value)."""
    raw = os.environ.get(MEMORY_LIMIT_ENV_VAR, "").strip()
    if not raw:
        return None
    text = raw.lower().removesuffix("b").removesuffix("i")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    try:
        value = float(text[: len(text) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        if raw not in _WARNED_TIMEOUTS:
            _WARNED_TIMEOUTS.add(raw)
            warnings.warn(f"tmcore: {MEMORY_LIMIT_ENV_VAR}={raw!r} is not a size in bytes "
                          f"(e.g. 8G); it is ignored", RuntimeWarning, stacklevel=2)
        return None
    return int(value)


def cache_dir() -> Path:
    """The folder of the built kernels: ``TMCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/tmcore``,
    else ``~/.cache/tmcore`` (read now)."""
    if os.environ.get("TMCORE_CACHE_DIR"):
        return Path(os.environ["TMCORE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tmcore"


def compile_timeout() -> float | None:
    """Seconds one compiler run may take (``TMCORE_COMPILE_TIMEOUT``, read now; ``None`` for
    ``inf`` / ``none``); a value that is not seconds > 0 warns (once) and gives the default."""
    raw = os.environ.get(TIMEOUT_ENV_VAR, "").strip()
    if raw == "":
        return DEFAULT_TIMEOUT
    if raw.lower() in ("none", "inf", "+inf", "infinity"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isinf(value) and value > 0:
        return None
    if not value > 0:  # NaN, negative, -inf
        if raw not in _WARNED_TIMEOUTS:
            _WARNED_TIMEOUTS.add(raw)
            warnings.warn(f"tmcore: {TIMEOUT_ENV_VAR}={raw!r} is not a number of seconds > 0 "
                          f"(or inf / none for no limit); using {DEFAULT_TIMEOUT:g} s",
                          RuntimeWarning, stacklevel=2)
        return DEFAULT_TIMEOUT
    return value
