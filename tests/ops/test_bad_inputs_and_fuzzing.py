"""Robustness of tmcore's public functions: bad input, validate mode, numerics, long runs,
determinism, and fuzzing with valid and invalid arguments.

What is checked always, what only in validate mode and what not at all is
listed in docs/guides/errors-and-cache.md and in ``tmcore.runtime.validate``.
The long-scan length on NumPy is ``TMCORE_LONG_SCAN_STEPS`` (default 2,000;
100,000 takes about 5 minutes on one core); the 100,000-step run
itself is done by JAX's ``lax.scan`` over the same ``tmcore.scan.step_fwd``.
"""

from __future__ import annotations

import itertools
import math
import os
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tmcore
from tmcore.runtime.options import reload_environment

RNG = np.random.default_rng(20240607)

#: Compiling the JAX scan's VJP in half precision takes ~30 s per dtype on a busy 2-core
#: machine; ``slow`` tests run with TMCORE_SLOW_TESTS=1 (conftest; the torch half-precision
#: scans always run).
SLOW = pytest.mark.slow


# --------------------------------------------------------------------------- fixtures


def _params(rng: np.random.Generator, channels: int, n: int, forget_bias: float = 0.0):
    bound = tmcore.xavier_uniform_bound(2 * channels, 4 * channels)
    params = tmcore.conv_params_from_pointwise(
        rng.uniform(-bound, bound, (4 * channels, 2 * channels)), n
    )
    bias = np.zeros(4 * channels)
    bias[channels:2 * channels] = forget_bias
    return params._replace(pointwise_bias=bias)


def _scan_case(rng, batch=2, channels=3, shape=(3, 4, 2), steps=3, dtype=np.float64):
    n = len(shape)
    h0 = rng.normal(size=(batch, channels, *shape)) * 0.1
    c0 = rng.normal(size=(batch, channels, *shape)) * 0.1
    args = dict(
        h0=h0, c0=c0,
        read_coords=rng.uniform(-1, 1, (batch, steps, n)),
        write_coords=rng.uniform(-1, 1, (batch, steps, n)),
        write_sigma=rng.uniform(0.1, 0.5, (batch, steps)),
        write_content=rng.normal(size=(batch, steps, channels)),
        params=_params(rng, channels, n),
    )
    return {k: (tmcore.ConvParams(*(p.astype(dtype) for p in v)) if k == "params"
                else v.astype(dtype)) for k, v in args.items()}


def _finite(*arrays) -> bool:
    return all(np.isfinite(np.asarray(a, dtype=np.float64)).all() for a in arrays)


# --------------------------------------------------------------------------- 1. validation

S3 = (3, 4, 2)
VOL = RNG.normal(size=(2, 3, *S3))
COORDS = RNG.uniform(-1, 1, (2, 5, 3))
CONTENT = RNG.normal(size=(2, 4, 3))
MU = RNG.uniform(-1, 1, (2, 4, 3))
SIGMA = np.full((2, 4), 0.3)
PARAMS = _params(RNG, 3, 3)
SCAN = _scan_case(RNG)


def _scan(**changes):
    kwargs = {**SCAN, **changes}
    return tmcore.memory_scan(**kwargs)


def _scan_vjp(**changes):
    kwargs = {**SCAN, "g_reads": np.ones((2, 3, 3)), **changes}
    return tmcore.memory_scan_vjp(**kwargs)


X6 = RNG.normal(size=(2, 6, *S3))
H3 = RNG.normal(size=(2, 3, *S3))

