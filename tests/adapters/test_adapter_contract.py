"""The adapter contract, written once and run for both frameworks (PyTorch and JAX).

Each framework is a small shim (:class:`TorchShim`, :class:`JaxShim`) that builds one
layer from the same configuration and parameters and runs it on NumPy inputs; the
tests then state what every adapter must do: the same errors for the same bad
configuration (both come from :func:`tmcore.layer.layer_config`), one read per chunk
broadcast to its tokens, a ragged last chunk trimmed, streaming in whole chunks equal
to one call, a bool reset mask (a float one refused), an empty batch, the multi-layer
modes (causal is causal, threaded is not), and equal results across frameworks.
"""

from __future__ import annotations

import numpy as np
import pytest

D, C, SHAPE, L = 6, 2, (3, 2, 3), 2


class TorchShim:
    name = "torch"

    def __init__(self):
        self.torch = pytest.importorskip("torch", reason="torch is not installed")
        self.tmt = pytest.importorskip("tmcore.adapters.torch")

    def build(self, **config):
        self.torch.manual_seed(0)
        memory = self.tmt.TensorMemory(**{"embed_dim": D, "memory_channels": C,
                                          "memory_shape": SHAPE, "chunk_size": L, **config})
        return memory.double()

    def state_dict(self, model):
        return {k: v.detach().numpy() for k, v in model.state_dict().items()}

    def from_state_dict(self, sd, **config):
        model = self.build(**config)
        copies = {k: self.torch.tensor(np.array(v)) for k, v in sd.items()}  # writable
        model.load_state_dict(copies, strict=True)
        return model

    def run(self, model, x, state=None, reset=None):
        t = self.torch
        state = None if state is None else tuple(t.as_tensor(s) for s in state)
        with t.no_grad():
            out, (h, c) = model(t.as_tensor(x), state,  # the pair-state (non-streaming) call
                                reset=None if reset is None else t.as_tensor(reset),
                                stream=False)
        return out.numpy(), (h.numpy(), c.numpy())

    def call(self, model, x, state=None, **kwargs):
        """The layer's own call (streaming by default), masks as tensors."""
        t = self.torch
        kwargs = {k: t.as_tensor(v) if isinstance(v, np.ndarray) else v
                  for k, v in kwargs.items()}
        with t.no_grad():
            return model(t.as_tensor(x), state, **kwargs)

    def stack(self, x, mode):
        """Two gated memory residuals after identity blocks, in ``mode``."""
        t, nn = self.torch, self.torch.nn
        t.manual_seed(1)
        blocks = nn.ModuleList([nn.Identity(), nn.Identity()])
        handle = self.tmt.attach_memory(blocks, mode, embed_dim=D, memory_channels=C,
                                        memory_shape=SHAPE, chunk_size=L, dtype=t.float64)
        with t.no_grad():
            y = t.as_tensor(x)
            for block in blocks:
                y = block(y)
        handle.remove()
        return y.numpy()


class JaxShim:
    name = "jax"

    def __init__(self):
        self.jax = pytest.importorskip("jax", reason="jax is not installed")
        pytest.importorskip("flax", reason="flax is not installed")
        self.tmj = pytest.importorskip("tmcore.adapters.jax")
        self.jnp = self.jax.numpy

    def build(self, **config):
        config = {"embed_dim": D, "memory_channels": C, "memory_shape": SHAPE,
                  "chunk_size": L, **config}
        return self.tmj.init(self.jax.random.key(0), dtype=self.jnp.float64, **config)

    def state_dict(self, model):
        return self.tmj.state_dict_from_params(model)

    def from_state_dict(self, sd, **config):
        return self.tmj.params_from_state_dict(sd, config=self.build(**config)["config"])

    def run(self, model, x, state=None, reset=None):
        jnp = self.jnp
        out, (h, c) = self.tmj.apply(model, jnp.asarray(x),
                                     None if state is None else tuple(map(jnp.asarray, state)),
                                     reset=None if reset is None else jnp.asarray(reset),
                                     stream=False)
        return np.asarray(out), (np.asarray(h), np.asarray(c))

    def call(self, model, x, state=None, **kwargs):
        """The layer's own call (streaming by default), masks as arrays."""
        kwargs = {k: self.jnp.asarray(v) if isinstance(v, np.ndarray) else v
                  for k, v in kwargs.items()}
        return self.tmj.apply(model, self.jnp.asarray(x), state, **kwargs)

    def stack(self, x, mode):
        keys = self.jax.random.split(self.jax.random.key(1), 2)
        layers = [self.tmj.residual_init(k, D, C, SHAPE, L, dtype=self.jnp.float64)
                  for k in keys]
        out, _ = self.tmj.stack_apply(layers, self.jnp.asarray(x), mode=mode)
        return np.asarray(out)


