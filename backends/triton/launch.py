"""What the fused Triton scans (dense and local) share around their launches: when they run
(:func:`usable`), precision, tiles, the fallback for kernels that fail (:func:`guarded`),
CUDA-graph replay (:func:`replay`), the entry checks, and the parameter gradients' partial
sums. The options (``triton``, ``triton_tf32``, ``cuda_graphs``): docs/guides/backends.md.
The kernel modules import ``triton``, so only :func:`kernels` imports them, when needed.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tmcore.backends.fused import check_scan_shapes, untraced
from tmcore.runtime.options import environment, get_options
from tmcore.types import ConvParams

__all__ = ["ENV_VAR", "MAX_CHANNELS", "kernels", "available", "interpreting", "usable",
           "precision", "Tiles", "guarded", "check_shapes", "contiguous", "param_sums",
           "param_grads", "replay", "graph_cache_bytes", "MAX_GRAPHS"]

ENV_VAR = "TMCORE_TRITON"
#: Widest memory the kernels take (register tiles are ``C x C``); wider: the generic loop.
MAX_CHANNELS = 128

_DTYPES = (torch.float32, torch.float64)
_KERNELS: dict[str, Any] = {}  # module name -> the module, or None if triton is missing
#: Keys whose kernels failed (compile or launch): the per-step path runs for them.
_BROKEN: set = set()


def kernels(name: str) -> Any:
    """The kernel module ``<name>`` of this package, or None where ``triton`` does not import."""
    if name not in _KERNELS:
        try:
            _KERNELS[name] = importlib.import_module(f"tmcore.backends.triton.{name}")
        except ImportError:
            _KERNELS[name] = None
    return _KERNELS[name]


def available() -> bool:
    """Whether ``triton`` imports (the kernels can be built)."""
    return kernels("dense_kernels") is not None


def _setting() -> bool | None:
    """The ``triton`` option: ``True`` / ``False``, or ``None`` for automatic (CUDA only)."""
    choice = get_options().triton
    return None if choice == "auto" else bool(choice)


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET``) instead of compiling."""
    return environment("TRITON_INTERPRET", "") not in ("", "0")


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a fused scan may run on ``tensors``: the ``triton`` option (``"auto"``: CUDA only;
    ``True``: also CPU under ``TRITON_INTERPRET=1``), plain untraced float32 / float64 tensors of
    one device, ``n <= 3``, ``C <=`` :data:`MAX_CHANNELS`."""
    setting = _setting()
    if setting is False:
        return False
    first = tensors[0]
    if first.device.type == "cpu":
        if not (setting and interpreting()):
            return False
    elif first.device.type != "cuda":
        return False
    if first.dtype not in _DTYPES or not 3 <= first.ndim <= 5 or first.shape[1] > MAX_CHANNELS:
        return False
    if not untraced(tensors) or any(t.device != first.device for t in tensors):
        return False
    return available()


def precision(t: torch.Tensor) -> str:
    """The ``tl.dot`` input precision: ``"tf32"`` where the ``triton_tf32`` option allows it (CUDA
    float32), else ``"ieee"``."""
    tf32 = get_options().triton_tf32 and t.is_cuda and t.dtype == torch.float32
    return "tf32" if tf32 else "ieee"


class Tiles:
    """The register tiles of a state ``(B, C, *S)``: ``cells`` cells (the grid, or a box)
    ``BP`` at a time, all ``C`` channels (``CB``: ``C`` rounded up to a power of two >= 16)."""

    def __init__(self, state: Any, cells: int) -> None:
        self.batch, self.channels = state.shape[:2]
        self.spatial = tuple(int(s) for s in state.shape[2:])
        self.n = len(self.spatial)
        self.cb = max(16, 1 << (self.channels - 1).bit_length())
        # (CB, BP) register tiles kept small: ptxas -v of the sm_90 builds at C = 32 showed
        # 0.6-5.6 KB of spills with 32-cell tiles and 4 warps, 12-252 B with 16 and 8
        self.bp = max(16, min(32 if self.cb <= 16 else 16, 1 << (cells - 1).bit_length()))
        self.num_warps = 4 if self.cb <= 16 else 8

    def launch_kw(self, warps: int | None = None) -> dict:
        """The launch's ``num_warps`` (the interpreter takes none)."""
        return {} if interpreting() else {"num_warps": warps or self.num_warps}


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def guarded(what: str, key: tuple, shown: int, like: torch.Tensor,
            run: Callable[[], Any]) -> Any:
    """``run()`` on ``like``'s device, or None once ``key``'s kernels failed: then a
    ``RuntimeWarning`` (once, naming ``what`` and ``key[:shown]``) and the per-step path for
    ``key`` from then on."""
    if key in _BROKEN:
        return None
    try:
        with _on_device(like):
            return run()
    except Exception as err:  # noqa: BLE001 - e.g. a Triton too old to compile them
        _BROKEN.add(key)
        warnings.warn(f"tmcore: the fused Triton {what} failed for {key[:shown]} "
                      f"({type(err).__name__}: {str(err)[:300]}); using the per-step path",
                      RuntimeWarning, stacklevel=4)
        return None