# (id, call, exception type, [substrings the message must contain])
BAD_CALLS = [
    # trilinear_sample
    ("sample-volume-list", lambda: tmcore.trilinear_sample(VOL.tolist(), COORDS), TypeError,
     ["volume", "expected an array", "list"]),
    ("sample-volume-scalar", lambda: tmcore.trilinear_sample(1.0, COORDS), TypeError,
     ["volume", "float"]),
    ("sample-volume-rank", lambda: tmcore.trilinear_sample(VOL[0, 0, 0], COORDS), ValueError,
     ["volume", "(B, C, *S)", "(4, 2)"]),
    ("sample-volume-rank7", lambda: tmcore.trilinear_sample(VOL[..., None, None], COORDS),
     ValueError, ["volume", "1 to 4 spatial axes"]),
    ("sample-volume-int", lambda: tmcore.trilinear_sample(VOL.astype(np.int32), COORDS),
     TypeError, ["volume", "real floating", "int32"]),
    ("sample-volume-bool", lambda: tmcore.trilinear_sample(VOL > 0, COORDS), TypeError,
     ["volume", "real floating", "bool"]),
    ("sample-volume-complex", lambda: tmcore.trilinear_sample(VOL + 0j, COORDS), TypeError,
     ["volume", "real floating", "complex"]),
    ("sample-coords-int", lambda: tmcore.trilinear_sample(VOL, COORDS.astype(np.int64)),
     TypeError, ["coords", "int64"]),
    ("sample-coords-none", lambda: tmcore.trilinear_sample(VOL, None), TypeError,
     ["coords", "None"]),
    ("sample-coords-rank", lambda: tmcore.trilinear_sample(VOL, COORDS[0]), ValueError,
     ["coords", "(B, Q, n)", "(5, 3)"]),
    ("sample-coords-batch", lambda: tmcore.trilinear_sample(VOL, COORDS[:1]), ValueError,
     ["coords", "B = volume.shape[0]", "2", "(1, 5, 3)"]),
    ("sample-coords-n", lambda: tmcore.trilinear_sample(VOL, COORDS[..., :2]), ValueError,
     ["coords", "n = number of spatial axes", "3", "(2, 5, 2)"]),
    ("sample-grid-empty", lambda: tmcore.trilinear_sample(VOL[:, :, :0], COORDS), ValueError,
     ["volume", "zero-size", "(2, 3, 0, 4, 2)"]),
    ("sample-batch-empty", lambda: tmcore.trilinear_sample(VOL[:0], COORDS[:0]), ValueError,
     ["volume", "zero-size"]),
    ("sample-vjp-g-none", lambda: tmcore.trilinear_sample_vjp(VOL, COORDS, None), TypeError,
     ["g", "None"]),
    ("sample-vjp-g-shape", lambda: tmcore.trilinear_sample_vjp(VOL, COORDS, np.ones((2, 5, 4))),
     ValueError, ["g", "(B, Q, C)", "(2, 5, 3)", "(2, 5, 4)"]),
    # gaussian_splat
    ("splat-shape-empty", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, ()), ValueError,
     ["shape", "1 to 4 positive ints", "()"]),
    ("splat-shape-zero", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, (3, 0, 2)),
     ValueError, ["shape", "positive", "(3, 0, 2)"]),
    ("splat-shape-negative", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, (3, -4, 2)),
     ValueError, ["shape", "(3, -4, 2)"]),
    ("splat-shape-five-axes", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, (2,) * 5),
     ValueError, ["shape", "1 to 4"]),
    ("splat-shape-float", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, (3, 4.5, 2)),
     TypeError, ["shape", "4.5", "not an int"]),
    ("splat-shape-nan", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, (3, math.nan, 2)),
     TypeError, ["shape", "nan"]),
    ("splat-shape-str", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, "342"), TypeError,
     ["shape", "'342'"]),
    ("splat-shape-int", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, 3), TypeError,
     ["shape", "got 3"]),
    ("splat-shape-none", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, None), TypeError,
     ["shape", "None"]),
    ("splat-shape-bool", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, (True, 4, 2)),
     TypeError, ["shape", "bool"]),
    ("splat-content-rank", lambda: tmcore.gaussian_splat(CONTENT[0], MU, SIGMA, S3), ValueError,
     ["content", "(B, K, C)", "(4, 3)"]),
    ("splat-content-empty-c", lambda: tmcore.gaussian_splat(CONTENT[..., :0], MU, SIGMA, S3),
     ValueError, ["content", "zero-size"]),
    ("splat-mu-n", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, (3, 4)), ValueError,
     ["mu", "(B, K, n)", "(2, 4, 2)", "(2, 4, 3)"]),
    ("splat-mu-k", lambda: tmcore.gaussian_splat(CONTENT, MU[:, :3], SIGMA, S3), ValueError,
     ["mu", "(2, 4, 3)", "(2, 3, 3)"]),
    ("splat-sigma-rank", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA[..., None], S3),
     ValueError, ["sigma", "(B, K)", "(2, 4, 1)"]),
    ("splat-sigma-batch", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA[:1], S3), ValueError,
     ["sigma", "B = content.shape[0]"]),
    ("splat-sigma-int", lambda: tmcore.gaussian_splat(CONTENT, MU, np.ones((2, 4), int), S3),
     TypeError, ["sigma", "real floating"]),
    ("splat-radius-zero", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, S3, radius=0.0),
     ValueError, ["radius", "positive", "0.0"]),
    ("splat-radius-nan", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, S3, radius=math.nan),
     ValueError, ["radius", "nan"]),
    ("splat-radius-str", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, S3, radius="2"),
     TypeError, ["radius", "'2'"]),
    ("splat-eps-negative", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, S3, eps=-1e-6),
     ValueError, ["eps", ">= 0", "-1e-06"]),
    ("splat-eps-inf", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, S3, eps=math.inf),
     ValueError, ["eps", "finite"]),
    ("splat-eps-none", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA, S3, eps=None),
     TypeError, ["eps", "None"]),
    ("splat-vjp-g-shape",
     lambda: tmcore.gaussian_splat_vjp(CONTENT, MU, SIGMA, S3, np.ones((2, 3, 3, 4))),
     ValueError, ["g", "(B, C, *shape)", "(2, 3, 3, 4, 2)", "(2, 3, 3, 4)"]),
    ("splat-vjp-g-none", lambda: tmcore.gaussian_splat_vjp(CONTENT, MU, SIGMA, S3, None),
     TypeError, ["g", "None"]),
    # factorized_conv
    ("conv-x-list", lambda: tmcore.factorized_conv(X6.tolist(), PARAMS), TypeError,
     ["x", "list"]),
    ("conv-x-rank", lambda: tmcore.factorized_conv(X6[0, 0, 0], PARAMS), ValueError,
     ["x", "(B, C_in, *S)", "(4, 2)"]),
    ("conv-x-channels", lambda: tmcore.factorized_conv(X6[:, :5], PARAMS), ValueError,
     ["params.depthwise_weight", "(3, 5, 3)", "(3, 6, 3)"]),
    ("conv-x-ndim", lambda: tmcore.factorized_conv(X6[..., 0], PARAMS), ValueError,
     ["params.depthwise_weight", "(2, 6, 3)"]),
    ("conv-params-none", lambda: tmcore.factorized_conv(X6, None), TypeError,
     ["params", "ConvParams", "NoneType"]),
    ("conv-params-short", lambda: tmcore.factorized_conv(X6, tuple(PARAMS)[:3]), TypeError,
     ["params", "ConvParams", "3 entries"]),
    ("conv-params-dict", lambda: tmcore.factorized_conv(X6, PARAMS._asdict()), TypeError,
     ["params", "dict"]),
    ("conv-params-int", lambda: tmcore.factorized_conv(
        X6, PARAMS._replace(pointwise_bias=np.zeros(12, int))), TypeError,
     ["params.pointwise_bias", "real floating"]),
    ("conv-params-bias", lambda: tmcore.factorized_conv(
        X6, PARAMS._replace(pointwise_bias=np.zeros(11))), ValueError,
     ["params.pointwise_bias", "(12,)", "(11,)"]),
    ("conv-vjp-g", lambda: tmcore.factorized_conv_vjp(X6, PARAMS, np.ones((2, 11, *S3))),
     ValueError, ["g", "(B, C_out, *S)", "(2, 12, 3, 4, 2)"]),
    # convlstm_step
    ("cell-x-shape", lambda: tmcore.convlstm_step(H3[:, :2], H3, H3, PARAMS), ValueError,
     ["x", "shape of h", "(2, 3, 3, 4, 2)", "(2, 2, 3, 4, 2)"]),
    ("cell-c-shape", lambda: tmcore.convlstm_step(H3, H3, H3[:1], PARAMS), ValueError,
     ["c", "shape of h", "(1, 3, 3, 4, 2)"]),
    ("cell-h-rank", lambda: tmcore.convlstm_step(H3[0, 0, 0], H3[0, 0, 0], H3[0, 0, 0], PARAMS),
     ValueError, ["h", "(B, C, *S)", "(4, 2)"]),
    ("cell-params-channels", lambda: tmcore.convlstm_step(
        H3, H3, H3, _params(RNG, 2, 3)), ValueError, ["params.depthwise_weight", "(3, 6, 3)"]),
    ("cell-vjp-g-c-none", lambda: tmcore.convlstm_step_vjp(H3, H3, H3, PARAMS, H3, None),
     TypeError, ["g_c", "None"]),
    # memory_scan
    ("scan-h0-list", lambda: _scan(h0=SCAN["h0"].tolist()), TypeError, ["h0", "list"]),
    ("scan-c0-none", lambda: _scan(c0=None), TypeError, ["c0", "None"]),
    ("scan-c0-shape", lambda: _scan(c0=SCAN["c0"][:, :2]), ValueError,
     ["c0", "shape of h0", "(2, 3, 3, 4, 2)", "(2, 2, 3, 4, 2)"]),
    ("scan-h0-grid-empty", lambda: _scan(h0=SCAN["h0"][..., :0], c0=SCAN["c0"][..., :0]),
     ValueError, ["h0", "zero-size"]),
    ("scan-read-rank", lambda: _scan(read_coords=SCAN["read_coords"][0]), ValueError,
     ["read_coords", "(B, T, n)", "(3, 3)"]),
    ("scan-read-steps-zero", lambda: _scan(
        read_coords=SCAN["read_coords"][:, :0], write_coords=SCAN["write_coords"][:, :0],
        write_sigma=SCAN["write_sigma"][:, :0], write_content=SCAN["write_content"][:, :0]),
     ValueError, ["read_coords", "T >= 1", "(2, 0, 3)"]),
    ("scan-write-coords-batch", lambda: _scan(write_coords=SCAN["write_coords"][:1]),
     ValueError, ["write_coords", "(B, T, n)", "(2, 3, 3)", "(1, 3, 3)"]),
    ("scan-write-coords-steps", lambda: _scan(write_coords=SCAN["write_coords"][:, :2]),
     ValueError, ["write_coords", "(2, 3, 3)", "(2, 2, 3)"]),
    ("scan-sigma-shape", lambda: _scan(write_sigma=SCAN["write_sigma"][..., None]), ValueError,
     ["write_sigma", "(B, T)", "(2, 3)", "(2, 3, 1)"]),
    ("scan-content-channels", lambda: _scan(write_content=SCAN["write_content"][..., :2]),
     ValueError, ["write_content", "(B, T, C)", "(2, 3, 3)", "(2, 3, 2)"]),
    ("scan-content-int", lambda: _scan(write_content=SCAN["write_content"].astype(np.int16)),
     TypeError, ["write_content", "real floating", "int16"]),
    ("scan-params-c", lambda: _scan(params=_params(RNG, 2, 3)), ValueError,
     ["params.depthwise_weight", "(3, 6, 3)", "(3, 4, 3)"]),
    ("scan-params-n", lambda: _scan(params=_params(RNG, 3, 2)), ValueError,
     ["params.depthwise_weight", "(3, 6, 3)", "(2, 6, 3)"]),
    ("scan-params-pointwise", lambda: _scan(params=SCAN["params"]._replace(
        pointwise_weight=np.zeros((8, 6)), pointwise_bias=np.zeros(8))), ValueError,
     ["params.pointwise_weight", "(4C, 2C)", "(12, 6)", "(8, 6)"]),
    ("scan-checkpoint-zero", lambda: _scan(checkpoint_every=0), ValueError,
     ["checkpoint_every", ">= 1", "got 0"]),
    ("scan-checkpoint-negative", lambda: _scan_vjp(checkpoint_every=-2), ValueError,
     ["checkpoint_every", "-2"]),
    ("scan-checkpoint-float", lambda: _scan_vjp(checkpoint_every=2.0), TypeError,
     ["checkpoint_every", "2.0"]),
    ("scan-checkpoint-bool", lambda: _scan_vjp(checkpoint_every=True), TypeError,
     ["checkpoint_every", "True"]),
    ("scan-radius-negative", lambda: _scan(radius=-1.0), ValueError, ["radius", "-1.0"]),
    ("scan-eps-negative", lambda: _scan(eps=-1.0), ValueError, ["eps", "-1.0"]),
    ("scan-vjp-g-reads-none", lambda: _scan_vjp(g_reads=None), TypeError, ["g_reads", "None"]),
    ("scan-vjp-g-reads-shape", lambda: _scan_vjp(g_reads=np.ones((2, 3, 4))), ValueError,
     ["g_reads", "(B, T, C)", "(2, 3, 3)", "(2, 3, 4)"]),
    ("scan-vjp-g-h-shape", lambda: _scan_vjp(g_h=np.ones((2, 3, 3, 4))), ValueError,
     ["g_h", "(2, 3, 3, 4, 2)", "(2, 3, 3, 4)"]),
    # addressing
    ("n2v-rank0", lambda: tmcore.normalized_to_voxel(np.float64(0.5), (4,)), ValueError,
     ["coords", "(..., n)", "()"]),
    ("n2v-n", lambda: tmcore.normalized_to_voxel(COORDS, (4, 4)), ValueError,
     ["coords", "n = len(shape)", "2", "(2, 5, 3)"]),
    ("n2v-int", lambda: tmcore.normalized_to_voxel(np.zeros((2, 3), int), (4, 4, 4)),
     TypeError, ["coords", "real floating"]),
    ("v2n-size-one", lambda: tmcore.voxel_to_normalized(np.zeros((2, 2)), (1, 4)), ValueError,
     ["shape", ">= 2", "(1, 4)"]),
    ("squash-list", lambda: tmcore.squash_coords([0.1, 0.2]), TypeError, ["logits", "list"]),
    ("squash-vjp-g-shape", lambda: tmcore.squash_coords_vjp(COORDS, COORDS[0]), ValueError,
     ["g", "shape of logits", "(2, 5, 3)", "(5, 3)"]),
    ("sigma-scale-zero", lambda: tmcore.sigma_from_logit(SIGMA, 0.0), ValueError,
     ["sigma_scale", "> 0", "0.0"]),
    ("sigma-scale-nan", lambda: tmcore.sigma_from_logit(SIGMA, math.nan), ValueError,
     ["sigma_scale", "nan"]),
    ("sigma-scale-str", lambda: tmcore.sigma_from_logit(SIGMA, "1"), TypeError,
     ["sigma_scale", "'1'"]),
    ("sigma-vjp-g-shape", lambda: tmcore.sigma_from_logit_vjp(SIGMA, SIGMA[:1]), ValueError,
     ["g", "shape of logit", "(2, 4)", "(1, 4)"]),
    ("cell-centers-zero", lambda: tmcore.cell_centers((4, 0), xp=np), ValueError,
     ["shape", "(4, 0)"]),
    ("xavier-zero", lambda: tmcore.xavier_uniform_bound(0, 4), ValueError,
     ["c_in", ">= 1", "got 0"]),
    ("xavier-float", lambda: tmcore.xavier_uniform_bound(4, 2.5), TypeError,
     ["c_out", "2.5"]),
    ("params-ndim-zero", lambda: tmcore.conv_params_from_pointwise(np.zeros((8, 4)), 0),
     ValueError, ["ndim", "[1, 4]", "got 0"]),
    ("params-ndim-float", lambda: tmcore.conv_params_from_pointwise(np.zeros((8, 4)), 2.5),
     TypeError, ["ndim", "2.5"]),
    ("params-pointwise-rank", lambda: tmcore.conv_params_from_pointwise(np.zeros(8), 3),
     ValueError, ["pointwise_weight", "(C_out, C_in)", "(8,)"]),
    ("validate-str", lambda: tmcore.options(validate="yes"), TypeError,
     ["validate", "'yes'"]),
]


