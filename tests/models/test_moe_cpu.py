"""Mixture-of-experts models through optimize() on CPU in float64: transformers' Qwen3-MoE with
the per-token expert dispatch ("batched_mm"): logprobs and every parameter gradient, router and
experts included, equal the plain model run row by row, over several groups, ragged responses
and GQA. Routing is per token, so computing a shared prompt once is exact for MoE layers too.
Dispatches the proof does not follow, rows grouped so that they mix tokens, and the auxiliary
router loss are refused by name; the rollout engine and the recipe run the MoE model. The
grouped expert op (models/moe_experts.py) is tested in test_moe_grouped_experts.py."""

import json

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.testing import (make_batch, rel_err, row_by_row_response_logprobs,
                                    same_dtype_numerics)
from moe_helpers import TOL, assert_matches_plain_model, moe

tf = pytest.importorskip("transformers")


def test_qwen3_moe_logprobs_and_every_gradient_equal_the_plain_model():
    packed_model, plain = moe(), moe()
    tokens, mask, p = make_batch([7, 3, 5], [[4, 2, 6], [3], [1, 5]], vocab=50,
                                 generator=torch.Generator().manual_seed(0))
    dk.counters.clear()
    lp = dk.optimize(packed_model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert dk.counters["attention_rewritten"] == 2 and dk.counters.get("dense_fallback", 0) == 0
    names = assert_matches_plain_model(lp, packed_model, plain, tokens, mask, p)
    assert any("mlp.gate" in n for n in names) and any("experts" in n for n in names)


@pytest.mark.parametrize("dispatch", ["grouped_mm", "eager"])
def test_dispatches_the_proof_does_not_follow_are_refused(dispatch):
    with pytest.raises(ValueError, match=f"got '{dispatch}': set model.config"):
        dk.optimize(moe(dispatch=dispatch))


def test_the_auxiliary_router_loss_is_refused(tmp_path):
    with pytest.raises(ValueError, match="load-balancing loss would not be computed"):
        dk.optimize(moe(output_router_logits=True))
    # the builder from a config.json set it to False silently, also over an explicit override
    from dualkv_compile.models import qwen3_moe_from_hf_config

    moe().config.save_pretrained(tmp_path / "off")
    moe(output_router_logits=True).config.save_pretrained(tmp_path / "on")
    for path, overrides in [(tmp_path / "on", {}), (tmp_path / "off",
                                                    {"output_router_logits": True})]:
        with pytest.raises(ValueError, match="output_router_logits=True .* is not supported"):
            qwen3_moe_from_hf_config(str(path), **overrides)
    assert not qwen3_moe_from_hf_config(str(tmp_path / "off")).config.output_router_logits


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_the_moe_builder_builds_in_float32_whatever_config_json_says(tmp_path, dtype):
    # it built in config.json's dtype: fp32 weights loaded into a bf16 build were rounded for
    # good (1.9e-4) before the recipe's cast, where the dense builder kept them
    from dualkv_compile.models import qwen3_moe_from_hf_config

    moe().config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"dtype": dtype}))
    model = qwen3_moe_from_hf_config(str(tmp_path))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("fallback", ["error", "dense"])
def test_a_setting_changed_after_optimize_is_named_at_the_call(fallback):
    # it met Dynamo ("data-dependent expression") or a refusal about a context manager
    tokens, mask, p = make_batch([5, 3], [[2, 3], [4]], vocab=50,
                                 generator=torch.Generator().manual_seed(0))
    for change, match in [("_experts_implementation", "got 'eager': set model.config"),
                          ("output_router_logits", "load-balancing loss would not be computed")]:
        model = moe()
        wrapper = dk.optimize(model, dk.DualKVConfig(fallback=fallback))
        setattr(model.config, change, "eager" if change.startswith("_") else True)
        with pytest.raises(ValueError, match=match):
            wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)


class _Grouped(torch.nn.Module):
    """An MLP wrapper that repeats each token's row k times (as MoE dispatch does), then runs
    `mix` over the grouped rows and folds them back: token-local or not, depending on `mix`."""

    def __init__(self, inner, mix, k=2):
        super().__init__()
        self.inner, self.mix, self.k = inner, mix, k

    def forward(self, x):
        b, t, d = x.shape
        rows = x.reshape(-1, d).repeat_interleave(self.k, dim=0)  # [T * k, d]
        rows = self.mix(rows, t)
        return self.inner(rows.view(b * t, self.k, d).sum(1).view(b, t, d))


def _per_token_outer(rows, t):  # each row times itself: local
    return torch.bmm(rows.unsqueeze(2), rows.unsqueeze(1)).sum(-1)


def _across_rows(rows, t):  # every row against every row: mixes tokens
    return rows.T.matmul(rows).sum(0).expand_as(rows)


def _regrouped(rows, t):  # [T*k, d] read as [k, T, d]: pairs rows of different tokens
    return rows.view(-1, t, rows.shape[-1]).flip(0).reshape(rows.shape)


