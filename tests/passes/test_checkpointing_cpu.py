"""Activation checkpointing with optimize(): the model's own checkpointed layers (HF
gradient_checkpointing_enable, torchtune set_activation_checkpointing) and the partitioner's
memory budget. Exact against the row-by-row model in fp64, and the partitioned graphs recompute
the layers but never the shared-prefix attention or its inputs."""

import copy

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.passes._common import Refusal
from dualkv_compile.testing import (
    make_batch,
    rel_err,
    row_by_row_response_logprobs,
    same_dtype_numerics,
    tiny_model,
)

TOL = 1e-10


def checkpointed(family, **checkpoint_kwargs):
    model = same_dtype_numerics(tiny_model(family)).double()
    if family.startswith("hf_"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, **checkpoint_kwargs})
        model.train()
    else:
        from torchtune.modules import TransformerSelfAttentionLayer
        from torchtune.training import set_activation_checkpointing

        set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer},
                                     **checkpoint_kwargs)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    return make_batch([9, 5, 1], [[6, 0, 11], [3, 3], [7]], shuffle=True, vocab=90, generator=g)


def logprob_grads(model, config):
    tokens, mask, p = batch()
    wrapper = dk.optimize(model, config)
    lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    weights = torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype).view_as(lp)
    (lp * weights).sum().backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    ref = row_by_row_response_logprobs(model, tokens, mask, p)
    (ref * weights).sum().backward()
    assert rel_err(lp.detach(), ref.detach()) < TOL
    for name, param in model.named_parameters():
        assert rel_err(grads[name], param.grad) < TOL, name
    return wrapper._backends["hidden"].last_partition


def flex_backward_inputs(backward):
    (node, *more) = [n for n in backward.graph.nodes
                     if n.op == "call_function" and "flex_attention_backward" in str(n.target)]
    return [node] + more


def regions_backward_inputs(backward):
    (node, *more) = [n for n in backward.graph.nodes if n.op == "call_function"
                     and "regions_attention_backward" in str(n.target)]
    return [node] + more


def assert_attention_not_recomputed(backward, kernel="flex"):
    """q, k, v, out and logsumexp reach every attention backward (flex, or the regions op) as
    saved tensors (or views of one)."""
    targets = {str(n.target) for n in backward.graph.nodes if n.op == "call_function"}
    forward_op = "flex_attention" if kernel == "flex" else "dualkv.regions_attention.default"
    assert forward_op not in targets, "the attention forward is recomputed in the backward"
    nodes = flex_backward_inputs(backward) if kernel == "flex" else regions_backward_inputs(backward)
    for node in nodes:
        saved = node.args[:5] if kernel == "flex" else node.args[1:6]  # (dout, q, k, v, out, lse)
        for arg in saved:
            while arg.op == "call_function" and arg.target in (
                    torch.ops.aten.detach.default, torch.ops.aten.view.default):
                arg = arg.args[0]
            assert arg.op == "placeholder", (node.name, arg.format_node())


@pytest.mark.parametrize("family", ["hf_qwen3", "qwen2_5"])
def test_checkpointed_layers_are_exact_and_recompute_all_but_attention(family):
    partition = logprob_grads(checkpointed(family), dk.DualKVConfig(backend="aot_eager"))
    assert dk.counters["checkpoints_inlined"] == 2  # one region per layer
    assert dk.counters["attention_rewritten"] == 2
    forward, backward = partition
    ops = [n.target for n in backward.graph.nodes if n.op == "call_function"]
    # the layers' norms are recomputed in the backward: checkpointing is really on
    assert ops.count(torch.ops.aten.rsqrt.default) >= 4
    assert_attention_not_recomputed(backward)


def test_checkpoint_arguments_that_change_no_value_are_taken():
    # preserve_rng_state=False was refused as "has 13 inputs ...; its body takes 13"
    logprob_grads(checkpointed("hf_qwen3", preserve_rng_state=False, determinism_check="none"),
                  dk.DualKVConfig(backend="aot_eager"))
    assert dk.counters["checkpoints_inlined"] == 2


