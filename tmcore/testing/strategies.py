"""Hypothesis strategies and comparison helpers for property-testing tmcore on any namespace.

Shapes are drawn by hypothesis; bulk values (volumes, contents, parameters) come
from a NumPy generator seeded by a drawn integer, which keeps example generation
fast while staying deterministic under the "ci" profile. Coordinates are drawn
entry by entry so that the interesting positions (cell centres, exactly +-1,
beyond the border) appear often.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import array_api_compat
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

import tmcore
from tmcore.testing.finite_diff import relative_error
from tmcore.testing.reference import cell_centers

__all__ = [
    "SCAN_INPUTS",
    "conv_cases",
    "lstm_cases",
    "sample_cases",
    "scan_cases",
    "splat_cases",
    "assert_rel",
    "coords_array",
    "fd_step_for_sigma",
    "grid_shapes",
    "log_uniform_sigma",
    "namespace_of",
    "radii",
    "seeds",
    "serving_backend",
    "smooth_coords_array",
    "splat_margin_ok",
    "to_numpy",
]

seeds = st.integers(min_value=0, max_value=2**32 - 1)
radii = st.one_of(st.none(), st.sampled_from([1.0, 2.0, 3.0]), st.floats(1.0, 3.0))
log_uniform_sigma = st.floats(-3.0, 1.0).map(lambda e: float(10.0**e))


@st.composite
def grid_shapes(
    draw, min_ndim: int = 1, max_ndim: int = 4, max_size: int = 5, max_cells: int = 24
) -> tuple[int, ...]:
    """Draw a spatial grid shape with ``min_ndim`` to ``max_ndim`` axes.

    The longest axes are shortened until the shape has at most ``max_cells``
    cells.

    Parameters
    ----------
    min_ndim : int, default 1
        The fewest spatial axes.
    max_ndim : int, default 4
        The most spatial axes.
    max_size : int, default 5
        The longest axis.
    max_cells : int, default 24
        The most cells in all.

    Returns
    -------
    hypothesis.strategies.SearchStrategy
        A strategy (``st.composite``) drawing a tuple of int.
        The shape ``S`` (each call of the strategy draws one).
    """
    n = draw(st.integers(min_ndim, max_ndim))
    sizes = draw(st.lists(st.integers(1, max_size), min_size=n, max_size=n))
    while math.prod(sizes) > max_cells:
        sizes[sizes.index(max(sizes))] -= 1
    return tuple(sizes)


def _coordinate(size: int) -> st.SearchStrategy[float]:
    """One normalized coordinate for an axis of length ``size``: inside, on a cell
    centre, exactly on the border, or beyond it (``|x|`` up to 1.5)."""
    centres = [float(v) for v in np.linspace(-1.0, 1.0, size)]
    return st.one_of(
        st.floats(-1.0, 1.0),
        st.sampled_from(centres),
        st.sampled_from([-1.0, 1.0]),
        st.tuples(st.sampled_from([-1.0, 1.0]), st.floats(1.0, 1.5)).map(lambda t: t[0] * t[1]),
    )


def _smooth_coordinate(size: int) -> st.SearchStrategy[float]:
    """A coordinate at which trilinear sampling is differentiable, with a margin.

    Inside: voxel position ``i + f`` with ``f`` in ``[0.01, 0.99]`` (at least 1e-2
    voxels from every cell centre and border). Outside: ``|x| >= 1.001``. An axis
    of length 1 has no kinks that matter (the gradient is 0 everywhere).
    """
    if size == 1:
        return st.floats(-1.5, 1.5)
    inside = st.tuples(st.integers(0, size - 2), st.floats(0.01, 0.99)).map(
        lambda t: 2.0 * (t[0] + t[1]) / (size - 1) - 1.0
    )
    outside = st.tuples(st.sampled_from([-1.0, 1.0]), st.floats(1.001, 1.5)).map(
        lambda t: t[0] * t[1]
    )
    return st.one_of(inside, outside)


@st.composite
def coords_array(draw, batch: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """Draw normalized coordinates: inside, on cell centres, on and beyond the border.

    Parameters
    ----------
    batch : int
        ``B``.
    count : int
        The number of points per batch element (``Q``, ``K`` or ``T``).
    shape : tuple of int
        The spatial shape ``S``; component ``k`` addresses axis ``n - 1 - k``.

    Returns
    -------
    hypothesis.strategies.SearchStrategy
        A strategy (``st.composite``) drawing arrays of shape ``(batch, count, n)``.
        The coordinates, float64, ``|x|`` up to 1.5.
    """
    n = len(shape)
    values = [
        [[draw(_coordinate(shape[n - 1 - k])) for k in range(n)] for _ in range(count)]
        for _ in range(batch)
    ]
    return np.asarray(values, dtype=np.float64).reshape(batch, count, n)


@st.composite
def smooth_coords_array(draw, batch: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """Draw normalized coordinates away from every kink of the n-linear read.

    Like :func:`coords_array`, but each voxel position keeps a margin from
    integer positions and the border, so finite differences apply.

    Parameters
    ----------
    batch : int
        ``B``.
    count : int
        The number of points per batch element.
    shape : tuple of int
        The spatial shape ``S``.

    Returns
    -------
    hypothesis.strategies.SearchStrategy
        A strategy (``st.composite``) drawing arrays of shape ``(batch, count, n)``.
        The coordinates, float64.
    """
    n = len(shape)
    values = [
        [[draw(_smooth_coordinate(shape[n - 1 - k])) for k in range(n)] for _ in range(count)]
        for _ in range(batch)
    ]
    return np.asarray(values, dtype=np.float64).reshape(batch, count, n)


def fd_step_for_sigma(sigma: np.ndarray, eps: float = 1e-6) -> float:
    """Give a finite-difference step small against the narrowest Gaussian's width.

    Parameters
    ----------
    sigma : numpy.ndarray
        The spreads of the writes, any shape.
    eps : float, default 1e-6
        The splat's ``eps``.

    Returns
    -------
    float
        ``min(1e-6, 1e-4 * width)`` with ``width = sqrt((2 min(sigma)^2 + eps) / 2)``.
    """
    width = math.sqrt((2.0 * float(np.min(sigma)) ** 2 + eps) / 2.0)
    return min(1e-6, 1e-4 * width)


def splat_margin_ok(shape: tuple[int, ...], mu: np.ndarray, sigma: np.ndarray,
                    radius: float | None) -> bool:
    """Tell whether no cell centre lies within ``1e-4 sigma + 1e-5`` of a truncation edge.

    Away from the edges the truncated splat is smooth, so finite differences
    apply.

    Parameters
    ----------
    shape : tuple of int
        The spatial shape ``S`` of ``n`` axes.
    mu : numpy.ndarray, shape ``(..., n)``
        The write centres, in grid_sample order.
    sigma : numpy.ndarray, shape ``mu.shape[:-1]``
        The spreads.
    radius : float or None
        The truncation radius in sigmas; None is always fine.

    Returns
    -------
    bool
        True when every cell centre keeps the margin.
    """
    if radius is None:
        return True
    n = len(shape)
    for idx in np.ndindex(*mu.shape[:-1]):
        for a in range(n):
            gap = np.abs(np.abs(cell_centers(shape[a]) - mu[idx][n - 1 - a]) - radius * sigma[idx])
            if np.min(gap) <= 1e-4 * sigma[idx] + 1e-5:
                return False
    return True


def _is_masked(x: Any) -> bool:
    """A masked array (marray, ``numpy.ma``): it carries ``.data`` and ``.mask``."""
    if isinstance(x, np.ma.MaskedArray):
        return True
    return not isinstance(x, np.ndarray) and hasattr(x, "mask") and hasattr(x, "data")


_READ_ERRORS = (TypeError, ValueError, RuntimeError, BufferError, AttributeError)


def namespace_of(xp: Any) -> Any:
    """Give the namespace tmcore dispatches on for the arrays ``xp`` makes.

    Parameters
    ----------
    xp : module
        An array namespace (``numpy``, ``torch``, ...).

    Returns
    -------
    module
        ``array_api_compat.array_namespace(xp.asarray([0.0]))``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX narrowing float64
        return array_api_compat.array_namespace(xp.asarray([0.0]))


