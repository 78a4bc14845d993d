"""Array namespaces that wrap another one, to test what tmcore asks of a namespace.

:func:`no_device_namespace`: array_api_strict's functions and dtypes, but its arrays have
no ``.device`` (nor ``to_device``), a creation function refuses any device but None, and
NumPy cannot read the arrays (no DLPack, no ``__array__``): the kit reads them back
through :func:`to_numpy`, the hook of this module, which registers as their backend
(:func:`make_ops`, the generic table: the generic path runs).

:func:`float32_namespace`: NumPy's, without float64, like mlx: every float64 result is
made float32 (the default floating dtype), and ``float64`` is not an attribute.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import array_api_compat
import array_api_compat.numpy as numpy_compat
import array_api_strict
import numpy as np

from tmcore.runtime.dispatch import Ops
from tmcore.runtime.options import Options

_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
           "xor", "lshift", "rshift")
_OPERATORS = (*(f"__{op}__" for op in _BINARY), *(f"__r{op}__" for op in _BINARY),
              "__neg__", "__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__",
              "__ge__", "__eq__", "__ne__", "__getitem__")
_PYTHON = ("__bool__", "__float__", "__int__", "__index__", "__len__", "__complex__")


class WrappedArray:
    """An array of a wrapping namespace: the base array, without ``.device``."""

    __slots__ = ("_base", "_namespace")
    __hash__ = None

    def __init__(self, base: Any, namespace: types.ModuleType):
        self._base, self._namespace = base, namespace

    def __array_namespace__(self, api_version: str | None = None) -> types.ModuleType:
        return self._namespace

    dtype = property(lambda self: self._base.dtype)
    shape = property(lambda self: tuple(self._base.shape))
    ndim = property(lambda self: self._base.ndim)
    size = property(lambda self: self._base.size)
    T = property(lambda self: self._wrap(self._base.T))
    mT = property(lambda self: self._wrap(self._base.mT))

    def unwrap(self) -> Any:
        """The base array."""
        return self._base

    def _wrap(self, value: Any) -> Any:
        return _wrap(value, self._namespace)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._base[_unwrap(key)] = _unwrap(value)

    def __repr__(self) -> str:
        return f"WrappedArray({self._base!r})"


def _operator(name: str):
    def op(self, *args):
        return self._wrap(getattr(self._base, name)(*map(_unwrap, args)))

    return op


def _inplace(name: str):
    def op(self, other):
        self._base = getattr(self._base, name)(_unwrap(other))
        return self

    return op


for _name in _OPERATORS:
    setattr(WrappedArray, _name, _operator(_name))
for _op in _BINARY:
    setattr(WrappedArray, f"__i{_op}__", _inplace(f"__i{_op}__"))
for _name in _PYTHON:
    setattr(WrappedArray, _name, lambda self, _name=_name: getattr(self._base, _name)())


def _unwrap(value: Any) -> Any:
    if isinstance(value, WrappedArray):
        return value.unwrap()
    if isinstance(value, (tuple, list)):
        return type(value)(_unwrap(v) for v in value)
    return value


def _wrap(value: Any, namespace: types.ModuleType) -> Any:
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # unique_all & co.
        return type(value)(*(_wrap(v, namespace) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_wrap(v, namespace) for v in value)
    if array_api_compat.is_array_api_obj(value) and not isinstance(value, WrappedArray):
        if getattr(namespace, "float64", None) is None and value.dtype == np.float64:
            value = value.astype(np.float32)
        return WrappedArray(value, namespace)
    return value


def _function(fn: Any, name: str, namespace: types.ModuleType):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        device = kwargs.pop("device", None)
        if device is not None:
            raise TypeError(f"{name}: this namespace has no devices, got device={device!r}")
        return _wrap(fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}),
                     namespace)

    return call


def _namespace(name: str, base: types.ModuleType, float64: bool) -> types.ModuleType:
    namespace = types.ModuleType(name)
    for attr in [a for a in dir(base) if not a.startswith("_")] + ["__array_api_version__",
                                                                  "__array_namespace_info__"]:
        value = getattr(base, attr, None)
        if isinstance(value, types.ModuleType):
            continue  # linalg, fft: not used by tmcore
        if callable(value) and not isinstance(value, type) and attr != "__array_namespace_info__":
            value = _function(value, attr, namespace)
        setattr(namespace, attr, value)
    if not float64:
        del namespace.float64, namespace.complex128
    return namespace


def no_device_namespace() -> types.ModuleType:
    """array_api_strict without devices (arrays read back only through :func:`to_numpy`)."""
    return _NO_DEVICE


def float32_namespace() -> types.ModuleType:
    """NumPy without float64 (no ``float64``; float64 results come back float32)."""
    return _FLOAT32


def to_numpy(x: WrappedArray) -> np.ndarray:
    """The kit's read-back hook: the values of a wrapped array as NumPy."""
    return np.asarray(x.unwrap())


def make_ops(generic: Ops, options: Options) -> Ops:
    """The backend of the wrapped namespaces: the generic table (it brings :func:`to_numpy`)."""
    return generic


_NO_DEVICE = _namespace("no_device_strict", array_api_strict, float64=True)
_FLOAT32 = _namespace("float32_numpy", numpy_compat, float64=False)
