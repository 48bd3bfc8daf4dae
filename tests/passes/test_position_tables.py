"""passes/position_tables.py: position-only tensors routed through dualkv::materialize, an
opaque copy, so that compiled kernels load them instead of recomputing them. The models' exact
comparisons with the pass active are in test_optimize_cpu.py."""

import torch

from dualkv_compile.passes import position_tables as pt


def test_materialize_is_an_exact_copy_with_an_identity_gradient():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = torch.ops.dualkv.materialize(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    (y * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_materialize_traces_into_a_compiled_graph():
    def f(x):
        return torch.ops.dualkv.materialize(x.cos()) * x

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(out, x.detach().cos() * x.detach())
    out.sum().backward()
    x0 = x.detach()  # d/dx cos(x) * x, through the copy's identity backward
    assert torch.allclose(x.grad, x0.cos() - x0 * x0.sin(), rtol=0, atol=1e-14)


class RopeLike(torch.nn.Module):
    """cos/sin of positions x frequencies (a buffer), viewed per use, applied to activations;
    plus a position-only tensor scaled by a trainable parameter."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.linspace(1.0, 0.01, 32))
        self.scale = torch.nn.Parameter(torch.ones(32))

    def forward(self, x, positions):
        angles = positions[:, :, None].float() * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        y = x * cos.unsqueeze(2) + x * sin.unsqueeze(2)  # x [1, T, H, 32], tokens on axis 1
        return y + (angles * self.scale).unsqueeze(2), angles[:, :1]  # small: not stored


def traced(module, activations_first=True):
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, example_inputs
        return gm.forward

    x = torch.randn(1, 16, 2, 32)
    positions = torch.arange(16)[None]
    torch.compile(module, backend=backend, fullgraph=True)(x, positions)
    gm = captured["gm"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    activations = next(n for n in placeholders if tuple(n.meta["example_value"].shape) == (1, 16, 2, 32))
    return gm, activations, captured["inputs"]


def test_pass_stores_the_viewed_tables_once_and_keeps_the_values(monkeypatch):
    torch._dynamo.reset()
    module = RopeLike()
    gm, activations, inputs = traced(module)
    before = gm(*inputs)
    monkeypatch.setattr(pt, "_MIN_ELEMENTS", 64)
    # cos and sin (their unsqueezes read the stored copies, not copies of their own), and the
    # angles, which a product with the trainable scale reads; not the [1, 1, 32] slice, which
    # is below the threshold and only returned
    assert pt.materialize_position_tables(gm.graph, activations) == 3
    gm.graph.lint()
    gm.recompile()
    stored = {str(n.args[0].target): n for n in gm.graph.nodes
              if n.target is torch.ops.dualkv.materialize.default}
    assert {"cos", "sin"} < set(stored), stored
    for name in ("cos", "sin"):
        assert [u.target for u in stored[name].users] == ["unsqueeze"]
    after = gm(*inputs)
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_pass_leaves_tables_below_the_size_threshold(monkeypatch):
    torch._dynamo.reset()
    gm, activations, _ = traced(RopeLike())
    monkeypatch.setattr(pt, "_MIN_ELEMENTS", 16 * 32 + 1)  # cos and sin are [1, 16, 32]
    assert pt.materialize_position_tables(gm.graph, activations) == 0
    assert not any(n.target is torch.ops.dualkv.materialize.default for n in gm.graph.nodes)


class QuadraticBias(torch.nn.Module):
    """A [T, T] tensor computed from positions alone, added to activations."""

    def forward(self, x, positions):
        p = positions[0].float()
        return x[..., :16] + (p[:, None] - p[None, :]).abs()[None, :, None, :]


def test_quadratic_position_tensors_are_not_stored(monkeypatch):
    torch._dynamo.reset()
    gm, activations, _ = traced(QuadraticBias())
    monkeypatch.setattr(pt, "_MIN_ELEMENTS", 1)
    monkeypatch.setattr(pt, "_MAX_ELEMENTS_PER_TOKEN", 8)  # [16, 16] has 16 per token
    assert pt.materialize_position_tables(gm.graph, activations) == 0
    monkeypatch.setattr(pt, "_MAX_ELEMENTS_PER_TOKEN", 16)
    assert pt.materialize_position_tables(gm.graph, activations) == 1


def test_position_only_excludes_activations_and_trainable_parameters():
    torch._dynamo.reset()
    gm, activations, _ = traced(RopeLike())
    only = pt._position_only(gm.graph, activations)
    by_name = {n.name: n for n in gm.graph.nodes}
    scale = next(n for n in gm.graph.nodes if n.op == "placeholder" and "scale" in n.name)
    inv_freq = next(n for n in gm.graph.nodes if n.op == "placeholder" and "inv_freq" in n.name)
    assert activations not in only and scale not in only and inv_freq in only
    # every node that reads the activations or the parameter, directly or not, is outside
    outside = {activations, scale}
    for node in gm.graph.nodes:
        if any(i in outside for i in node.all_input_nodes):
            outside.add(node)
    assert not (outside & only)
    assert {"cos", "sin"} <= {str(n.target) for n in only if n.op == "call_method"}, by_name
