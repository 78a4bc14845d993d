"""What each attached Tensor Memory reads, writes and keeps over a stream.

:func:`trace` runs a model once (no gradient) with a forward pre-hook on every
:class:`~tmcore.adapters.torch.TensorMemory` in it (from
:func:`~tmcore.adapters.torch.attach_memory`, :func:`tmcore.adapters.hf.attach_memory` or
built by hand) that recomputes, from the tokens the memory receives and with the layer's
own pieces (:func:`tmcore.layer.layer.chunk`, its :meth:`~tmcore.layer.Layer.heads`,
:func:`~tmcore.adapters.torch.memory_scan` one chunk at a time), the per-chunk addresses,
spreads, reads and state norms; the gate and the residual stream come from the
:class:`~tmcore.adapters.torch.MemoryResidual` around it. :func:`plot` draws one row.

Sizes: ``B`` rows, ``N`` tokens, ``T = ceil(N / L)`` chunks, ``n`` grid axes, ``C``
channels, ``d`` the token width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from tmcore import layer as tl
from tmcore.adapters.torch.bridge import XP
from tmcore.adapters.torch.functional import memory_scan
from tmcore.adapters.torch.modules import MemoryResidual, TensorMemory
from tmcore.layer.layer import chunk, unchunk

__all__ = ["MemoryTrace", "plot", "trace"]


class MemoryTrace(NamedTuple):
    """One memory layer over one call (every tensor detached, on the model's device).

    Parameters
    ----------
    read_coords, write_coords : Tensor, shape ``(B, T, n)``
        Each chunk's read and write coordinates, in ``(-1, 1)``.
    sigma : Tensor, shape ``(B, T)``
        Each chunk's write spread (normalized units; the grid's cell spacing along
        an axis of ``S_a`` cells is ``2 / (S_a - 1)``).
    content : Tensor, shape ``(B, T, C)``
        What each chunk writes.
    reads : Tensor, shape ``(B, T, C)``
        What each chunk reads (the state before its write).
    h_norm, c_norm : Tensor, shape ``(B, T)``
        The L2 norms of ``h`` and ``c`` after each chunk's update.
    gate : float or None
        ``sigmoid(gate)`` of the residual around the memory (``None``: no residual).
    read_rms, stream_rms : Tensor, shape ``(B, N)``, or None
        Per token, the RMS over ``d`` of what the residual adds (``sigmoid(gate) *
        out``) and of its input (the residual stream); ``None`` without a residual.
    """

    read_coords: Tensor
    write_coords: Tensor
    sigma: Tensor
    content: Tensor
    reads: Tensor
    h_norm: Tensor
    c_norm: Tensor
    gate: float | None
    read_rms: Tensor | None
    stream_rms: Tensor | None


def trace(model: nn.Module, run: Callable[[], Any]) -> tuple[Any, list[MemoryTrace]]:
    """Run ``run()`` once under ``torch.no_grad`` and trace every memory of ``model``.

    Each memory must be called once by ``run``, from a chunk boundary (no state, an
    ``(h, c)`` pair or a :class:`~tmcore.layer.StreamState` with no unfinished chunk),
    without ``reset``, ``doc_starts`` or ``valid``, with the paper's dense update, and
    (when streaming) with whole chunks: what the layer then computes is what the probe
    recomputes.

    Parameters
    ----------
    model : torch.nn.Module
        A model holding one or more :class:`TensorMemory` (in ``model.modules()``
        order: block order for attached memories).
    run : callable
        Calls the model, e.g. ``lambda: model(input_ids)``.

    Returns
    -------
    result : Any
        What ``run()`` returned.
    traces : list of MemoryTrace
        One per memory, in ``model.modules()`` order.

    Raises
    ------
    ValueError
        If ``model`` holds no memory, ``run`` does not call each memory exactly
        once, or a call is one the probe does not recompute (see above; the
        message names the argument).
    """
    memories = [m for m in model.modules() if isinstance(m, TensorMemory)]
    if not memories:
        raise ValueError("model: holds no TensorMemory (attach one first)")
    residuals = {id(r.memory): r for r in model.modules() if isinstance(r, MemoryResidual)}
    traced: dict[int, list[MemoryTrace]] = {id(m): [] for m in memories}
    inputs: dict[int, Tensor] = {}

    def seen(module: nn.Module, args: tuple, kwargs: dict) -> None:
        # recomputed during the call: whatever the call's context sets, the heads see too
        traced[id(module)].append(_recompute(module, residuals.get(id(module)),
                                             inputs.get(id(module)), *args, **kwargs))

    def residual_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs[id(module.memory)] = args[0] if args else kwargs["x"]

    hooks = [m.register_forward_pre_hook(seen, with_kwargs=True) for m in memories]
    hooks += [r.register_forward_pre_hook(residual_input, with_kwargs=True)
              for r in residuals.values()]
    try:
        with torch.no_grad():
            result = run()
    finally:
        for hook in hooks:
            hook.remove()
    for index, memory in enumerate(memories):
        if len(traced[id(memory)]) != 1:
            raise ValueError(f"run: called memory {index} {len(traced[id(memory)])} times; "
                             f"the probe traces one call per memory")
    return result, [traced[id(m)][0] for m in memories]


def _recompute(memory: TensorMemory, residual: MemoryResidual | None,
               residual_in: Tensor | None, x: Tensor, state: Any = None, *, reset: Any = None,
               doc_starts: Any = None, valid: Any = None, stream: bool = True) -> MemoryTrace:
    """The trace of one call ``memory(x, state, ...)`` (arguments as the memory got them)."""
    config = memory.config
    for name, value in (("reset", reset), ("doc_starts", doc_starts), ("valid", valid)):
        if value is not None:
            raise ValueError(f"{name}: the probe recomputes calls without masks")
    if config.update != "dense" or config.dynamics != "none":
        raise ValueError("memory: the probe recomputes the dense update without dynamics "
                         f"(got update={config.update!r}, dynamics={config.dynamics!r})")
    batch, tokens, _ = x.shape
    size = config.chunk_size
    if stream and tokens % size:
        raise ValueError(f"x: a streaming call of {tokens} tokens leaves an unfinished chunk "
                         f"of {size}; the probe traces whole chunks")
    if isinstance(state, tl.StreamState):
        if bool(torch.as_tensor(state.count).any()):
            raise ValueError("state: a StreamState with an unfinished chunk")
        state = (state.h, state.c)
    h, c = memory.init_state(batch) if state is None else state
    inputs = memory.layer.heads(XP, memory.params(), chunk(XP, x, size))
    reads, norms = [], []
    for t in range(inputs.read_coords.shape[1]):
        read, h, c = memory_scan(h, c, *(v[:, t:t + 1] for v in inputs), memory.cell.params(),
                                 eps=config.eps, radius=config.radius)
        reads.append(read)
        norms.append(torch.stack([h.flatten(1).norm(dim=1), c.flatten(1).norm(dim=1)], -1))
    reads_ = torch.cat(reads, 1)
    h_norm, c_norm = torch.stack(norms, 1).unbind(-1)
    gate = read_rms = stream_rms = None
    if residual is not None and residual_in is not None:
        gate = float(torch.sigmoid(residual.gate).reshape(()))
        out = unchunk(XP, memory.layer.read_out(XP, memory.params(), reads_), tokens, size)
        read_rms = (gate * out).square().mean(-1).sqrt()
        stream_rms = residual_in.square().mean(-1).sqrt()
    return MemoryTrace(inputs.read_coords, inputs.write_coords, inputs.write_sigma,
                       inputs.write_content, reads_, h_norm, c_norm, gate, read_rms, stream_rms)


def plot(traces: list[MemoryTrace], path: str | Path, row: int = 0,
         title: str | None = None, marks: Mapping[str, Sequence[int]] | None = None) -> None:
    """Draw one row's traces: a column per layer; coordinates, sigma, state norms, read size.

    Needs matplotlib.

    Parameters
    ----------
    traces : list of MemoryTrace
        :func:`trace`'s result.
    path : str or Path
        The image file to write (its suffix picks the format).
    row : int, default 0
        The batch row drawn.
    title : str, optional
        The figure's title.
    marks : mapping of str to sequence of int, optional
        Vertical lines on every panel, one colour per label (e.g. ``{"facts": [...],
        "question": [...]}``), at chunk indices.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, len(traces), figsize=(5 * len(traces), 10), squeeze=False,
                             sharex="col")
    for layer, tr in enumerate(traces):
        coords, spread, state, size = axes[:, layer]
        steps = range(tr.sigma.shape[1])
        for k in range(tr.read_coords.shape[-1]):
            line, = coords.plot(steps, tr.read_coords[row, :, k].cpu(), label=f"read {k}")
            coords.plot(steps, tr.write_coords[row, :, k].cpu(), linestyle="--",
                        color=line.get_color(), label=f"write {k}")
        coords.set_title(f"layer {layer}: coordinates (solid read, dashed write)", fontsize=9)
        spread.plot(steps, tr.sigma[row].cpu())
        spread.set_title("write sigma", fontsize=9)
        state.plot(steps, tr.h_norm[row].cpu(), label="|h|")
        state.plot(steps, tr.c_norm[row].cpu(), label="|c|")
        state.set_title("state norms after each chunk", fontsize=9)
        state.legend(fontsize=7)
        if tr.read_rms is not None:
            ratio = (tr.read_rms[row] / tr.stream_rms[row].clamp_min(1e-12)).cpu()
            size.plot(range(ratio.shape[0]), ratio)
            size.set_title(f"gated read RMS / stream RMS per token (gate {tr.gate:.2f})",
                           fontsize=9)
        size.set_xlabel("chunk (token for the last panel)")
        for k, (label, where) in enumerate((marks or {}).items()):
            for ax in axes[:, layer]:
                for i, x in enumerate(where):
                    ax.axvline(x, color=f"C{k + 3}", linewidth=0.8, linestyle=":",
                               label=label if i == 0 and ax is coords else None)
    axes[0, 0].legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
