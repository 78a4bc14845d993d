"""The option scans' static options are checked wherever they enter (issue 51, item 6):
a wrong ``update`` / ``window`` / ``method`` / ``checkpoint_every`` given straight to
the step (as the torch custom ops take them) is a named error, never another scan."""

from __future__ import annotations

import pytest

from tmcore.scan.options import ScanOptions, check_options, step_for

_GOOD = ScanOptions("local", 2, 1e-6, None, "fast", 1)


@pytest.mark.parametrize("field,value,error,match", [
    ("update", "bogus", ValueError, "update: expected one of"),
    ("update", -1, ValueError, "update: expected one of"),
    ("window", -1, ValueError, "window: expected an int"),
    ("window", None, TypeError, "window: expected an int"),
    ("method", "zzz", ValueError, "method: expected one of"),
    ("checkpoint_every", -1, ValueError, "checkpoint_every: expected an int"),
])
@pytest.mark.parametrize("warp", [False, True])
def test_bad_scan_options_are_named(field, value, error, match, warp):
    bad = _GOOD._replace(**{field: value})
    with pytest.raises(error, match=match):
        step_for(bad, warp)
    with pytest.raises(error, match=match):
        check_options(bad)


def test_good_scan_options_pass():
    assert check_options(_GOOD) == _GOOD
    assert check_options(ScanOptions()) == ScanOptions()  # dense: no window needed
