"""The backend kit: one call (or a pytest option) runs the property suite on a namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import wrapped_namespace
from hypothesis import strategies as st

import tmcore.ops.cell
from tmcore.testing import (
    PROPERTIES,
    check_namespace,
    registered_backend,
    require_float64,
    run_property,
)
from tmcore.testing.properties import Property
from tmcore.testing.strategies import assert_rel, to_numpy

REPO = Path(__file__).resolve().parents[2]


def test_kit_passes_on_array_api_strict():
    pytest.importorskip("array_api_strict", reason="array_api_strict is not installed")
    report = check_namespace("array_api_strict", max_examples=3)
    assert report, str(report)
    assert sorted(report.passed) == sorted(PROPERTIES)
    assert "0 failed" in str(report)


def test_kit_reports_the_violated_property_with_a_minimal_example(monkeypatch):
    """A subtly wrong sigmoid in the ConvLSTM must be caught, named and shrunk."""
    real_sigmoid = tmcore.ops.cell.sigmoid
    monkeypatch.setattr(tmcore.ops.cell, "sigmoid", lambda xp, x: real_sigmoid(xp, x) * 1.0001)
    report = check_namespace("numpy", properties=["convlstm_matches_reference",
                                                  "trilinear_matches_reference"],
                             max_examples=20)
    assert not report
    assert report.passed == ["trilinear_matches_reference"]
    [failure] = report.failures
    assert failure.name == "convlstm_matches_reference"
    assert "relative error" in failure.error
    assert "case=" in failure.minimal_example  # hypothesis' falsifying example
    with pytest.raises(AssertionError, match="FAILED convlstm_matches_reference"):
        check_namespace("numpy", properties=["convlstm_matches_reference"], max_examples=5,
                        raise_on_failure=True)


def test_kit_rejects_unknown_property():
    with pytest.raises(ValueError, match="unknown property"):
        check_namespace("numpy", properties=["no_such_property"])


def test_pytest_plugin_runs_the_suite_on_a_named_namespace():
    pytest.importorskip("array_api_strict", reason="array_api_strict is not installed")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--pyargs", "tmcore.testing.suite",
           "--tmcore-namespace=array_api_strict", "--tmcore-max-examples=2",
           "-k", "trilinear"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout, result.stdout


def test_pytest_plugin_time_budget_stops_a_huge_example_budget():
    """--tmcore-time-budget reaches run_property: 10**6 examples end in seconds."""
    pytest.importorskip("array_api_strict", reason="array_api_strict is not installed")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--pyargs", "tmcore.testing.suite",
           "--tmcore-namespace=array_api_strict", "--tmcore-max-examples=1000000",
           "--tmcore-time-budget=2", "-k", "trilinear_matches or conv_matches"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout, result.stdout


# ----------------------------------------------------------------------------- read-back


class _DLPackOnly:
    """An array that NumPy only reads through DLPack: ``np.asarray`` of it is a 0-d
    object array (what marray and ndonnx arrays looked like to the old kit)."""

    def __init__(self, data: np.ndarray):
        self._data = data
        self.shape, self.dtype = data.shape, data.dtype

    def __dlpack__(self, **kwargs):
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._data.__dlpack_device__()


class _Unwrappable:
    """Like ndonnx: no DLPack export, but ``unwrap_numpy()``."""

    def __init__(self, data: np.ndarray):
        self._data = data

    def unwrap_numpy(self) -> np.ndarray:
        return self._data


class _Masked:
    """Like marray: ``.data`` and ``.mask``."""

    def __init__(self, data, mask):
        self.data, self.mask = data, mask


def test_read_back_uses_dlpack_not_a_0d_object_array():
    data = np.arange(6.0).reshape(2, 3)
    assert np.asarray(_DLPackOnly(data)).shape == ()  # the trap the kit fell into
    got = to_numpy(_DLPackOnly(data))
    assert got.shape == (2, 3) and got.dtype == np.float64
    np.testing.assert_array_equal(got, data)
    got[0, 0] = -1.0  # a copy, never the producer's memory
    assert data[0, 0] == 0.0
    assert_rel(_DLPackOnly(data), data, 0.0, "dlpack-only")


def test_read_back_unwraps_ndonnx_style_and_masked_arrays():
    data = np.arange(4.0)
    np.testing.assert_array_equal(to_numpy(_Unwrappable(data)), data)
    clean = to_numpy(_Masked(_DLPackOnly(data), _DLPackOnly(np.zeros(4, dtype=bool))))
    np.testing.assert_array_equal(clean, data)
    # a masked entry must not pass as its stale data: it reads as NaN
    masked = to_numpy(_Masked(data, np.array([False, True, False, False])))
    assert np.isnan(masked[1]) and np.array_equal(masked[[0, 2, 3]], data[[0, 2, 3]])
    with pytest.raises(AssertionError, match="relative error"):
        assert_rel(_Masked(data, np.array([False, True, False, False])), data, 1e-3, "masked")


class _OnAccelerator:
    """DLPack export refused (memory on a device), ``to_device("cpu")`` works."""

    def __init__(self, data: np.ndarray):
        self._data = data

    def __dlpack__(self, **kwargs):
        raise BufferError("memory is on an accelerator")

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA

    def to_device(self, device, /, *, stream=None):
        assert device == "cpu"
        return self._data


def test_read_back_copies_accelerator_arrays_to_the_host():
    data = np.arange(3.0)
    np.testing.assert_array_equal(to_numpy(_OnAccelerator(data)), data)


def test_read_back_refuses_what_numpy_only_sees_as_an_object():
    with pytest.raises(TypeError, match="object array"):
        to_numpy(object())


# ----------------------------------------------------------------------------- float64


def _namespace_like_numpy(name: str, **overrides) -> types.ModuleType:
    module = types.ModuleType(name)
    for attr in ("float32", "float64"):
        setattr(module, attr, getattr(np, attr))
    module.asarray = np.asarray
    for attr, value in overrides.items():
        setattr(module, attr, value)
    return module


def test_float64_check_fails_fast_for_a_namespace_without_float64():
    no_f64 = _namespace_like_numpy("no_f64")
    del no_f64.float64
    with pytest.raises(ValueError, match="no float64 dtype"):
        check_namespace(no_f64)

    def narrowing(a, dtype=None, **_):
        return np.asarray(a, dtype=np.float32)

    with pytest.raises(ValueError, match="gives dtype float32.*trilinear_sample_in_every_dtype"):
        check_namespace(_namespace_like_numpy("narrow", asarray=narrowing))
    with pytest.raises(ValueError, match="float64"):
        run_property(_namespace_like_numpy("narrow", asarray=narrowing),
                     "conv_matches_reference", max_examples=1)
    require_float64(np)  # numpy passes


def test_float64_check_is_skipped_when_only_float32_is_checked(monkeypatch):
    calls = []
    monkeypatch.setattr("tmcore.testing.kit.require_float64", lambda xp: calls.append(xp))
    check_namespace("numpy", properties=["trilinear_sample_in_every_dtype"], max_examples=1)
    assert calls == []
    check_namespace("numpy", properties=["conv_matches_reference"], max_examples=1)
    assert len(calls) >= 1


def test_jax_without_x64_fails_fast_with_how_to_enable_it():
    pytest.importorskip("jax", reason="jax is not installed")
    script = (
        "import time; t = time.perf_counter()\n"
        "import jax\n"
        "from tmcore.testing import check_namespace\n"
        "try:\n"
        "    check_namespace('jax.numpy')\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
        "print('SECONDS', time.perf_counter() - t)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=REPO, env={**env, "JAX_PLATFORMS": "cpu"}, timeout=240,
                            check=False)
    out = result.stdout
    assert "ERR xp: float64 is off" in out, out + result.stderr
    assert 'jax.config.update("jax_enable_x64", True)' in out
    seconds = float(out.split("SECONDS")[1])
    assert seconds < 60, out  # up front, not after minutes of rounding "failures"


# ----------------------------------------------------------------------------- budgets


def test_time_budget_caps_a_run_and_every_property_runs_at_least_once():
    names = ["trilinear_matches_reference", "conv_matches_reference"]
    start = time.perf_counter()
    report = check_namespace("numpy", properties=names, max_examples=100_000, time_budget=0.5)
    elapsed = time.perf_counter() - start
    assert report, str(report)
    assert set(report.examples) == set(names)
    assert all(1 <= report.examples[n] < 100_000 for n in names), report.examples
    assert elapsed < 30, elapsed  # 100 000 examples each would take many minutes
    assert "examples)" in str(report)


def test_max_examples_is_the_number_of_examples_run():
    assert run_property(np, "conv_matches_reference", max_examples=3) == 3
    report = check_namespace("numpy", properties=["conv_matches_reference"], max_examples=2)
    assert report.examples == {"conv_matches_reference": 2}


def test_a_failure_is_still_shrunk_when_the_budget_is_spent(monkeypatch):
    real_sigmoid = tmcore.ops.cell.sigmoid
    monkeypatch.setattr(tmcore.ops.cell, "sigmoid", lambda xp, x: real_sigmoid(xp, x) * 1.0001)
    report = check_namespace("numpy", properties=["convlstm_matches_reference"],
                             max_examples=50, time_budget=1e-3)
    [failure] = report.failures
    assert "relative error" in failure.error and "case=" in failure.minimal_example


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_examples": 0}, "max_examples"),
    ({"max_examples": 2.5}, "max_examples"),
    ({"time_budget": 0}, "time_budget"),
    ({"time_budget": float("nan")}, "time_budget"),
])
def test_bad_budgets_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_namespace("numpy", **kwargs)


def test_command_line_prints_the_tally():
    cmd = [sys.executable, "-m", "tmcore.testing", "numpy", "--max-examples", "1",
           "--properties", "conv_matches_reference,factorized_conv_in_every_dtype"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "numpy: 2/2 passed" in result.stdout


# ----------------------------------------------------------------------------- reports


def test_an_expected_zero_is_reported_as_an_absolute_error():
    with pytest.raises(AssertionError) as info:
        assert_rel(np.array([0.0, 0.08]), np.zeros(2), 1e-3, "d_x")
    message = str(info.value)
    assert message.startswith("d_x: absolute error 0.08 > 1e-33 where the expected value is 0;")
    assert "worst at index (1,): actual 0.08, expected 0.0" in message
    assert "e+28" not in message and "actual=\n[0.   0.08]" in message


def _raise_value_error(value: int) -> None:
    raise ValueError(f"a backend failed on {value}")


@pytest.fixture
def two_bugs(monkeypatch):
    """A property with two distinct failures: an assertion and an error raised elsewhere."""

    def check(xp, case):
        if case > 5:
            _raise_value_error(case)
        assert case >= -5, f"case {case} < -5"

    monkeypatch.setitem(PROPERTIES, "two_bugs", Property(check, st.integers(-10, 10), 50,
                                                         needs_float64=False))
    return "two_bugs"


def test_every_distinct_failure_is_reported_with_where_an_error_was_raised(two_bugs):
    report = check_namespace("numpy", properties=[two_bugs])
    assert [f.name for f in report.failures] == [two_bugs, two_bugs], str(report)
    errors = sorted(f.error for f in report.failures)
    assert errors[0].startswith("(distinct failure ") and " of 2) " in errors[0]
    [value_error] = [e for e in errors if "ValueError: a backend failed on 6" in e]
    assert f"{Path(__file__).name}\", line" in value_error and "_raise_value_error" in value_error
    [assertion] = [e for e in errors if "AssertionError: case -6 < -5" in e]
    assert "raised at" not in assertion  # its message says where already
    assert "2 failed" not in str(report) and "0 passed, 1 failed" in str(report)


def test_shrinking_stops_when_the_time_budget_is_spent(monkeypatch):
    """After the budget only failing cases are replayed: the property runs a couple of
    times instead of through hypothesis' whole shrink."""
    runs = []

    def check(xp, case):
        runs.append(case)
        assert sum(case) < 100, "too big"

    monkeypatch.setitem(PROPERTIES, "always_fails", Property(
        check, st.lists(st.integers(100, 10_000), min_size=3, max_size=30), 20,
        needs_float64=False))
    report = check_namespace("numpy", properties=["always_fails"])
    unbudgeted = len(runs)
    runs.clear()
    budgeted = check_namespace("numpy", properties=["always_fails"], time_budget=1e-6)
    [failure] = budgeted.failures
    assert "too big" in failure.error and "case=" in failure.minimal_example
    assert len(runs) <= 3 < unbudgeted, (len(runs), unbudgeted)
    assert report.failures[0].minimal_example != failure.minimal_example  # shrunk further


def test_a_backend_module_may_read_its_arrays_back():
    """The kit reads arrays NumPy cannot (no DLPack, no ``__array__``) through the
    ``to_numpy`` of the backend module registered for their namespace."""
    xp = wrapped_namespace.no_device_namespace()
    x = xp.asarray(np.arange(3.0))
    with pytest.raises(TypeError, match=r"define to_numpy\(x\)"):
        to_numpy(x)
    with registered_backend(xp, wrapped_namespace.make_ops) as backend:
        assert backend.module == "wrapped_namespace"
        np.testing.assert_array_equal(to_numpy(x), np.arange(3.0))
    with pytest.raises(TypeError):
        to_numpy(x)
