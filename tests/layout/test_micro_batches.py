"""Micro-batches by packed-token budget (dualkv_compile.plan_micro_batches): every row exactly
once, no micro-batch over the budget, first-fit decreasing, oversized groups split; and the
GRPO loss and every gradient over the planned micro-batches equal the one-micro-batch result
(CPU, float64, 1e-10), for sequence and token aggregation. The two-process case is in
test_fsdp.py (fsdp_worker.py's "micro_batches")."""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.rl import GRPOLoss
from dualkv_compile.testing import make_batch, same_dtype_numerics, tiny_model

TOL = 1e-10


def batch(seed=0):
    """4 groups of 3 rows: prompts 9, 5, 12, 3 tokens; ragged responses."""
    g = torch.Generator().manual_seed(seed)
    tokens, mask, p = make_batch([9, 5, 12, 3], [[6, 1, 11], [3, 3, 0], [14, 2, 7], [1, 9, 4]],
                                 vocab=90, generator=g)
    return tokens, mask, p


def test_every_row_once_within_the_budget():
    _, mask, p = batch()
    # packed sizes: 9+18=27, 5+6=11, 12+23=35, 3+14=17
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=40)
    assert plan.packed_tokens == [35, 38, 17] and plan.split_groups == []
    assert plan.rows == [[6, 7, 8], [0, 1, 2, 3, 4, 5], [9, 10, 11]]  # 35 | 27+11 | 17
    rows = sorted(r for mb in plan.rows for r in mb)
    assert rows == list(range(12))


def test_a_budget_filled_exactly_is_within_it():
    # the boundaries: a group of exactly the budget is not split, a row of exactly the budget
    # is not over it, and two groups that fill it exactly share a micro-batch
    _, mask, p = make_batch([4, 3, 1], [[3, 3], [3, 4], [1, 2]], vocab=90,
                            generator=torch.Generator().manual_seed(0))
    dk.counters.clear()
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=2, max_tokens=10)
    # packed: 4+6 = 10, 3+7 = 10, 1+3 = 4
    assert plan.split_groups == [] and plan.packed_tokens == [10, 10, 4]
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=2, max_tokens=7)
    # group 0 split into rows {0} (7) and {1} (7); group 1 into {2} (6) and {3} (7): no row over
    assert plan.split_groups == [0, 1] and dk.counters["rows_over_budget"] == 0
    assert max(plan.packed_tokens) == 7
    _, mask, p = make_batch([2, 1], [[2, 2], [1, 2]], vocab=90,
                            generator=torch.Generator().manual_seed(0))
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=2, max_tokens=10)
    assert plan.packed_tokens == [10] and len(plan.rows) == 1  # 6 + 4


def test_a_group_over_the_budget_is_split_and_pays_its_prompt_per_part():
    _, mask, p = batch()
    dk.counters.clear()
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=26)
    assert plan.split_groups == [0, 2]  # 27 and 35 tokens
    assert max(plan.packed_tokens) <= 26 and dk.counters["groups_split"] == 2
    assert sorted(r for mb in plan.rows for r in mb) == list(range(12))
    # group 2 (prompt 12; responses 14, 2, 7): rows {6} and {7, 8}, each with the prompt
    parts = [[r for r in mb if r in (6, 7, 8)] for mb in plan.rows]
    assert sorted(x for x in parts if x) == [[6], [7, 8]]


def test_the_recipes_logprob_passes_do_not_count_the_batch_again():
    # old and reference logprobs plan the update's batch again: each step counted its split
    # groups three times (counters["groups_split"] read 6 for 2 groups)
    from dualkv_compile.rl import micro_batched_logprobs

    tokens, mask, p = batch()
    policy = dk.optimize(tiny_model("qwen2_5", vocab=90))
    dk.counters.clear()
    with torch.no_grad():
        micro_batched_logprobs(policy, tokens, mask, p, group_size=3, temperature=1.0,
                               max_tokens=26)
    assert dk.counters["groups_split"] == 0
    dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=26)  # the update's
    assert dk.counters["groups_split"] == 2


def test_a_row_over_the_budget_gets_a_micro_batch_of_its_own():
    _, mask, p = batch()
    dk.counters.clear()
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=20)
    assert [6] in plan.rows and dk.counters["rows_over_budget"] == 1  # 12 + 14 tokens
    assert plan.packed_tokens[plan.rows.index([6])] == 26
    assert sorted(r for mb in plan.rows for r in mb) == list(range(12))
    assert all(t <= 20 for rows, t in zip(plan.rows, plan.packed_tokens) if rows != [6])


