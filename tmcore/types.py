"""The data the core and the backends exchange (pytrees: named tuples), and the one device
lookup; a leaf module that imports nothing of tmcore. Sizes: ``B`` batch, ``T`` steps, ``C``
channels, ``S`` the grid (``n`` axes), ``k`` the checkpoint interval."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import array_api_compat

__all__ = ["ConvParams", "LocalScanResiduals", "Residuals", "ScanGrads", "StepInputs",
           "WarpInputs", "WarpParams", "device_of", "host_values", "traced"]


def device_of(x: Any) -> Any:
    """``x``'s device (the ``.device`` attribute where it is one: cheap, traceable), or ``None``
    where its namespace has none, which array-API creation functions take as the default."""
    try:
        device = x.device
    except Exception:  # e.g. an array spread over several devices
        device = None
    if device is not None and not callable(device):
        return device
    try:
        return array_api_compat.device(x)
    except (AttributeError, TypeError):  # a namespace without devices
        return None


class ConvParams(NamedTuple):
    """A factorized conv's parameters over ``n`` axes (the ConvLSTM's gates: ``2C -> 4C``).

    Parameters
    ----------
    depthwise_weight : array, shape ``(n, C_in, 3)``
        The taps (previous, centre, next) per axis and channel.
    depthwise_bias : array, shape ``(n, C_in)``
        The bias of each depthwise pass.
    pointwise_weight, pointwise_bias : array, shapes ``(C_out, C_in)``, ``(C_out,)``
        The channel-mixing matrix and its bias.
    """

    depthwise_weight: Any
    depthwise_bias: Any
    pointwise_weight: Any
    pointwise_bias: Any


class StepInputs(NamedTuple):
    """The chunk steps' addressing and content, batch-first (``[T]``: a scan's steps).

    Parameters
    ----------
    read_coords, write_coords : array, shape ``(B, [T,] n)``
        The normalized read position and write centre.
    write_sigma : array, shape ``(B, [T])``
        The write spread.
    write_content : array, shape ``(B, [T,] C)``
        The content written.
    """

    read_coords: Any
    write_coords: Any
    write_sigma: Any
    write_content: Any


class WarpInputs(NamedTuple):
    """:class:`StepInputs` plus the warp's ``shift (B, [T,] n)`` (normalized units, in
    coordinate order: component ``k`` moves along spatial axis ``n - 1 - k``)."""

    read_coords: Any
    write_coords: Any
    write_sigma: Any
    write_content: Any
    shift: Any


class WarpParams(NamedTuple):
    """A warped step's parameters: the gates' conv and the per-cell flow's (``C -> n``;
    ``None`` without a flow)."""

    cell: ConvParams
    flow: ConvParams | None = None


class ScanGrads(NamedTuple):
    """The gradients of a scan's VJP, each shaped like its input.

    Parameters
    ----------
    h0, c0 : array, shape ``(B, C, *S)``
        For the initial state.
    read_coords, write_coords, write_sigma, write_content : array
        For the :class:`StepInputs` fields ``(B, T, ...)``.
    params : ConvParams
        For the gate conv.
    """

    h0: Any
    c0: Any
    read_coords: Any
    write_coords: Any
    write_sigma: Any
    write_content: Any
    params: ConvParams


class Residuals(NamedTuple):
    """What a scan's backward needs: the states entering steps ``0, k, 2k, ...`` (``h, c
    (ceil(T / k), B, C, *S)``, policy ``"checkpoint"``) or the steps' ``log``, time-major."""

    h: Any
    c: Any
    log: Any


class LocalScanResiduals(NamedTuple):
    """What the local scan's backward needs: each step's box before its update
    ``h_boxes, c_boxes (T, B, C, *box)`` and the cells each read used ``read_boxes (T, B,
    C, *corners)``; on the masked path the dense input states ``(T, B, C, *S)`` and
    ``read_boxes=None``."""

    h_boxes: Any
    c_boxes: Any
    read_boxes: Any


def traced(value: Any = None) -> bool:
    """Whether ``value`` is an abstract value of a tracing framework (a JAX tracer: its
    values cannot be read on the host), or torch.compile is tracing (its sizes may be
    symbolic too); ``traced()``: only the latter."""
    torch = sys.modules.get("torch")
    compiling = torch is not None and bool(torch.compiler.is_compiling())
    if value is None or compiling or (torch is not None and type(value) is torch.Tensor):
        return compiling  # (a plain tensor: no class to search, once per decode token)
    return any("Tracer" in cls.__name__ for cls in type(value).__mro__)


def host_values(value: Any) -> Any:
    """``value``'s values as (nested) Python lists or a scalar, read on the host; ``None``
    where they cannot be read (traced, or an abstract array: a meta or fake tensor)."""
    if traced(value):
        return None
    try:
        if hasattr(value, "tolist"):
            return value.tolist()
        if value.ndim == 0:  # element by element: only namespaces without tolist
            return bool(value) if "bool" in str(value.dtype) else int(value)
        return [host_values(value[i, ...]) for i in range(value.shape[0])]
    except Exception as error:  # each framework raises its own type for abstract values
        if isinstance(error, (ValueError, TypeError)) and not _abstract(error):
            raise
        return None


def _abstract(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}"
    return any(word in text for word in ("Tracer", "Concretization", "meta", "fake", "Fake"))
