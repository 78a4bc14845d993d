"""The primitives: each a generic array-API forward and a hand-written VJP, one per file.

- :mod:`~tmcore.ops.addressing` -- coordinates, cell centres, the sigma and coordinate
  squashes;
- :mod:`~tmcore.ops.sample` -- the n-linear read; :mod:`~tmcore.ops.splat` -- the
  Gaussian write;
- :mod:`~tmcore.ops.conv` -- the factorized conv; :mod:`~tmcore.ops.cell` -- the ConvLSTM
  step;
- :mod:`~tmcore.ops.window` -- the local window's geometry, box write and one local step;
- :mod:`~tmcore.ops.warp` -- resampling the state at displaced cell centres;
- :mod:`~tmcore.ops.common` -- activations, separable profiles, boxes.

Importing this package registers the generic :class:`tmcore.runtime.dispatch.Ops` table
(:data:`GENERIC`), the reference every backend's fast path is tested against.
"""

from tmcore.ops import cell, conv, sample, splat
from tmcore.runtime.dispatch import Ops, no_workspace, register_generic

__all__ = ["GENERIC"]


#: The generic table: every primitive's array-API forward and VJP.
GENERIC = Ops(sample.sample_fwd, sample.sample_bwd, splat.splat_fwd, splat.splat_bwd,
              conv.conv_fwd, conv.conv_bwd, cell.gates_fwd, cell.gates_bwd,
              cell.gates_residuals, no_workspace)
register_generic(GENERIC)
