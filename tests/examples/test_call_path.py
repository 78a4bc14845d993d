"""``python -m benchmarks.call_path``: the library files one call runs code in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch call needs torch")
pytest.importorskip("jax", reason="the JAX trace needs jax")

from benchmarks import call_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("tmcore/", "backends/", "adapters/")


def test_call_path_names_existing_library_files(capsys):
    call_path.main(["--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["command"] == "python -m benchmarks.call_path --json"
    library = [p for folder in ("tmcore", "backends", "adapters")
               for p in (ROOT / folder).rglob("*.py") if "testing" not in p.parts]
    for framework, adapter in (("torch", "adapters/torch/"), ("jax", "adapters/jax/")):
        found = result[framework]
        files = found["functions"]
        # the call enters through its adapter, reaches the layer, and names each file once
        assert 3 <= found["files"] == len(files) < len(library), (framework, files)
        assert any(name.startswith(adapter) for name in files), files
        assert "tmcore/layer/layer.py" in files, files
        for name, functions in files.items():
            assert name.startswith(LIBRARY) and not name.startswith("tmcore/testing/"), name
            assert (ROOT / name).is_file(), name
            assert functions >= 1, name
    # issue 59's bound: a warm torch forward runs code in at most 15 library files (27
    # at 7c824dd)
    assert result["torch"]["files"] <= 15, result["torch"]["functions"]


def test_files_run_counts_only_library_code():
    import tmcore

    seen = call_path.files_run(lambda: tmcore.get_options())
    assert seen == {"tmcore/runtime/options.py": 1}
    assert call_path.files_run(lambda: json.dumps({"a": 1})) == {}
