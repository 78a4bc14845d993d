"""The backend kit on namespaces nobody here wrote (marray, ndonnx, dask) and on two made
here: one without devices, one without float64.

The first three run only if their package is installed (the ``test`` extras install
them) and are skipped with a reason otherwise. Budgets are small: marray (NumPy
underneath) runs the whole suite; ndonnx and dask build graphs op by op, so they run
the forward/VJP-vs-reference properties with one example each.

marray and ndonnx arrays are not array-like to NumPy (``np.asarray`` gives a
0-d object array); before the kit read results back through DLPack /
``unwrap_numpy`` every property failed on shape.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import wrapped_namespace

from tmcore.runtime.dispatch import generic_ops, ops_for
from tmcore.testing import PROPERTIES, check_namespace, load_namespace, registered_backend

REFERENCE_PROPERTIES = ["trilinear_matches_reference", "splat_matches_reference",
                        "conv_matches_reference", "convlstm_matches_reference",
                        "memory_scan_matches_reference"]


def test_kit_passes_on_marray_over_numpy():
    pytest.importorskip("marray", reason="marray is not installed")
    xp = load_namespace("marray.numpy")
    assert type(xp.asarray(np.zeros(2))).__name__ == "MArray"
    # marray 0.0.12: np.asarray(MArray) is a 0-d object array; the old read-back
    # (np.asarray first) failed every property on shape
    report = check_namespace(xp, max_examples=2)
    assert report, str(report)
    assert sorted(report.passed) == sorted(PROPERTIES)


def test_marray_masked_entries_are_not_read_as_data():
    """A masked output must fail the comparison, not pass on its underlying data."""
    pytest.importorskip("marray", reason="marray is not installed")
    from tmcore.testing.strategies import assert_rel

    xp = load_namespace("marray.numpy")
    data = np.arange(3.0)
    masked = xp.asarray(data, mask=np.array([False, True, False]))
    with pytest.raises(AssertionError, match="relative error"):
        assert_rel(masked, data, 1e-3, "masked output")
    assert_rel(xp.asarray(data), data, 0.0, "unmasked output")


@pytest.fixture
def ndonnx():
    module = pytest.importorskip("ndonnx", reason="ndonnx is not installed")
    with warnings.catch_warnings():
        # without onnxruntime ndonnx propagates values with its reference implementation
        warnings.simplefilter("ignore", UserWarning)
        yield module


def test_kit_passes_on_ndonnx(ndonnx):
    # ndonnx 0.23 exports no DLPack and np.asarray gives an object array: the
    # kit reads it back with unwrap_numpy(). The scan (6 s more) is in the table.
    names = REFERENCE_PROPERTIES[:4]
    report = check_namespace(ndonnx, properties=names, max_examples=1)
    assert report, str(report)
    assert report.passed == names


def test_kit_passes_on_dask():
    pytest.importorskip("dask.array", reason="dask is not installed")
    names = [*REFERENCE_PROPERTIES, "conv_vjp_matches_central_differences"]
    report = check_namespace("array_api_compat.dask.array", properties=names, max_examples=1)
    assert report, str(report)
    assert report.passed == names


def test_a_namespace_without_devices_passes_every_property_on_the_generic_path():
    """Arrays without ``.device`` whose creation functions refuse any device but None
    (tests/kit/wrapped_namespace.py): the generic path asks for a device only through
    ``tmcore.types.device_of``, which says None. Read back through its backend's hook."""
    xp = wrapped_namespace.no_device_namespace()
    assert not hasattr(xp.asarray(1.0), "device")
    with pytest.raises(TypeError, match="no devices"):
        xp.zeros(1, device="cpu")
    with registered_backend(xp, wrapped_namespace.make_ops):
        assert ops_for(xp) is generic_ops()  # its backend is the generic table
    report = check_namespace(xp, max_examples=2, backend=wrapped_namespace.make_ops)
    assert report, str(report)
    assert sorted(report.passed) == sorted(PROPERTIES)


def test_a_namespace_without_float64_runs_the_properties_that_need_none():
    """Like mlx: no ``float64``, float32 the default. The kit says which properties run
    without float64, and those pass (every function in float32 and float16, by value)."""
    xp = wrapped_namespace.float32_namespace()
    assert xp.asarray(0.5).dtype == xp.float32 and not hasattr(xp, "float64")
    without = [name for name, prop in PROPERTIES.items() if not prop.needs_float64]
    with pytest.raises(ValueError, match="no float64 dtype") as info:
        check_namespace(xp, backend=wrapped_namespace.make_ops)
    assert f"properties={without}" in str(info.value)
    report = check_namespace(xp, properties=without, max_examples=2,
                             backend=wrapped_namespace.make_ops)
    assert report, str(report)
    assert report.passed == without and len(without) == 8