def test_parts_of_a_split_group_in_one_micro_batch_pay_its_prompt_once():
    # prompt 1, responses 5, 9, 1, budget 10: parts {0} (6 tokens), {1} (10), {2} (2); part
    # {2} joins {0}, where pack() holds the prompt once: 7 tokens, not 8 (the plan counted the
    # prompt per part), and the group is split across 2 micro-batches, not 3
    tokens, mask, p = make_batch([1], [[5, 9, 1]], vocab=90)
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=10)
    assert plan.rows == [[1], [0, 2]] and plan.packed_tokens == [10, 7]
    assert plan.split_groups == [0]
    for rows, packed in zip(plan.rows, plan.packed_tokens):
        assert dk.pack(tokens[rows], prompt_len=p, padding_mask=mask[rows]).num_tokens == packed


def test_the_planners_notes_are_logged_once_per_process(caplog, monkeypatch):
    # the notes hold the step's token counts, so deduplicating on the text logged them every
    # step of a ragged run
    from dualkv_compile import stats

    monkeypatch.setattr(stats, "_logged", set())
    _, mask, p = batch()
    with caplog.at_level("INFO", logger="dualkv_compile.layout.plan"):
        for budget in (20, 19, 24):  # over-budget rows and split groups, other numbers each time
            dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=budget)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2, notes
    assert "max_tokens=20" in notes[0] + notes[1]


def test_impossible_budgets_are_named():
    _, mask, p = batch()
    with pytest.raises(ValueError, match="max_tokens=0"):
        dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=0)
    with pytest.raises(ValueError, match="do not split into groups of group_size=5"):
        dk.plan_micro_batches(mask, prompt_len=p, group_size=5, max_tokens=100)


def small():
    """2 groups of 2 rows, L=9, prompt_len=5 (prompts 5 and 3 tokens): the plan at 12 tokens
    is packed_tokens=[11, 8]."""
    _, mask, p = make_batch([5, 3], [[4, 2], [1, 4]], vocab=50,
                            generator=torch.Generator().manual_seed(0))
    assert mask.shape == (4, 9) and p == 5
    return mask, p


def test_a_small_batch_plans_as_expected():
    mask, p = small()
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=2, max_tokens=12)
    assert plan.packed_tokens == [11, 8] and plan.rows == [[0, 1], [2, 3]]
    assert plan.split_groups == [] and len(plan) == 2
    # 0/1 integer masks and 0-d integer tensors are taken as pack takes them
    same = dk.plan_micro_batches(mask.long(), prompt_len=torch.tensor(p), group_size=2,
                                 max_tokens=12)
    assert same == plan
    rows = dk.micro_batch_rows(mask, prompt_len=p, group_size=2, groups=None, max_tokens=12)
    assert [r.tolist() for r in rows] == plan.rows
    assert dk.micro_batch_rows(mask, prompt_len=p, group_size=2, groups=1,
                               max_tokens=None) == [slice(0, 2), slice(2, 4)]


def test_tokens_check_that_rows_are_group_major():
    # the planner costs group g from rows g*N .. g*N+N-1; with groups interleaved it plans
    # sizes pack never builds: here [20, 20] where the packed micro-batches hold 22 each
    tokens, mask, p = make_batch([8, 2], [[6, 6], [6, 6]], vocab=50,
                                 generator=torch.Generator().manual_seed(0))
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=2, max_tokens=20,
                                 tokens=tokens)  # group-major: accepted, the same plan
    assert plan == dk.plan_micro_batches(mask, prompt_len=p, group_size=2, max_tokens=20)
    order = torch.tensor([0, 2, 1, 3])
    mixed, mixed_mask = tokens[order], mask[order]
    blind = dk.plan_micro_batches(mixed_mask, prompt_len=p, group_size=2, max_tokens=20)
    assert blind.packed_tokens == [20, 20]
    assert [dk.pack(mixed[r], prompt_len=p, padding_mask=mixed_mask[r]).num_tokens
            for r in blind.rows] == [22, 22]
    match = r"rows must be group-major .*N = group_size = 2\): row 1's prompt differs from row 0's"
    with pytest.raises(ValueError, match=match):
        dk.plan_micro_batches(mixed_mask, prompt_len=p, group_size=2, max_tokens=20, tokens=mixed)
    for max_tokens in (20, None):
        with pytest.raises(ValueError, match=match):
            dk.micro_batch_rows(mixed_mask, prompt_len=p, group_size=2, groups=1,
                                max_tokens=max_tokens, tokens=mixed)
    with pytest.raises(ValueError, match=r"tokens must be an integer tensor .* torch.float32"):
        dk.plan_micro_batches(mask, prompt_len=p, group_size=2, max_tokens=20,
                              tokens=tokens.float())
    with pytest.raises(ValueError, match=r"tokens \(4, 7\) and padding_mask \(4, 14\) differ"):
        dk.plan_micro_batches(mask, prompt_len=p, group_size=2, max_tokens=20,
                              tokens=tokens[:, :7])
    # equal valid prompts padded differently are one prompt, as pack groups them: row 3's
    # prompt (2 tokens, left-padded to 8 columns) moved to the right-padded columns 0-1
    tokens[3, :2], tokens[3, 2:p] = tokens[3, p - 2:p].clone(), 0
    mask[3, :2], mask[3, 2:p] = True, False
    assert dk.pack(tokens, prompt_len=p, padding_mask=mask).num_groups == 2
    assert dk.micro_batch_rows(mask, prompt_len=p, group_size=2, groups=1, max_tokens=None,
                               tokens=tokens) == [slice(0, 2), slice(2, 4)]


