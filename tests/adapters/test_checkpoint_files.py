"""Hostile checkpoints are refused (or converted) cheaply, a StreamState saves and loads with
``weights_only=True``, and the custom op's backward validates its residuals.

The stride-0 checkpoints claim gigabytes in a few kilobytes; they are handled in a
subprocess under an address-space limit (what it has mapped + 1 GiB), which also
reports the rise of its resident memory.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from tmcore.adapters import torch as tt  # noqa: E402

_PRELUDE = """
import io, json, os, resource, sys
def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
def limit():
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
results = {}
def case(name, fn):
    try:
        results[name] = ["ok", str(fn())]
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results[name] = [type(exc).__name__, str(exc)]
import torch
D, C, L = 40000, 4, 1  # write_proj.weight (d, L*d): 1.6e9 floats = 6.4 GB, stored as 1
def hostile():
    z = torch.zeros(())
    sd = {"write_proj.weight": z.expand(D, L * D), "write_proj.bias": z.expand(D),
          "writer.content_net.weight": z.expand(C, D), "writer.content_net.bias": z.expand(C),
          "writer.sigma_net.weight": z.expand(1, D), "writer.sigma_net.bias": z.expand(1),
          "coord_net.weight": z.expand(3, D), "coord_net.bias": z.expand(3),
          "out_proj.weight": z.expand(D, C), "out_proj.bias": z.expand(D),
          "gate_conv.pointwise.weight": z.expand(4 * C, 2 * C, 1, 1, 1),
          "gate_conv.pointwise.bias": z.expand(4 * C),
          "grid_cache": z.expand(1, 3, 4, 4, 4)}
    for axis, name in enumerate(("conv_d", "conv_h", "conv_w")):
        kernel = [1, 1, 1]
        kernel[axis] = 3
        sd[f"gate_conv.{name}.weight"] = z.expand(2 * C, 1, *kernel)
        sd[f"gate_conv.{name}.bias"] = z.expand(2 * C)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    return buffer.getvalue()
