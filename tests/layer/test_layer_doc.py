"""docs/LAYER.md says what the code does: every file it names exists, every name in its
API table is importable from ``tmcore.layer``, the ``StreamState`` table lists the real
fields, and its claims about ``memory_shape`` and ``count`` hold."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import tmcore.layer as tl

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "docs" / "LAYER.md").read_text()


def _section(title: str) -> str:
    start = TEXT.index(title)
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start:end if end > 0 else None]


def test_every_named_file_exists():
    paths = set(re.findall(r"`((?:tmcore|adapters|backends)/[\w/]+(?:\.py)?)`", TEXT))
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing


def test_every_module_of_the_layer_package_is_in_the_table():
    named = set(re.findall(r"`tmcore/layer/(\w+)\.py`", TEXT))
    modules = {p.stem for p in (ROOT / "tmcore" / "layer").glob("*.py")} - {"__init__"}
    assert modules <= named, sorted(modules - named)


def test_api_table_names_are_importable():
    rows = [line for line in _section("## `tmcore.layer` API").splitlines()
            if line.startswith("| `")]
    names = set()
    for row in rows:
        first = row.split("|")[1]
        names.update(re.findall(r"`(?:Layer\()?([A-Za-z_][\w]*)", first))
    assert len(names) >= 25
    missing = sorted(n for n in names if not hasattr(tl, n))
    assert not missing, missing


def test_layer_config_keywords_in_the_table_exist():
    row = next(line for line in TEXT.splitlines() if line.startswith("| `layer_config("))
    documented = set(re.findall(r"(\w+)=", row.split("|")[1]))
    real = set(inspect.signature(tl.layer_config).parameters)
    assert documented and documented <= real, documented - real


def test_stream_state_table_lists_the_fields():
    section = _section("## Streaming and packed documents")
    fields = set(re.findall(r"^\| `(\w+)`", section, flags=re.M))
    fields |= {"c"} if "| `h`, `c` |" in section else set()
    assert fields == set(tl.StreamState._fields)


def test_memory_shape_and_count_claims():
    with pytest.raises(TypeError, match="bare int"):
        tl.layer_config(8, 2, 4, 4)
    assert "a bare int is a `TypeError`" in TEXT
    config = tl.layer_config(4, 2, (3, 3), 2)
    rng = np.random.default_rng(0)
    params = tl.init_params(np, config, lambda s: rng.uniform(-s.bound, s.bound, s.shape))
    import tmcore

    def scan(h0, c0, inputs, **masks):
        return tmcore.memory_scan(h0, c0, *inputs, tl.cell_params(params), eps=config.eps,
                                  **masks)

    _, state = tl.Layer(config).forward_stream(np, params, np.ones((2, 3, 4)), None, scan=scan)
    assert state.count.dtype == np.int32 and state.count.shape == (2,)
    assert "int32 array `(B,)`" in TEXT
