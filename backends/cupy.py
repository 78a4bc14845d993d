"""CuPy: the generic primitives, and the whole scan through the torch backend's fused Triton
kernels (:mod:`tmcore.backends.triton.dense`) over a zero-copy DLPack bridge when torch and
triton are installed and the ``triton`` option allows it; else the generic loop. The bridge
takes any namespace with ``from_dlpack``: the tests run it on NumPy and CPU torch under
Triton's interpreter (not measured on a GPU yet).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from tmcore.backends.mixed import with_float32_compute
from tmcore.runtime.dispatch import Ops
from tmcore.runtime.options import get_options
from tmcore.types import ConvParams

__all__ = ["make_ops", "bridged_scan_fwd", "bridged_scan_bwd"]


def _torch_side():
    """``(torch, tmcore.backends.triton.dense)`` when the fused scan is reachable, else None; torch
    is imported only if installed and ``triton`` is not off."""
    if get_options().triton is False:
        return None
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch  # noqa: F401

        from tmcore.backends.triton import dense
    except ImportError:
        return None
    return sys.modules["torch"], dense


def _to_torch(torch, *arrays):
    return [torch.from_dlpack(a) for a in arrays]


def bridged_scan_fwd(xp: Any, h0, c0, read_coords, write_coords, write_sigma, write_content,
                     params: ConvParams, eps: float, radius: float | None,
                     checkpoint_every: int, reset: Any = None, active: Any = None):
    """:func:`tmcore.memory_scan_fwd` through the torch Triton kernels, or None where they do not
    apply."""
    side = _torch_side()
    if side is None or reset is not None or active is not None:
        return None
    torch, triton_scan = side
    *arrays, = _to_torch(torch, h0, c0, read_coords, write_coords, write_sigma,
                         write_content, *params)
    out = triton_scan.scan_fwd(None, *arrays[:6], ConvParams(*arrays[6:]), eps, radius,
                               checkpoint_every)
    if out is None:
        return None
    return tuple(xp.from_dlpack(t) for t in out)


def bridged_scan_bwd(xp: Any, read_coords, write_coords, write_sigma, write_content,
                     params: ConvParams, h_checkpoints, c_checkpoints, g_reads, g_h, g_c,
                     eps: float, radius: float | None, checkpoint_every: int,
                     reset: Any = None, active: Any = None):
    """:func:`tmcore.memory_scan_bwd` through the torch Triton kernels, or None where they do not
    apply."""
    from tmcore.types import ScanGrads

    side = _torch_side()
    if side is None or reset is not None or active is not None:
        return None
    torch, triton_scan = side
    arrays = _to_torch(torch, read_coords, write_coords, write_sigma, write_content, *params,
                       h_checkpoints, c_checkpoints, g_reads, g_h, g_c)
    grads = triton_scan.scan_bwd(None, *arrays[:4], ConvParams(*arrays[4:8]), *arrays[8:],
                                 eps, radius, checkpoint_every)
    if grads is None:
        return None
    back = [xp.from_dlpack(t) for t in grads[:6]]
    return ScanGrads(*back, ConvParams(*(xp.from_dlpack(t) for t in grads.params)))


def make_ops(generic: Ops, options: Any) -> Ops:
    """The CuPy table: generic primitives, float16 in float32, the bridged fused scan."""
    fused = generic._replace(scan_fwd=bridged_scan_fwd, scan_bwd=bridged_scan_bwd)
    return with_float32_compute(fused)