"""


def _run(body: str) -> dict:
    code = _PRELUDE + textwrap.dedent(body) + (
        "\nresults['_rss_rise_mib'] = ['ok', str(rss_mib() - start)]\n"
        "print('RESULTS' + json.dumps(results))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMCORE_NATIVE="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc: tested on Linux")
def test_a_stride0_checkpoint_converts_without_allocating_or_is_refused_by_the_target():
    results = _run("""
        from tmcore.adapters import torch as tt
        blob = hostile()
        small = tt.TensorMemory(8, 4, (4, 4, 4), 4)
        meta = tt.TensorMemory(D, C, (4, 4, 4), L, device="meta")
        limit()
        start = rss_mib()
        sd = torch.load(io.BytesIO(blob), weights_only=True)
        case("size", lambda: len(blob))
        case("refused", lambda: tt.convert_reference_state_dict(sd, target=small))
        out = tt.convert_reference_state_dict(sd)
        case("views", lambda: out["write_proj.weight"].stride())
        case("shapes", lambda: all(tuple(out[k].shape) == tuple(v.shape)
                                   for k, v in meta.state_dict().items()
                                   if k != "_extra_state") and
                               set(out) == set(meta.state_dict()))
        case("loads", lambda: meta.load_state_dict(out, strict=True) and "loaded")
        case("meta_target", lambda: len(tt.convert_reference_state_dict(sd, target=meta)))
    """)
    assert int(results["size"][1]) < 4096  # a few kilobytes claim 6.4 GB
    kind, message = results["refused"]
    assert kind == "ValueError" and message.startswith("write_proj.weight: expected shape"), \
        results["refused"]
    assert "(the target's)" in message
    assert results["views"][1] == "(0, 0)"  # still the stride-0 view: nothing materialized
    assert results["shapes"] == ["ok", "True"]
    assert results["loads"][0] == "ok", results["loads"]
    assert results["meta_target"][0] == "ok", results["meta_target"]
    assert float(results["_rss_rise_mib"][1]) < 100


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc: tested on Linux")
@pytest.mark.skipif(importlib.util.find_spec("jax") is None
                    or importlib.util.find_spec("flax") is None,
                    reason="jax / flax is not installed")
def test_jax_params_from_a_stride0_state_dict_are_refused_before_materializing():
    results = _run("""
        import numpy as np, jax
        from tmcore.adapters import jax as tj, torch as tt
        sd = tt.convert_reference_state_dict(torch.load(io.BytesIO(hostile()),
                                                        weights_only=True))
        sd = {k: np.asarray(v) for k, v in sd.items()}
        small = tj.init(jax.random.PRNGKey(0), 8, 4, (4, 4, 4), 4)
        limit()
        start = rss_mib()
        case("broadcast", lambda: tj.params_from_state_dict(sd))
        case("expected", lambda: tj.params_from_state_dict(sd, expected=small))
        bad = dict(sd, **{"content_net.weight": np.zeros((5, D), np.float32)})
        case("misshapen", lambda: tj.params_from_state_dict(bad))
    """)
    kind, message = results["broadcast"]
    assert kind == "ValueError" and "sd['write_proj.weight']: a broadcast (stride-0)" in message
    kind, message = results["expected"]
    assert kind == "ValueError" and "does not fit expected" in message
    assert "write_proj.weight: expected shape (8, 32)" in message
    kind, message = results["misshapen"]
    assert kind == "ValueError" and message.startswith("sd['content_net.weight']: expected "
                                                       "shape (C, d)"), results["misshapen"]
    assert float(results["_rss_rise_mib"][1]) < 100


def _reference_sd(d: int = 8, c: int = 2, length: int = 2) -> dict:
    gen = torch.Generator().manual_seed(0)
    sd = {"write_proj.weight": (d, length * d), "write_proj.bias": (d,),
          "writer.content_net.weight": (c, d), "writer.content_net.bias": (c,),
          "writer.sigma_net.weight": (1, d), "writer.sigma_net.bias": (1,),
          "coord_net.weight": (3, d), "coord_net.bias": (3,), "out_proj.weight": (d, c),
          "out_proj.bias": (d,), "gate_conv.pointwise.weight": (4 * c, 2 * c, 1, 1, 1),
          "gate_conv.pointwise.bias": (4 * c,), "grid_cache": (1, 3, 4, 4, 4)}
    for axis, name in enumerate(("conv_d", "conv_h", "conv_w")):
        kernel = [1, 1, 1]
        kernel[axis] = 3
        sd[f"gate_conv.{name}.weight"] = (2 * c, 1, *kernel)
        sd[f"gate_conv.{name}.bias"] = (2 * c,)
    return {k: torch.randn(shape, generator=gen) for k, shape in sd.items()}


def test_convert_checks_against_the_target_and_shares_memory():
    sd = _reference_sd()
    model = tt.TensorMemory(8, 2, (4, 4, 4), 2)
    out = tt.convert_reference_state_dict(sd, target=model)
    model.load_state_dict(out, strict=True)
    assert out["write_proj.weight"].data_ptr() == sd["write_proj.weight"].data_ptr()
    assert out["cell.pointwise_weight"].data_ptr() == sd["gate_conv.pointwise.weight"].data_ptr()
    with pytest.raises(ValueError, match=r"grid_cache: expected shape \(1, 3, D, H, W\) = "
                                         r"\(1, 3, 5, 5, 5\)"):
        tt.convert_reference_state_dict(sd, target=tt.TensorMemory(8, 2, (5, 5, 5), 2))
    with pytest.raises(TypeError, match=r"write_proj.weight: expected dtype torch.float64 "
                                        r"\(the target's write_proj.weight\)"):
        tt.convert_reference_state_dict(sd, target=tt.TensorMemory(8, 2, (4, 4, 4), 2,
                                                                   dtype=torch.float64))
    with pytest.raises(ValueError, match=r"gate_conv.conv_h.weight: expected shape "
                                         r"\(2C, 1, 1, 3, 1\)"):
        tt.convert_reference_state_dict({**sd, "gate_conv.conv_h.weight": torch.zeros(4, 1, 3,
                                                                                      1, 1)})
    with pytest.raises(TypeError, match="target: expected a TensorMemory or its state dict"):
        tt.convert_reference_state_dict(sd, target=3)


@pytest.mark.parametrize("sd, match", [
    ([("write_proj.weight", torch.zeros(1))], "sd: expected a mapping of str keys"),
    ({0: torch.zeros(1)}, r"sd: expected str keys \(a state dict\), got the key 0 \(int\)"),
    ("write_proj.weight", "sd: expected a mapping"),
])
def test_convert_refuses_what_is_not_a_state_dict(sd, match):
    with pytest.raises(TypeError, match=match):
        tt.convert_reference_state_dict(sd)


def test_params_from_state_dict_refuses_what_is_not_a_state_dict():
    tj = pytest.importorskip("tmcore.adapters.jax", reason="jax / flax is not installed")
    with pytest.raises(TypeError, match="sd: expected a mapping"):
        tj.params_from_state_dict([1, 2])
    with pytest.raises(TypeError, match="sd: expected str keys"):
        tj.params_from_state_dict({1: np.zeros(1)})
    model = tt.TensorMemory(8, 2, (4, 4, 4), 2)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = tj.params_from_state_dict(sd, expected=tj.init(__import__("jax").random.PRNGKey(0),
                                                            8, 2, (4, 4, 4), 2))
    assert params["write_proj"]["weight"].shape == (8, 16)
    with pytest.raises(TypeError, match=r"sd\['out_proj.bias'\]: expected a floating array"):
        tj.params_from_state_dict({**sd, "out_proj.bias": np.zeros(8, np.int32)})


# --------------------------------------------------------------------------- StreamState


def _stream():
    torch.manual_seed(0)
    memory = tt.TensorMemory(8, 2, (3, 3), 4)
    x = torch.randn(2, 7, 8)  # 7 tokens: an unfinished chunk of 3
    out, state = memory(x, stream=True)
    assert isinstance(state, tt.StreamState)
    return memory, state


def _with_count(state, kind):
    count = state.count
    values = [int(k) for k in (count.tolist() if isinstance(count, torch.Tensor) else count)]
    return state._replace(count=tuple(values) if kind == "tuple"
                          else torch.tensor(values, dtype=torch.int64))


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        else:
            assert tuple(x) == tuple(y)


@pytest.mark.parametrize("kind", ["tuple", "tensor"])
def test_a_stream_state_round_trips_through_weights_only_loads(kind):
    memory, state = _stream()
    state = _with_count(state, kind)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert isinstance(loaded, tt.StreamState)
    _same(loaded, state)
    buffer = io.BytesIO()
    torch.save(tt.state_to_dict(state), buffer)
    buffer.seek(0)
    again = tt.state_from_dict(torch.load(buffer, weights_only=True))
    assert type(again.count) is type(state.count)
    _same(again, state)
    # and the stream continues from the loaded state exactly as from the original
    torch.manual_seed(1)
    y = torch.randn(2, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(memory(y, _with_count(_stream()[1], kind))[0],
                                   memory(y, again)[0], rtol=0, atol=0)


def test_the_dict_form_loads_in_a_process_that_registered_nothing(tmp_path):
    _, state = _stream()
    path = tmp_path / "state.pt"
    torch.save(tt.state_to_dict(state), path)
    code = (f"import torch; d = torch.load({str(path)!r}, weights_only=True); "
            f"print(sorted(d), d['count_kind'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert "['c', 'count', 'count_kind', 'h', 'pending', 'read']" in out.stdout
    pair = tt.state_from_dict(tt.state_to_dict((state.h, state.c)))
    assert isinstance(pair, tuple) and pair[0] is not None
    with pytest.raises(ValueError, match="data: expected the keys"):
        tt.state_from_dict({"h": state.h})
    with pytest.raises(TypeError, match="state: expected a StreamState or a pair"):
        tt.state_to_dict("state")


# --------------------------------------------------------------------------- one config


def test_a_memory_and_its_config_round_trip_and_run_in_jax(tmp_path):
    """memory_to_dict stores LayerConfig.to_dict next to the weights (weights_only loads
    it); memory_from_dict rebuilds the module bit for bit, and the same config dict, read
    by LayerConfig.from_dict, makes the JAX parameters of the same layer."""
    from tmcore.layer import LayerConfig

    torch.manual_seed(0)
    memory = tt.TensorMemory(8, 3, (3, 2, 4), 3, sigma_scale=0.6, radius=2.5, eps=1e-5,
                             forget_bias=1.0, update="local", window=2, dynamics="warp",
                             dtype=torch.float64)
    with torch.no_grad():  # a shift head that moves the state (zero at init)
        memory.warp_net.weight.normal_(0.0, 0.3)
    path = tmp_path / "memory.pt"
    torch.save(tt.memory_to_dict(memory), path)
    data = torch.load(path, weights_only=True)
    assert data["config"] == memory.config.to_dict()
    again = tt.memory_from_dict(data, dtype=torch.float64)
    assert again.config == memory.config
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = memory(x)[0]
        torch.testing.assert_close(again(x)[0], expected, rtol=0, atol=0)
    tmj = pytest.importorskip("tmcore.adapters.jax")
    jax = pytest.importorskip("jax")
    with jax.enable_x64(True):
        sd = {k: v.numpy() for k, v in data["state_dict"].items()}
        params = tmj.params_from_state_dict(sd, config=LayerConfig.from_dict(data["config"]))
        out, _ = tmj.apply(params, jax.numpy.asarray(x.numpy()))
        np.testing.assert_allclose(np.asarray(out), expected.numpy(), rtol=1e-10, atol=1e-12)


def test_a_saved_config_is_checked_before_anything_is_built():
    memory = tt.TensorMemory(8, 3, (3, 2, 4), 3)
    data = tt.memory_to_dict(memory)
    with pytest.raises(ValueError, match=r"data\['config'\]: missing keys \['flow'\]"):
        tt.memory_from_dict({**data, "config": {k: v for k, v in data["config"].items()
                                                if k != "flow"}})
    with pytest.raises(TypeError, match=r"data\['config'\].chunk_size: expected an int"):
        tt.memory_from_dict({**data, "config": {**data["config"], "chunk_size": 3.0}})
    with pytest.raises(MemoryError, match="embed_dim"):  # gigabytes asked, none allocated
        tt.memory_from_dict({**data, "config": {**data["config"], "chunk_size": 10**9}})
    with pytest.raises(TypeError, match="data: expected the dict memory_to_dict made"):
        tt.memory_from_dict(data["state_dict"])
    with pytest.raises(RuntimeError, match="memory_shape"):  # the stored grid, checked
        tt.memory_from_dict({**data, "config": {**data["config"], "memory_shape": [4, 2, 3]}})


# --------------------------------------------------------------------------- residuals


def _scan_args(T=5, k=2):
    gen = torch.Generator().manual_seed(0)
    b, c, s = 2, 2, (3, 3)
    h0 = torch.randn(b, c, *s, generator=gen, dtype=torch.float64)
    primals = (h0, torch.randn_like(h0), torch.rand(b, T, 2, generator=gen,
                                                    dtype=torch.float64) * 2 - 1,
               torch.rand(b, T, 2, generator=gen, dtype=torch.float64) * 2 - 1,
               torch.rand(b, T, generator=gen, dtype=torch.float64) + 0.2,
               torch.randn(b, T, c, generator=gen, dtype=torch.float64),
               torch.randn(2, 2 * c, 3, generator=gen, dtype=torch.float64),
               torch.zeros(2, 2 * c, dtype=torch.float64),
               torch.randn(4 * c, 2 * c, generator=gen, dtype=torch.float64) * 0.3,
               torch.zeros(4 * c, dtype=torch.float64))
    reads, h, c_, hc, cc = torch.ops.tmcore.memory_scan(*primals, 1e-6, None, k)
    cot = (torch.ones_like(reads), torch.ones_like(h), torch.ones_like(c_))
    return primals, (hc, cc), cot, k


def _backward(primals, residuals, cot, k):
    return torch.ops.tmcore.memory_scan_backward(*primals, *residuals, *cot, 1e-6, None, k)


def test_the_scan_backward_accepts_the_forwards_residuals():
    primals, residuals, cot, k = _scan_args()
    grads = _backward(primals, residuals, cot, k)
    assert len(grads) == len(primals) and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("damage, error, match", [
    ("extra", ValueError, r"h_checkpoints: expected shape \(ceil\(T / k\), B, C, \*S\) = "
                          r"\(3, 2, 2, 3, 3\) \(T = 5 .* k = checkpoint_every = 2"),
    ("missing", ValueError, r"h_checkpoints: expected shape .* got \(2, 2, 2, 3, 3\)"),
    ("transposed", ValueError, r"h_checkpoints: expected the contiguous tensor the forward "
                               r"returned, got strides"),
    ("expanded", ValueError, r"c_checkpoints: expected the contiguous tensor"),
    ("integer", TypeError, r"h_checkpoints: expected a floating dtype"),
    ("malformed", ValueError, r"c_checkpoints: expected shape .* got \(3, 2, 2, 9\)"),
])
def test_the_scan_backward_refuses_malformed_residuals(damage, error, match):
    primals, (hc, cc), cot, k = _scan_args()
    if damage == "extra":
        hc = torch.cat([hc, hc[:1]])
    elif damage == "missing":
        hc = hc[:2].contiguous()
    elif damage == "transposed":
        hc = hc.transpose(-1, -2)  # same shape (3 x 3 grid), other values
    elif damage == "expanded":
        cc = cc[:1].expand_as(cc)
    elif damage == "integer":
        hc = hc.to(torch.int64)
    else:
        cc = cc.reshape(3, 2, 2, 9)
    with pytest.raises(error, match=match):
        _backward(primals, (hc, cc), cot, k)
