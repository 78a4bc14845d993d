"""pytest entry of the backend kit.

Run tmcore's property suite against any namespace, optionally with your backend::

    pytest --pyargs tmcore.testing.suite --tmcore-namespace=array_api_strict \
        --tmcore-max-examples=5 --tmcore-time-budget=60
    pytest --pyargs tmcore.testing.suite --tmcore-namespace=numpy \
        --tmcore-backend=mypkg.ops:make_ops

The plugin is registered through the ``pytest11`` entry point when tmcore is
installed; with plugin autoloading disabled, add ``-p tmcore.testing.pytest_plugin``.
Each property is one test item; a failure prints the error, hypothesis' minimal example
and (captured output) what served the namespace.
``--tmcore-time-budget`` (seconds) is split evenly over the collected suite
items; each item runs at least one example. A namespace without float64
fails every item that needs it at once, with a message saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
        "--tmcore-backend",
        action="store",
        default=None,
        help="module:function of a make_ops(generic, options) that serves the namespace's "
             "arrays during the suite (default: the registered backends)",
    )
    group.addoption(
        "--tmcore-max-examples",
        action="store",
        type=int,
        default=None,
        help="per-property hypothesis example budget (default: each property's own)",
    )
    group.addoption(
        "--tmcore-time-budget",
        action="store",
        type=float,
        default=None,
        help="seconds for the whole property suite, split evenly over its collected items "
             "(each runs at least one example; default: no limit)",
    )


_BUDGET_ITEMS = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Count the suite items that share ``--tmcore-time-budget`` (after ``-k``)."""
    config.stash[_BUDGET_ITEMS] = sum(
        "tmcore_time_budget" in getattr(item, "fixturenames", ()) for item in items)


@pytest.fixture(scope="session")
def tmcore_namespace(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """The namespace named by ``--tmcore-namespace``, served by ``--tmcore-backend`` if given."""
    name = request.config.getoption("--tmcore-namespace")
    if not name:
        pytest.skip("no --tmcore-namespace given")
    from tmcore.testing.kit import load_namespace, registered_backend  # lazy: hypothesis

    xp = load_namespace(name)
    backend = request.config.getoption("--tmcore-backend")
    with registered_backend(xp, backend) if backend else contextlib.nullcontext():
        yield xp


@pytest.fixture(scope="session")
def tmcore_max_examples(request: pytest.FixtureRequest) -> int | None:
    return request.config.getoption("--tmcore-max-examples")


@pytest.fixture
def tmcore_time_budget(request: pytest.FixtureRequest) -> float | None:
    """This item's share of ``--tmcore-time-budget`` in seconds (``None``: no limit)."""
    total = request.config.getoption("--tmcore-time-budget")
    if total is None:
        return None
    if total <= 0:
        raise pytest.UsageError(f"--tmcore-time-budget: expected positive seconds, got {total}")
    return total / max(request.config.stash.get(_BUDGET_ITEMS, 1), 1)