SHIMS = {"torch": TorchShim, "jax": JaxShim}


@pytest.fixture(autouse=True, scope="module")
def _x64():
    try:
        import jax
    except ImportError:
        yield
        return
    with jax.enable_x64(True):
        yield


@pytest.fixture(params=list(SHIMS))
def fw(request):
    return SHIMS[request.param]()


def _x(batch=2, tokens=9, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, tokens, D))


BAD_CONFIG = [
    ({"embed_dim": 2.0}, TypeError, "embed_dim"),
    ({"embed_dim": True}, TypeError, "embed_dim"),
    ({"memory_channels": 0}, ValueError, "memory_channels"),
    ({"chunk_size": 1.5}, TypeError, "chunk_size"),
    ({"memory_shape": (4.7, 5, 3)}, TypeError, "memory_shape"),
    ({"memory_shape": (2, 0)}, ValueError, "memory_shape"),
    ({"sigma_scale": 0.0}, ValueError, "sigma_scale"),
    ({"eps": -1.0}, ValueError, "eps"),
    ({"radius": 0.0}, ValueError, "radius"),
]


@pytest.mark.parametrize("config, error, name", BAD_CONFIG,
                         ids=[f"{next(iter(c))}={next(iter(c.values()))}" for c, *_ in BAD_CONFIG])
def test_same_errors_for_the_same_bad_configuration(fw, config, error, name):
    with pytest.raises(error, match=name):
        fw.run(fw.build(**config), _x())


def test_numpy_integers_are_sizes(fw):
    model = fw.build(embed_dim=np.int64(D), memory_shape=(np.int64(3), 2, np.int32(3)),
                     chunk_size=np.int64(L))
    out, (h, _) = fw.run(model, _x())
    assert out.shape == (2, 9, D) and h.shape == (2, C, *SHAPE)


def test_one_read_per_chunk_and_a_trimmed_ragged_chunk(fw):
    out, (h, c) = fw.run(fw.build(), _x(tokens=9))
    assert out.shape == (2, 9, D) and h.shape == c.shape == (2, C, *SHAPE)
    for start in range(0, 9, L):
        for k in range(start + 1, min(start + L, 9)):
            np.testing.assert_array_equal(out[:, k], out[:, start])
    assert not np.allclose(out[:, 0], out[:, L])
    np.testing.assert_array_equal(np.abs(h) <= 1.0, True)


