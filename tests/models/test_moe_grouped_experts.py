"""The grouped expert op (models/moe_experts.py: a token's experts grouped by expert inside one
token-local op) on CPU: through optimize() its logprobs and every gradient equal the plain
model's (whole-model and per-layer compile regions, with checkpointing); alone it equals
transformers' batched_mm dispatch with gradients, and its grouped-GEMM form the per-expert loop
in bf16; every model set to it is checked (a GELU expert model is refused), and so is a routing
table not from the tokens."""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.testing import make_batch, rel_err, same_dtype_numerics
from moe_helpers import TOL, assert_matches_plain_model, moe

tf = pytest.importorskip("transformers")


def test_the_grouped_dispatch_is_checked_on_every_model_that_names_it():
    # once any model registered the op, a GELU expert model set to it by hand was run with
    # SiLU (0.031 off the plain model), though use_grouped_experts refuses it
    from dualkv_compile.models import use_grouped_experts

    use_grouped_experts(moe())
    gelu = moe(hidden_act="gelu")
    gelu.set_experts_implementation("dualkv_grouped")
    with pytest.raises(ValueError, match="has hidden_act='gelu'"):
        dk.optimize(gelu)


def test_grouped_expert_op_logprobs_and_every_gradient_equal_the_plain_model():
    # #27 item 5's dispatch: the experts grouped by expert inside one token-local op
    # (models/moe_experts.py); the plain model keeps transformers' batched_mm
    from dualkv_compile.models import use_grouped_experts

    packed_model, plain = moe(), moe()
    use_grouped_experts(packed_model)
    assert packed_model.config._experts_implementation == "dualkv_grouped"
    tokens, mask, p = make_batch([7, 3, 5], [[4, 2, 6], [3], [1, 5]], vocab=50,
                                 generator=torch.Generator().manual_seed(0))
    dk.counters.clear()
    lp = dk.optimize(packed_model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert dk.counters["attention_rewritten"] == 2 and dk.counters.get("dense_fallback", 0) == 0
    assert_matches_plain_model(lp, packed_model, plain, tokens, mask, p)


def _experts(num_experts, hidden_size, seed=0):
    """A Qwen3-MoE experts module of these sizes, float64, weights N(0, 0.5)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = tf.Qwen3MoeConfig(hidden_size=hidden_size, moe_intermediate_size=8,
                            num_experts=num_experts)
    cfg._experts_implementation = "batched_mm"
    experts = Qwen3MoeExperts(cfg).double()
    g = torch.Generator().manual_seed(seed)
    for w in (experts.gate_up_proj, experts.down_proj):
        w.data = torch.randn(w.shape, dtype=torch.float64, generator=g) * 0.5
    return experts


def test_grouped_expert_op_equals_transformers_dispatch_with_gradients():
    # the op alone, eager, against transformers' batched_mm on the same experts module, every
    # expert hit or not (9 tokens, 2 of 6 experts each)
    from transformers.integrations.moe import batched_mm_experts_forward

    from dualkv_compile.models.moe_experts import moe_experts

    experts = _experts(num_experts=6, hidden_size=16)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(9, 16, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(9)])  # expert 5 unused
    w = torch.rand(9, 2, dtype=torch.float64, generator=g, requires_grad=True)
    grad = torch.randn(9, 16, dtype=torch.float64, generator=g)
    ours = moe_experts(hidden, index, w, experts.gate_up_proj, experts.down_proj)
    leaves = [hidden, w, experts.gate_up_proj, experts.down_proj]
    d_ours = torch.autograd.grad(ours, leaves, grad)
    theirs = batched_mm_experts_forward(experts, hidden, index, w)
    d_theirs = torch.autograd.grad(theirs, leaves, grad)
    assert rel_err(ours, theirs) < TOL
    for a, b in zip(d_ours, d_theirs):
        assert rel_err(a, b) < TOL
    assert (d_ours[3][5] == 0).all()  # the unused expert gets no gradient


class _MisroutedExperts(torch.nn.Module):
    """Calls the grouped op with a routing table that is not the tokens' own (arange over the
    rows): row s would be routed by its position, not by its token."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x):
        from dualkv_compile.models.moe_experts import moe_experts

        b, t, d = x.shape
        rows = x.reshape(-1, d)
        index = torch.arange(rows.shape[0], device=x.device)[:, None] % 2
        w = torch.ones(rows.shape[0], 1, dtype=x.dtype, device=x.device)
        out = moe_experts(rows, index, w, self.experts.gate_up_proj, self.experts.down_proj)
        return out.view(b, t, d)


