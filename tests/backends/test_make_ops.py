"""The guide's `make_ops` example (docs/guides/adding-a-backend.md) as a registered backend.

The example module is registered the way the guide says, one registry row naming it
by its module name, and resolved through ``tmcore.backends.ops_for_namespace`` (what
``ops_for`` caches): the NumPy table is the example's, its read is the override (it
counts its calls) and agrees with the generic read bit for bit, and its fused scan
declines.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import array_api_compat
import numpy as np

import tmcore.backends as backends
from tmcore.runtime.dispatch import generic_ops

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "adding-a-backend.md"
NAME = "tmcore.backends.toy"


def _example() -> str:
    section = GUIDE.read_text().split("## Writing `make_ops`", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_registered_example_serves_numpy(monkeypatch):
    toy = types.ModuleType(NAME)
    exec(compile(_example(), f"{GUIDE.name}[make_ops example]", "exec"), toy.__dict__)
    monkeypatch.setitem(sys.modules, NAME, toy)
    monkeypatch.setattr(backends, "_REGISTRY",
                        [(array_api_compat.is_numpy_namespace, "numpy", NAME),
                         *backends._REGISTRY])
    xp = array_api_compat.array_namespace(np.empty(0))
    table = backends.ops_for_namespace(xp, generic_ops())
    generic = generic_ops()
    assert table.sample_fwd is not generic.sample_fwd
    assert table.sample_bwd is generic.sample_bwd  # everything else is generic's

    toy.reads.clear()
    rng = np.random.default_rng(1)
    volume = rng.standard_normal((1, 2, 3, 4))  # (B, C, *S), n = 2
    coords = rng.uniform(-1.2, 1.2, (1, 5, 2))  # (B, Q, n), some beyond the border
    out = table.sample_fwd(xp, volume, coords)
    assert toy.reads == [5]  # the override ran
    np.testing.assert_array_equal(out, generic.sample_fwd(xp, volume, coords))
    assert table.scan_fwd(xp, volume) is None  # the fused scan declines