def test_streaming_in_whole_chunks_equals_one_call(fw):
    model = fw.build()
    x = _x(tokens=12)
    whole, whole_state = fw.run(model, x)
    state, pieces = None, []
    for start, stop in ((0, 4), (4, 6), (6, 12)):
        piece, state = fw.run(model, x[:, start:stop], state)
        pieces.append(piece)
    np.testing.assert_allclose(np.concatenate(pieces, 1), whole, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(state[0], whole_state[0], rtol=1e-13, atol=1e-13)


def test_reset_mask(fw):
    model = fw.build()
    x = _x(tokens=6)
    _, state = fw.run(model, x)
    out, _ = fw.run(model, x, state, reset=np.array([True, False]))
    fresh, _ = fw.run(model, x)
    carried, _ = fw.run(model, x, state)
    np.testing.assert_array_equal(out[0], fresh[0])
    np.testing.assert_array_equal(out[1], carried[1])
    with pytest.raises(TypeError, match="reset: expected a bool mask"):
        fw.run(model, x, state, reset=np.array([1.0, 0.0]))


def test_empty_batch(fw):
    out, (h, _) = fw.run(fw.build(), _x(batch=0))
    assert out.shape == (0, 9, D) and h.shape == (0, C, *SHAPE)


def test_stream_only_arguments_are_refused_alike_without_stream(fw):
    # one check serves both adapters: what only a streamed call takes, and the flag's type
    model, x = fw.build(), _x(tokens=6)
    _, streamed = fw.call(model, x[:, :3])
    starts = np.zeros((2, 6), bool)
    starts[:, 0] = True
    for kwargs, message in (({"doc_starts": starts}, "doc_starts: packed documents"),
                            ({"valid": np.ones((2, 6), bool)}, "valid: packed documents"),
                            ({}, "state: a StreamState continues a stream")):
        state = streamed if not kwargs else None
        with pytest.raises(ValueError, match=message):
            fw.call(model, x, state, stream=False, **kwargs)
    with pytest.raises(TypeError, match="stream: expected True or False, got 1"):
        fw.call(model, x, stream=1)


def test_wrong_state_is_refused_naming_it(fw):
    with pytest.raises(ValueError, match=r"state.h: expected shape \(B, C, \*S\)"):
        fw.run(fw.build(), _x(), (np.zeros((2, C, 3, 3, 3)), np.zeros((2, C, 3, 3, 3))))


def test_causal_mode_is_causal_and_threaded_is_not(fw):
    x = _x(tokens=12, seed=5)
    p = 5  # inside chunk 2 (positions 4, 5)
    x2 = x.copy()
    x2[:, p + 1:] = _x(tokens=12 - p - 1, seed=6)
    a, b = fw.stack(x, "causal"), fw.stack(x2, "causal")
    np.testing.assert_array_equal(a[:, :p + 1], b[:, :p + 1])
    assert not np.allclose(a[:, p + 1:], b[:, p + 1:])
    a, b = fw.stack(x, "threaded"), fw.stack(x2, "threaded")
    assert np.abs(a[:, 0] - b[:, 0]).max() > 0  # the reference leaks the future


def test_frameworks_agree_on_the_same_parameters():
    shims = []
    for cls in SHIMS.values():
        try:
            shims.append(cls())
        except pytest.skip.Exception:
            pass
    if len(shims) < 2:
        pytest.skip("needs both torch and jax")
    torch_shim, jax_shim = shims
    source = torch_shim.build(sigma_scale=0.7)
    sd = torch_shim.state_dict(source)
    x = _x(tokens=7, seed=3)
    a, (ha, _) = torch_shim.run(source, x)
    b, (hb, _) = jax_shim.run(jax_shim.from_state_dict(sd, sigma_scale=0.7), x)
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ha, hb, rtol=1e-10, atol=1e-12)
    # and back: the JAX parameters load into torch
    back = torch_shim.from_state_dict(jax_shim.state_dict(jax_shim.from_state_dict(sd)),
                                      sigma_scale=0.7)
    np.testing.assert_array_equal(torch_shim.run(back, x)[0], a)


# --------------------------------------------------------------------------- one vocabulary

@pytest.mark.parametrize("module", ["torch", "jax"])
def test_both_adapters_name_the_gated_residual_one_way(module):
    # one noun in both adapters: MemoryResidual (0.1's GatedMemoryResidual is gone)
    pytest.importorskip(module, reason=f"{module} is not installed")
    adapter = pytest.importorskip(f"tmcore.adapters.{module}")
    assert "MemoryResidual" in adapter.__all__
    assert not hasattr(adapter, "GatedMemoryResidual")
