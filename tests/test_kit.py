"""The backend kit: one call (or a pytest option) runs the property suite on a namespace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tmcore.cell
from tmcore.testing import PROPERTIES, check_namespace

REPO = Path(__file__).resolve().parents[1]


def test_kit_passes_on_array_api_strict():
    pytest.importorskip("array_api_strict", reason="array_api_strict is not installed")
    report = check_namespace("array_api_strict", max_examples=3)
    assert report, str(report)
    assert sorted(report.passed) == sorted(PROPERTIES)
    assert "0 failed" in str(report)


def test_kit_reports_the_violated_property_with_a_minimal_example(monkeypatch):
    """A subtly wrong sigmoid in the ConvLSTM must be caught, named and shrunk."""
    real_sigmoid = tmcore.cell.sigmoid
    monkeypatch.setattr(tmcore.cell, "sigmoid", lambda xp, x: real_sigmoid(xp, x) * 1.0001)
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
           "-k", "trilinear or float32"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout, result.stdout
