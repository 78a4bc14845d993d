"""CuPy: the fused Triton scan through a zero-copy DLPack bridge, else the generic path.

The per-primitive math on CuPy is the generic array-API path (a few dense
contractions, launched on CuPy's current stream; no single-primitive kernel
measured to beat it). The whole scan, ``memory_scan_fwd`` / ``memory_scan_bwd``,
runs the fused Triton kernels of :mod:`tmcore.backends.triton.dense` when torch and
triton are installed and the ``triton`` option allows it: the CuPy arrays are
handed to torch without a copy (``torch.from_dlpack``; the DLPack protocol
orders the two libraries' streams), the same kernels as for torch CUDA tensors
run (three launches per chunk step, CUDA graph replay), and the results come
back the same way (``cupy.from_dlpack``). So CuPy gets exactly the kernels the
torch backend tests, and no second copy of them. Without torch or triton, for
``n = 4``, halves or anything else the kernels decline, the generic loop runs.

The bridge is namespace-agnostic (:func:`bridged_scan_fwd` /
:func:`bridged_scan_bwd` take any namespace with ``from_dlpack``); the tests run
it on NumPy arrays and CPU torch under Triton's interpreter, which is all that
can run without a GPU. Not measured on a GPU yet.
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
    """``(torch, tmcore.backends.triton.dense)`` when the fused scan can be reached, else None.

    torch is imported here only if it is installed and the ``triton`` option is not
    off (a CuPy user without torch keeps the generic path, and pays no import).
    """
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
                     checkpoint_every: int):
    """:func:`tmcore.scan.memory_scan_fwd` through the torch Triton kernels (zero-copy),
    or ``None`` where they do not apply."""
    side = _torch_side()
    if side is None:
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
                     eps: float, radius: float | None, checkpoint_every: int):
    """:func:`tmcore.scan.memory_scan_bwd` through the torch Triton kernels (zero-copy),
    or ``None`` where they do not apply."""
    from tmcore.types import ScanGrads

    side = _torch_side()
    if side is None:
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
    """The CuPy table: the generic primitives, float16 computed in float32 (as for
    NumPy), and the fused scan through the bridge where it applies."""
    fused = generic._replace(scan_fwd=bridged_scan_fwd, scan_bwd=bridged_scan_bwd)
    return with_float32_compute(fused)
