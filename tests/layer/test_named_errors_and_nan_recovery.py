"""Every unclear error of the second hardening round gets a named error, validate mode's
scope is what the docs say, and a stream poisoned by one NaN token recovers at a reset or
a document start."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore  # noqa: E402
from tmcore.adapters import torch as tt  # noqa: E402

D, C, GRID, L = 8, 2, (3, 3), 4


def _memory() -> tt.TensorMemory:
    torch.manual_seed(0)
    return tt.TensorMemory(D, C, GRID, L)


# --------------------------------------------------------------------------- named errors


def test_a_numpy_state_pair_names_state_h():
    memory = _memory()
    x = torch.randn(2, 8, D)
    h = np.zeros((2, C, *GRID), np.float32)
    with pytest.raises(TypeError, match=r"^state.h: expected a torch.Tensor, got numpy.ndarray"):
        memory(x, (h, h.copy()))
    with pytest.raises(TypeError, match=r"^state.c: expected a torch.Tensor"):
        memory(x, (torch.zeros(2, C, *GRID), h), stream=False)


def test_a_numpy_field_of_a_stream_state_is_named():
    memory = _memory()
    x = torch.randn(2, 6, D)
    with torch.no_grad():
        _, state = memory(x, stream=True)
    for field in ("pending", "read", "h"):
        bad = state._replace(**{field: getattr(state, field).numpy()})
        with pytest.raises(TypeError, match=rf"^state.{field}: expected a torch.Tensor"):
            memory(x, bad)
    with pytest.raises(TypeError, match=r"^state.count: expected a tuple of ints or an integer "
                                        r"torch.Tensor"):
        memory(x, state._replace(count=np.asarray(state.count)))


def test_numpy_bool_masks_to_torch_are_named():
    memory = _memory()
    x = torch.randn(2, 6, D)
    with pytest.raises(TypeError, match=r"^reset: expected a bool torch.Tensor of shape \(B,\), "
                                        r"got numpy.ndarray"):
        memory(x, reset=np.array([True, False]))
    with pytest.raises(TypeError, match=r"^doc_starts: expected a bool array of shape \(B, N\) "
                                        r"= \(2, 6\) of the same kind .* got a numpy.ndarray"):
        memory(x, doc_starts=np.zeros((2, 6), bool))


def test_jax_still_takes_numpy_masks():
    tj = pytest.importorskip("tmcore.adapters.jax", reason="jax / flax is not installed")
    import jax
    import jax.numpy as jnp

    params = tj.init(jax.random.PRNGKey(0), D, C, GRID, L)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, D)).astype(np.float32))
    starts = np.zeros((2, 6), bool)
    out, _ = tj.apply(params, x, doc_starts=starts)
    assert out.shape == (2, 6, D)


# --------------------------------------------------------------------------- validate mode


def test_validate_mode_checks_the_inputs_and_the_cell_weights_not_the_linear_weights():
    """The documented scope: arrays handed to tmcore's functions (the state, the cell
    weights the scan receives, the heads' outputs computed from the tokens) are checked;
    ``out_proj`` is not. A NaN token is reported as the head output it poisons."""
    x = torch.randn(2, 8, D)
    memory = _memory()
    with torch.no_grad():
        memory.cell.pointwise_weight[0, 0] = math.nan
    with tmcore.options(validate=True), pytest.raises(
            ValueError, match=r"params.pointwise_weight: expected finite values"):
        memory(x)
    memory = _memory()
    with torch.no_grad():
        memory.out_proj.weight[0, 0] = math.nan
    with tmcore.options(validate=True):
        out, _ = memory(x)  # not an input of any tmcore function: not checked
    assert torch.isnan(out).any()
    with tmcore.options(validate=True), pytest.raises(
            ValueError, match="read_coords: expected finite values"):
        _memory()(torch.full((2, 8, D), math.nan))
    doc = tmcore.options.__doc__ + tmcore.Options.__doc__
    assert "INPUTS" in doc and "out_proj" in doc


# --------------------------------------------------------------------------- NaN in a stream


def _poisoned(memory, x):
    bad = x.clone()
    bad[:, 5] = math.nan  # one NaN token in chunk 1
    return bad


def test_one_nan_token_poisons_the_stream_until_a_reset():
    memory = _memory()
    torch.manual_seed(1)
    x = torch.randn(2, 12, D)
    y = torch.randn(2, 9, D)
    with torch.no_grad():
        out, state = memory(_poisoned(memory, x), stream=True)
        assert torch.isfinite(out[:, :4]).all()  # chunk 0 read before the NaN arrived
        assert torch.isnan(out[:, 8:]).all()  # every later chunk reads the poisoned state
        assert torch.isnan(state.h).all() and torch.isnan(state.c).all()
        still, _ = memory(y, state)
        assert torch.isnan(still).all()  # carried on: poisoned
        cleared, fresh_state = memory(y, state, reset=torch.tensor([True, False]))
        alone, _ = memory(y[:1], stream=True)
        torch.testing.assert_close(cleared[:1], alone, rtol=0, atol=0)  # row 0: as new
        assert torch.isnan(cleared[1]).all()  # row 1 kept its poisoned state
        assert torch.isfinite(fresh_state.h[0]).all()


def test_a_document_start_clears_a_poisoned_stream():
    memory = _memory()
    torch.manual_seed(2)
    x = torch.randn(1, 16, D)
    starts = torch.zeros(1, 16, dtype=torch.bool)
    starts[0, 10] = True  # a new document after the NaN (token 5)
    with torch.no_grad():
        out, _ = memory(_poisoned(memory, x), doc_starts=starts)
        alone, _ = memory(x[:, 10:], stream=True)
    assert torch.isnan(out[:, 8:10]).all()
    torch.testing.assert_close(out[:, 10:], alone, rtol=0, atol=0)


def test_a_poisoned_plain_state_recovers_after_a_reset():
    memory = _memory()
    x = torch.randn(2, 8, D)
    with torch.no_grad():
        _, (h, c) = memory(_poisoned(memory, x), stream=False)
        assert torch.isnan(h).all()
        out, _ = memory(x, (h, c), reset=torch.tensor([True, True]), stream=False)
        fresh, _ = memory(x, stream=False)
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)


def test_the_docs_say_what_a_nan_poisons_and_what_clears_it():
    root = Path(__file__).parents[2]
    guide = (root / "docs" / "guides" / "errors-and-cache.md").read_text()
    for text in (guide,):
        section = text[text.index("Non-finite input"):][:1500].lower()
        for needle in ("reset", "document start", "h, c", "validate"):
            assert needle in section, needle
