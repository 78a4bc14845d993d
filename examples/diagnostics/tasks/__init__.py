"""The synthetic tasks of the diagnostic suite (data generated on the fly)."""

from examples.diagnostics.tasks.base import Batch, Task
from examples.diagnostics.tasks.binding import CoordinateBinding
from examples.diagnostics.tasks.mapping import MapBuilding
from examples.diagnostics.tasks.noharm import NoHarm
from examples.diagnostics.tasks.occlusion import Occlusion, OcclusionFinalFrame

__all__ = ["Batch", "Task", "CoordinateBinding", "MapBuilding", "NoHarm", "Occlusion",
           "OcclusionFinalFrame"]