def test_the_grouped_op_with_a_routing_table_not_from_the_tokens_is_refused():
    from dualkv_compile.passes._common import Refusal
    from dualkv_compile.testing import tiny_model

    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    dim = model.layers[0].mlp.w1.in_features
    experts = _experts(num_experts=2, hidden_size=dim)
    model.layers[0].mlp = _MisroutedExperts(experts)
    tokens, mask, p = make_batch([7, 3], [[4, 2], [3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    with pytest.raises(Refusal, match="routing table must carry the tokens on axis 0"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_layer_region_with_grouped_experts_and_checkpointing_equals_the_plain_model():
    # the path FSDP2 takes (compile_region="layer"): one graph per decoder layer, transformers'
    # gradient checkpointing inlined, the grouped expert op
    from dualkv_compile.models import use_grouped_experts

    packed_model, plain = moe(), moe()
    use_grouped_experts(packed_model)
    packed_model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False})
    packed_model.train()
    tokens, mask, p = make_batch([7, 3, 5], [[4, 2, 6], [3], [1, 5]], vocab=50,
                                 generator=torch.Generator().manual_seed(1))
    dk.counters.clear()
    wrapper = dk.optimize(packed_model, dk.DualKVConfig(compile_region="layer"))
    lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert wrapper.compile_region() == "layer" and dk.counters["checkpoints_inlined"] >= 1
    assert_matches_plain_model(lp, packed_model, plain, tokens, mask, p)


def test_grouped_gemm_form_equals_the_per_expert_loop_in_bf16():
    # the CUDA path's grouped GEMMs (torch's grouped_mm: 2-D x 3-D for the projections, 2-D x
    # 2-D for the weight gradients), run on the CPU where torch has them, against the loop
    from dualkv_compile.models.moe_experts import grouped_experts, grouped_experts_backward

    experts = _experts(num_experts=6, hidden_size=16)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(11, 16, generator=g).bfloat16()
    index = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(11)])  # 5 unused
    w = torch.rand(11, 2, generator=g).bfloat16()
    grad = torch.randn(11, 16, generator=g).bfloat16()
    args = (hidden, index, w, experts.gate_up_proj.detach().bfloat16(),
            experts.down_proj.detach().bfloat16())
    from dualkv_compile.models.moe_experts import _grouped_mm

    try:  # torch's own op on known-good input first: a skip must not hide a bug of ours
        _grouped_mm()(torch.ones(4, 8).bfloat16(), torch.ones(2, 8, 8).bfloat16(),
                      offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError) as e:  # TypeError: None, no op
        pytest.skip(f"torch {torch.__version__} has no CPU grouped_mm in bf16: {e}")
    fast = [grouped_experts(*args, grouped=True),
            *grouped_experts_backward(grad, *args, grouped=True)]
    loop = [grouped_experts(*args, grouped=False),
            *grouped_experts_backward(grad, *args, grouped=False)]
    for name, a, b in zip(["out", "d_hidden", "d_weights", "d_gate_up", "d_down"], fast, loop):
        assert a.shape == b.shape and rel_err(a.float(), b.float()) < 2e-2, name
    assert (fast[4][5] == 0).all()


def test_an_expert_id_outside_the_experts_is_refused():
    # histc dropped an id >= E (rows no expert computed, uninitialised memory summed) and took
    # -1 as expert 0
    from dualkv_compile.models.moe_experts import grouped_experts

    experts = _experts(num_experts=4, hidden_size=8)
    hidden = torch.randn(3, 8, dtype=torch.float64)
    weights = torch.rand(3, 2, dtype=torch.float64)
    args = (experts.gate_up_proj.detach().double(), experts.down_proj.detach().double())
    for bad in (4, -1):
        index = torch.tensor([[0, 1], [2, bad], [3, 1]])
        with pytest.raises(RuntimeError, match=r"an expert id outside \[0, 4\)"):
            grouped_experts(hidden, index, weights, *args, grouped=False)
