"""One configuration surface for every tmcore switch: :func:`options` and :func:`get_options`.

Fields (environment variable, default: meaning):

- ``native`` (``TMCORE_NATIVE``, True): the fused C kernels for the CPU cell
  (torch, JAX).
- ``triton`` (``TMCORE_TRITON``, ``"auto"``): Triton kernels for torch;
  ``"auto"`` lets the backend decide (CUDA tensors, Triton installed), True
  forces them wherever they can run (CPU under ``TRITON_INTERPRET=1``), False
  turns them off.
- ``generic`` (``TMCORE_GENERIC``, False): force the generic array-API path
  everywhere (no backend fast path at all).
- ``deterministic`` (``TMCORE_DETERMINISTIC``, True): no kernel whose result
  depends on thread timing (atomic adds on CUDA); False allows them where they
  are faster.
- ``validate`` (``TMCORE_VALIDATE``, False): validate mode. Its scope is the
  INPUTS of tmcore's public functions: every array argument they receive must
  be finite and every ``sigma`` > 0 (reads values back to the host). In a layer
  call that means the state and the cell weights the scan receives and the
  heads' outputs (coordinates, sigma, content) computed from the tokens and the
  linear weights, so a NaN token or head weight is reported as the head output
  it poisons (``read_coords: expected finite values``); the JAX ``apply`` also
  checks ``x`` and the state first. The layer's linear weights are not
  inspected themselves (a NaN in ``out_proj`` is not reported at all), nor is
  any output.
- ``depthwise`` (``TMCORE_DEPTHWISE``, ``"auto"``): the depthwise-tap kernel of
  the torch and JAX backends; ``"auto"`` lets the backend choose (fused C
  kernels on the CPU, a grouped conv on accelerators), ``"grouped"`` forces the
  grouped conv (torch ``conv3d``, ``lax.conv_general_dilated``), ``"shifts"``
  the shifted-slice products; both forced kernels skip the fused C conv.
- ``triton_tf32`` (``TMCORE_TRITON_TF32``, False): TF32 products for float32 in the
  Triton kernels on CUDA (faster, about 1e-3 relative error).
- ``cuda_graphs`` (``TMCORE_CUDA_GRAPHS``, True): capture the Triton scan loops as
  CUDA graphs (CUDA only; a failed capture runs the launches eagerly).

Values are exactly ``True``, ``False`` or ``None`` (``triton`` also the string
``"auto"``; ``depthwise`` one of its strings or ``None``); anything else (``1``,
``"yes"``, a NumPy ``bool_`` or array) is a ``TypeError`` naming the field
(``ValueError`` for an unknown ``depthwise`` string), raised before anything
changes.

Two layers, innermost first:

1. :func:`options` — local to the current thread / asyncio task (a context
   variable): ``tmcore.options(native=False)`` sets it for the rest of the
   current context; ``with tmcore.options(native=False): ...`` sets it inside
   the block and restores the previous value on exit. A new thread starts from
   the defaults.
2. The environment variables, which set the defaults: ``0``, ``false``, ``no``, ``off``
   (any case) mean False, any other non-empty value True (``TMCORE_TRITON`` also takes
   ``auto``); unset or empty means the default above. They are read once, when
   tmcore is imported (every dispatch asks for the options, so they must cost a few
   dict lookups); after changing one in a running process, call
   :func:`reload_environment`.

Process settings that are not switches are read from the environment here too, when
they are used (rarely: building the C kernels): :func:`cache_dir`
(``TMCORE_CACHE_DIR``), :func:`compile_timeout` (``TMCORE_COMPILE_TIMEOUT``),
:func:`memory_limit` (``TMCORE_MEMORY_LIMIT``, the size gates' bound) and
:func:`environment` for the variables of other tools (``CC``, ``TRITON_INTERPRET``,
``XDG_CACHE_HOME``). No other module of tmcore reads the environment.

Where a choice is made: ``generic`` and ``triton`` when :func:`tmcore.runtime.dispatch.ops_for`
picks a table (its cache is keyed by the options, so a change takes effect on
the next call); ``native`` and ``validate`` at every call. Under ``jax.jit`` they
are read while tracing: a function traced under one setting keeps it (the JAX
adapter keys its compiled functions by :func:`get_options`).
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

    :func:`get_options` returns one; :func:`options` changes them. Each field's
    default comes from its environment variable (``TMCORE_<NAME>``), else the
    value below.

    Parameters
    ----------
    native : bool, default True
        Use the fused C kernels for the CPU cell (torch, JAX).
    triton : bool or ``"auto"``, default ``"auto"``
        Triton kernels for torch: ``"auto"`` lets the backend decide (CUDA
        tensors, Triton installed), True forces them wherever they can run
        (CPU under ``TRITON_INTERPRET=1``), False turns them off.
    generic : bool, default False
        Force the generic array-API path everywhere (no backend fast path).
    deterministic : bool, default True
        Allow no kernel whose result depends on thread timing (atomic adds on
        CUDA); False allows them where they are faster.
    validate : bool, default False
        Validate mode: every array argument of a public function must be finite
        and every ``sigma`` > 0 (reads values back to the host).
    depthwise : {"auto", "grouped", "shifts"}, default ``"auto"``
        The depthwise-tap kernel of the torch and JAX backends: ``"auto"`` lets
        the backend choose, ``"grouped"`` forces the grouped conv, ``"shifts"``
        the shifted-slice products.
    triton_tf32 : bool, default False
        TF32 products for float32 in the Triton kernels on CUDA.
    cuda_graphs : bool, default True
        Capture the Triton scan loops as CUDA graphs (CUDA only).
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
    """What :func:`options` set in this context: ``entries`` in the order they were
    made, each ``(block, changes)`` -- ``block`` the open ``with`` block that made it
    (a :class:`_Block`), or ``None`` for a plain setter call -- and ``overrides``,
    the entries folded into one sorted ``(field, value)`` tuple (the cache key)."""

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

# Context-local overrides (a _Local).
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
    """``value`` if it is a valid setting of field ``name`` (exactly True, False, None, or
    for ``triton`` the str ``"auto"``); else ``TypeError`` naming the field. Exact types:
    a NumPy ``bool_`` or 0-d array is refused (an array ``== "auto"`` is truthy and
    unhashable, and would break every later call in the thread)."""
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


# The switches' environment variables are read once, at import, and again by
# reload_environment(): get_options() runs at every dispatch and must cost a few dict
# lookups (reading os.environ costs about 0.7 us per UNSET variable, 20x this function).
_ENV: list[tuple] = [()]


def reload_environment() -> Options:
    """Read the switches' environment variables again (they are read once, at import).

    Call it after changing ``TMCORE_*`` variables in a running process (a test's
    ``monkeypatch.setenv``); a variable set before the process starts needs nothing.

    Returns
    -------
    Options
        The options now in effect in this thread / task.
    """
    _ENV[0] = tuple(os.environ.get(ENV_VARS[name]) for name in _FIELDS)
    _warn_bad_env()
    return get_options()


def get_options() -> Options:
    """The options in effect in the current thread / asyncio task.

    Each field is the innermost :func:`options` override, else its environment
    variable, else the default. The switches' environment variables are read once, at
    import: after changing one in a running process, call
    :func:`reload_environment`.

    Returns
    -------
    Options
        The effective value of every switch (hashable; the JAX adapter keys its
        compiled functions by it).
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

    ``tmcore.options(native=False)`` applies at once and stays for the rest of
    the current context; ``with tmcore.options(native=False): ...`` applies
    inside the block only. A keyword left out keeps its current value; ``None``
    returns that option to its default (environment variable, else built-in).
    See the module docstring for the fields. ``with tmcore.options() as opts``
    binds the effective :class:`Options`.

    Parameters
    ----------
    **changes : bool, str or None
        Fields of :class:`Options` and their new values: exactly ``True``,
        ``False`` or ``None`` (``triton`` also ``"auto"``; ``depthwise`` one of
        ``"auto"``, ``"grouped"``, ``"shifts"`` or ``None``). Every value is
        checked before anything changes, so a refused call changes nothing.

    Raises
    ------
    TypeError
        If a keyword is not a field of :class:`Options`, or a value is not of
        an accepted type (``1``, ``"yes"``, a NumPy ``bool_`` or array).
    ValueError
        If ``depthwise`` is a string other than its three kernels.
    RuntimeError
        On exiting a block that is not open in this thread / task.

    Notes
    -----
    As a context manager the block's setting is applied by ``__enter__`` (it
    replaces the immediate application of the call, so a ``with`` leaves nothing
    behind) and undone if entering fails; ``__exit__`` removes exactly this
    block's setting and any setter calls made inside it. Blocks may be exited in
    any order (e.g. ``ExitStack`` or hand-written ``__enter__`` / ``__exit__``):
    exiting an outer block before an inner one drops the outer block's setting and
    keeps the inner one's until it exits, so nothing leaks. Exiting a block that is
    not open in this thread / task (exited twice, or entered in another thread) is
    a ``RuntimeError``.

    Reusing one object: creating it applies its changes at once (the setter
    form); a ``with`` entered right after creating it (nothing changed in
    between) takes that application over, which is why ``with
    tmcore.options(...):`` leaves nothing behind. Any later ``with obj:`` --
    nested, repeated or in another thread -- applies the same changes on top of
    what is in effect when it is entered, and its exit removes exactly that entry
    (a nested reuse exits innermost first). To keep a setting for later without
    applying it now, keep the keywords instead:
    ``quiet = functools.partial(tmcore.options, validate=False)``, then
    ``with quiet(): ...``.
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
    """The value of another tool's environment variable (``CC``, ``TRITON_INTERPRET``,
    ...), read now; ``default`` when it is unset."""
    return os.environ.get(name, default)


