"""examples/hf: the --tiny smoke run (pretrain, zero_init memory identical at step 0,
Trainer fine-tuning, held-out losses, generate demo), and the committed results render
into the example's README table."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                    "'tmcore[hf]')")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

from examples.hf import __main__ as cli  # noqa: E402
from examples.hf.finetune import Config, run, table  # noqa: E402


def test_tiny_run_trains_both_arms_and_the_memory_starts_as_an_identity(tmp_path):
    results = run(Config.tiny(), [0], tmp_path, log=lambda *_: None)
    row = results["seeds"][0]
    assert row["identity_at_step0"] and row["memory_step0_loss"] == results["pretrain"]["heldout"]
    for key in ("plain_heldout", "memory_heldout", "plain_train_loss", "memory_train_loss"):
        assert math.isfinite(row[key])
    assert row["delta"] == row["memory_heldout"] - row["plain_heldout"]
    assert isinstance(row["demo"], str) and row["demo"].startswith(Config.tiny().demo_prompt)
    assert {"command", "commit", "config", "seeds", "corpus"} <= set(results)
    assert results["corpus"]["train_files"] > 0 and results["corpus"]["heldout_files"] > 0
    assert "| 0 |" in table(results)


def test_committed_results_render_into_the_readme(tmp_path):
    results = json.loads(cli.RESULTS.read_text())
    assert len(results["seeds"]) >= 3
    for key in ("command", "commit", "config"):
        assert results[key]
    assert all(r["identity_at_step0"] for r in results["seeds"])
    readme = tmp_path / "README.md"
    shutil.copy(cli.README, readme)
    rendered = cli.render(cli.RESULTS, readme)
    assert readme.read_text() == cli.README.read_text(), "README table is stale: render it"
    assert rendered in readme.read_text()
    empty = tmp_path / "empty.md"
    empty.write_text("no block")
    with pytest.raises(SystemExit, match="results: finetune"):
        cli.render(cli.RESULTS, empty)


def test_the_default_run_is_sized_for_one_cpu_thread():
    results = json.loads(cli.RESULTS.read_text())
    config = Config()
    assert results["config"]["finetune_steps"] == config.finetune_steps
    assert results["threads"] == 1
    assert re.match(r"python -m examples\.hf run", results["command"])
    assert Path(results["corpus"]["folder"]).name.startswith("python")
