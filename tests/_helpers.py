"""Test-suite helpers: the kit's strategies (tmcore.testing.strategies), re-exported."""

from tmcore.testing.strategies import *  # noqa: F403
from tmcore.testing.strategies import __all__  # noqa: F401