@pytest.mark.parametrize("mix,message", [
    (_across_rows, "both operands carry tokens"),
    (_regrouped, "merges or splits the sequence axis"),
], ids=["across_rows", "regrouped"])
def test_grouped_rows_that_mix_tokens_are_refused(mix, message):
    from dualkv_compile.passes._common import Refusal
    from dualkv_compile.testing import tiny_model

    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    model.layers[0].mlp = _Grouped(model.layers[0].mlp, mix)
    tokens, mask, p = make_batch([7, 3], [[4, 2], [3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    with pytest.raises(Refusal, match=message):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_grouped_rows_handled_per_token_are_exact():
    from dualkv_compile.testing import tiny_model

    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    model.layers[0].mlp = _Grouped(model.layers[0].mlp, _per_token_outer)
    tokens, mask, p = make_batch([7, 3], [[4, 2], [3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    lp = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert rel_err(lp, row_by_row_response_logprobs(model, tokens, mask, p)) < TOL


@pytest.mark.parametrize("grouped", [False, True], ids=["batched_mm", "grouped_op"])
def test_the_rollout_engine_samples_what_the_reference_samples_on_qwen3_moe(grouped):
    from dualkv_compile.models import use_grouped_experts
    from dualkv_compile.rollout import RolloutEngine
    from dualkv_compile.rollout.uncached import uncached_generate

    model = moe(seed=1)
    if grouped:
        use_grouped_experts(model)
    prompts = torch.randint(2, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    prompts[1, :4] = 0
    kw = dict(group_size=3, max_generated_tokens=8, pad_id=0, top_p=0.9)
    ours = RolloutEngine(model).generate(prompts, rng=torch.Generator().manual_seed(4), **kw)
    theirs = uncached_generate(model, prompts, rng=torch.Generator().manual_seed(4), **kw)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("grouped", [False, True], ids=["dispatch", "grouped_experts"])
def test_the_recipe_trains_a_qwen3_moe_checkpoint_and_writes_one_transformers_reads(tmp_path,
                                                                                     grouped):
    """Qwen3HFCheckpointer reads a transformers Qwen3-MoE checkpoint into the recipe (built by
    models.qwen3_moe_from_hf_config) and writes the trained weights back in its format; with
    the grouped expert op too (a checkpoint could only run the per-token dispatch, which
    gathers every token's expert weights: 1.9 TiB a layer at Qwen3-30B-A3B's size)."""
    from omegaconf import OmegaConf
    from recipe_helpers import ROOT, load_recipe

    folder = tmp_path / "moe"
    cfg = tf.Qwen3MoeConfig(vocab_size=12, hidden_size=32, intermediate_size=16,
                            moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, max_position_embeddings=256)
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM._from_config(cfg).save_pretrained(folder, safe_serialization=True)
    conf = OmegaConf.load(ROOT / "recipes" / "configs" / "tiny_moe_grpo.yaml")
    conf.model = {"_component_": "dualkv_compile.models.qwen3_moe_from_hf_config",
                  "path": str(folder), **({"grouped_experts": True} if grouped else {})}
    conf.checkpointer = {"_component_": "dualkv_compile.models.Qwen3HFCheckpointer",
                         "checkpoint_dir": str(folder), "output_dir": str(tmp_path / "hf")}
    for key, value in {"output_dir": str(tmp_path / "run"), "num_steps": 2}.items():
        OmegaConf.update(conf, key, value)
    recipe = load_recipe().GRPORecipe(conf)
    recipe.setup()
    assert (recipe.model.config._experts_implementation == "batched_mm") != grouped
    source = tf.Qwen3MoeForCausalLM.from_pretrained(folder)
    for name, value in source.state_dict().items():  # the checkpoint's weights were loaded
        assert torch.equal(recipe.model.state_dict()[name], value), name
    recipe.train()
    recipe.cleanup()
    assert recipe.history[-1]["grad_norm"] > 0
    again = tf.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf" / "epoch_2")
    for name, value in recipe.model.state_dict().items():  # exactly what the recipe held
        assert torch.equal(again.state_dict()[name], value), name


def test_moe_config_overrides_take_transformers_names(tmp_path):
    tf.Qwen3MoeConfig(vocab_size=12, hidden_size=32, moe_intermediate_size=16, num_experts=4,
                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8).save_pretrained(tmp_path)
    from dualkv_compile import models

    model = models.qwen3_moe_from_hf_config(tmp_path, num_hidden_layers=1)
    assert len(model.model.layers) == 1
    with pytest.raises(ValueError, match=r"\['experts_per_token', 'num_layers'\] are not fields"):
        models.qwen3_moe_from_hf_config(tmp_path, num_layers=1, experts_per_token=1)


def test_expert_load_weighted_by_token_rows_equals_the_replicated_batchs():
    # a forward hook on each router collects its expert choices over the packed sequence;
    # weighted by token_rows they count exactly the experts the plain model picks on the
    # replicated rows' valid tokens (each shared prompt token once per row)
    packed_model, plain = moe(), moe()
    tokens, mask, p = make_batch([7, 3, 5], [[4, 2, 6], [3], [1, 5]], vocab=50,
                                 generator=torch.Generator().manual_seed(3))

    def collect(model):
        seen = []
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda m, i, out: seen.append(out[2].detach()))
        return seen

    ours, theirs = collect(packed_model), collect(plain)
    wrapper = dk.optimize(packed_model)
    wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert wrapper.uses_dualkv
    weights = wrapper.token_rows(tokens, prompt_len=p, padding_mask=mask)
    row_by_row_response_logprobs(plain, tokens, mask, p)
    experts = packed_model.config.num_experts
    layers = len(packed_model.model.layers)
    load = [torch.zeros(experts, dtype=torch.long) for _ in range(layers)]
    for i, chosen in enumerate(ours):  # one call: layer i's [T, k]
        load[i] += torch.bincount(chosen.flatten(), weights.repeat_interleave(chosen.shape[1]),
                                  minlength=experts).long()
    want = [torch.zeros(experts, dtype=torch.long) for _ in range(layers)]
    for i, chosen in enumerate(theirs):  # row by row: layers in order, then the next row
        want[i % layers] += torch.bincount(chosen.flatten(), minlength=experts)
    assert [x.tolist() for x in load] == [x.tolist() for x in want]
    assert int(weights.sum()) == int(mask.sum())  # every replicated valid token, once
