"""PyTorch adapter: autograd-aware ops, the Tensor Memory layer, attaching it to models.

Quick start::

    import torch
    from tmcore.adapters.torch import TensorMemory, MemoryResidual

    memory = TensorMemory(embed_dim=128, memory_channels=32, memory_shape=(8, 8, 8),
                          chunk_size=16)
    layer = MemoryResidual(memory, gate_init=0.0)    # x + sigmoid(gate) * memory(norm(x))
    x = torch.randn(8, 256, 128)                      # (B, N, d)
    y, state = layer(x)                               # a StreamState: h, c (B, C, *S), ...
    y2, state = layer(torch.randn(8, 256, 128), state)  # streaming: carry the state
    y3, (h, c) = layer(x, stream=False)               # the reference: ragged chunk padded

The layer itself (config checks, parameter plan, heads, chunking, reset, modes,
stored-grid check) is :mod:`tmcore.layer`; this module only holds it in
``nn.Module`` s, registers tmcore's VJPs with autograd and attaches memories to
models (:mod:`tmcore.adapters.torch.attach`).

Gradients come from tmcore's hand-written VJPs, registered as
``torch.library`` custom ops (``torch.ops.tmcore.*``, see
:mod:`tmcore.adapters.torch.bridge`): they work in eager mode, under
``torch.compile`` (``fullgraph=True``, no graph breaks), with ``torch.func``
(``grad``, ``vmap`` by looping over the mapped dimension, per-sample
gradients), DDP and FSDP (FSDP1 and ``fully_shard``). Second-order gradients
work in eager mode (``create_graph=True``); third order, Hessians through
nested ``torch.func.grad`` and double backward of a compiled model do not.
Forward mode (``torch.func.jvp``, ``jacfwd``) is not available: it raises a
``NotImplementedError`` saying so. ``torch.jit.trace`` / ``torch.jit.script``
are not supported (the layer runs Python per chunk and calls custom ops with
Python-side validation); use ``torch.compile`` or ``torch.export``-free eager.
Returned gradients are contiguous. Under ``no_grad`` (or when nothing requires
grad) the scan keeps no checkpoints, so inference memory does not grow with
the sequence.

Multi-layer modes (:func:`attach_memory`): ``"causal"`` (every layer scans from
the segment's initial state, a read at chunk ``t`` sees only tokens before
chunk ``t`` plus the chunk's first token: right for language models) and
``"threaded"`` (the paper's reference: layer ``l`` starts from the state layer
``l-1`` reached after the whole sequence; NOT causal, every position sees
later tokens: only for bidirectional inputs such as images or clips).
"""

from tmcore import layer as tl
from tmcore.adapters.torch.attach import MemoryHandle, attach_memory, detach_memory, detach_state
from tmcore.adapters.torch.checkpoints import (
    convert_reference_state_dict,
    memory_from_dict,
    memory_to_dict,
    state_from_dict,
    state_to_dict,
)
from tmcore.adapters.torch.functional import (
    doc_starts_from_offsets,
    gaussian_splat,
    memory_scan,
    option_scan,
    trilinear_sample,
)
from tmcore.adapters.torch.modules import (
    ConvLSTMCell,
    GatedMemoryResidual,
    MemoryResidual,
    TensorMemory,
    WarpFlow,
)

__all__ = [
    "ConvLSTMCell",
    "GatedMemoryResidual",
    "MODES",
    "MemoryHandle",
    "MemoryResidual",
    "StreamState",
    "TensorMemory",
    "WarpFlow",
    "attach_memory",
    "convert_reference_state_dict",
    "memory_from_dict",
    "memory_to_dict",
    "detach_memory",
    "detach_state",
    "doc_starts_from_offsets",
    "gaussian_splat",
    "memory_scan",
    "option_scan",
    "state_from_dict",
    "state_to_dict",
    "trilinear_sample",
]

#: Multi-layer modes of :func:`attach_memory` (:data:`tmcore.layer.MODES`).
MODES = tl.MODES
# The state between streamed calls (tmcore.layer.StreamState, documented there): (h, c) at
# the last chunk boundary plus the unfinished chunk's tokens, their count and its read.
StreamState = tl.StreamState
