"""What the fused torch paths (C and Triton kernels) check before they run: which tensors
they may take, and every shape their kernels index by.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tmcore.ops.window import window_sizes
from tmcore.types import ConvParams

__all__ = ["PLAIN", "is_wrapped", "untraced", "expect_shape", "check_state",
           "check_scan_shapes", "window_boxes"]

#: Plain tensors and parameters: not fake, functional, nested-subclass or other subclasses.
PLAIN = (torch.Tensor, torch.nn.Parameter)
is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                     lambda t: False)


def untraced(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``tensors`` are plain tensors of one dtype that autograd does not record and no
    functorch transform wraps (those need torch ops; fakes have no memory for a kernel)."""
    first = tensors[0]
    grad_mode = torch.is_grad_enabled()
    for t in tensors:  # the type first: nothing else is asked of a foreign tensor
        if (type(t) not in PLAIN or t.dtype != first.dtype
                or (grad_mode and t.requires_grad) or is_wrapped(t)):
            return False
    return True


def expect_shape(name: str, t: Any, shape: tuple[int, ...], layout: str,
                 kernel: str = "CPU kernel") -> None:
    """``ValueError`` unless ``t.shape == shape`` (the kernels index every buffer by the state's
    shapes: a wrong one would be accessed out of bounds)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {layout} = {tuple(shape)} for the fused "
                         f"{kernel}, got {tuple(t.shape)}")


def check_state(name: str, t: Any) -> None:
    """``ValueError`` unless ``t`` is shaped ``(B, C, *S)`` with 1 to 4 spatial axes."""
    if not 3 <= t.ndim <= 6:
        raise ValueError(f"{name}: expected shape (B, C, *S) with 1 to 4 spatial axes, got "
                         f"{tuple(t.shape)}")


def window_boxes(spatial: tuple[int, ...], window: int) -> tuple[tuple[int, ...], ...]:
    """``(size, box, corners)`` per axis of a local scan on ``spatial``: the window, the box
    (window and halo, in the grid) and the read's corners (1 on a 1-cell axis, else 2)."""
    return (*window_sizes(spatial, window), tuple(1 if s == 1 else 2 for s in spatial))


@functools.lru_cache(maxsize=64)
def _layouts(like: tuple[int, ...], steps: int, saved: int | None,
             window: int | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Argument name -> ``(expected shape, layout)`` of the scans' arrays, the state ``like =
    (B, C, *S)`` (cached: a decode step asks for the same shapes every token)."""
    batch, channels, *spatial = like
    n, c2 = len(spatial), 2 * channels
    checkpoints = ((saved, *like), "(ceil(T / checkpoint_every), B, C, *S)")
    out = {"c0": (like, "(B, C, *S) like h0"), "g_c": (like, "(B, C, *S) like g_h"),
           "g_reads": ((batch, steps, channels), "(B, T, C)"),
           "write_coords": ((batch, steps, n), "(B, T, n)"),
           "write_sigma": ((batch, steps), "(B, T)"),
           "write_content": ((batch, steps, channels), "(B, T, C)"),
           "h_checkpoints": checkpoints, "c_checkpoints": checkpoints,
           "params.depthwise_weight": ((n, c2, 3), "(n, 2C, 3)"),
           "params.depthwise_bias": ((n, c2), "(n, 2C)"),
           "params.pointwise_weight": ((4 * channels, c2), "(4C, 2C)"),
           "params.pointwise_bias": ((4 * channels,), "(4C,)")}
    if window is not None:
        _, box, corners = window_boxes(tuple(spatial), window)
        lead = (steps, batch, channels)
        out.update({"residuals.h_boxes": ((*lead, *box), "(T, B, C, *box)"),
                    "residuals.c_boxes": ((*lead, *box), "(T, B, C, *box)"),
                    "residuals.read_boxes": ((*lead, *corners), "(T, B, C, *corners)")})
    return out


_PARAM_NAMES = tuple(f"params.{k}" for k in ConvParams._fields)


def check_scan_shapes(state: Any, read_coords: Any, arrays: dict[str, Any],
                      params: ConvParams, *, saved: int | None = None,
                      window: int | None = None, kernel: str = "CPU kernel") -> None:
    """Check a fused scan's ``arrays`` (by argument name: ``c0``, ``g_reads``, ``write_*``,
    ``saved`` checkpoints, with ``window`` the local residuals) and ``params`` against ``state
    (B, C, *S)`` and ``read_coords (B, T, n)``; ``ValueError`` naming the first that is off."""
    check_state("h0", state)
    batch, channels, *spatial = state.shape
    n = len(spatial)
    if read_coords.ndim != 3 or tuple(read_coords.shape[::2]) != (batch, n):
        raise ValueError(f"read_coords: expected shape (B, T, n) = ({batch}, T, {n}), got "
                         f"{tuple(read_coords.shape)}")
    layouts = _layouts(tuple(state.shape), read_coords.shape[1], saved, window)
    for name, t in (*arrays.items(), *zip(_PARAM_NAMES, params, strict=True)):
        shape, layout = layouts[name]
        expect_shape(name, t, shape, layout, kernel)