#: The variable bounding the bytes one call may need (``memory_limit``).
MEMORY_LIMIT_ENV_VAR = "TMCORE_MEMORY_LIMIT"
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def memory_limit() -> int | None:
    """The bound, in bytes, every size gate checks a call's parameters, activations and
    state against before allocating (``TMCORE_MEMORY_LIMIT``: bytes, or a number with a
    ``K``, ``M``, ``G`` or ``T`` suffix, powers of 1024; read now). ``None`` (unset): the
    device's own memory bounds it (host memory, a cgroup or ``RLIMIT_AS``; a GPU's total
    memory). A value that is not a positive size is refused by name with a warning (once
    per value), and no bound applies."""
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
    """The configured folder of the built kernels: ``TMCORE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tmcore``, else ``~/.cache/tmcore`` (read now; the backend builds
    elsewhere when it is not safe to use)."""
    if os.environ.get("TMCORE_CACHE_DIR"):
        return Path(os.environ["TMCORE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tmcore"


def compile_timeout() -> float | None:
    """Seconds one compiler run may take (``TMCORE_COMPILE_TIMEOUT``, default 120, read
    now); ``None`` (no limit) for ``inf`` or ``none``. A value that is not a number of
    seconds > 0 (text, 0, negative, NaN) is refused by name with a warning (once per
    value), and the default applies."""
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
