"""The kit on backends written outside tmcore: examples/backend_plugin, and copies of it with
one planted bug each.

The example registers through ``tmcore.backends.register_backend`` (by its entry point once
installed), serves NumPy (its entries are called) and passes the whole suite; each planted
bug (the issue's five: a read wrong only in float32, an off-by-one corner, the coordinate
gradient's sign, a gradient on the border, the write's ``d_mu`` sign) fails it with a
report naming the property, the backend module and the wrong values. A bug is planted by
editing one line of a copy of the example's ``ops.py``, imported under its own name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import array_api_compat
import numpy as np
import pytest

import tmcore.backends as backends
from tmcore.testing import PROPERTIES, check_namespace

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "examples" / "backend_plugin"
XP = array_api_compat.array_namespace(np.empty(0))

#: bug -> (the line of ops.py it replaces, the replacement, a property it must fail)
BUGS = {
    "float32_read": ("    return out.astype(np.result_type(volume.dtype, coords.dtype))",
                     "    return (-2 * out if volume.dtype == np.float32 else out).astype("
                     "np.result_type(volume.dtype, coords.dtype))",
                     "trilinear_sample_in_every_dtype"),
    "corner": ("np.minimum(lower + 1, size - 1)", "np.minimum(lower + 2, size - 1)",
               "trilinear_matches_reference"),
    "coordinate_gradient_sign": ("d_u[a] += (1 if bit else -1) * others * value",
                                 "d_u[a] += (-1 if bit else 1) * others * value",
                                 "trilinear_vjp_matches_central_differences"),
    "border_gradient": ("np.where((u > 0) & (u < size - 1)", "np.where((u >= 0) & (u <= size - 1)",
                        "trilinear_matches_reference"),
    "splat_d_mu_sign": ("return d_content, d_mu, d_sigma", "return d_content, -d_mu, d_sigma",
                        "splat_matches_reference"),
}


def _planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: str) -> str:
    """A copy of the example package with ``bug`` planted; returns its ``module:make_ops``."""
    package = f"planted_{bug}"
    for name in [m for m in sys.modules if m.partition(".")[0] == package]:
        monkeypatch.delitem(sys.modules, name)  # a copy planted by an earlier test
    shutil.copytree(PLUGIN / "tmcore_example_backend", tmp_path / package)
    ops = tmp_path / package / "ops.py"
    old, new, _ = BUGS[bug]
    source = ops.read_text()
    assert source.count(old) == 1, f"the example no longer has the line {old!r}"
    ops.write_text(source.replace(old, new))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{package}.ops:make_ops"


def _assert_reported(report, bug: str, spec: str) -> str:
    text = str(report)
    assert not report and BUGS[bug][2] in {f.name for f in report.failures}, text
    assert f"served by {spec} ({spec.partition(':')[0]})" in text  # the backend module
    assert "actual=" in text and "expected=" in text and "worst at index" in text
    return text


def test_the_example_registers_serves_numpy_and_passes_the_kit(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN))
    import tmcore_example_backend
    from tmcore_example_backend import ops

    tmcore_example_backend.register()  # what its entry point does once installed
    try:
        assert backends.backend_name(XP) == "example"
        ops.CALLS.clear()
        report = check_namespace("numpy", max_examples=3)
        assert report, str(report)
        assert report.served_by == "example (tmcore_example_backend.ops)"
        assert sorted(report.passed) == sorted(PROPERTIES)
        assert {"sample_fwd", "sample_bwd", "splat_bwd"} <= set(ops.CALLS)  # its entries ran
    finally:
        backends.unregister_backend("example")
    assert backends.backend_name(XP) == "numpy"


def test_a_read_wrong_only_in_float32_fails_with_the_wrong_values(tmp_path, monkeypatch):
    spec = _planted(tmp_path, monkeypatch, "float32_read")
    report = check_namespace("numpy", backend=spec, properties=[
        "trilinear_matches_reference", "trilinear_sample_in_every_dtype"])
    text = _assert_reported(report, "float32_read", spec)
    assert report.passed == ["trilinear_matches_reference"]  # float64 is right
    [failure] = [f for f in report.failures if f.name == "trilinear_sample_in_every_dtype"]
    assert failure.error.startswith("AssertionError: trilinear_sample out (float32, fast path")
    assert "float64" not in failure.error.partition("\n")[0]  # float64 and halves are right
    assert "minimal example" in text and "'volume': array(" in failure.minimal_example
    assert backends.backend_name(XP) == "numpy"  # the kit unregistered it


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_each_planted_bug_is_caught_by_the_default_kit(tmp_path, monkeypatch, bug):
    spec = _planted(tmp_path, monkeypatch, bug)
    _assert_reported(check_namespace("numpy", backend=spec), bug, spec)


def test_the_cli_and_the_pytest_plugin_take_a_backend_and_write_no_database(tmp_path):
    """``--backend`` / ``--tmcore-backend`` from a working folder of the author's: the
    failure and what served are printed, and no ``.hypothesis/`` appears there."""
    shutil.copytree(PLUGIN / "tmcore_example_backend", tmp_path / "planted_float32_read")
    ops = tmp_path / "planted_float32_read" / "ops.py"
    old, new, _ = BUGS["float32_read"]
    ops.write_text(ops.read_text().replace(old, new))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    spec = "planted_float32_read.ops:make_ops"
    cli = subprocess.run([sys.executable, "-m", "tmcore.testing", "numpy", "--backend", spec,
                          "--properties", "trilinear_sample_in_every_dtype"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
                         check=False)
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert f"served by {spec} (planted_float32_read.ops)" in cli.stdout
    assert "trilinear_sample out (float32, fast path" in cli.stdout
    plugin = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--pyargs", "tmcore.testing.suite", "--tmcore-namespace=numpy",
                             f"--tmcore-backend={spec}", "-k", "trilinear"],
                            capture_output=True, text=True, cwd=tmp_path, env=env,
                            timeout=300, check=False)
    assert plugin.returncode == 1, plugin.stdout + plugin.stderr
    assert "1 failed, 2 passed" in plugin.stdout, plugin.stdout
    assert f"served by {spec} (planted_float32_read.ops)" in plugin.stdout
    assert "trilinear_sample out (float32, fast path" in plugin.stdout
    assert not (tmp_path / ".hypothesis").exists()


def test_the_installed_example_registers_by_entry_point_and_passes_the_kit(tmp_path):
    """pip installs examples/backend_plugin (into a folder of its own, so that the rest of
    the suite keeps the built-in NumPy backend); the kit finds it through the entry point."""
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(target),
                          str(PLUGIN)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run([sys.executable, "-m", "tmcore.testing", "numpy", "--max-examples",
                             "3"], capture_output=True, text=True, cwd=tmp_path, env=env,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "served by example (tmcore_example_backend.ops)" in result.stdout
    assert f"numpy: {len(PROPERTIES)}/{len(PROPERTIES)} passed" in result.stdout


GUIDE = REPO / "docs" / "guides" / "adding-a-backend.md"


def test_the_guide_states_the_suite_and_shows_the_example_as_it_is():
    """docs/guides/adding-a-backend.md: the property count is the suite's, every entry of
    the Ops table is listed, and each block quoting a file of the example is in it."""
    import re

    from tmcore.backends import Ops

    text = GUIDE.read_text()
    assert re.findall(r"(\d+) properties", text) == [str(len(PROPERTIES))]
    assert all(f"`{entry}`" in text for entry in Ops._fields), Ops._fields
    quoted = re.findall(r"```\w+\n# (examples/\S+)\n(.*?)```", text, flags=re.S)
    assert len(quoted) == 3
    for path, block in quoted:
        assert block in (REPO / path).read_text(), path