@pytest.mark.parametrize("call, error, fragments", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_a_clear_error(call, error, fragments):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_numpy_integer_sizes_and_checkpoint_are_accepted():
    out = tmcore.gaussian_splat(CONTENT, MU, SIGMA, tuple(np.int64(s) for s in S3))
    assert out.shape == (2, 3, *S3)
    grads = _scan_vjp(checkpoint_every=np.int32(2))
    assert grads.write_content.shape == SCAN["write_content"].shape


def test_namespace_mixing_names_the_argument():
    strict = pytest.importorskip("array_api_strict")
    with pytest.raises(TypeError) as info:
        tmcore.trilinear_sample(VOL, strict.asarray(COORDS))
    assert "coords" in str(info.value) and "one namespace" in str(info.value)
    with pytest.raises(TypeError, match="write_sigma: all arrays must come from one namespace"):
        _scan(write_sigma=strict.asarray(SCAN["write_sigma"]))
    with pytest.raises(TypeError, match="params.pointwise_bias: all arrays"):
        _scan(params=SCAN["params"]._replace(
            pointwise_bias=strict.asarray(SCAN["params"].pointwise_bias)))


def test_device_mixing_names_the_argument():
    torch = pytest.importorskip("torch")
    volume = torch.zeros(2, 3, 4, 4, 4)
    coords = torch.zeros(2, 5, 3, device="meta")
    with pytest.raises(ValueError) as info:
        tmcore.trilinear_sample(volume, coords)
    message = str(info.value)
    assert "coords" in message and "one device" in message
    assert "cpu" in message and "meta" in message
    args = {k: (tmcore.ConvParams(*map(torch.as_tensor, v)) if k == "params"
                else torch.as_tensor(v)) for k, v in SCAN.items()}
    args["write_content"] = args["write_content"].to("meta")
    with pytest.raises(ValueError, match="write_content: all arrays must be on one device"):
        tmcore.memory_scan(**args)


# --------------------------------------------------------------------------- validate mode


def test_validation_switches(monkeypatch):
    monkeypatch.delenv("TMCORE_VALIDATE", raising=False)
    reload_environment()
    assert not tmcore.get_options().validate
    with tmcore.options(validate=True):
        assert tmcore.get_options().validate
        with tmcore.options(validate=False):
            assert not tmcore.get_options().validate
        assert tmcore.get_options().validate
    monkeypatch.setenv("TMCORE_VALIDATE", "1")
    reload_environment()
    assert tmcore.get_options().validate
    with tmcore.options(validate=False):
        assert not tmcore.get_options().validate
    monkeypatch.setenv("TMCORE_VALIDATE", "0")
    reload_environment()
    assert not tmcore.get_options().validate


def _nan_at(array, index=(0, 0, 0)):
    out = np.array(array, copy=True)
    out[index] = np.nan
    return out


VALUE_CALLS = [
    ("sample-nan-coords", lambda: tmcore.trilinear_sample(VOL, _nan_at(COORDS)),
     ["coords", "1 NaN or inf", "(2, 5, 3)"]),
    ("sample-inf-volume", lambda: tmcore.trilinear_sample(VOL * np.inf, COORDS),
     ["volume", "NaN or inf"]),
    ("splat-nan-mu", lambda: tmcore.gaussian_splat(CONTENT, _nan_at(MU), SIGMA, S3),
     ["mu", "NaN or inf"]),
    ("splat-zero-sigma", lambda: tmcore.gaussian_splat(CONTENT, MU, SIGMA * 0.0, S3),
     ["sigma", "> 0", "minimum of 0.0"]),
    ("splat-negative-sigma", lambda: tmcore.gaussian_splat_vjp(
        CONTENT, MU, -SIGMA, S3, np.ones((2, 3, *S3))), ["sigma", "> 0", "-0.3"]),
    ("scan-nan-read", lambda: _scan(read_coords=_nan_at(SCAN["read_coords"])),
     ["read_coords", "NaN or inf"]),
    ("scan-nan-write", lambda: _scan_vjp(write_coords=_nan_at(SCAN["write_coords"])),
     ["write_coords", "NaN or inf"]),
    ("scan-zero-sigma", lambda: _scan(write_sigma=SCAN["write_sigma"] * 0.0),
     ["write_sigma", "> 0"]),
    ("scan-nan-g", lambda: _scan_vjp(g_reads=np.full((2, 3, 3), np.nan)),
     ["g_reads", "18 NaN or inf"]),
    ("scan-nan-params", lambda: _scan(params=SCAN["params"]._replace(
        pointwise_weight=_nan_at(SCAN["params"].pointwise_weight, (0, 0)))),
     ["params.pointwise_weight", "NaN or inf"]),
    ("squash-nan", lambda: tmcore.squash_coords(_nan_at(COORDS)), ["logits", "NaN"]),
]


@pytest.mark.parametrize("call, fragments", [c[1:] for c in VALUE_CALLS],
                         ids=[c[0] for c in VALUE_CALLS])
def test_validate_mode_rejects_nonfinite_and_nonpositive_sigma(call, fragments, monkeypatch):
    monkeypatch.delenv("TMCORE_VALIDATE", raising=False)
    reload_environment()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        call()  # off by default: no exception, no sync
        with tmcore.options(validate=True), pytest.raises(ValueError) as info:
            call()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_validate_mode_from_environment(monkeypatch):
    monkeypatch.setenv("TMCORE_VALIDATE", "1")
    reload_environment()
    with pytest.raises(ValueError, match="coords: expected finite values"):
        tmcore.trilinear_sample(VOL, _nan_at(COORDS))


def test_validate_mode_skips_values_it_cannot_read():
    """Under jax.jit the values are tracers: validate mode checks nothing, never crashes."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    with tmcore.options(validate=True):
        out = jax.jit(tmcore.trilinear_sample)(jnp.asarray(VOL, jnp.float32),
                                               jnp.asarray(_nan_at(COORDS), jnp.float32))
        assert out.shape == (2, 5, 3)
        with pytest.raises(ValueError, match="coords: expected finite"):
            tmcore.trilinear_sample(jnp.asarray(VOL, jnp.float32),
                                    jnp.asarray(_nan_at(COORDS), jnp.float32))


def _load(name):
    if name == "numpy":
        return np
    return pytest.importorskip(name)


@pytest.mark.parametrize("name", ["numpy", "array_api_strict"])
def test_nan_propagates_as_nan_outside_validate_mode(name):
    xp = _load(name)
    a = {k: (tmcore.ConvParams(*map(xp.asarray, v)) if k == "params" else xp.asarray(v))
         for k, v in SCAN.items()}
    nan_coords = xp.asarray(_nan_at(COORDS, (0, 1, 2)))
    read = np.asarray(tmcore.trilinear_sample(xp.asarray(VOL), nan_coords))
    assert read.shape == (2, 5, 3)
    assert np.isnan(read[0, 1]).all() and np.isfinite(np.delete(read[0], 1, axis=0)).all()
    for radius in (None, 2.0):
        volume = np.asarray(tmcore.gaussian_splat(
            xp.asarray(CONTENT), xp.asarray(_nan_at(MU, (1, 2, 0))), xp.asarray(SIGMA), S3,
            radius=radius))
        assert volume.shape == (2, 3, *S3)
        assert np.isnan(volume[1]).all() and np.isfinite(volume[0]).all()
    reads, h, c = tmcore.memory_scan(**{**a, "write_coords": xp.asarray(
        _nan_at(SCAN["write_coords"], (0, 1, 0)))})
    reads, h, c = map(np.asarray, (reads, h, c))
    assert reads.shape == (2, 3, 3) and h.shape == c.shape == (2, 3, *S3)
    assert np.isfinite(reads[0, :2]).all() and np.isnan(reads[0, 2]).all()
    assert np.isnan(h[0]).all() and np.isfinite(h[1]).all()
    grads = tmcore.memory_scan_vjp(**{**a, "read_coords": xp.asarray(
        _nan_at(SCAN["read_coords"], (1, 0, 1)))}, g_reads=xp.ones((2, 3, 3)))
    assert np.asarray(grads.read_coords).shape == (2, 3, 3)
    # the NaN component's own slope is 0 (as outside the grid); the others see the NaN
    assert np.isnan(np.asarray(grads.read_coords)[1, 0]).any()
    assert np.isnan(np.asarray(grads.h0)[1]).all() and np.isfinite(np.asarray(grads.h0)[0]).all()


def test_nan_coordinates_through_the_torch_read():
    torch = pytest.importorskip("torch")
    volume = torch.as_tensor(VOL)
    coords = torch.as_tensor(_nan_at(COORDS, (0, 1, 2)))

    with tmcore.options(generic=True):
        generic = tmcore.trilinear_sample(volume, coords)
    assert torch.isnan(generic[0, 1]).all()
    fast = tmcore.trilinear_sample(volume, coords)
    assert fast.shape == (2, 5, 3)
    assert torch.isnan(fast[0, 1]).all(), "the grid_sample fast path must propagate NaN"
    assert torch.isfinite(fast[1]).all() and torch.isfinite(fast[0, 0]).all()


# --------------------------------------------------------------------------- 2. numerics

SIGMAS = [1e-4, 1e-2, 1.0, 1e3]
COORDINATES = [1.0, -1.0, 0.37, 1e6]


def _edge_case(sigma, coord, scale, rng):
    batch, writes, channels = 2, 3, 4
    content = rng.normal(size=(batch, writes, channels)) * scale
    mu = np.full((batch, writes, 3), coord)
    mu[0, 0, 0] = -coord
    mu[1, 1] = 0.123  # one write near a cell centre, at every sigma
    return content, mu, np.full((batch, writes), sigma)


@pytest.mark.parametrize("dtype, scale", [(np.float64, 1e30), (np.float32, 1e15),
                                          (np.float32, 1.0)])
def test_splat_and_read_are_finite_at_the_edges(dtype, scale):
    rng = np.random.default_rng(1)
    shape = (4, 5, 3)
    for sigma, coord in itertools.product(SIGMAS, COORDINATES):
        content, mu, sig = (a.astype(dtype) for a in _edge_case(sigma, coord, scale, rng))
        g = rng.normal(size=(2, 4, *shape)).astype(dtype)
        volume = tmcore.gaussian_splat(content, mu, sig, shape)
        grads = tmcore.gaussian_splat_vjp(content, mu, sig, shape, g)
        read = tmcore.trilinear_sample(g, mu)
        d_read = tmcore.trilinear_sample_vjp(g, mu, content / scale)
        assert volume.dtype == dtype and all(d.dtype == dtype for d in grads)
        assert _finite(volume, *grads, read, *d_read), (sigma, coord, scale)


def _half_cases(rng, max_content):
    for sigma, coord, scale in itertools.product(SIGMAS, [1.0, -1.0, 0.37, 1e4],
                                                 [1.0, max_content]):
        yield (sigma, coord, scale), _edge_case(sigma, coord, scale, rng)


PRIMITIVES = {"splat": tmcore.gaussian_splat, "splat_vjp": tmcore.gaussian_splat_vjp,
              "sample": tmcore.trilinear_sample, "sample_vjp": tmcore.trilinear_sample_vjp}


def _jitted_primitives():
    import jax

    return {name: jax.jit(f, static_argnums=(3,) if name.startswith("splat") else ())
            for name, f in PRIMITIVES.items()}


def _assert_half_finite(to_xp, to_np, limit, f=PRIMITIVES):
    """Every output whose float64 value is comfortably inside the dtype's range is finite."""
    rng = np.random.default_rng(2)
    shape = (4, 5, 3)
    for key, (content, mu, sigma) in _half_cases(rng, 1e4):
        g = rng.normal(size=(2, 4, *shape))
        volume = rng.normal(size=(2, 4, *shape))
        g_read = rng.normal(size=(2, 3, 4))
        exact = [tmcore.gaussian_splat(content, mu, sigma, shape),
                 *tmcore.gaussian_splat_vjp(content, mu, sigma, shape, g),
                 tmcore.trilinear_sample(volume, mu),
                 *tmcore.trilinear_sample_vjp(volume, mu, g_read)]
        a = [to_xp(x) for x in (content, mu, sigma, g, volume, g_read)]
        low = [f["splat"](*a[:3], shape), *f["splat_vjp"](*a[:3], shape, a[3]),
               f["sample"](a[4], a[1]), *f["sample_vjp"](a[4], a[1], a[5])]
        names = ["volume", "d_content", "d_mu", "d_sigma", "read", "d_volume", "d_coords"]
        for name, ref, out in zip(names, exact, low, strict=True):
            mask = np.abs(ref) < limit
            assert np.isfinite(to_np(out)[mask]).all(), (name, key)


def _half_backends():
    cases = [pytest.param("numpy", "float16")]
    cases += [pytest.param(fw, dt) for fw in ("torch", "jax") for dt in ("float16", "bfloat16")]
    return cases


@pytest.mark.parametrize("framework, dtype", _half_backends())
def test_half_precision_is_finite_where_the_math_is(framework, dtype):
    limit = 65504.0 / 4 if dtype == "float16" else 1e37
    functions = PRIMITIVES
    if framework == "numpy":
        to_xp, to_np = (lambda a: np.asarray(a, np.float16)), (lambda a: np.asarray(a))
    elif framework == "torch":
        torch = pytest.importorskip("torch")
        dt = getattr(torch, dtype)
        to_xp, to_np = (lambda a: torch.as_tensor(a, dtype=dt)), (lambda a: a.float().numpy())
    else:
        jnp = pytest.importorskip("jax.numpy")
        dt = getattr(jnp, dtype)
        to_xp = lambda a: jnp.asarray(a, dt)  # noqa: E731
        to_np = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
        functions = _jitted_primitives()  # eager JAX compiles every op: slow
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _assert_half_finite(to_xp, to_np, limit, functions)


def test_numpy_float16_generic_path_in_the_usual_range():
    """sigma in [0.1, 10], coordinates up to +-100, contents up to 100: all finite."""
    rng = np.random.default_rng(3)
    shape = (4, 3, 5)
    for sigma, coord, scale in itertools.product([0.1, 1.0, 10.0], [1.0, -1.0, 0.37, 100.0],
                                                 [1.0, 100.0]):
        content, mu, sig = (a.astype(np.float16) for a in _edge_case(sigma, coord, scale, rng))
        g = rng.normal(size=(2, 4, *shape)).astype(np.float16)
        out = [tmcore.gaussian_splat(content, mu, sig, shape),
               *tmcore.gaussian_splat_vjp(content, mu, sig, shape, g / scale),
               tmcore.trilinear_sample(g, mu), *tmcore.trilinear_sample_vjp(g, mu, content)]
        assert all(o.dtype == np.float16 for o in out)
        assert _finite(*out), (sigma, coord, scale)
    case = _scan_case(rng, steps=4, dtype=np.float16)
    reads, h, c = tmcore.memory_scan(**case)
    grads = tmcore.memory_scan_vjp(**case, g_reads=np.ones_like(reads))
    assert reads.dtype == np.float16 and _finite(reads, h, c, *grads[:6], *grads.params)


@pytest.mark.parametrize("framework, dtype", [("torch", "float16"), ("torch", "bfloat16"),
                                              pytest.param("jax", "float16", marks=SLOW),
                                              pytest.param("jax", "bfloat16", marks=SLOW)])
def test_half_precision_scan_with_huge_tokens(framework, dtype):
    rng = np.random.default_rng(4)
    case = _scan_case(rng, steps=6)
    case["write_content"] = case["write_content"] * 1e4
    case["write_sigma"] = np.array([[1e-4, 1e-2, 1.0, 1e3, 0.3, 1e-4]] * 2)
    case["read_coords"][0, :, 0] = [1.0, -1.0, 1e4, -1e4, 0.0, 1.0]
    if framework == "torch":
        torch = pytest.importorskip("torch")
        conv = lambda a: torch.as_tensor(a, dtype=getattr(torch, dtype))  # noqa: E731
        to_np = lambda a: a.float().numpy()  # noqa: E731
        a = {k: (tmcore.ConvParams(*map(conv, v)) if k == "params" else conv(v))
             for k, v in case.items()}
        reads, h, c = tmcore.memory_scan(**a)
        grads = tmcore.memory_scan_vjp(**a, g_reads=conv(np.ones((2, 6, 3))))
    else:
        jnp = pytest.importorskip("jax.numpy")
        conv = lambda a: jnp.asarray(a, getattr(jnp, dtype))  # noqa: E731
        to_np = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
        run = _jax_scan_and_vjp()
        reads, h, c, grads = run(*(conv(v) for k, v in case.items() if k != "params"),
                                 tmcore.ConvParams(*map(conv, case["params"])))
    assert str(reads.dtype).endswith(dtype)
    assert _finite(*map(to_np, (reads, h, c, *grads[:6], *grads.params)))
    assert np.abs(to_np(h)).max() <= 1.0


def _jax_scan_and_vjp():
    """jit(forward and VJP of the JAX adapter's scan): tmcore's step_fwd / step_bwd under
    lax.scan, compiled once (eager JAX compiles every op, which is slow)."""
    jax = pytest.importorskip("jax")
    adapter = pytest.importorskip("tmcore.adapters.jax")

    def run(h0, c0, read_coords, write_coords, write_sigma, write_content, params):
        primals = (h0, c0, read_coords, write_coords, write_sigma, write_content, params)
        (reads, h, c), pullback = jax.vjp(adapter.memory_scan, *primals)
        grads = pullback((jax.numpy.ones_like(reads), jax.numpy.ones_like(h),
                          jax.numpy.zeros_like(c)))
        return reads, h, c, tmcore.ScanGrads(*grads)

    return jax.jit(run)


def _long_case(steps, rng):
    shape = (2, 2, 2)
    return dict(
        h0=np.zeros((1, 2, *shape)), c0=np.zeros((1, 2, *shape)),
        read_coords=rng.uniform(-1.5, 1.5, (1, steps, 3)),
        write_coords=rng.uniform(-1.5, 1.5, (1, steps, 3)),
        write_sigma=10.0 ** rng.uniform(-4, 3, (1, steps)),
        write_content=rng.normal(size=(1, steps, 2)) * 10.0,
        # forget gate biased open (+5): the cell state integrates, the hardest case
        params=_params(rng, 2, 3, forget_bias=5.0),
    )


LONG_STEPS = int(os.environ.get("TMCORE_LONG_SCAN_STEPS", "2000"))


def test_long_scan_stays_finite_and_bounded():
    """|h| <= 1 always; |c_t| <= |c_{t-1}| + 1, so |c_T| <= T."""
    case = _long_case(LONG_STEPS, np.random.default_rng(5))
    start = time.perf_counter()
    reads, h, c = tmcore.memory_scan(**case)
    elapsed = time.perf_counter() - start
    assert _finite(reads, h, c)
    assert np.abs(h).max() <= 1.0 and np.abs(reads).max() <= 1.0
    assert np.abs(c).max() <= LONG_STEPS
    print(f"numpy {LONG_STEPS}-step scan: {elapsed:.1f} s, max|h| {np.abs(h).max():.3f}, "
          f"max|c| {np.abs(c).max():.3f}")


def test_100k_step_scan_under_lax_scan():
    """The same step (tmcore.scan.step_fwd) 100,000 times, compiled by lax.scan."""
    jax = pytest.importorskip("jax")
    adapter = pytest.importorskip("tmcore.adapters.jax")
    steps = 100_000
    case = _long_case(steps, np.random.default_rng(6))
    a = {k: (tmcore.ConvParams(*map(jax.numpy.asarray, v)) if k == "params"
             else jax.numpy.asarray(v)) for k, v in case.items()}
    start = time.perf_counter()
    reads, h, c = jax.block_until_ready(adapter.memory_scan(**a))
    elapsed = time.perf_counter() - start
    reads, h, c = map(np.asarray, (reads, h, c))
    assert _finite(reads, h, c)
    assert np.abs(h).max() <= 1.0 and np.abs(reads).max() <= 1.0
    assert np.abs(c).max() <= steps
    print(f"jax 100k-step scan: {elapsed:.1f} s, max|h| {np.abs(h).max():.3f}, "
          f"max|c| {np.abs(c).max():.3f}")


def test_1000_step_backward_is_finite():
    steps = 1000
    case = _long_case(steps, np.random.default_rng(7))
    g_reads = np.random.default_rng(8).normal(size=(1, steps, 2))
    grads = tmcore.memory_scan_vjp(**case, g_reads=g_reads, g_h=np.ones_like(case["h0"]),
                                   checkpoint_every=32)
    assert _finite(*grads[:6], *grads.params)
    for name, value in zip(grads._fields[:6], grads[:6], strict=True):
        assert value.shape == np.shape(case[name]), name


# --------------------------------------------------------------------------- 3. determinism


def _run_twice(xp_convert, to_np, checkpoint_every=2):
    outs = []
    for _ in range(2):
        case = _scan_case(np.random.default_rng(9), steps=5)
        a = {k: (tmcore.ConvParams(*map(xp_convert, v)) if k == "params" else xp_convert(v))
             for k, v in case.items()}
        reads, h, c = tmcore.memory_scan(**a)
        grads = tmcore.memory_scan_vjp(**a, g_reads=xp_convert(np.ones((2, 5, 3))),
                                       g_h=xp_convert(np.ones_like(case["h0"])),
                                       checkpoint_every=checkpoint_every)
        outs.append([to_np(x) for x in (reads, h, c, *grads[:6], *grads.params)])
    for first, second in zip(*outs, strict=True):
        assert first.tobytes() == second.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("framework", ["numpy", "array_api_strict", "torch", "jax"])
def test_scan_is_bitwise_deterministic_on_cpu(framework, dtype):
    if framework == "numpy":
        _run_twice(lambda a: np.asarray(a, dtype), np.asarray)
    elif framework == "array_api_strict":
        strict = pytest.importorskip("array_api_strict")
        _run_twice(lambda a: strict.asarray(np.asarray(a, dtype)), np.asarray)
    elif framework == "torch":
        torch = pytest.importorskip("torch")
        _run_twice(lambda a: torch.as_tensor(np.asarray(a, dtype)), lambda t: t.numpy())
    else:
        jax = pytest.importorskip("jax")
        if dtype == "float64" and not jax.config.jax_enable_x64:
            pytest.skip("jax x64 is off")
        run = _jax_scan_and_vjp()
        outs = []
        for _ in range(2):
            case = _scan_case(np.random.default_rng(9), steps=5, dtype=dtype)
            reads, h, c, grads = run(*(jax.numpy.asarray(v) for k, v in case.items()
                                       if k != "params"),
                                     tmcore.ConvParams(*map(jax.numpy.asarray, case["params"])))
            outs.append([np.asarray(x) for x in (reads, h, c, *grads[:6], *grads.params)])
        for first, second in zip(*outs, strict=True):
            assert first.tobytes() == second.tobytes()


# --------------------------------------------------------------------------- 4. fuzzing

ALLOWED = (ValueError, TypeError)


def _mutations(draw, value):
    """A drawn replacement for one argument: invalid more often than not."""
    kind = draw(st.sampled_from(
        ["keep", "none", "list", "scalar", "int", "bool", "add-axis", "drop-axis", "grow",
         "zero", "strict", "0d", "str"]))
    if not isinstance(value, np.ndarray):
        return kind, draw(st.sampled_from([value, None, 0, -1, 2.5, "x", (), (0,), [2, 2],
                                           math.nan, True, (2, 2, 2, 2, 2)]))
    if kind == "keep":
        return kind, value
    if kind == "none":
        return kind, None
    if kind == "list":
        return kind, value.tolist()
    if kind == "scalar":
        return kind, 1.5
    if kind == "int":
        return kind, value.astype(np.int64)
    if kind == "bool":
        return kind, value > 0
    if kind == "add-axis":
        return kind, value[None]
    if kind == "drop-axis":
        return kind, value[0] if value.ndim else value
    if kind == "grow":
        axis = draw(st.integers(0, max(value.ndim - 1, 0)))
        return kind, np.concatenate([value, value], axis=axis) if value.ndim else value
    if kind == "zero":
        axis = draw(st.integers(0, max(value.ndim - 1, 0)))
        return kind, np.take(value, [], axis=axis) if value.ndim else value
    if kind == "strict":
        try:
            import array_api_strict
        except ImportError:
            return kind, value
        return kind, array_api_strict.asarray(value)
    if kind == "0d":
        return kind, np.asarray(1.0)
    return kind, "not an array"


@st.composite
def _public_calls(draw):
    """(function name, args, kwargs, expected output shapes or None) with random mutations."""
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    b, c, k, q, t = (draw(st.integers(1, 3)) for _ in range(5))
    n = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)))
    vol = rng.normal(size=(b, c, *shape))
    params = list(_params(rng, c, n))
    which = draw(st.sampled_from([
        "trilinear_sample", "trilinear_sample_vjp", "gaussian_splat", "gaussian_splat_vjp",
        "factorized_conv", "convlstm_step", "convlstm_step_vjp", "memory_scan",
        "memory_scan_vjp", "normalized_to_voxel", "squash_coords_vjp", "sigma_from_logit",
    ]))
    coords = rng.uniform(-1.2, 1.2, (b, q, n))
    mu = rng.uniform(-1.2, 1.2, (b, k, n))
    sigma = rng.uniform(0.05, 2.0, (b, k))
    content = rng.normal(size=(b, k, c))
    state = (b, c, *shape)
    steps = {"read_coords": rng.uniform(-1, 1, (b, t, n)),
             "write_coords": rng.uniform(-1, 1, (b, t, n)),
             "write_sigma": rng.uniform(0.05, 1, (b, t)), "write_content": rng.normal(
                 size=(b, t, c))}
    table = {
        "trilinear_sample": ([vol, coords], {}, [(b, q, c)]),
        "trilinear_sample_vjp": ([vol, coords, rng.normal(size=(b, q, c))], {},
                                 [state, (b, q, n)]),
        "gaussian_splat": ([content, mu, sigma, shape], {"radius": draw(
            st.sampled_from([None, 1.5]))}, [state]),
        "gaussian_splat_vjp": ([content, mu, sigma, shape, rng.normal(size=state)], {},
                               [(b, k, c), (b, k, n), (b, k)]),
        "factorized_conv": ([rng.normal(size=(b, 2 * c, *shape)), params], {},
                            [(b, 4 * c, *shape)]),
        "convlstm_step": ([vol, vol * 0.5, vol * 0.1, params], {}, [state, state]),
        "convlstm_step_vjp": ([vol, vol, vol, params, vol, vol], {}, [state] * 3),
        "memory_scan": ([vol, vol, *steps.values(), params],
                        {"checkpoint_every": draw(st.integers(1, 3))},
                        [(b, t, c), state, state]),
        "memory_scan_vjp": ([vol, vol, *steps.values(), params, rng.normal(size=(b, t, c))],
                            {"checkpoint_every": draw(st.integers(1, 3))},
                            [state, state, (b, t, n), (b, t, n), (b, t), (b, t, c)]),
        "normalized_to_voxel": ([coords, shape], {}, [(b, q, n)]),
        "squash_coords_vjp": ([coords, coords], {}, [(b, q, n)]),
        "sigma_from_logit": ([sigma], {"sigma_scale": 0.5}, [(b, k)]),
    }
    args, kwargs, expected = table[which]
    args = list(args)
    mutated = False
    for _ in range(draw(st.integers(0, 2))):
        position = draw(st.integers(0, len(args) + len(kwargs) - 1))
        if position < len(args):
            target = args[position]
            if isinstance(target, list):  # params: mutate one field, or the container
                field = draw(st.integers(-1, 3))
                if field < 0:
                    kind, args[position] = _mutations(draw, None)
                else:
                    target = list(target)
                    kind, target[field] = _mutations(draw, target[field])
                    args[position] = target
            else:
                kind, args[position] = _mutations(draw, target)
        else:
            key = list(kwargs)[position - len(args)]
            kind, kwargs[key] = _mutations(draw, kwargs[key])
        mutated = mutated or kind != "keep"
    return which, args, kwargs, None if mutated else expected