def serving_backend(xp: Any) -> Any:
    """Give the backend serving ``xp``'s arrays under the current options.

    Parameters
    ----------
    xp : module
        An array namespace.

    Returns
    -------
    tmcore.backends.Backend or None
        None for the generic path.
    """
    from tmcore.backends import backend_for

    return None if tmcore.get_options().generic else backend_for(namespace_of(xp))


def _backend_reader(x: Any) -> Any:
    """The ``to_numpy`` of the module of the backend registered for ``x``'s namespace."""
    if isinstance(x, np.ndarray) or not array_api_compat.is_array_api_obj(x):
        return None
    from tmcore.backends import backend_for

    backend = backend_for(array_api_compat.array_namespace(x))
    return getattr(sys.modules.get(backend.module), "to_numpy", None) if backend else None


def _plain_numpy(x: Any, _moved: bool = False) -> np.ndarray:
    """A NumPy view/copy of an unmasked array of any namespace.

    Order matters: the ``to_numpy(x)`` of the backend module registered for ``x``'s
    namespace, where it defines one (e.g. a sparse array's densification); DLPack
    (zero-copy on the CPU and exact for every namespace that exports it); for arrays
    on an accelerator, ``array_api_compat.to_device(x, "cpu")`` (CuPy, torch); then
    hooks of namespaces that do not export DLPack (ndonnx' ``unwrap_numpy``);
    ``np.asarray`` last, and only if it gives a real numeric array: for an object that
    is not array-like to NumPy it silently returns a 0-d ``object`` array, which would
    make every shape comparison fail for the wrong reason.
    """
    reader = _backend_reader(x)
    if reader is not None:
        return np.asarray(reader(x))
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except _READ_ERRORS:
            pass
        try:  # a producer on another device may copy to the host on request
            return np.from_dlpack(x, device="cpu", copy=True)
        except _READ_ERRORS:
            pass
        if not _moved:
            try:
                moved = array_api_compat.to_device(x, "cpu")
            except _READ_ERRORS:
                moved = x
            if moved is not x:
                return _plain_numpy(moved, _moved=True)
    unwrap = getattr(x, "unwrap_numpy", None)  # ndonnx: no DLPack export
    if callable(unwrap):
        return np.asarray(unwrap())
    try:
        out = np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"cannot read a {type(x).__name__} back into NumPy: it exports "
                        f"neither DLPack nor __array__, and no backend module registered for "
                        f"its namespace defines to_numpy(x) ({exc})") from exc
    if out.dtype == object:
        raise TypeError(f"cannot read a {type(x).__name__} back into NumPy: np.asarray gives "
                        "an object array; the namespace should export DLPack (__dlpack__), or "
                        "a backend module registered for it define to_numpy(x)")
    return out


