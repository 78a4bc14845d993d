"""The benchmark harness at a tiny size: it runs, and its baseline is the same math.

No timing is asserted; only that the plain autograd baseline
(``benchmarks/plain_torch.py``) gives tmcore's outputs and gradients, and that
the windowed truncated write equals the dense one.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch", reason="the benchmarks need torch")

from benchmarks.common import TINY  # noqa: E402
from benchmarks.run import check_gradients  # noqa: E402


def test_plain_autograd_matches_tmcore():
    result = check_gradients(TINY, rtol=1e-10)
    assert "x" in result["compared"] and "cell.pointwise_weight" in result["compared"]


def test_window_write_matches_dense_truncated_splat():
    from benchmarks import truncated

    result = truncated.run(tiny=True, log=lambda _: None)
    assert result["max_abs_diff"] < 1e-5


def test_harness_tiny_run(tmp_path):
    pytest.importorskip("matplotlib", reason="the report draws plots")
    from benchmarks.run import main

    impls = ["torch", "torch-ops", "plain", "numpy"]
    if importlib.util.find_spec("jax") is not None:
        impls.append("jax")  # timed in a process of its own (benchmarks.jax_timing)
    results = main(["--tiny", "--out", str(tmp_path), "--impls", *impls,
                    "--skip", "streaming", "memory", "peak", "profile", "truncated"])
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "Time per chunk step" in text and "floor" in text
    for impl in impls:
        assert results["timings"]["tiny"]["impls"][impl]["train"]["ms_per_step"] > 0, impl


def test_cpu_speed_and_memory_scripts_run(tmp_path):
    """benchmarks/cpu_speed.py (the side-by-side CPU ratios) and the long no_grad scan of
    benchmarks/memory.py run at a tiny size and report what their tables read."""
    import json

    from benchmarks import cpu_speed
    from benchmarks.memory import measure_long_scan

    out = tmp_path / "cpu_speed.json"
    cpu_speed.main(["--configs", "tiny", "--rounds", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m benchmarks.cpu_speed")
    assert "tiny" in json.dumps(result["configs"])
    scan = measure_long_scan(200)
    assert scan["steps"] == 200 and scan["output_bytes"] == 2 * 200 * 64 * 4


def test_peak_memory_measures_a_fresh_process_and_marks_growth():
    """benchmarks/peak_memory.py: one fresh process's peak rise, and the table that puts a
    run beside the recorded one (a rise over the tolerance is marked)."""
    import sys

    from benchmarks import peak_memory

    mib = peak_memory.measure(sys.executable, TINY, "step", warm=False)
    assert 0 < mib < 2048
    then = {"rows": [{"commit": "aaaa (old)", "median_mib": {
        "step/first": 100.0, "step/warm": 50.0}}]}
    now = [{"commit": "bbbb (new)", "median_mib": {"step/first": 120.0, "step/warm": 50.0}}]
    table = peak_memory.report(now, then)
    assert "| step | 120.0 | 50.0 | 100.0 (+20.0) **grew** | 50.0 (+0.0) |" in table
    assert "recorded at aaaa" in table and "no_grad" not in table


def test_suite_time_records_the_summary_and_cpu_time():
    import sys

    from benchmarks.run import REPO
    from benchmarks.suite_time import time_suite

    if not (REPO / ".venv" / ".tmcore-installed").exists():
        pytest.skip("suite_time needs the environment make test builds (.venv)")
    # a sleep: wall_s is rounded to 0.1 s, and the sum alone may take less than 0.05 s
    script = ("import time; sum(range(3_000_000)); time.sleep(0.2); "
              "print('===== 3 passed, 1 skipped in 0.1s =====')")
    result = time_suite((sys.executable, "-c", script))
    assert result["returncode"] == 0
    assert result["pytest_summary"] == "3 passed, 1 skipped in 0.1s"
    assert result["user_cpu_s"] >= 0 and result["wall_s"] > 0
    assert result["commit"] and "cores" in result["machine"]


@pytest.mark.parametrize("name", ["decode_cost", "decode_token", "decode_floor"])
def test_side_by_side_pages_are_rendered_from_their_results(name):
    """The committed tables of the side-by-side decode benchmarks are their ``render`` of the
    committed results (no number typed by hand)."""
    import importlib
    import json
    from pathlib import Path

    module = importlib.import_module(f"benchmarks.{name}")
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    result = json.loads((results / f"{name}.json").read_text())
    assert module.render(result) == (results / f"{name}.md").read_text()
    assert all(len(run["rounds"]) == result["config"]["rounds"] for run in result["runs"])


def test_decode_token_worker_times_every_position():
    """The worker that another checkout's interpreter runs as a file: one median per
    position of the chunk, each a positive time."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_token.py"
    out = subprocess.run([sys.executable, str(script), "--worker", "1", "8"],
                         capture_output=True, text=True, check=True, cwd="/").stdout
    times = json.loads(out.strip().splitlines()[-1])["us"]
    assert len(times) == 4 and all(t > 0 for t in times)


def test_decode_floor_times_every_form_and_its_floor_is_the_librarys_tokens(tmp_path):
    """A tiny run of the floor benchmark: every form timed in every round, and the unchecked
    kernel call (the floor) generates the library's tokens (so it times the same work)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import json

    from benchmarks import decode_floor

    out = tmp_path / "floor.json"
    decode_floor.main(["--widths", "16", "--rounds", "2", "--new-tokens", "5",
                       "--json", str(out), "--md", str(tmp_path / "floor.md")])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["floor_equals_library"] is True and len(run["rounds"]) == 2
    assert all(r[form] > 0 for r in run["rounds"] for form in decode_floor.FORMS)