def _shapes(out):
    if isinstance(out, tuple) and not hasattr(out, "shape"):
        leaves = []
        for item in out:
            if isinstance(item, tmcore.ConvParams):
                continue
            leaves.append(tuple(item.shape))
        return leaves
    return [tuple(out.shape)]


@settings(max_examples=250, deadline=5000,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_public_calls())
def test_fuzz_public_api(call):
    which, args, kwargs, expected = call
    function = getattr(tmcore, which)
    if which in ("factorized_conv", "convlstm_step", "convlstm_step_vjp", "memory_scan",
                 "memory_scan_vjp"):
        index = next(i for i, a in enumerate(args) if isinstance(a, list) and len(a) == 4
                     and all(hasattr(p, "shape") for p in a)) if any(
            isinstance(a, list) and len(a) == 4 and all(hasattr(p, "shape") for p in a)
            for a in args) else None
        if index is not None:
            args[index] = tmcore.ConvParams(*args[index])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            out = function(*args, **kwargs)
        except ALLOWED:
            assert expected is None, "a valid call raised"
            return
    if expected is not None:
        shapes = _shapes(out)
        if which == "memory_scan_vjp":
            shapes = shapes[:6]
        assert shapes == [tuple(e) for e in expected]


@settings(max_examples=60, deadline=5000)
@given(st.one_of(st.none(), st.integers(-3, 6), st.floats(allow_nan=True), st.text(max_size=3),
                 st.lists(st.one_of(st.integers(-2, 5), st.floats(0, 5), st.none()),
                          max_size=6).map(tuple)))
