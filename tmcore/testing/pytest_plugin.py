"""pytest entry of the backend kit.

Run tmcore's property suite against any namespace::

    pytest --pyargs tmcore.testing.suite --tmcore-namespace=array_api_strict

The plugin is registered through the ``pytest11`` entry point when tmcore is
installed; with plugin autoloading disabled, add ``-p tmcore.testing.pytest_plugin``.
Each property is one test item; a failure prints hypothesis' minimal example.
"""

from __future__ import annotations

from types import ModuleType

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tmcore")
    group.addoption(
        "--tmcore-namespace",
        action="store",
        default=None,
        help="dotted name of an array-API namespace to run tmcore's property suite on "
             "(e.g. array_api_strict, mlx.core); used by tmcore.testing.suite",
    )
    group.addoption(
        "--tmcore-max-examples",
        action="store",
        type=int,
        default=None,
        help="per-property hypothesis example budget (default: each property's own)",
    )


@pytest.fixture(scope="session")
def tmcore_namespace(request: pytest.FixtureRequest) -> ModuleType:
    """The namespace named by ``--tmcore-namespace``."""
    name = request.config.getoption("--tmcore-namespace")
    if not name:
        pytest.skip("no --tmcore-namespace given")
    from tmcore.testing.kit import load_namespace  # lazy: hypothesis only when used

    return load_namespace(name)


@pytest.fixture(scope="session")
def tmcore_max_examples(request: pytest.FixtureRequest) -> int | None:
    return request.config.getoption("--tmcore-max-examples")
