"""tmcore.options: one surface for every switch (context manager, setter, thread-local)."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

import tmcore
from tmcore.backends import native as _native
from tmcore.runtime.dispatch import generic_ops, ops_for
from tmcore.runtime.options import reload_environment

FIELDS = ("native", "triton", "generic", "deterministic", "validate")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in FIELDS:
        monkeypatch.delenv(f"TMCORE_{name.upper()}", raising=False)
        reload_environment()


def test_defaults_and_fields():
    opts = tmcore.get_options()
    assert opts == tmcore.Options(native=True, triton="auto", generic=False,
                                  deterministic=True, validate=False, depthwise="auto")
    assert hash(opts) == hash(tmcore.Options())


def test_context_manager_restores_and_nests():
    with tmcore.options(native=False, validate=True) as opts:
        assert opts.native is False and opts.validate is True
        assert not _native.enabled() and tmcore.get_options().validate
        with tmcore.options(native=None):  # None: back to the default
            assert tmcore.get_options().native is True
            assert tmcore.get_options().validate is True
        assert tmcore.get_options().native is False
    assert tmcore.get_options() == tmcore.Options()
    assert _native.enabled()


def test_setter_applies_for_the_rest_of_the_context():
    def body():
        tmcore.options(validate=True)
        assert tmcore.get_options().validate
        with pytest.raises(ValueError, match="coords: expected finite values"):
            tmcore.trilinear_sample(np.zeros((1, 1, 2, 2)), np.full((1, 1, 2), np.nan))
        return tmcore.get_options().validate

    import contextvars

    assert contextvars.copy_context().run(body) is True
    assert tmcore.get_options().validate is False  # the copy's setting stayed there


def test_thread_local():
    seen = {}
    with tmcore.options(generic=True):
        thread = threading.Thread(target=lambda: seen.setdefault("generic",
                                                                  tmcore.get_options().generic))
        thread.start()
        thread.join()
        assert tmcore.get_options().generic is True
    assert seen["generic"] is False


def test_bad_values_are_refused():
    with pytest.raises(TypeError, match="unknown option 'nativ'"):
        tmcore.options(nativ=False)
    with pytest.raises(TypeError, match="validate: expected True, False or None"):
        tmcore.options(validate=1)
    with pytest.raises(TypeError, match="triton: expected True, False, 'auto' or None"):
        tmcore.options(triton="yes")
    with tmcore.options(triton="auto"), tmcore.options(triton=True):
        assert tmcore.get_options().triton is True


@pytest.mark.parametrize("raw, expected", [("0", False), ("off", False), ("FALSE", False),
                                           ("1", True), ("yes", True), ("", None)])
def test_environment_sets_defaults(monkeypatch, raw, expected):
    for name in ("native", "generic", "deterministic", "validate"):
        monkeypatch.setenv(f"TMCORE_{name.upper()}", raw)
        reload_environment()
        default = getattr(tmcore.Options(), name)
        assert getattr(tmcore.get_options(), name) is (default if expected is None else expected)
        # an explicit option wins over the environment
        with tmcore.options(**{name: not getattr(tmcore.get_options(), name)}):
            assert getattr(tmcore.get_options(), name) is not (
                default if expected is None else expected)
    monkeypatch.setenv("TMCORE_TRITON", "auto")
    reload_environment()
    assert tmcore.get_options().triton == "auto"


def test_generic_option_switches_the_dispatch_table():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import array_api_compat.torch as xp_torch

    fast = ops_for(xp_torch)
    assert fast is not generic_ops()
    with tmcore.options(generic=True):
        assert ops_for(xp_torch) is generic_ops()
        with tmcore.options(generic=False):
            assert ops_for(xp_torch) is fast
    assert ops_for(xp_torch) is fast
    assert torch.is_tensor(tmcore.trilinear_sample(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2)))


def test_native_option_turns_the_fused_kernels_off():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from tmcore.backends.native import calls

    x = torch.randn(1, 2, 3, dtype=torch.float64)
    w = torch.randn(1, 2, 3, dtype=torch.float64)
    params = tmcore.ConvParams(w, torch.zeros(1, 2, dtype=torch.float64),
                               torch.randn(4, 2, dtype=torch.float64),
                               torch.zeros(4, dtype=torch.float64))
    with tmcore.options(native=False):
        assert calls.kernels_for(x) is None
        off = tmcore.factorized_conv(x, params)
    on = tmcore.factorized_conv(x, params)
    torch.testing.assert_close(on, off)


def test_environment_sets_the_default_of_every_thread_and_options_win(monkeypatch):
    monkeypatch.setenv("TMCORE_VALIDATE", "1")
    reload_environment()
    assert tmcore.get_options().validate is True
    seen = []
    thread = threading.Thread(target=lambda: seen.append(tmcore.get_options().validate))
    thread.start()
    thread.join()
    assert seen == [True]
    with tmcore.options(validate=False):
        assert tmcore.get_options().validate is False
    monkeypatch.delenv("TMCORE_VALIDATE")
    reload_environment()
    assert tmcore.get_options().validate is False


def test_environment_in_a_fresh_process():
    code = ("import tmcore; o = tmcore.get_options(); "
            "print(o.native, o.generic, o.validate, o.deterministic, o.triton)")
    env = {"TMCORE_NATIVE": "0", "TMCORE_GENERIC": "1", "TMCORE_VALIDATE": "1",
           "TMCORE_DETERMINISTIC": "0", "TMCORE_TRITON": "1", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.split() == ["False", "True", "True", "False", "True"]


def test_depthwise_kernel_option(monkeypatch):
    """``depthwise`` picks the backends' depthwise kernel; bad values are refused by name."""
    assert tmcore.get_options().depthwise == "auto"
    with tmcore.options(depthwise="shifts"):
        assert tmcore.get_options().depthwise == "shifts"
    with pytest.raises(ValueError, match="depthwise: expected 'auto', 'grouped', 'shifts'"):
        tmcore.options(depthwise="conv")
    monkeypatch.setenv("TMCORE_DEPTHWISE", "grouped")
    reload_environment()
    assert tmcore.get_options().depthwise == "grouped"
    monkeypatch.setenv("TMCORE_DEPTHWISE", "nonsense")  # ignored: the default stays
    reload_environment()
    assert tmcore.get_options().depthwise == "auto"