def to_numpy(x: Any) -> np.ndarray:
    """Copy an array of any namespace to NumPy (its backend's ``to_numpy``, DLPack, ...).

    Masked arrays (marray) are read as their data with masked entries set to
    NaN, so an output that tmcore should never mask fails every comparison
    instead of passing on stale data. Arrays on an accelerator are moved to the
    CPU first; ``np.asarray`` is the last resort and never accepted when it gives
    a 0-d object array.

    Parameters
    ----------
    x : array
        An array of any namespace.

    Returns
    -------
    numpy.ndarray
        A copy, shaped like ``x``.

    Raises
    ------
    TypeError
        If ``x`` offers no way to read its values.
    """
    if _is_masked(x):
        data = np.array(_plain_numpy(x.data), copy=True)
        mask = np.broadcast_to(_plain_numpy(x.mask).astype(bool), data.shape)
        if mask.any():
            data = data.astype(np.result_type(data.dtype, np.float16))
            data[mask] = np.nan
        return data
    return np.array(_plain_numpy(x), copy=True)


def assert_rel(actual: Any, expected: np.ndarray, tol: float, what: str,
               floor: float = 1e-30) -> None:
    """Assert ``relative_error(actual, expected, floor) <= tol`` with the whole failure.

    Parameters
    ----------
    actual : array
        The value under test, of any namespace (read with :func:`to_numpy`).
    expected : numpy.ndarray
        The trusted value.
    tol : float
        The largest relative error allowed.
    what : str
        What is compared, for the message.
    floor : float, default 1e-30
        As in :func:`tmcore.testing.finite_diff.relative_error`: where ``max|expected|``
        is below it the error is absolute (``tol * floor`` allowed), and said so.

    Raises
    ------
    AssertionError
        If the shapes differ or the error exceeds ``tol``; the message gives the error,
        the worst entry (index, actual, expected) and both arrays.
    """
    actual = to_numpy(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = relative_error(actual, expected, floor=floor)
    if err <= tol:
        return
    diff = np.abs(actual.astype(np.float64) - expected)
    index = np.unravel_index(int(np.argmax(np.where(np.isnan(diff), np.inf, diff))), diff.shape)
    scale = float(np.max(np.abs(expected)))
    if scale >= floor:
        measure = f"relative error {err:.3g} > {tol:.1g}"
    else:  # a relative error means nothing here (8e28 for 8e-2 over a floor of 1e-30)
        measure = (f"absolute error {float(np.nanmax(diff)):.3g} > {tol * floor:.1g} where the "
                   + ("expected value is 0" if scale == 0 else f"expected values are at most "
                      f"{scale:.3g}"))
    raise AssertionError(
        f"{what}: {measure}; worst at index {tuple(int(i) for i in index)}: actual "
        f"{actual[index].item()!r}, expected {expected[index].item()!r}\nactual=\n{actual}\n"
        f"expected=\n{expected}")


# ----------------------------------------------------------------------------- cases


def _conv_params(rng: np.random.Generator, n: int, c_in: int, c_out: int) -> list[np.ndarray]:
    return [
        rng.standard_normal((n, c_in, 3)) * 0.6,
        rng.standard_normal((n, c_in)) * 0.3,
        rng.standard_normal((c_out, c_in)) / math.sqrt(c_in),
        rng.standard_normal((c_out,)) * 0.3,
    ]


def _draw_writes(draw: Any, batch: int, count: int, shape: tuple[int, ...],
                 smooth: bool) -> tuple[np.ndarray, np.ndarray, float | None]:
    """Draw ``count`` writes per batch element: centres ``(B, K, n)``, spreads ``(B, K)``
    and a truncation radius; with ``smooth``, only writes whose cell centres keep away
    from the truncation edges (:func:`splat_margin_ok`)."""
    mu = draw(coords_array(batch, count, shape))
    sigma = np.asarray(draw(st.lists(log_uniform_sigma, min_size=batch * count,
                                     max_size=batch * count))).reshape(batch, count)
    radius = draw(radii)
    if smooth:
        assume(splat_margin_ok(shape, mu, sigma, radius))
    return mu, sigma, radius


# ----------------------------------------------------------------------------- strategies


@st.composite
def sample_cases(draw, smooth: bool = False, max_cells: int = 24) -> dict:
    """Draw an input of the read: a volume, coordinates and a cotangent.

    Parameters
    ----------
    smooth : bool, default False
        Coordinates away from kinks (for finite differences).
    max_cells : int, default 24
        The most cells of the grid.

    Returns
    -------
    SearchStrategy of dict
        ``volume (B, C, *S)``, ``coords (B, Q, n)``, ``g (B, Q, C)``, float64.
    """
    shape = draw(grid_shapes(max_cells=max_cells))
    batch, channels, queries = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(
        st.integers(1, 3))
    rng = np.random.default_rng(draw(seeds))
    make = smooth_coords_array if smooth else coords_array
    return dict(
        volume=rng.standard_normal((batch, channels, *shape)),
        coords=draw(make(batch, queries, shape)),
        g=rng.standard_normal((batch, queries, channels)),
    )


@st.composite
def splat_cases(draw, smooth: bool = False, max_cells: int = 24) -> dict:
    """Draw an input of the write: contents, centres, spreads, a shape and a cotangent.

    Parameters
    ----------
    smooth : bool, default False
        Keep cell centres away from truncation edges (for finite differences).
    max_cells : int, default 24
        The most cells of the grid.

    Returns
    -------
    SearchStrategy of dict
        ``content (B, K, C)``, ``mu (B, K, n)``, ``sigma (B, K)`` (1e-3 to 10),
        ``shape``, ``radius`` (None or 1 to 3) and ``g (B, C, *shape)``.
    """
    shape = draw(grid_shapes(max_cells=max_cells))
    batch, k, channels = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(seeds))
    mu, sigma, radius = _draw_writes(draw, batch, k, shape, smooth)
    return dict(
        content=rng.standard_normal((batch, k, channels)),
        mu=mu,
        sigma=sigma,
        shape=shape,
        radius=radius,
        g=rng.standard_normal((batch, channels, *shape)),
    )


