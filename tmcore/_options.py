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
- ``validate`` (``TMCORE_VALIDATE``, False): validate mode; public functions
  also check that arrays are finite and sigma > 0 (reads values back to the
  host).
- ``depthwise`` (``TMCORE_DEPTHWISE``, ``"auto"``): the depthwise-tap kernel of
  the torch and JAX backends; ``"auto"`` lets the backend choose (fused C
  kernels on the CPU, a grouped conv on accelerators), ``"grouped"`` forces the
  grouped conv (torch ``conv3d``, ``lax.conv_general_dilated``), ``"shifts"``
  the shifted-slice products; both forced kernels skip the fused C conv.

Three layers, innermost first:

1. :func:`options` — local to the current thread / asyncio task (a context
   variable): ``tmcore.options(native=False)`` sets it for the rest of the
   current context; ``with tmcore.options(native=False): ...`` sets it inside
   the block and restores the previous value on exit. A new thread starts from
   the defaults.
2. Process-wide settings (:func:`tmcore.set_validation` only, kept for
   compatibility).
3. The environment variables: ``0``, ``false``, ``no``, ``off`` (any case) mean
   False, any other non-empty value True (``TMCORE_TRITON`` also takes
   ``auto``); unset or empty means the default above. They are read from
   ``os.environ`` when :func:`get_options` is called (a few dict lookups), so
   a variable set before the first tmcore call, or changed later through
   ``os.environ`` (a test's ``monkeypatch.setenv``), counts.

Where a choice is made: ``generic`` and ``triton`` when :func:`tmcore._dispatch.ops_for`
picks a table (its cache is keyed by the options, so a change takes effect on
the next call); ``native`` and ``validate`` at every call. Under ``jax.jit`` they
are read while tracing: a function traced under one setting keeps it (the JAX
adapter keys its compiled functions by :func:`get_options`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import warnings
from typing import Any, Literal

__all__ = ["Options", "options", "get_options", "ENV_VARS"]

TritonMode = bool | Literal["auto"]
DepthwiseKernel = Literal["auto", "grouped", "shifts"]
_DEPTHWISE = ("auto", "grouped", "shifts")


@dataclasses.dataclass(frozen=True)
class Options:
    """The effective value of every switch (hashable: usable as a cache key)."""

    native: bool = True
    triton: TritonMode = "auto"
    generic: bool = False
    deterministic: bool = True
    validate: bool = False
    depthwise: DepthwiseKernel = "auto"


_FIELDS = tuple(f.name for f in dataclasses.fields(Options))

#: field -> environment variable that sets its default
ENV_VARS: dict[str, str] = {name: f"TMCORE_{name.upper()}" for name in _FIELDS}

_FALSE = ("0", "false", "no", "off")

# Context-local overrides: a tuple of (field, value) pairs, or () for none.
_LOCAL: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "tmcore_options", default=()
)
# Process-wide overrides (set_validation): field -> value, and the same as a cache key.
_PROCESS: dict[str, Any] = {}
_PROCESS_KEY: list[tuple] = [()]
# (environment values, process overrides, local overrides) -> Options
_CACHE: dict[tuple, Options] = {}
_WARNED: set[tuple[str, str]] = set()
# (environment values, process key, local overrides, Options) of the last answer
_LAST: list[tuple] = [(None, None, None, None)]


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


def _check(name: str, value: Any) -> Any:
    if name not in _FIELDS:
        raise TypeError(f"options: unknown option {name!r}; expected one of {', '.join(_FIELDS)}")
    if name == "depthwise" and value is not None and value not in _DEPTHWISE:
        raise ValueError(f"depthwise: expected 'auto', 'grouped', 'shifts' or None, got {value!r}")
    if name == "depthwise":
        return value
    if value is None or isinstance(value, bool) or (name == "triton" and value == "auto"):
        return value
    expected = "True, False, 'auto' or None" if name == "triton" else "True, False or None"
    raise TypeError(f"{name}: expected {expected}, got {value!r}")


# The raw values are read from os.environ's own dict (CPython's ``os._Environ._data``,
# what ``os.environ[...] = ...`` and ``putenv`` through it update): one dict lookup per
# variable instead of ``os.environ.get``'s encode-and-decode, since every dispatch asks
# for the options. Elsewhere (no ``_data``) the public mapping is used.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
if _ENV_DATA is not None and _ENCODE is not None:
    _K0, _K1, _K2, _K3, _K4, _K5 = (_ENCODE(ENV_VARS[name]) for name in _FIELDS)

    def _env_key(get: Any = _ENV_DATA.get) -> tuple:
        return (get(_K0), get(_K1), get(_K2), get(_K3), get(_K4), get(_K5))

    def _decode(raw: Any) -> str | None:
        return None if raw is None else os.environ.decodevalue(raw)
else:  # pragma: no cover - non-CPython environ
    def _env_key() -> tuple:
        return tuple(os.environ.get(ENV_VARS[name]) for name in _FIELDS)

    def _decode(raw: Any) -> str | None:
        return raw


def get_options() -> Options:
    """The options in effect here: :func:`options` overrides, else process-wide, else
    the environment variables, else the defaults."""
    local = _LOCAL.get()
    env = _env_key()
    last = _LAST[0]  # the previous answer: most calls ask again under the same settings
    if last[0] == env and last[1] is _PROCESS_KEY[0] and last[2] is local:
        return last[3]
    key = (env, _PROCESS_KEY[0], local)
    found = _CACHE.get(key)
    if found is not None:
        _LAST[0] = (*key, found)
        return found
    values: dict[str, Any] = {}
    for name, raw in zip(_FIELDS, key[0], strict=True):
        parsed = _parse_env(name, _decode(raw))
        if parsed is not None:
            values[name] = parsed
    values.update(_PROCESS)
    values.update(local)
    found = Options(**values)
    if len(_CACHE) > 256:  # keys are few in practice; never let the cache grow unbounded
        _CACHE.clear()
    _CACHE[key] = found
    _LAST[0] = (*key, found)
    return found


class options:  # noqa: N801  (a function-like name: it is called, rarely instantiated)
    """Set tmcore options for the current thread / task; also a context manager.

    ``tmcore.options(native=False)`` applies at once and stays for the rest of
    the current context; ``with tmcore.options(native=False): ...`` applies
    inside the block only. A keyword left out keeps its current value; ``None``
    returns that option to its default (environment variable, else built-in).
    See the module docstring for the fields. ``with tmcore.options() as opts``
    binds the effective :class:`Options`.
    """

    def __init__(self, **changes: Any) -> None:
        checked = {name: _check(name, value) for name, value in changes.items()}
        current = dict(_LOCAL.get())
        for name, value in checked.items():
            if value is None:
                current.pop(name, None)
            else:
                current[name] = value
        self._token = _LOCAL.set(tuple(sorted(current.items())))

    def __enter__(self) -> Options:
        return get_options()

    def __exit__(self, *exc: object) -> None:
        _LOCAL.reset(self._token)

    def __repr__(self) -> str:
        return f"tmcore.options -> {get_options()!r}"


def set_process_option(name: str, value: Any) -> None:
    """Process-wide override of one option (``None``: back to the environment); the
    innermost :func:`options` still wins. Used by :func:`tmcore.set_validation`."""
    value = _check(name, value)
    if value is None:
        _PROCESS.pop(name, None)
    else:
        _PROCESS[name] = value
    _PROCESS_KEY[0] = tuple(sorted(_PROCESS.items()))


def _warn_bad_env() -> None:
    """Warn once per variable about a value that will be read as True by accident."""
    for name in _FIELDS:
        raw = os.environ.get(ENV_VARS[name])
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


_warn_bad_env()