def check_shapes(state: torch.Tensor, read_coords: torch.Tensor, arrays: dict,
                 params: ConvParams, **kw: Any) -> None:
    """Every shape the kernels index by (:func:`tmcore.backends.fused.check_scan_shapes`) and a
    state within their 32-bit offsets: a ``ValueError`` naming the argument."""
    check_scan_shapes(state, read_coords, arrays, params, kernel="Triton kernels", **kw)
    steps = read_coords.shape[1]
    if 2 * state.numel() * max(4, steps) >= 2**31:
        raise ValueError(f"h0: the Triton kernels index with 32-bit offsets; a state of "
                         f"{tuple(state.shape)} over {steps} steps is too large for them")


def contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' inputs: ``tensors``, each made contiguous."""
    return tuple(t.contiguous() for t in tensors)


def param_sums(slots: int, channels: int, like: dict) -> tuple[torch.Tensor, ...]:
    """Zeroed per-program partial sums (``slots`` rows) of the parameter gradients: ``d_pw
    (slots, 4C, 2C)``, ``d_pb (slots, 4C)``, bias-class sums ``E`` and correlations ``corr``
    ``(slots, 2C, 27)``."""
    return (torch.zeros((slots, 4 * channels, 2 * channels), **like),
            torch.zeros((slots, 4 * channels), **like),
            torch.zeros((slots, 2 * channels, 27), **like),
            torch.zeros((slots, 2 * channels, 27), **like))


def param_grads(params: ConvParams, d_pw: torch.Tensor, d_pb: torch.Tensor,
                e_sums: torch.Tensor, corr: torch.Tensor, s3: tuple[int, int, int]) -> ConvParams:
    """The gradients of ``params`` from the partial sums: ``y`` is linear in the stencil ``K``
    and in ``Bias`` (constant per cell class), so autograd of ``<corr, K> + <E, Bias>`` on
    these few small tensors gives the taps' ``(n, 2C, 3)`` and biases' ``(n, 2C)`` gradients."""
    taps, biases = params[0], params[1]
    corr, e_sums = corr.sum(0), e_sums.sum(0)
    n, c2 = biases.shape
    with torch.inference_mode(False), torch.enable_grad():
        t = taps.detach().clone().requires_grad_(True)
        b = biases.detach().clone().requires_grad_(True)
        ident = t.new_tensor([0.0, 1.0, 0.0]).expand(c2, 3)
        padded = [ident] * (3 - n) + [t[a] for a in range(n)]
        stencil = (padded[0][:, :, None, None] * padded[1][:, None, :, None]
                   * padded[2][:, None, None, :])
        loss = (stencil.reshape(c2, 27) * corr.detach().clone()).sum()
        field = t.new_zeros((c2, 3, 3, 3))
        for axis in range(3 - n, 3):
            # class 0 = first cell, 1 = interior, 2 = last; a single cell is first and last
            not_first = t.new_tensor([0.0, 1.0, 1.0])
            not_last = t.new_tensor([1.0 if s3[axis] > 1 else 0.0, 1.0, 0.0])
            taps_a = padded[axis]
            sums = taps_a[:, :1] * not_first + taps_a[:, 1:2] + taps_a[:, 2:] * not_last
            view = [c2, 1, 1, 1]
            view[axis + 1] = 3
            field = field * sums.reshape(view) + b[axis - (3 - n)].reshape(c2, 1, 1, 1)
        loss = loss + (field.reshape(c2, 27) * e_sums.detach().clone()).sum()
        d_taps, d_biases = torch.autograd.grad(loss, (t, b))
    return ConvParams(d_taps.detach(), d_biases.detach(), d_pw.sum(0), d_pb.sum(0))


# --------------------------------------------------------------------------- CUDA graphs

_GRAPHS: collections.OrderedDict = collections.OrderedDict()
_FAILED: set = set()
_GRAPH_LOCK = threading.Lock()
#: Captured scan loops kept (each holds its static inputs, outputs and memory pool).
MAX_GRAPHS = 8


def replay(key: tuple, fn, inputs: tuple[torch.Tensor, ...]) -> tuple:
    """``fn(*inputs)``, on CUDA through a graph captured once per ``key`` (after one eager run that
    compiles the kernels): later calls copy the inputs in, replay and clone the outputs. A
    failed capture makes the key eager for good; not used while a stream is capturing."""
    if (not get_options().cuda_graphs or not inputs[0].is_cuda or key in _FAILED
            or torch.cuda.is_current_stream_capturing()):
        return fn(*inputs)
    with _GRAPH_LOCK:
        entry = _GRAPHS.get(key)
        if entry is None:
            try:
                entry = _capture(fn, inputs)
            except Exception:  # noqa: BLE001 - any capture failure: eager from now on
                _FAILED.add(key)
                return fn(*inputs)
            _GRAPHS[key] = entry
            while len(_GRAPHS) > MAX_GRAPHS:
                _GRAPHS.popitem(last=False)
        _GRAPHS.move_to_end(key)
        graph, static, outs = entry
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value)
        graph.replay()
        return tuple(o.clone() for o in outs)


def graph_cache_bytes() -> int:
    """Bytes the cached graphs' static inputs and outputs hold (pools aside): memory a step's peak
    does not show, as it stays allocated between calls."""
    total = 0
    for _, static, outs in _GRAPHS.values():
        total += sum(t.numel() * t.element_size() for t in (*static, *outs))
    return total


def _capture(fn, inputs):  # pragma: no cover - needs a CUDA device
    static = tuple(x.clone() for x in inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*static)  # compiles every kernel before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*static)
    return graph, static, tuple(outs)
