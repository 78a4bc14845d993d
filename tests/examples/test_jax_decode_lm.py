"""examples/jax_lm: the NNX LM's scanned greedy decode, its jitted step, an eager loop and
teacher forcing choose the same tokens (a smoke run of ``python -m examples.jax_lm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("flax", reason="flax is not installed")


def test_jax_lm_decoders_agree_with_teacher_forcing():
    from examples.jax_lm.__main__ import main

    result = main(["--steps", "3", "--prompt", "abcde"])     # 5 bytes, chunk 4: ragged
    assert result["agree"], result
    assert len(result["scan"]) == 3
