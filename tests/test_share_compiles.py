"""optimize(ref, config, share_compiles_with=policy): GRPO's reference model reuses the policy
wrapper's compiled graphs (the weights are graph inputs), for the whole-model and the layer
region; each wrapper still computes with its own weights (CPU, fp64, against each model row by
row), and a wrapper of another architecture or config is refused."""

import copy

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.rl.model_checks import COMPILES_PER_LENGTH
from dualkv_compile.testing import (mixed_batch, rel_err, row_by_row_response_logprobs,
                                    same_dtype_numerics, tiny_model)

TOL = 1e-10


def _pair(family):
    policy = same_dtype_numerics(tiny_model(family)).double()
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for q in ref.parameters():
            q.add_(0.05 * torch.randn(q.shape, generator=g, dtype=q.dtype))
    return policy, ref


@pytest.mark.parametrize("region", ["model", "layer"])
@pytest.mark.parametrize("family", ["qwen2_5", "hf_qwen3"])
def test_the_reference_reuses_the_policys_graphs_with_its_own_weights(family, region):
    policy, ref = _pair(family)
    config = dk.DualKVConfig(compile_region=region)
    wp = dk.optimize(policy, config)
    wr = dk.optimize(ref, config, share_compiles_with=wp)
    tokens, mask, p = mixed_batch()
    dk.counters.clear()
    with torch.no_grad():  # the old and reference logprobs of a GRPO step
        lp = {"policy": wp.response_logprobs(tokens, prompt_len=p, padding_mask=mask),
              "ref": wr.response_logprobs(tokens, prompt_len=p, padding_mask=mask)}
    assert dk.counters["graphs_compiled"] == 1
    for name, model in (("policy", policy), ("ref", ref)):
        assert rel_err(lp[name], row_by_row_response_logprobs(model, tokens, mask, p)) < TOL
    assert rel_err(lp["policy"], lp["ref"]) > 1e-3  # the two weight sets differ
    # with grad: one more graph, again shared; gradients land on each model's own weights
    for wrapper, model in ((wp, policy), (wr, ref)):
        out = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (out * weights).sum().backward()
        ours = {n: q.grad.clone() for n, q in model.named_parameters()}
        model.zero_grad()
        (row_by_row_response_logprobs(model, tokens, mask, p) * weights).sum().backward()
        for n, q in model.named_parameters():
            assert rel_err(ours[n], q.grad) < TOL, n
    assert dk.counters["graphs_compiled"] == 2 == COMPILES_PER_LENGTH  # the recipe's estimate


def test_sharing_with_another_architecture_or_config_is_refused():
    policy = tiny_model("qwen2_5")
    wp = dk.optimize(policy)
    with pytest.raises(ValueError, match="configs differ"):
        dk.optimize(copy.deepcopy(policy), dk.DualKVConfig(compile_region="layer"),
                    share_compiles_with=wp)
    with pytest.raises(ValueError, match="cannot share the compiled graphs of a"):
        dk.optimize(tiny_model("hf_qwen3"), share_compiles_with=wp)
    with pytest.raises(ValueError, match=r"parameter .* differs"):
        dk.optimize(tiny_model("qwen2_5", dim=64), share_compiles_with=wp)
    with pytest.raises(ValueError, match="the models are on meta and cpu"):
        dk.optimize(copy.deepcopy(policy).to("meta"), share_compiles_with=wp)
    with pytest.raises(TypeError, match="must be a DualKVModel"):
        dk.optimize(copy.deepcopy(policy), share_compiles_with=policy)


def test_the_recipes_reference_copy_mirrors_the_policy_unless_it_has_dropout(caplog):
    from dualkv_compile.rl.distributed import reference_copy

    model = tiny_model("qwen2_5").train()
    ref = reference_copy(model)
    assert ref.training and all(q.requires_grad for q in ref.parameters())
    assert all(a is not b for a, b in zip(model.parameters(), ref.parameters()))
    model.layers[0].attn.attn_dropout = 0.1  # torchtune keeps the attention dropout as a rate
    with caplog.at_level("WARNING"):
        ref = reference_copy(model)
    assert not ref.training and not any(q.requires_grad for q in ref.parameters())
    assert "eval mode (the model has dropout)" in caplog.text
    eval_copy = reference_copy(model.eval())  # eval mode runs no dropout: mirrored as it is
    assert not eval_copy.training and all(q.requires_grad for q in eval_copy.parameters())
