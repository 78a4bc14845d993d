"""An out-of-tree tmcore backend: NumPy's n-linear read by corner gathers (:mod:`.ops`).

Installed, it registers itself through the ``tmcore.backends`` entry point
(``pyproject.toml``); this module imports neither NumPy nor :mod:`.ops`, so that
``import tmcore`` stays light: :mod:`.ops` is imported when NumPy arrays first arrive.
"""

import array_api_compat

from tmcore.backends import register_backend

__all__ = ["register"]


def register() -> None:
    """Serve NumPy's arrays with :func:`tmcore_example_backend.ops.make_ops`."""
    register_backend("example", array_api_compat.is_numpy_namespace,
                     "tmcore_example_backend.ops:make_ops", requires="numpy")