@st.composite
def conv_cases(draw, max_cells: int = 24) -> dict:
    """Draw an input of the factorized conv.

    Parameters
    ----------
    max_cells : int, default 24
        The most cells of the grid.

    Returns
    -------
    SearchStrategy of dict
        ``x (B, C_in, *S)``, ``params`` (the four conv arrays) and
        ``g (B, C_out, *S)``.
    """
    shape = draw(grid_shapes(max_cells=max_cells))
    batch, c_in, c_out = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(seeds))
    return dict(
        x=rng.standard_normal((batch, c_in, *shape)),
        params=_conv_params(rng, len(shape), c_in, c_out),
        g=rng.standard_normal((batch, c_out, *shape)),
    )


@st.composite
def lstm_cases(draw, max_cells: int = 24, max_channels: int = 3) -> dict:
    """Draw an input of the ConvLSTM step.

    Parameters
    ----------
    max_cells : int, default 24
        The most cells of the grid.
    max_channels : int, default 3
        The most channels ``C``.

    Returns
    -------
    SearchStrategy of dict
        ``x, h, c (B, C, *S)``, ``params`` (``C_in = 2C``, ``C_out = 4C``) and the
        cotangents ``g_h, g_c (B, C, *S)``.
    """
    shape = draw(grid_shapes(max_cells=max_cells))
    batch, channels = draw(st.integers(1, 2)), draw(st.integers(1, max_channels))
    rng = np.random.default_rng(draw(seeds))
    state_shape = (batch, channels, *shape)
    return dict(
        x=rng.standard_normal(state_shape),
        h=rng.standard_normal(state_shape),
        c=rng.standard_normal(state_shape),
        params=_conv_params(rng, len(shape), 2 * channels, 4 * channels),
        g_h=rng.standard_normal(state_shape),
        g_c=rng.standard_normal(state_shape),
    )