PLAN_ARGS = {"prompt_len": 5, "group_size": 2, "max_tokens": 12}
ROWS_ARGS = {"prompt_len": 5, "group_size": 2, "groups": 1, "max_tokens": None}


@pytest.mark.parametrize("bad, match", [
    ({"prompt_len": 100}, r"prompt_len=100 is outside \[1, L=9\]"),
    ({"prompt_len": 10}, r"prompt_len=10 is outside \[1, L=9\]"),
    ({"prompt_len": 0}, r"prompt_len=0 is outside \[1, L=9\]"),
    ({"prompt_len": -1}, r"prompt_len=-1 is outside \[1, L=9\]"),
    ({"prompt_len": 5.0}, r"prompt_len=5\.0 must be an integer"),
    ({"prompt_len": True}, r"prompt_len=True must be an integer"),
    ({"group_size": 2.0}, r"group_size=2\.0 must be an integer"),
    ({"group_size": True}, r"group_size=True must be an integer"),
    ({"group_size": 0}, r"group_size=0 must be an integer >= 1"),
    ({"group_size": -2}, r"group_size=-2 must be an integer >= 1"),
    ({"max_tokens": None}, r"max_tokens=None must be an integer"),
    ({"max_tokens": 12.0}, r"max_tokens=12\.0 must be an integer"),
    ({"max_tokens": True}, r"max_tokens=True must be an integer"),
    ({"group_size": torch.tensor(True)}, r"group_size=tensor\(True\) must be an integer"),
    ({"max_tokens": torch.tensor([12, 13])}, r"max_tokens=tensor\(\[12, 13\]\) must be an "
                                             r"integer"),
])
def test_plan_micro_batches_names_a_bad_argument(bad, match):
    mask, _ = small()
    with pytest.raises(ValueError, match=match):
        dk.plan_micro_batches(mask, **{**PLAN_ARGS, **bad})


@pytest.mark.parametrize("bad, match", [
    ({"groups": -1}, r"groups=-1 must be an integer >= 1"),
    ({"groups": 0}, r"groups=0 must be an integer >= 1"),
    ({"groups": 1.0}, r"groups=1\.0 must be an integer"),
    ({"groups": True}, r"groups=True must be an integer"),
    ({"groups": None}, r"groups=None must be an integer"),  # no max_tokens either
    ({"groups": 0, "max_tokens": 12}, r"groups=0 must be an integer >= 1"),
    ({"prompt_len": 100}, r"prompt_len=100 is outside \[1, L=9\]"),
    ({"prompt_len": 0}, r"prompt_len=0 is outside \[1, L=9\]"),
    ({"group_size": 2.0}, r"group_size=2\.0 must be an integer"),
    ({"group_size": 0}, r"group_size=0 must be an integer >= 1"),
    ({"group_size": 3}, r"4 rows do not split into groups of group_size=3"),
    ({"max_tokens": 12.5}, r"max_tokens=12\.5 must be an integer"),
])
def test_micro_batch_rows_names_a_bad_argument(bad, match):
    mask, _ = small()
    with pytest.raises(ValueError, match=match):
        dk.micro_batch_rows(mask, **{**ROWS_ARGS, **bad})


def _with(mask, index, value):
    mask = mask.clone()
    mask[index] = value
    return mask


@pytest.mark.parametrize("fn, args", [(dk.plan_micro_batches, PLAN_ARGS),
                                      (dk.micro_batch_rows, ROWS_ARGS)])
@pytest.mark.parametrize("make_mask, match", [
    (lambda m: m.float(), r"padding_mask must be bool or integer 0/1 .*float32"),
    (lambda m: m.long() * 2, r"padding_mask must hold only 0 and 1 .*\[2\]"),
    (lambda m: m[0], r"padding_mask must be a bool or 0/1 integer tensor \[B, L\], got "
                     r"Tensor \(9,\)"),
    (lambda m: m[:, :, None], r"padding_mask must be .*tensor \[B, L\], got Tensor \(4, 9, 1\)"),
    (lambda m: m.tolist(), r"padding_mask must be .*tensor \[B, L\], got list"),
    (lambda m: m[:0], r"padding_mask has no rows \(B=0\)"),
    # what pack() refuses later, refused before planning (it was planned)
    (lambda m: _with(m, (0, 6), False), r"hole inside the response of row 0"),
    (lambda m: _with(m, (0, slice(0, 5)), False), r"row 0 has no valid prompt token"),
])
def test_a_bad_padding_mask_is_named(fn, args, make_mask, match):
    mask, _ = small()
    with pytest.raises(ValueError, match=match):
        fn(make_mask(mask), **args)


