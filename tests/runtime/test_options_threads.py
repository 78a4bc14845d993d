"""tmcore.options cannot poison a thread: strict value types, a block applied on entry and
undone if entering fails, out-of-order exits restored, reuse of one object."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tmcore
from tmcore.runtime import options as _options

FIELDS = ("native", "triton", "generic", "deterministic", "validate", "depthwise")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in FIELDS:
        monkeypatch.delenv(f"TMCORE_{name.upper()}", raising=False)


def _works() -> None:
    """A tmcore call in this thread still runs (nothing unhashable was stored)."""
    out = tmcore.trilinear_sample(np.zeros((1, 1, 2, 2)), np.zeros((1, 1, 2)))
    assert out.shape == (1, 1, 1)


@pytest.mark.parametrize("name, value", [
    ("triton", np.array("auto")),  # == "auto" is truthy and it is unhashable
    ("triton", np.str_("auto")),
    ("triton", "AUTO"),
    ("native", np.bool_(True)),
    ("validate", np.array(True)),
    ("generic", 0),
    ("deterministic", 1.0),
    ("depthwise", np.array("auto")),
])
def test_values_of_the_wrong_type_are_refused_by_name_and_change_nothing(name, value):
    before = tmcore.get_options()
    with pytest.raises(TypeError, match=rf"^{name}: expected .*got .*of type"):
        tmcore.options(**{name: value})
    with pytest.raises(TypeError, match=rf"^{name}: expected"):
        with tmcore.options(**{name: value}):
            pass  # pragma: no cover
    assert tmcore.get_options() == before
    _works()


def test_a_refused_value_in_a_thread_leaves_that_thread_working():
    seen = []

    def body():
        try:
            tmcore.options(triton=np.array("auto"))
        except TypeError as exc:
            seen.append(str(exc))
        _works()
        seen.append(tmcore.get_options())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen[0].startswith("triton: expected True, False, 'auto' or None")
    assert seen[1] == tmcore.Options()


def test_validate_refuses_numpy_bools():
    with pytest.raises(TypeError, match="validate: expected True, False or None"):
        tmcore.options(validate=np.bool_(True))
    assert tmcore.get_options().validate is False


def test_the_block_is_applied_on_entry_and_undone_if_entering_fails(monkeypatch):
    calls = {"n": 0}
    real = _options.get_options

    def failing():
        calls["n"] += 1
        raise RuntimeError("entering failed")

    block = tmcore.options(native=False)  # the call applies at once (setter form) ...
    assert tmcore.get_options().native is False
    monkeypatch.setattr(_options, "get_options", failing)
    with pytest.raises(RuntimeError, match="entering failed"):
        with block:
            pass  # pragma: no cover
    monkeypatch.setattr(_options, "get_options", real)
    assert calls["n"] == 1
    assert tmcore.get_options() == tmcore.Options()  # ... and a failed `with` undoes all of it


def test_a_with_block_leaves_nothing_behind_and_setters_inside_it_end_with_it():
    with tmcore.options(validate=True) as opts:
        assert opts.validate is True
        tmcore.options(native=False)  # a setter inside the block: lasts until its end
        assert tmcore.get_options().native is False
    assert tmcore.get_options() == tmcore.Options()


def test_out_of_order_exits_restore_exactly():
    outer, inner = tmcore.options(native=False), None
    outer.__enter__()
    inner = tmcore.options(validate=True)
    inner.__enter__()
    assert tmcore.get_options().native is False and tmcore.get_options().validate is True
    outer.__exit__(None, None, None)  # the outer block first
    now = tmcore.get_options()
    assert now.native is True, "the outer block's setting leaked past its exit"
    assert now.validate is True  # the inner block is still open
    inner.__exit__(None, None, None)
    assert tmcore.get_options() == tmcore.Options()


def test_out_of_order_exits_of_the_same_field():
    a = tmcore.options(native=False)
    a.__enter__()
    b = tmcore.options(native=True)
    b.__enter__()
    a.__exit__(None, None, None)
    assert tmcore.get_options().native is True  # b's value, still open
    b.__exit__(None, None, None)
    assert tmcore.get_options().native is True  # the default
    c = tmcore.options(native=False)
    c.__enter__()
    d = tmcore.options(validate=True)
    d.__enter__()
    d.__exit__(None, None, None)
    assert tmcore.get_options().native is False  # in order: c still open
    c.__exit__(None, None, None)
    assert tmcore.get_options() == tmcore.Options()


def test_exiting_a_block_that_is_not_open_is_a_clear_error():
    block = tmcore.options(native=False)
    with block:
        pass
    with pytest.raises(RuntimeError, match="not open in this thread / task"):
        block.__exit__(None, None, None)
    entered = tmcore.options(validate=True)
    entered.__enter__()
    errors = []

    def elsewhere():
        try:
            entered.__exit__(None, None, None)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert errors and "entered in another thread" in errors[0]
    assert tmcore.get_options().validate is True  # this thread's block is untouched
    entered.__exit__(None, None, None)
    assert tmcore.get_options() == tmcore.Options()


def test_an_exception_in_flight_is_not_hidden_by_a_bad_exit():
    block = tmcore.options(native=False)
    with block:
        pass
    assert block.__exit__(ValueError, ValueError("x"), None) is None


def test_one_object_reused_nested_and_in_threads():
    quiet = tmcore.options(validate=True)
    with quiet:  # right after the call: takes the call's own application over
        assert tmcore.get_options().validate is True
        with quiet:
            assert tmcore.get_options().validate is True
        assert tmcore.get_options().validate is True
    assert tmcore.get_options().validate is False
    with quiet:  # a later entry applies the same change again
        assert tmcore.get_options().validate is True
    assert tmcore.get_options().validate is False
    seen = []

    def body():
        with quiet:
            seen.append(tmcore.get_options().validate)
        seen.append(tmcore.get_options().validate)

    threads = [threading.Thread(target=body) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen.count(True) == 4 and seen.count(False) == 4
    assert tmcore.get_options() == tmcore.Options()


def test_the_docstring_explains_reuse_and_validate_scope():
    doc = tmcore.options.__doc__
    assert "Reusing one object" in doc and "any order" in doc
    assert "INPUTS" in tmcore.Options.__doc__
