"""Attach a gated Tensor Memory to every block of an existing torch model, and remove it.

Each memory is a submodule of its block (``block.tensor_memory``) applied by a forward hook
registered in front of the block's other hooks, so everything that walks the model sees it
(docs/guides/pytorch.md). Per-call bookkeeping is local to the calling thread (a plain
object under ``torch.compile``, which then traces no lock); activation checkpointing replays
the recorded start state of the call (docs/guides/huggingface.md, gradient checkpointing).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tmcore import layer as tl
from tmcore.adapters.torch.bridge import XP as _XP
from tmcore.adapters.torch.modules import MemoryResidual, TensorMemory
from tmcore.runtime.validate import check_bool_mask
from tmcore.scan.base import tree_map
from tmcore.types import traced

__all__ = ["ATTRIBUTE", "MemoryHandle", "attach_memory", "blocks_of", "detach_memory",
           "detach_state"]

#: Name of the memory submodule attach_memory adds to each block.
ATTRIBUTE = "tensor_memory"

#: Start states remembered for activation-checkpoint recomputation, per handle
#: (a few calls' worth; each entry only references tensors the graph holds anyway).
_RECORDS_PER_LAYER = 4

State = tuple[Tensor, Tensor]
_AMBIGUOUS: Any = object()  # a record key two live calls shared


def detach_state(state: Any) -> Any:
    """Detach a layer's state from the autograd graph (truncated backprop between calls).

    Parameters
    ----------
    state : None, Tensor, pair of Tensor, StreamState or sequence of them
        A state ``(h, c)`` (each ``(B, C, *S)``), a :class:`tmcore.layer.StreamState`, or a
        (nested) tuple or list of them (a stack's per-layer states).

    Returns
    -------
    None, Tensor, tuple, list or StreamState
        The same structure with every tensor detached (not copied); a stream state's
        ``count`` keeps its values.
    """
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, state)


def _in_backward(compiling: bool) -> bool:
    """Whether the autograd engine runs a backward in this thread (never while
    ``compiling``: the compiled backward re-runs no hook)."""
    return not compiling and torch._C._current_graph_task_id() != -1


def blocks_of(blocks: Any) -> tuple[list[nn.Module], bool | None]:
    """``(layers, batch_first)``: the blocks of an ``nn.ModuleList``, ``nn.Sequential``, a list
    of modules or an ``nn.TransformerEncoder`` (its ``layers``), and the first block's
    ``self_attn.batch_first`` (``None`` if it has none); ``TypeError`` / ``ValueError`` else."""
    if isinstance(blocks, nn.TransformerEncoder):
        layers = list(blocks.layers)
    elif isinstance(blocks, (nn.ModuleList, nn.Sequential)) or (
            isinstance(blocks, Iterable) and not isinstance(blocks, nn.Module)):
        layers = list(blocks)
    else:
        raise TypeError(f"blocks: expected an nn.ModuleList, nn.Sequential, "
                        f"nn.TransformerEncoder or a list of modules, got {type(blocks).__name__}")
    if not layers or not all(isinstance(b, nn.Module) for b in layers):
        raise ValueError("blocks: expected at least one nn.Module block")
    attn = getattr(layers[0], "self_attn", None)
    return layers, getattr(attn, "batch_first", None)


class _CallState:
    """Per-call bookkeeping (a plain object: what a thread-local holds outside compile)."""

    carried: Any = None
    current: Any = None
    reset: Any = None
    doc_starts: Any = None
    valid: Any = None


def _checkpoints_forward(module: nn.Module) -> bool:
    """A Hugging Face ``GradientCheckpointingLayer`` (transformers 5) in checkpointing mode:
    it checkpoints only its ``forward``, so a forward hook runs outside the checkpoint."""
    return (getattr(module, "gradient_checkpointing", False) is True and module.training
            and torch.is_grad_enabled()
            and callable(getattr(module, "_gradient_checkpointing_func", None)))


def _with_tensors(state: Any, tensors: Sequence[Tensor]) -> Any:
    """``state`` (a pair or a :class:`tmcore.layer.StreamState`) with its tensor fields, in
    order, replaced by ``tensors``."""
    replaced = iter(tensors)
    return tree_map(lambda v: next(replaced) if isinstance(v, Tensor) else v, state)


def _checkpointed(module: nn.Module, memory: nn.Module, x: Tensor, init: Any, reset: Any,
                  kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
    """``memory(x, init, ...)`` inside the block's checkpoint function, the start state's
    tensors its explicit inputs (a reentrant checkpoint differentiates only those)."""
    box: list[Any] = []

    def run(x: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        state = None if init is None else _with_tensors(init, tensors)
        out, new = memory(x, state, reset=reset, **kwargs)
        box[:] = [new]
        return (out, *(v for v in new if isinstance(v, Tensor)))

    inputs = () if init is None else (v for v in init if isinstance(v, Tensor))
    out, *tensors = module._gradient_checkpointing_func(run, x, *inputs)
    return out, _with_tensors(box[0], tensors)


class _Hook:
    """The forward hook of block ``layer`` (a picklable, deep-copyable object, unlike a
    closure: a copied model's hooks call the copied handle and memories)."""

    def __init__(self, handle: MemoryHandle, layer: int):
        self.handle, self.layer = handle, layer

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (self.handle._run(self.layer, module, args, output[0]), *output[1:])
        return self.handle._run(self.layer, module, args, output)


class MemoryHandle:
    """The memories attached to a model's blocks, their streaming state and hooks.

    Made by :func:`tmcore.adapters.torch.attach_memory`. ``handle.memories[l]`` is block
    ``l``'s :class:`~tmcore.adapters.torch.MemoryResidual`; after every model call
    ``handle.state[l]`` is the state layer ``l`` reached, where the next call starts with
    ``streaming=True`` (per layer in ``causal`` mode, from the last layer's in ``threaded``
    mode). The hooks assume the blocks run in order, once each, per model call.

    Parameters
    ----------
    blocks : list of nn.Module
        The blocks, in order.
    memories : list of nn.Module
        One :class:`~tmcore.adapters.torch.MemoryResidual` per block.
    mode : {"causal", "threaded"}
        The multi-layer mode (:data:`tmcore.layer.MODES`).
    streaming : bool
        Carry ``state`` from one model call to the next.
    batch_first : bool
        Whether the block outputs are ``(B, N, d)`` (else ``(N, B, d)``).

    Raises
    ------
    ValueError
        If ``mode`` is unknown or a block already has a memory attached.
    """

    def __init__(self, blocks: list[nn.Module], memories: list[nn.Module], mode: str,
                 streaming: bool, batch_first: bool):
        self.mode = tl.check_mode(mode)
        self.streaming, self.batch_first = bool(streaming), bool(batch_first)
        for index, block in enumerate(blocks):
            if hasattr(block, ATTRIBUTE):
                raise ValueError(f"blocks[{index}]: already has an attribute {ATTRIBUTE!r} "
                                 f"(memory attached twice?); remove the first handle first")
        self._blocks = list(blocks)
        for block, memory in zip(self._blocks, memories, strict=True):
            block.add_module(ATTRIBUTE, memory)
        self._forget()
        self._state_cut = True  # no state, or one detached from earlier calls' graphs
        self._setup_transient()
        self._hooks = [block.register_forward_hook(_Hook(self, layer), prepend=True)
                       for layer, block in enumerate(self._blocks)]

    def _forget(self) -> None:
        """No state, and no pending reset, document or padding mask for the next call."""
        self.state: list[State] | None = None
        self._reset = self._doc_starts = self._valid = None

    def _setup_transient(self) -> None:
        self._local = threading.local()  # per-call bookkeeping of the calling thread
        self._compiled_local = _CallState()  # the same under torch.compile (traceable)
        self._records: dict[tuple, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_local", "_compiled_local", "_records", "_lock")}
        state["state"] = detach_state(self.state)  # a copy carries the state, not its graph
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup_transient()

    def __repr__(self) -> str:
        return (f"MemoryHandle(mode={self.mode!r}, streaming={self.streaming}, "
                f"layers={len(self._blocks)}, attached={self.attached})")

    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    @property
    def memories(self) -> list[nn.Module]:
        """Each block's memory (``block.tensor_memory``), in block order."""
        return [getattr(block, ATTRIBUTE) for block in self._blocks] if self.attached else []

    def parameters(self) -> Iterator[nn.Parameter]:
        """Iterate over the memories' parameters, each once (e.g. for their own optimizer group).

        Yields
        ------
        nn.Parameter
            Each parameter of the memories.
        """
        yield from dict.fromkeys(p for memory in self.memories for p in memory.parameters())

    # ----------------------------------------------------------------- the hook

    def _record_key(self, layer: int, args: tuple) -> tuple | None:
        """Identify the block input of this call, as the recomputation will see it again."""
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is None or x.device.type == "meta":
            return None
        try:
            return (layer, x.data_ptr(), tuple(x.shape), x._version)
        except RuntimeError:
            # an inference tensor (no version counter, and no backward recomputes its
            # call) or a torch.func transform's tensor (no storage): nothing to record
            return None

    def _run(self, layer: int, module: nn.Module, args: tuple, y: Tensor) -> Tensor:
        memory = getattr(module, ATTRIBUTE)
        x = y if self.batch_first else y.transpose(0, 1)
        compiling = traced()
        key = None if compiling else self._record_key(layer, args)
        if _in_backward(compiling):  # activation checkpointing is recomputing this block
            with self._lock:
                record = self._records.get(key) if key is not None else None
            if record is _AMBIGUOUS:
                raise RuntimeError(
                    f"tmcore: block {layer} with attached memory is recomputed in the backward "
                    f"(activation checkpointing), but the same input tensor went through it "
                    f"twice from different states; run backward after each forward, or pass "
                    f"a fresh tensor to each call")
            if record is None:
                raise RuntimeError(
                    f"tmcore: block {layer} with attached memory was re-run during the "
                    f"backward pass (activation checkpointing?) but its forward call is no "
                    f"longer known (more than {_RECORDS_PER_LAYER} calls ago, or its input "
                    f"tensor was changed in place); run backward after each forward")
            if not record[4] and not record[5]:
                raise RuntimeError(
                    f"tmcore: block {layer} is recomputed by a reentrant checkpoint "
                    f"(use_reentrant=True), which differentiates only the checkpoint's "
                    f"explicit inputs, but its memory started from a state another call or "
                    f"layer produced (streaming, or threaded mode): the gradient through "
                    f"that state would be silently lost. Detach the streamed state between "
                    f"calls (handle.detach_state(), then the gradients are exact) or "
                    f"checkpoint with use_reentrant=False")
            out, _ = memory(x, record[1], reset=record[2], **record[3])
            return out if self.batch_first else out.transpose(0, 1)
        local = self._compiled_local if compiling else self._local
        layers = len(self._blocks)
        if layer == 0:
            local.carried = tl.segment_states(self.mode, self.state if self.streaming else None,
                                              layers)
            local.current = [None] * layers
            local.reset, self._reset = self._reset, None
            local.doc_starts, self._doc_starts = self._doc_starts, None
            local.valid, self._valid = self._valid, None
            local.carried_cut = self._state_cut or not self.streaming or self.state is None
        elif getattr(local, "current", None) is None or local.current[layer - 1] is None:
            raise RuntimeError(f"tmcore: block {layer} ran before block {layer - 1} in this call; "
                               f"attached memories need the blocks to run in order, once each")
        init, applies = tl.start_state(self.mode, layer, local.carried,
                                       local.current[layer - 1] if layer else None)
        reset = local.reset if applies else None
        # causal mode streams (a StreamState per layer); threaded mode passes plain (h, c)
        # between layers, as the reference does (set_valid, start_documents: causal only)
        kwargs = ({"stream": True, "doc_starts": local.doc_starts, "valid": local.valid}
                  if self.mode == "causal" else {"stream": False})
        if key is not None:
            # whether a reentrant recomputation may start from ``init`` (no gradient is lost
            # through it): no state, or a carried one the user cut (detach_state)
            cut = init is None or (local.carried_cut and (self.mode == "causal" or layer == 0))
            self._remember(key, args[0], init, reset, kwargs, cut)
        if _checkpoints_forward(module):
            out, state = _checkpointed(module, memory, x, init, reset, kwargs)
        else:
            out, state = memory(x, init, reset=reset, **kwargs)
        local.current[layer] = state
        if layer == layers - 1:
            self.state = list(local.current)
            self._state_cut = False  # produced by this call (cut only by detach_state)
            local.current = local.carried = local.reset = local.doc_starts = local.valid = None
        return out if self.batch_first else out.transpose(0, 1)

    def _remember(self, key: tuple, x: Tensor, init: Any, reset: Any,
                  kwargs: dict[str, Any], cut: bool = True) -> None:
        """Keep this call's start of block ``key[0]`` for a recomputation in the backward. A key
        whose tensor is gone is stale; one whose live tensor started from another state is
        ambiguous (the recomputation refuses it)."""
        with self._lock:
            old = self._records.pop(key, None)
            if old is _AMBIGUOUS or (old is not None and old[0]() is x
                                     and (old[1] is not init or old[2] is not reset
                                          or old[3].get("doc_starts")
                                          is not kwargs.get("doc_starts"))):
                self._records[key] = _AMBIGUOUS
            else:
                self._records[key] = (weakref.ref(x), init, reset, kwargs,
                                      torch.is_grad_enabled(), cut)
            while len(self._records) > _RECORDS_PER_LAYER * len(self._blocks):
                self._records.pop(next(iter(self._records)))

    # ----------------------------------------------------------------- state

    def reset_state(self, mask: Tensor | None = None) -> None:
        """Forget the state, or start some sequences from zeros at the next call.

        Parameters
        ----------
        mask : Tensor, shape ``(B,)``, bool, optional
            The sequences to start from zeros (masks of several calls combine); ``None``:
            forget the whole state and the pending masks.

        Raises
        ------
        TypeError
            If ``mask`` is not a bool tensor.
        """
        if mask is None:
            self._forget()
            return
        check_bool_mask(_XP, mask, "mask", "(B,)", None)
        self._reset = mask if self._reset is None else (self._reset | mask)

    def start_documents(self, doc_starts: Tensor) -> None:
        """Mark packed documents for the next call (``causal`` mode).

        Parameters
        ----------
        doc_starts : Tensor, shape ``(B, N)``, bool
            True at each token that starts a document, as in
            :meth:`~tmcore.adapters.torch.TensorMemory.forward`, for every layer.

        Raises
        ------
        TypeError
            If ``doc_starts`` is not a bool tensor.
        ValueError
            If the handle's mode is not ``"causal"``.
        """
        if self.mode != "causal":
            raise ValueError(f"doc_starts: packed documents need mode='causal', "
                             f"this handle is {self.mode!r}")
        check_bool_mask(_XP, doc_starts, "doc_starts", "(B, N)", None)
        self._doc_starts = doc_starts

    def set_valid(self, valid: Tensor | None) -> None:
        """Mark the padding of the next call (``causal`` mode).

        Parameters
        ----------
        valid : Tensor, shape ``(B, N)``, bool, or None
            False at padding tokens, as in :meth:`~tmcore.adapters.torch.TensorMemory.forward`,
            for every layer; ``None`` clears the mask.

        Raises
        ------
        TypeError
            If ``valid`` is not a bool tensor.
        ValueError
            If the handle's mode is not ``"causal"``.
        """
        if valid is None:
            self._valid = None
            return
        if self.mode != "causal":
            raise ValueError(f"valid: padding masks need mode='causal', "
                             f"this handle is {self.mode!r}")
        check_bool_mask(_XP, valid, "valid", "(B, N)", None)
        self._valid = valid

    def detach_state(self) -> None:
        """Cut the graph to the previous calls (truncated backprop through time)."""
        self.state = detach_state(self.state)
        self._state_cut = True

    def set_state(self, state: Sequence[State] | None) -> None:
        """Replace the per-layer state.

        Parameters
        ----------
        state : sequence of (pair of Tensor or StreamState), or None
            One state per block; ``None``: zeros at the next call.

        Raises
        ------
        ValueError
            If there is not one state per block.
        """
        if state is not None and len(state) != len(self._blocks):
            raise ValueError(f"state: expected {len(self._blocks)} per-layer (h, c) pairs, "
                             f"got {len(state)}")
        self.state = None if state is None else [
            s if isinstance(s, tl.StreamState) else tuple(s) for s in state]
        self._state_cut = True

    def remove(self) -> None:
        """Remove the hooks and the memory submodules: the model is exactly as before."""
        for hook in self._hooks:
            hook.remove()
        if self._hooks:
            for block in self._blocks:
                if ATTRIBUTE in block._modules:
                    delattr(block, ATTRIBUTE)
        self._hooks = []
        self._forget()
        with self._lock:
            self._records.clear()

    def __enter__(self) -> MemoryHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def attach_memory(
    blocks: Any, mode: str = "causal", *, gate_init: float = 0.0, norm: Any = None,
    zero_init: bool = False, streaming: bool = False, batch_first: bool | None = None,
    **memory_kwargs: Any,
) -> MemoryHandle:
    """Add a gated Tensor Memory after every block of an existing model.

    Each block gets a submodule ``tensor_memory`` (a :class:`MemoryResidual`) and a forward
    hook; its code is not edited. The block's output ``y`` (or ``y[0]``) becomes ``y +
    sigmoid(gate_l) * memory_l(norm_l(y))``.

    Parameters
    ----------
    blocks : nn.ModuleList, nn.Sequential, nn.TransformerEncoder or list of nn.Module
        The blocks (:func:`blocks_of`); their outputs are ``(B, N, d)`` (or ``(N, B, d)``
        with ``batch_first=False``).
    mode : {"causal", "threaded"}, default "causal"
        The multi-layer mode (docs/guides/modes.md): ``"threaded"``, the paper's, is NOT
        causal.
    gate_init, norm, zero_init : see MemoryResidual
        Of each memory's :class:`MemoryResidual`.
    streaming : bool, default False
        Carry ``handle.state`` from one model call to the next (in ``"causal"`` mode
        calls of any lengths then equal one long call).
    batch_first : bool or None, default None
        Layout of the block outputs; ``None``: :func:`blocks_of`'s, else True.
    **memory_kwargs
        :class:`TensorMemory` arguments; ``device`` and ``dtype`` default to the blocks'.

    Returns
    -------
    MemoryHandle
        ``handle.remove()`` (or :func:`detach_memory`) undoes the attachment.

    Raises
    ------
    TypeError, ValueError
        If ``blocks`` holds no modules (:func:`blocks_of`), ``mode`` is unknown, or a
        :class:`TensorMemory` argument is bad (each error names it).
    """
    tl.check_mode(mode)
    layers, detected = blocks_of(blocks)
    if batch_first is None:
        batch_first = True if detected is None else bool(detected)
    ref = next((p for b in layers for p in b.parameters()), None)
    if ref is not None:
        memory_kwargs.setdefault("device", ref.device)
        memory_kwargs.setdefault("dtype", ref.dtype)
    memories = [MemoryResidual(TensorMemory(zero_init=zero_init, **memory_kwargs), norm=norm,
                               gate_init=gate_init) for _ in layers]
    return MemoryHandle(layers, memories, mode, streaming, batch_first)


def detach_memory(handle: MemoryHandle) -> None:
    """Remove the memories :func:`attach_memory` added (same as ``handle.remove()``).

    Parameters
    ----------
    handle : MemoryHandle
        What :func:`attach_memory` returned.
    """
    handle.remove()
