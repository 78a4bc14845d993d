"""PyTorch adapter: autograd-aware ops, the Tensor Memory layer, attaching it to models.

The layer itself is :mod:`tmcore.layer`; this package holds it in ``nn.Module`` s
(:class:`TensorMemory`, :class:`MemoryResidual`), registers tmcore's VJPs with autograd as
``torch.ops.tmcore.*`` custom ops (:mod:`~tmcore.adapters.torch.bridge`) and attaches
memories to models (:func:`attach_memory`). The guide, with what works under
``torch.compile``, ``torch.func``, DDP / FSDP and higher order: docs/guides/pytorch.md;
the multi-layer modes: docs/guides/modes.md.
"""

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
    MemoryResidual,
    TensorMemory,
    WarpFlow,
)
from tmcore.layer import MODES, StreamState  # (the multi-layer modes, the streamed state)

__all__ = [
    "ConvLSTMCell",
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
