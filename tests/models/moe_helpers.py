"""Helpers of the mixture-of-experts CPU tests (test_moe_cpu.py, test_moe_grouped_experts.py): a
tiny float64 transformers Qwen3-MoE with a given expert dispatch and its router's softmax in
float64, and the check that a packed model's logprobs and every gradient equal the plain model's
row by row."""

import types

import pytest
import torch
import torch.nn.functional as F

from dualkv_compile.testing import rel_err, row_by_row_response_logprobs, same_dtype_numerics

tf = pytest.importorskip("transformers")
TOL = 1e-10


def _router_forward_wide(self, hidden):
    """Qwen3MoeTopKRouter.forward with the softmax in the input's dtype (transformers computes
    it in float32 even for a float64 model; a float32 rounding would hide 1e-16 differences
    behind 1e-7 ones)."""
    hidden = hidden.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden, self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def moe(seed=0, dispatch="batched_mm", **overrides):
    cfg = tf.Qwen3MoeConfig(vocab_size=60, hidden_size=16, intermediate_size=32,
                            moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=4, **overrides)
    cfg._experts_implementation = dispatch
    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="sdpa").double()
    model = same_dtype_numerics(model)
    for layer in model.model.layers:
        layer.mlp.gate.forward = types.MethodType(_router_forward_wide, layer.mlp.gate)
    return model.eval()


def assert_matches_plain_model(lp, packed_model, plain, tokens, mask, p) -> list[str]:
    """The packed model's logprobs `lp` and, after a weighted backward, every parameter's
    gradient equal the plain model's row by row (TOL); returns the parameter names checked."""
    weights = torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype).view_as(lp)
    (lp * weights).sum().backward()
    ref = row_by_row_response_logprobs(plain, tokens, mask, p)
    (ref * weights).sum().backward()
    assert rel_err(lp.detach(), ref.detach()) < TOL
    names = []
    for (name, a), b in zip(packed_model.named_parameters(), plain.parameters()):
        assert rel_err(a.grad, b.grad) < TOL, name
        names.append(name)
    return names