@st.composite
def scan_cases(draw, smooth: bool = False, max_cells: int = 16, max_steps: int = 4,
               max_channels: int = 3) -> dict:
    """Draw an input of the scan and its VJP.

    Parameters
    ----------
    smooth : bool, default False
        Read coordinates away from kinks and cell centres away from truncation
        edges (for finite differences).
    max_cells : int, default 16
        The most cells of the grid.
    max_steps : int, default 4
        The most steps ``T``.
    max_channels : int, default 3
        The most channels ``C``.

    Returns
    -------
    SearchStrategy of dict
        The keys of :data:`SCAN_INPUTS` (``h0, c0 (B, C, *S)``,
        ``read_coords, write_coords (B, T, n)``, ``write_sigma (B, T)``,
        ``write_content (B, T, C)``), ``params``, the cotangents
        ``g_reads (B, T, C)``, ``g_h, g_c (B, C, *S)``, ``radius`` and
        ``checkpoint_every`` (1 to 3).
    """
    shape = draw(grid_shapes(max_cells=max_cells))
    batch, channels = draw(st.integers(1, 2)), draw(st.integers(1, max_channels))
    steps = draw(st.integers(1, max_steps))
    rng = np.random.default_rng(draw(seeds))
    make = smooth_coords_array if smooth else coords_array
    write_coords, write_sigma, radius = _draw_writes(draw, batch, steps, shape, smooth)
    state_shape = (batch, channels, *shape)
    return dict(
        h0=rng.standard_normal(state_shape) * 0.5,
        c0=rng.standard_normal(state_shape) * 0.5,
        read_coords=draw(make(batch, steps, shape)),
        write_coords=write_coords,
        write_sigma=write_sigma,
        write_content=rng.standard_normal((batch, steps, channels)),
        params=_conv_params(rng, len(shape), 2 * channels, 4 * channels),
        g_reads=rng.standard_normal((batch, steps, channels)),
        g_h=rng.standard_normal(state_shape),
        g_c=rng.standard_normal(state_shape),
        radius=radius,
        checkpoint_every=draw(st.integers(1, 3)),
    )


#: The array keys of a :func:`scan_cases` case, in ``memory_scan``'s argument order.
SCAN_INPUTS = ("h0", "c0", "read_coords", "write_coords", "write_sigma", "write_content")
