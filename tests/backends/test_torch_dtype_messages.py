"""Mixed float32 / float64 between the torch cell's input and its parameters is a named
``TypeError`` (issue 51, item 6: it was torch's bare ``RuntimeError: expected scalar
type Float but found Double``), on the fused path and on the torch ops."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import tmcore  # noqa: E402
from tmcore.types import ConvParams  # noqa: E402

C = 2


def _cell(dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = ((2, 2 * C, 3), (2, 2 * C), (4 * C, 2 * C), (4 * C,))
    return ConvParams(*(torch.randn(*s, generator=gen, dtype=dtype) for s in shapes))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("state,params", [(torch.float64, torch.float32),
                                          (torch.float32, torch.float64)])
def test_cell_params_of_another_dtype_are_named(native, state, params):
    x, h, c = (torch.randn(1, C, 3, 4, dtype=state) for _ in range(3))
    with tmcore.options(native=native), pytest.raises(
            TypeError, match=r"params\.depthwise_weight: expected the dtype of the conv input"):
        tmcore.convlstm_step(x, h, c, _cell(params))
    with tmcore.options(native=native), pytest.raises(TypeError, match=r"params\.\w+: expected"):
        tmcore.factorized_conv(x, ConvParams(*(torch.ones(*s, dtype=params) for s in
                                               ((2, C, 3), (2, C), (C, C), (C,)))))


def test_matching_dtypes_still_run():
    for dtype in (torch.float32, torch.float64):
        x, h, c = (torch.randn(1, C, 3, 4, dtype=dtype) for _ in range(3))
        h_new, c_new = tmcore.convlstm_step(x, h, c, _cell(dtype))
        assert h_new.dtype == c_new.dtype == dtype
