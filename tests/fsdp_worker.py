"""Run by tests/test_fsdp.py under torchrun (2 CPU processes, gloo): optimize() on FSDP2-sharded
torchtune decoders, fp64, against the unsharded model row by row. Prints one JSON line per case
on rank 0."""

import copy
import gc
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import dualkv_compile as dk
from dualkv_compile.testing import (make_batch, rel_err, row_by_row_response_logprobs,
                                    same_dtype_numerics, tiny_model)


def model_pair(family, checkpointed):
    sharded = same_dtype_numerics(tiny_model(family)).double()
    plain = same_dtype_numerics(tiny_model(family)).double()
    if checkpointed:
        from torchtune.modules import TransformerSelfAttentionLayer
        from torchtune.training import set_activation_checkpointing

        set_activation_checkpointing(sharded, auto_wrap_policy={TransformerSelfAttentionLayer})
    return sharded, plain


def run_case(name, family="qwen2_5", checkpointed=False, per_layer=True, enabled=True,
             region="auto"):
    rank, world = dist.get_rank(), dist.get_world_size()
    dk.counters.clear()
    torch._dynamo.reset()
    sharded, plain = model_pair(family, checkpointed)
    if per_layer:
        for layer in sharded.layers:
            fully_shard(layer)
    fully_shard(sharded)
    # each rank its own batch, as in data parallel training
    tokens, mask, p = make_batch([9, 5], [[6, 0, 11], [3, 3]], shuffle=True, vocab=99,
                                 generator=torch.Generator().manual_seed(rank))
    tokens = tokens % 101  # tiny_model's vocabulary
    wrapper = dk.optimize(sharded, dk.DualKVConfig(enabled=enabled, compile_region=region))
    result = {"case": name}
    try:
        with torch.no_grad():  # old/reference logprobs, as the recipe takes them
            frozen = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
        weights = torch.linspace(-1, 1, frozen.numel(), dtype=frozen.dtype).view_as(frozen)
        for _ in range(2):  # two micro-batches accumulate
            lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
            (lp * weights).sum().backward()
    except Exception as exc:  # reported to the test, which decides
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    ref = row_by_row_response_logprobs(plain, tokens, mask, p)
    (ref * weights).sum().backward()
    grad_err = 0.0
    for (pname, param), ref_param in zip(sharded.named_parameters(), plain.parameters()):
        expected = ref_param.grad.clone()
        dist.all_reduce(expected)  # FSDP averages the ranks' gradients
        expected *= 2 / world  # two accumulated micro-batches
        got = param.grad.full_tensor()
        grad_err = max(grad_err, rel_err(got, expected))
    errors = torch.tensor([rel_err(lp.detach(), ref.detach()), rel_err(frozen, ref.detach()),
                           grad_err], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    result.update(logprob_err=errors[0].item(), no_grad_err=errors[1].item(),
                  grad_err=errors[2].item(), region=wrapper.compile_region(),
                  counters=dict(dk.counters))
    return result


def shared_reference_case():
    """A sharded reference model with other weights shares the sharded policy's compiled
    graphs (optimize's share_compiles_with), each exact against its unsharded twin."""
    rank = dist.get_rank()
    dk.counters.clear()
    torch._dynamo.reset()
    policy, policy_plain = model_pair("qwen2_5", False)
    ref_plain = copy.deepcopy(policy_plain)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for q in ref_plain.parameters():
            q.add_(0.05 * torch.randn(q.shape, generator=g, dtype=q.dtype))
    ref = copy.deepcopy(ref_plain)
    for model in (policy, ref):
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    tokens, mask, p = make_batch([9, 5], [[6, 0, 11], [3, 3]], shuffle=True, vocab=99,
                                 generator=torch.Generator().manual_seed(rank))
    tokens = tokens % 101
    wp = dk.optimize(policy)
    wr = dk.optimize(ref, share_compiles_with=wp)
    result = {"case": "shared_reference"}
    try:
        with torch.no_grad():
            lp = wp.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
            lr = wr.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    except Exception as exc:  # reported to the test, which decides
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    errors = torch.tensor([rel_err(lp, row_by_row_response_logprobs(policy_plain, tokens, mask, p)),
                           rel_err(lr, row_by_row_response_logprobs(ref_plain, tokens, mask, p))],
                          dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    result.update(policy_err=errors[0].item(), ref_err=errors[1].item(),
                  counters=dict(dk.counters))
    return result


def rollout_case():
    """The rollout engine on the sharded model: the plain model's tokens, and one all-gather
    per sharded module per rollout whatever the number of decode steps."""
    from unittest import mock

    from dualkv_compile.rollout import RolloutEngine

    rank = dist.get_rank()
    torch._dynamo.reset()
    sharded, plain = model_pair("qwen2_5", checkpointed=True)
    for layer in sharded.layers:
        fully_shard(layer)
    fully_shard(sharded)
    prompts = torch.randint(1, 101, (2, 7), generator=torch.Generator().manual_seed(rank))
    prompts[1, :3] = 0
    result = {"case": "rollout"}
    gathers = []
    # FSDP2's all-gather: all_gather_single in torch 2.13, all_gather_into_tensor before
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    def counted(*args, **kwargs):
        gathers.append(1)
        return real(*args, **kwargs)

    def sample(model, steps):
        return RolloutEngine(model).generate(prompts, group_size=3, max_generated_tokens=steps,
                                             pad_id=0, rng=torch.Generator().manual_seed(5))
    try:
        with mock.patch.object(dist, name, counted):
            short = sample(sharded, 4)
            per_call = len(gathers)
            long = sample(sharded, 12)
    except Exception as exc:  # reported to the test, which decides
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    same = torch.equal(long, sample(plain, 12)) and torch.equal(short, long[:, :4])
    resharded = all(type(p).__name__ == "DTensor" for p in sharded.parameters())
    flags = torch.tensor([int(same), int(resharded)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    result.update(same_tokens=bool(flags[0]), resharded=bool(flags[1]), gathers_short=per_call,
                  gathers_long=len(gathers) - per_call)
    return result


def micro_batch_case():
    """GRPO loss gradients over token-budget micro-batches (a different number per rank, the
    shorter rank padding with weight-0 repeats, as the recipe does) equal one micro-batch per
    rank, on a sharded model, both aggregations."""
    from dualkv_compile.rl import GRPOLoss

    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    model, _ = model_pair("qwen2_5", checkpointed=False)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    groups = [[9, 5, 12], [4]][rank]
    lengths = [[[6, 1, 11], [3, 3, 2], [14, 2, 7]], [[5, 8, 1]]][rank]
    tokens, mask, p = make_batch(groups, lengths, vocab=99,
                                 generator=torch.Generator().manual_seed(rank))
    tokens = tokens % 101
    wrapper = dk.optimize(model)
    resp = mask[:, p:]
    total_tokens, total_rows = (float(x) for x in _all_sum(resp.sum(), resp.shape[0]))
    g = torch.Generator().manual_seed(7 + rank)
    with torch.no_grad():
        base = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    old = base + 0.1 * torch.randn(base.shape, generator=g, dtype=base.dtype)
    ref = base - 0.1 * torch.randn(base.shape, generator=g, dtype=base.dtype)
    adv = torch.randn(tokens.shape[0], generator=g, dtype=base.dtype)
    result = {"case": "micro_batches"}
    for aggregation in ("sequence", "token"):
        loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.05,
                           aggregation=aggregation)

        def grads(batches):
            model.zero_grad()
            n = int(_all_max(len(batches)))
            for i in range(n):
                rows = batches[i] if i < len(batches) else batches[0]
                share = 0.0 if i >= len(batches) else (
                    int(resp[rows].sum()) / total_tokens if aggregation == "token"
                    else resp[rows].shape[0] / total_rows)
                token_loss = loss_fn.token_loss(old[rows], ref[rows], adv[rows], resp[rows],
                                                scale=share * world)
                loss, _ = wrapper.response_loss(tokens[rows], prompt_len=p,
                                                padding_mask=mask[rows], token_loss=token_loss)
                loss.backward()
            return torch.cat([q.grad.full_tensor().flatten() for q in model.parameters()])

        plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=26)
        many = grads([torch.tensor(r) for r in plan.rows])
        one = grads([torch.arange(tokens.shape[0])])
        result[f"{aggregation}_err"] = rel_err(many, one)
    counts = [None] * world
    dist.all_gather_object(counts, len(plan))
    result["micro_batches_per_rank"] = counts
    return result


def refusal_case():
    """optimizer_step's input checks agree across ranks: a refusal on one rank alone (a float
    loss_mask on rank 1) stops both, where rank 0 used to wait in the first collective; an
    unsharded model in a process group is refused (its gradients were never averaged)."""
    from dualkv_compile.rl import GRPOLoss, optimizer_step

    rank = dist.get_rank()
    tokens, mask, p = make_batch([5], [[3, 4]], vocab=99)
    lp = torch.zeros(2, tokens.shape[1] - p, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    result = {"case": "refusals"}
    oov = tokens.clone()
    oov[0, p] = 10_000  # past the vocabulary: refused by the model's own token check
    for name, shard, loss_mask, ids in [
            ("one_rank", True, mask[:, p:].double() if rank else None, tokens),
            ("oov_one_rank", True, None, oov if rank else tokens),
            ("unsharded", False, None, tokens)]:
        model = same_dtype_numerics(tiny_model("qwen2_5")).double()
        if shard:
            fully_shard(model)
        try:
            optimizer_step(dk.optimize(model), GRPOLoss(), torch.optim.SGD(model.parameters()),
                           ids, mask, p, lp, lp, adv, group_size=2, temperature=1.0,
                           max_grad_norm=1.0, loss_mask=loss_mask)
            said = "accepted"
        except ValueError as e:
            said = str(e)
        said_by = [None] * dist.get_world_size()
        dist.all_gather_object(said_by, said)
        result[name] = said_by
    # micro_batched_logprobs (old and reference logprobs) alike: rank 0 waited in the
    # micro-batch count's all-reduce while rank 1 refused its tokens
    from dualkv_compile.rl import micro_batched_logprobs

    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    fully_shard(model)
    try:
        with torch.no_grad():
            micro_batched_logprobs(dk.optimize(model), oov if rank else tokens, mask, p,
                                   group_size=2, temperature=1.0)
        said = "accepted"
    except ValueError as e:
        said = str(e)
    said_by = [None] * dist.get_world_size()
    dist.all_gather_object(said_by, said)
    result["logprobs_oov_one_rank"] = said_by
    return result


def _all_sum(*values):
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _all_max(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    dist.init_process_group("gloo")
    cases = [
        run_case("layers"),
        run_case("layers_checkpointed", checkpointed=True),
        run_case("llama_layers", family="llama3_2"),
        run_case("root_only", per_layer=False),
        run_case("disabled", enabled=False),
        run_case("model_region", region="model"),
        shared_reference_case(),
        rollout_case(),
        micro_batch_case(),
        refusal_case(),
    ]
    if dist.get_rank() == 0:
        for case in cases:
            print("CASE " + json.dumps(case), flush=True)
    dist.barrier()  # as the recipe does: no collective work left when the group goes
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
