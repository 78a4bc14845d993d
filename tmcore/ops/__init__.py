"""The primitives, one per file, each a generic array-API forward with a hand-written VJP;
importing this package registers :data:`GENERIC`, the table every fast path is tested against.
"""

from tmcore.ops import cell, conv, sample, splat
from tmcore.runtime.dispatch import Ops, no_workspace, register_generic

__all__ = ["GENERIC"]


#: The generic table: every primitive's array-API forward and VJP.
GENERIC = Ops(sample.sample_fwd, sample.sample_bwd, splat.splat_fwd, splat.splat_bwd,
              conv.conv_fwd, conv.conv_bwd, cell.gates_fwd, cell.gates_bwd,
              cell.gates_residuals, no_workspace)
register_generic(GENERIC)