def grpo_loss_and_grads(model, tokens, mask, p, batches, aggregation):
    """The recipe's accumulation: each micro-batch's loss weighted by its share of the rows
    (sequence) or tokens (token), through response_loss; returns (loss, flat gradient)."""
    wrapper = dk.optimize(model)
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.05, aggregation=aggregation)
    resp = mask[:, p:]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        base = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    old = base + 0.1 * torch.randn(base.shape, generator=g, dtype=base.dtype)
    ref = base - 0.1 * torch.randn(base.shape, generator=g, dtype=base.dtype)
    adv = torch.randn(tokens.shape[0], generator=g, dtype=base.dtype)
    model.zero_grad()
    total = 0.0
    for rows in batches:
        share = (int(resp[rows].sum()) / int(resp.sum()) if aggregation == "token"
                 else resp[rows].shape[0] / resp.shape[0])
        token_loss = loss_fn.token_loss(old[rows], ref[rows], adv[rows], resp[rows],
                                        scale=share)
        loss, _ = wrapper.response_loss(tokens[rows], prompt_len=p, padding_mask=mask[rows],
                                        token_loss=token_loss)
        loss.backward()
        total += float(loss)
    return total, torch.cat([q.grad.flatten() for q in model.parameters()])


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
@pytest.mark.parametrize("max_tokens", [40, 26])  # whole groups; groups split
def test_planned_micro_batches_give_the_one_micro_batch_loss_and_gradients(aggregation,
                                                                          max_tokens):
    tokens, mask, p = batch()
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    one = grpo_loss_and_grads(model, tokens, mask, p, [torch.arange(12)], aggregation)
    plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=3, max_tokens=max_tokens)
    assert len(plan) > 2
    many = grpo_loss_and_grads(model, tokens, mask, p, [torch.tensor(r) for r in plan.rows],
                               aggregation)
    assert abs(many[0] - one[0]) <= TOL * max(1.0, abs(one[0]))
    assert (many[1] - one[1]).norm() <= TOL * one[1].norm()


def test_two_hundred_steps_of_varying_lengths_compile_once_per_length_bucket():
    # 200 rollout batches of 2-4 groups with prompt and response lengths drawn anew each step,
    # planned into micro-batches of at most 512 packed tokens: the compiled graph is traced once
    # per packed-length bucket a micro-batch lands in (rows, groups and lengths inside a bucket
    # change nothing), so the compiles are bounded by the buckets at or below the budget
    from dualkv_compile.layout.packing import bucket_length

    g = torch.Generator().manual_seed(0)
    model = tiny_model("qwen2_5")
    config = dk.DualKVConfig(pad_to=128, bucket_growth=1.5)
    wrapper = dk.optimize(model, config)
    dk.counters.clear()
    budget, n = 512, 3
    seen = set()
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    with torch.no_grad():
        for _ in range(200):
            groups = draw(2, 4)
            prompts = [draw(4, 120) for _ in range(groups)]
            responses = [[draw(1, 40) for _ in range(n)] for _ in range(groups)]
            tokens, mask, p = make_batch(prompts, responses, vocab=90, generator=g)
            plan = dk.plan_micro_batches(mask, prompt_len=p, group_size=n, max_tokens=budget)
            for rows in plan.rows:
                wrapper.response_logprobs(tokens[rows], prompt_len=p, padding_mask=mask[rows])
            seen.update(bucket_length(t, 128, 1.5) for t in plan.packed_tokens)
    buckets_in_budget = {bucket_length(t, 128, 1.5) for t in range(1, budget + 1)}
    assert seen <= buckets_in_budget and len(buckets_in_budget) == 4  # 128, 256, 384, 640
    assert dk.counters["graphs_compiled"] == len(seen)


def test_numpy_integers_are_ints_to_the_planner():
    import numpy as np

    mask = torch.ones(4, 9, dtype=torch.bool)
    want = dk.plan_micro_batches(mask, prompt_len=5, group_size=2, max_tokens=12)
    got = dk.plan_micro_batches(mask, prompt_len=np.int64(5), group_size=np.int32(2),
                                max_tokens=np.int64(12))
    assert got == want
    assert dk.micro_batch_rows(mask, prompt_len=5, group_size=np.int64(2), groups=np.int64(1),
                               max_tokens=None) == [slice(0, 2), slice(2, 4)]