def test_checkpointed_layers_with_the_regions_backend_save_its_inputs():
    config = dk.DualKVConfig(backend="aot_eager", attention_backend="regions")
    forward, backward = logprob_grads(checkpointed("hf_qwen3"), config)
    assert dk.counters["attention_rewritten"] == 2
    assert torch.ops.aten.rsqrt.default in [n.target for n in backward.graph.nodes]
    assert_attention_not_recomputed(backward, kernel="regions")


def test_memory_budget_recomputes_but_not_attention():
    model = same_dtype_numerics(tiny_model("hf_qwen3")).double()
    config = dk.DualKVConfig(backend="aot_eager", activation_memory_budget=0.1)
    forward, backward = logprob_grads(model, config)
    assert torch.ops.aten.rsqrt.default in [n.target for n in backward.graph.nodes]
    assert_attention_not_recomputed(backward)


def test_without_the_attention_tags_the_partitioner_recomputes_q(monkeypatch):
    """The check above can fail: with the joint-graph pass disabled, RoPE'd q is recomputed."""
    from dualkv_compile.passes import attention_saving

    monkeypatch.setattr(attention_saving, "save_attention", lambda graph: 0)
    forward, backward = logprob_grads(checkpointed("hf_qwen3"), dk.DualKVConfig(backend="aot_eager"))
    with pytest.raises(AssertionError, match="flex_attention_backward"):
        assert_attention_not_recomputed(backward)


def test_selective_checkpointing_is_refused_by_name():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        return create_selective_checkpoint_contexts(policy)

    model = checkpointed("hf_qwen3", context_fn=context_fn)
    tokens, mask, p = batch()
    with pytest.raises(Refusal, match="context_fn"):
        dk.optimize(model, dk.DualKVConfig(backend="aot_eager")).response_logprobs(
            tokens, prompt_len=p, padding_mask=mask)


@pytest.mark.parametrize("family", ["hf_qwen3", "qwen2_5"])
def test_every_inlined_function_call_carries_the_recompute_tags(family):
    from torch.utils.checkpoint import CheckpointPolicy

    model = checkpointed(family)
    tokens, mask, p = batch()
    wrapper = dk.optimize(model, dk.DualKVConfig(backend="eager"))
    stages = {}
    wrapper._observer = lambda stage, gm: stages.setdefault(stage, copy.deepcopy(gm))
    wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    traced, inlined = stages["traced"], stages["checkpoint_inline"]
    ops = ("call_function", "call_method", "call_module")
    bodies = [getattr(traced, n.args[0].target) for n in traced.graph.nodes
              if n.target is torch.ops.higher_order.tag_activation_checkpoint]
    in_bodies = sum(n.op == "call_function" for body in bodies for n in body.graph.nodes)
    tagged = [n for n in inlined.graph.nodes if n.op in ops
              and n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE]
    assert len(bodies) == 2 and len(tagged) == in_bodies  # every function call of the bodies
    assert all(n.op == "call_function" for n in tagged)  # methods: the partitioner's choice
    assert len({n.meta["ac_graph_id"] for n in tagged}) == 2  # one id per region
    assert not any(n.target is torch.ops.higher_order.tag_activation_checkpoint
                   for n in inlined.graph.nodes)
    assert not any(name.startswith("wrap_body") for name, _ in inlined.named_children())


def test_no_grad_calls_of_a_checkpointed_hf_model_in_train_mode():
    # gradient_checkpointing_enable() hooks the embedding to call requires_grad_ on its output;
    # torch 2.11's Dynamo could not trace that call, so old/reference logprobs (no_grad) of a
    # checkpointed transformers model in train mode failed. The packed body embeds without that
    # hook (the checkpoints are inlined, it has nothing to do) and keeps any other hook.
    model = checkpointed("hf_qwen3")
    tokens, mask, p = batch()
    wrapper = dk.optimize(model)
    with torch.no_grad():
        lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
        ref = row_by_row_response_logprobs(model, tokens, mask, p)
    assert wrapper.uses_dualkv and rel_err(lp, ref) < TOL
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: calls.append(o.shape))
    torch._dynamo.reset()
    with torch.no_grad():
        lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert calls and rel_err(lp, ref) < TOL  # a user's own hook still runs