def test_fuzz_grid_shape(shape):
    try:
        centres = tmcore.cell_centers(shape, xp=np)
    except ALLOWED as error:
        assert "shape" in str(error)
        return
    assert len(centres) == len(shape) and [c.shape[0] for c in centres] == list(shape)


@pytest.mark.parametrize("name", ["numpy", "array_api_strict"])
def test_checkpoints_are_collected_in_place_and_fall_back_to_stack(name):
    """The scan's checkpoint store writes into one preallocated array where the namespace
    allows item assignment, and falls back to ``stack`` (with its dtype promotion) when a
    state of another dtype arrives."""
    from tmcore.scan.base import _Stacker as _CheckpointStore

    xp = pytest.importorskip(name)
    if name == "numpy":
        import array_api_compat.numpy as xp
    states = [xp.full((2, 3), float(i), dtype=xp.float32) for i in range(3)]
    store = _CheckpointStore(xp, states[0], 3)
    for s in states:
        store.append(s)
    assert store.buffer is not None  # preallocated, no list
    out = store.result()
    assert out.shape == (3, 2, 3) and out.dtype == xp.float32
    assert float(xp.sum(out[2, ...])) == 12.0
    mixed = _CheckpointStore(xp, states[0], 3)
    mixed.append(states[0])
    mixed.append(xp.ones((2, 3), dtype=xp.float64))
    assert mixed.buffer is None and mixed.result().dtype == xp.float64
