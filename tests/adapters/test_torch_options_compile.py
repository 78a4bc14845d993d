"""``torch.compile`` and double backward through the torch layer's options.

Contract (tmcore.adapters.torch, ``_torch_ops.option_scan``): a ``TensorMemory`` with
``update="local"`` / ``dynamics="warp"`` / ``flow=True`` scans with a custom op made by
the adapter's one op factory (``tmcore::local_scan``, ``warp_scan``, ``warp_flow_scan``;
fake shapes, registered autograd, a backward op); eager calls run its
``autograd.Function`` twin, while ``torch.compile`` traces the op itself as one opaque
node, so ``torch.compile(module)`` works with and without ``fullgraph=True``, forward and
backward, with the eager values (float64, <= 1e-12; the scan itself bit for bit).
Double backward (``create_graph=True``) is not supported: it raises a ``RuntimeError``
instead of returning a silently first-order second derivative.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from tmcore.adapters.torch import MemoryResidual, TensorMemory  # noqa: E402
from tmcore.adapters.torch import bridge as _torch_ops  # noqa: E402
from tmcore.adapters.torch.bridge import _XP  # noqa: E402
from tmcore.layer.layer import chunk  # noqa: E402
from tmcore.scan.options import scan_options  # noqa: E402

D, C, S, L = 5, 2, (4, 3), 2
OPTIONS = {
    "local": {"update": "local", "window": 2},
    "warp": {"dynamics": "warp"},
    "local+warp+flow": {"update": "local", "window": 2, "dynamics": "warp", "flow": True},
}
ALL = OPTIONS["local+warp+flow"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles from scratch (no recompile limit across tests)
    yield
    torch._dynamo.reset()


def _memory(options, seed=0):
    """A float64 memory whose warp moves the state (non-zero shift head and flow map)."""
    torch.manual_seed(seed)
    memory = TensorMemory(D, C, S, L, **options).double()
    with torch.no_grad():
        if "dynamics" in options:
            memory.warp_net.weight.normal_(0.0, 0.3)
        if options.get("flow"):
            memory.warp_flow.pointwise_weight.normal_(0.0, 0.2)
    return memory


def _run(module, parameters, x, stream):
    out, state = module(x, stream=stream)
    loss = (out ** 2).sum() + (state[0] * state[1]).sum()
    grads = torch.autograd.grad(loss, [x, *parameters], allow_unused=True,
                                materialize_grads=True)
    return out, state[0], state[1], grads


def _assert_equal(got, want, tol=1e-12):
    got, want = list(got), list(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if isinstance(a, (tuple, list)):
            _assert_equal(a, b, tol)
        else:
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0.0, atol=tol)


# --------------------------------------------------------------------------- the op


@pytest.mark.parametrize("name", ["local", "local+warp+flow"])
def test_dynamic_scan_op_equals_the_function_bit_for_bit(name):
    """The custom op (what compile traces) computes the Function's values and gradients."""
    memory = _memory(OPTIONS[name])
    x = torch.randn(2, 6, D, dtype=torch.float64)
    h0 = torch.randn(2, C, *S, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, C, *S, dtype=torch.float64, requires_grad=True)
    flow = memory.warp_flow.params() if memory.config.flow else None
    results = []
    for compiling in (False, True):  # the Function twin, then the op itself
        inputs = memory.layer.heads(_XP, memory.params(), chunk(_XP, x, L))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda compiling=compiling: compiling)
            reads, h, c = _torch_ops.option_scan(scan_options(memory.config), h0, c0, inputs,
                                                 memory.cell.params(), flow)
        loss = (reads ** 2).sum() + (h * c).sum()
        grads = torch.autograd.grad(loss, [h0, c0, *memory.parameters()], allow_unused=True,
                                    materialize_grads=True)
        results.append(((reads, h, c), grads))
    for got, want in zip(results[1], results[0], strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    assert any(bool(g.abs().max() > 0) for g in results[0][1][2:])


def test_dynamic_scan_op_passes_opcheck():
    """Schema, fake (meta) shapes, autograd registration and AOT dispatch of the op."""
    memory = _memory(ALL)
    x = torch.randn(1, 4, D, dtype=torch.float64)
    with torch.no_grad():
        inputs = memory.layer.heads(_XP, memory.params(), chunk(_XP, x, L))
    h0 = torch.randn(1, C, *S, dtype=torch.float64)

    def leaf(t):
        return t.detach().clone().requires_grad_()

    params = [leaf(p) for p in (*memory.cell.params(), *memory.warp_flow.params())]
    args = (leaf(h0), leaf(0.5 * h0), *(leaf(t) for t in inputs), *params,
            *scan_options(memory.config), True)
    result = torch.library.opcheck(torch.ops.tmcore.warp_flow_scan.default, args)
    assert set(result.values()) == {"SUCCESS"}, result


# --------------------------------------------------------------------------- compile


def _graph_counter():
    """A compile backend recording, per Dynamo graph, its calls of an option scan op."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(sum(1 for node in gm.graph.nodes if node.op == "call_function"
                          and "tmcore" in str(node.target) and "scan" in str(node.target)))
        return gm.forward

    return graphs, backend


def test_compile_traces_the_scan_as_one_opaque_op():
    memory = _memory(ALL)
    graphs, backend = _graph_counter()
    compiled = torch.compile(memory, fullgraph=True, backend=backend)
    x = torch.randn(2, 6, D, dtype=torch.float64, requires_grad=True)
    out, (h, c) = compiled(x, stream=False)
    assert graphs == [1]  # one graph (no break), the whole scan of T = 3 chunks one op
    want, (h_want, _) = memory(x, stream=False)
    assert torch.equal(out, want) and torch.equal(h, h_want)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_option_layer_equals_eager(fullgraph):
    """aot_eager (Dynamo + AOTAutograd's joint graph, the custom op's fake and backward
    op): forward, backward and a no_grad call equal eager, float64."""
    memory = _memory(ALL)
    parameters = list(memory.parameters())
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(memory, fullgraph=fullgraph, backend="aot_eager")
    for stream in (False, True):
        _assert_equal(_run(compiled, parameters, x, stream), _run(memory, parameters, x, stream))
    with torch.no_grad():
        got, want = compiled(x, stream=False), memory(x, stream=False)
    _assert_equal([got[0], *got[1]], [want[0], *want[1]])


def test_compiled_residual_with_options_equals_eager():
    residual = MemoryResidual(_memory(ALL, seed=1), gate_init=0.5).double()
    parameters = list(residual.parameters())
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(residual, backend="aot_eager")
    _assert_equal(_run(compiled, parameters, x, True), _run(residual, parameters, x, True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("fullgraph", [False, True])
def test_inductor_compiled_option_layers_equal_eager(name, fullgraph):
    """The default compiler (inductor) on TensorMemory and MemoryResidual: values and
    gradients equal eager to 1e-12 (float64; inductor may reorder the heads' sums)."""
    memory = _memory(OPTIONS[name])
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(memory, fullgraph=fullgraph)
    parameters = list(memory.parameters())
    _assert_equal(_run(compiled, parameters, x, False), _run(memory, parameters, x, False))
    residual = MemoryResidual(memory, gate_init=0.5).double()
    compiled = torch.compile(residual, fullgraph=fullgraph)
    parameters = list(residual.parameters())
    _assert_equal(_run(compiled, parameters, x, True), _run(residual, parameters, x, True))


# --------------------------------------------------------------------------- double backward


def _second_order(module, x):
    out, state = module(x, stream=False)
    g, = torch.autograd.grad((out ** 2).sum() + (state[0] ** 2).sum(), x, create_graph=True)
    return torch.autograd.grad(g.sum(), x)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_double_backward_raises_a_clear_error(name):
    """create_graph=True through the option scan is refused (it would otherwise run and
    drop the scan's second-order terms); a first-order backward still works."""
    memory = _memory(OPTIONS[name])
    x = torch.randn(1, 4, D, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward .* not supported"):
        _second_order(memory, x)
    out, _ = memory(x, stream=False)
    g, = torch.autograd.grad(out.sum(), x)
    assert bool(torch.isfinite(g).all())


def test_double_backward_of_a_compiled_option_layer_raises():
    """Dynamo alone (backend="eager"): the op's autograd rule refuses it with tmcore's
    message; with AOTAutograd (every real backend), PyTorch's compiled backward refuses a
    double backward itself, as for the default layer."""
    x = torch.randn(1, 4, D, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(_memory(ALL), fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError, match="double backward .* not supported"):
        _second_order(compiled, x)
    compiled = torch.compile(_memory(ALL), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="double backward|in-place operation"):
        _second_order(compiled, x)


def test_compile_builds_one_graph_for_every_length():
    """A compiled streaming training call (the default) with the length marked dynamic
    serves ragged and whole lengths from ONE graph: the grid's sizes stay symbolic (no
    guard on ``N mod L`` or the chunk count), and it equals eager in float32."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MemoryResidual(TensorMemory(32, 8, (4, 4, 4), 4))
    compiled = torch.compile(model, backend="aot_eager")
    for tokens in (8, 9, 10, 11, 13, 16, 17):
        x = torch.randn(2, tokens, 32)
        torch._dynamo.mark_dynamic(x, 1)
        out, state = compiled(x)
        ref, ref_state = model(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state.h, ref_state.h, rtol=1e-5, atol=1e-5)
        assert torch.equal(state.count, ref_state.count)
        (out.sum() + state.h.sum()).backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
