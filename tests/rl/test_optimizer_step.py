"""rl.optimizer_step against the plain computation: the unmodified model row by row at the
sampling temperature, GRPOLoss over its logprobs (CPU, float64, 1e-10), with and without a loss
mask (DAPO's overlong filtering), over several micro-batches; a rank's uncounted rows change
nothing; and rl.truncated_responses, which gives the rows to filter."""

import copy

import numpy as np
import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.rl import GRPOLoss, mini_batches, optimizer_step, truncated_responses
from dualkv_compile.testing import (make_batch, row_by_row_response_logprobs,
                                    same_dtype_numerics, tiny_model)

TOL = 1e-10
T = 0.7  # not 1: a temperature dropped anywhere shows
FILTERED = [1, 4, 5]  # rows whose responses leave the loss


def setup(aggregation):
    g = torch.Generator().manual_seed(0)
    tokens, mask, p = make_batch([7, 4, 9], [[5, 8], [2, 6], [8, 3]], vocab=90, generator=g)
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    with torch.no_grad():
        base = row_by_row_response_logprobs(model, tokens, mask, p, temperature=T)
    old = base + 0.1 * torch.randn(base.shape, generator=g, dtype=base.dtype)
    ref = base - 0.1 * torch.randn(base.shape, generator=g, dtype=base.dtype)
    adv = torch.randn(tokens.shape[0], generator=g, dtype=base.dtype)
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.05, aggregation=aggregation)
    return model, tokens, mask, p, old, ref, adv, loss_fn


def step(model, tokens, mask, p, old, ref, adv, loss_fn, loss_mask, counted=True):
    """optimizer_step with SGD at lr 1 over 3 micro-batches: returns (stats, -update)."""
    before = [q.detach().clone() for q in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, p, old, ref, adv,
                           group_size=2, temperature=T, max_grad_norm=1e9,
                           micro_batch_groups=1, loss_mask=loss_mask, counted=counted)
    return stats, torch.cat([(b - q.detach()).flatten()
                             for b, q in zip(before, model.parameters())])


@pytest.mark.parametrize("filtered", [False, True], ids=["all_rows", "loss_mask"])
@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_the_step_is_the_plain_models_loss_gradient(aggregation, filtered):
    model, tokens, mask, p, old, ref, adv, loss_fn = setup(aggregation)
    loss_mask = mask[:, p:].clone()
    if filtered:
        loss_mask[FILTERED] = False
    plain = copy.deepcopy(model)
    stats, update = step(model, tokens, mask, p, old, ref, adv, loss_fn,
                         loss_mask if filtered else None)

    lp = row_by_row_response_logprobs(plain, tokens, mask, p, temperature=T)
    loss, _ = loss_fn(lp, old, ref, adv, loss_mask)
    loss.backward()
    grad = torch.cat([q.grad.flatten() for q in plain.parameters()])
    assert abs(stats.loss - loss.item()) <= TOL * max(1.0, abs(loss.item()))
    assert (update - grad).norm() <= TOL * grad.norm()

    if filtered:  # the filtered rows did weigh: without the mask the step differs
        _, unfiltered = step(copy.deepcopy(plain), tokens, mask, p, old, ref, adv, loss_fn, None)
        assert (unfiltered - update).norm() > 1e-3 * grad.norm()


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_without_a_reference_the_step_is_the_plain_models_kl_free_loss_gradient(aggregation):
    # kl_coef=0 takes ref=None (no reference model): the same step as the plain model's loss
    model, tokens, mask, p, old, ref, adv, _ = setup(aggregation)
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.0, aggregation=aggregation)
    plain = copy.deepcopy(model)
    stats, update = step(model, tokens, mask, p, old, None, adv, loss_fn, None)
    lp = row_by_row_response_logprobs(plain, tokens, mask, p, temperature=T)
    loss, _ = loss_fn(lp, old, ref, adv, mask[:, p:])
    loss.backward()
    grad = torch.cat([q.grad.flatten() for q in plain.parameters()])
    assert abs(stats.loss - loss.item()) <= TOL * max(1.0, abs(loss.item()))
    assert (update - grad).norm() <= TOL * grad.norm() and stats.kl == 0
    with pytest.raises(ValueError, match=r"ref is None, but the loss has a KL term"):
        step(plain, tokens, mask, p, old, None, adv, GRPOLoss(), None)


def test_uncounted_rows_change_nothing():
    # counted=False: a rank with no group of its own runs rows at weight 0 (FSDP's collectives)
    model, tokens, mask, p, old, ref, adv, loss_fn = setup("sequence")
    stats, update = step(model, tokens, mask, p, old, ref, adv, loss_fn, None, counted=False)
    assert update.abs().max() == 0 and stats.loss == 0 and stats.grad_norm == 0
    assert stats.kl == 0 and stats.clip_fraction == 0


def test_a_step_whose_loss_counts_no_token_moves_no_weight(caplog):
    # every response truncated under overlong filtering: the gradient is 0, and AdamW's step
    # still moved the weights (weight decay; momentum once it has any)
    model, tokens, mask, p, old, ref, adv, loss_fn = setup("token")
    before = [q.detach().clone() for q in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    stats = optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, p, old, ref, adv,
                           group_size=2, temperature=T, max_grad_norm=1.0,
                           loss_mask=torch.zeros_like(mask[:, p:]))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    assert tuple(stats) == (0.0, 0.0, 0.0, 0.0, False)  # stepped=False: the recipe's count
    assert "counts no response token on any rank" in caplog.text


def test_a_loss_mask_outside_the_responses_or_of_another_shape_is_refused():
    model, tokens, mask, p, old, ref, adv, loss_fn = setup("token")
    outside = mask[:, p:].clone()
    outside[2, -1] = True  # row 2's response is 6 tokens of 8
    with pytest.raises(ValueError, match=r"outside the padding mask's responses \(row 2\)"):
        step(model, tokens, mask, p, old, ref, adv, loss_fn, outside)
    with pytest.raises(ValueError, match=r"loss_mask must be bool of the responses' shape"):
        step(model, tokens, mask, p, old, ref, adv, loss_fn, mask[:, p:].float())


def test_the_plain_model_as_policy_is_refused_by_name():
    model, tokens, mask, p, old, ref, adv, loss_fn = setup("token")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer_step needs the wrapper dualkv_compile.optimize"):
        optimizer_step(model, loss_fn, opt, tokens, mask, p, old, ref, adv, group_size=2,
                       temperature=1.0, max_grad_norm=1.0)


def test_truncated_responses_end_without_a_stop_token():
    eos, pad = 1, 1  # pad = eos, as in many tokenizers
    # prompt 3 tokens (row 3 holds eos in its prompt); responses of width 4
    tokens = torch.tensor([[5, 6, 7, 2, eos, pad, pad],   # stops at its 2nd token
                           [5, 6, 7, 2, 3, 4, 2],         # cut at the cap
                           [5, 6, 7, 2, 3, 4, eos],       # stops at the last position
                           [eos, 6, 7, 3, 3, 3, 3]])      # eos only in the prompt: cut
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1] * 7, [1] * 7, [1] * 7], dtype=torch.bool)
    cut = truncated_responses(tokens, mask, prompt_len=3, stop_tokens=[eos])
    assert cut.tolist() == [False, True, False, True]
    # a stop token after the mask's end is not the response's
    assert truncated_responses(tokens, mask & (torch.arange(7) < 6), prompt_len=3,
                               stop_tokens=[eos]).tolist() == [False, True, True, True]
    # with no stop tokens every response is cut at the cap
    assert truncated_responses(tokens, mask, prompt_len=3, stop_tokens=()).all()
    # a narrower mask broadcast, a prompt_len past L or negative: every row read as cut (and
    # filtered out of the loss), without an error
    for bad, match in [(dict(mask=mask[:, :5]), r"of one shape, got \(4, 7\) and \(4, 5\)"),
                       (dict(prompt_len=10), r"prompt_len=10 is outside \[1, L=7\]"),
                       (dict(prompt_len=-1), r"prompt_len=-1 is outside")]:
        with pytest.raises(ValueError, match=match):
            truncated_responses(**{"tokens": tokens, "mask": mask, "prompt_len": 3,
                                   "stop_tokens": [eos], **bad})


def test_per_row_inputs_are_checked_before_any_micro_batch_runs():
    # advantages per group [G] or old logprobs of another batch's rows were indexed per
    # micro-batch: rows dropped silently, or an IndexError after an earlier micro-batch had
    # already left its gradients in .grad
    model, tokens, mask, p, old, ref, adv, loss_fn = setup("sequence")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    kw = dict(group_size=2, temperature=T, max_grad_norm=1e9)
    cases = [((old, ref, adv[::2]), r"advantages must be \[6\] .* got \(3,\)"),
             ((old, ref, torch.cat([adv, adv])), r"advantages must be \[6\]"),
             ((torch.cat([old, old]), ref, adv), r"old must be \[6, \d+\]"),
             ((old, ref[:, 1:], adv), r"ref must be \[6, \d+\]")]
    for (o, r, a), match in cases:
        with pytest.raises(ValueError, match=match):
            optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, p, o, r, a, **kw)
        assert all(q.grad is None for q in model.parameters())
    no_response = tokens.shape[1]
    empty = old[:, :0]
    with pytest.raises(ValueError, match="leaves no response columns"):
        optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, no_response, empty, empty,
                       adv, **kw)


def test_non_finite_inputs_the_loss_counts_and_a_non_bool_counted_are_refused():
    # a NaN old logprob with a positive advantage was masked out of the gradient by the
    # clipping: loss NaN, the step taken; NaN advantages or ref reached the gradient norm,
    # blamed on the learning rate; counted=2 halved the update
    model, tokens, mask, p, old, ref, adv, loss_fn = setup("token")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    kw = dict(group_size=2, temperature=T, max_grad_norm=1e9)
    resp = mask[:, p:]
    row, tok = [int(i) for i in resp.nonzero()[0]]
    pad_row, pad_tok = [int(i) for i in (~resp).nonzero()[0]]
    nan_old, nan_ref, nan_adv = old.clone(), ref.clone(), adv.clone()
    nan_old[row, tok] = float("nan")
    nan_ref[row, tok] = -float("inf")
    nan_adv[row] = float("nan")
    adv_pos = adv.abs()
    cases = [((nan_old, ref, adv_pos), {}, rf"old is not finite at row, token {row}, {tok},"),
             ((old, nan_ref, adv), {}, rf"ref is not finite at row, token {row}, {tok},"),
             ((old, ref, nan_adv), {}, rf"advantages is not finite at row {row},"),
             ((old, ref, adv), {"counted": 2}, r"counted=2 must be True or False"),
             ((old, ref, adv), {"counted": "no"}, r"counted='no' must be True or False")]
    for (o, r, a), extra, match in cases:
        with pytest.raises(ValueError, match=match):
            optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, p, o, r, a,
                           **kw, **extra)
        assert all(q.grad is None for q in model.parameters())
    # outside the counted tokens anything goes (padding; a filtered response)
    pad_old = old.clone()
    pad_old[pad_row, pad_tok] = float("nan")
    filtered = resp.clone()
    filtered[row] = False
    stats = optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, p, nan_old, ref,
                           adv, loss_mask=filtered, **kw)
    assert stats.stepped and stats.loss == stats.loss
    stats = optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, p, pad_old, ref,
                           adv, **kw)
    assert stats.stepped and stats.loss == stats.loss
    model, tokens, mask, p, old, ref, adv, loss_fn = setup("token")  # (weights not stepped)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for counted in (1, np.True_, torch.tensor(True)):  # a 0/1 counted as the bool it is
        assert optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, p, old, ref, adv,
                              counted=counted, **kw).stepped


def test_max_grad_norm_and_empty_or_integer_masks():
    # max_grad_norm=-1 reversed the update exactly (clip_grad_norm_'s coefficient went
    # negative), 0 zeroed it while AdamW still stepped; a rank's empty rows were refused as
    # "padding_mask has no rows (B=0)"; a 0/1 integer padding mask, which pack() takes, was
    # refused mid-step as "mask must be a bool tensor"
    model, tokens, mask, p, old, ref, adv, loss_fn = setup("sequence")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    kw = dict(group_size=2, temperature=T)
    for bad in (-1.0, 0, float("nan"), "1"):
        with pytest.raises(ValueError, match=rf"max_grad_norm={bad!r} must be a number > 0"):
            optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask, p, old, ref, adv,
                           max_grad_norm=bad, **kw)
    with pytest.raises(ValueError, match="tokens has no rows: a rank with nothing to train on "
                                         "passes rows of a group"):
        optimizer_step(dk.optimize(model), loss_fn, opt, tokens[:0], mask[:0], p, old[:0],
                       ref[:0], adv[:0], max_grad_norm=1.0, counted=False, **kw)
    with pytest.raises(ValueError, match=r"mask must be a tensor of the tokens' shape"):
        optimizer_step(dk.optimize(model), loss_fn, opt, tokens, mask[:, 1:], p, old, ref, adv,
                       max_grad_norm=1.0, **kw)
    assert all(q.grad is None for q in model.parameters())
    twin = copy.deepcopy(model)
    _, update = step(model, tokens, mask, p, old, ref, adv, loss_fn, None)
    _, int_update = step(twin, tokens, mask.long(), p, old, ref, adv, loss_fn, None)
    assert torch.equal(update, int_update)


@pytest.mark.parametrize("plan", [dict(micro_batch_groups=2), dict(max_tokens=30)],
                         ids=["groups", "token_budget"])
def test_micro_batched_logprobs_are_the_plain_models(plan, monkeypatch):
    # the recipe's old and reference logprobs, by the update's micro-batches (a whole-batch
    # forward compiled packed lengths the recipe's recompile budget did not count); a rank
    # with fewer micro-batches than another repeats its first, and keeps its own values
    from dualkv_compile.layout.plan import micro_batch_rows
    from dualkv_compile.rl import distributed as ddp
    from dualkv_compile.rl import micro_batched_logprobs

    model, tokens, mask, p, *_ = setup("sequence")
    policy = dk.optimize(model)
    batches = micro_batch_rows(mask, prompt_len=p, group_size=2,
                               groups=plan.get("micro_batch_groups"),
                               max_tokens=plan.get("max_tokens"))
    assert len(batches) > 1
    calls = []
    forward = policy.response_logprobs
    monkeypatch.setattr(policy, "response_logprobs",
                        lambda t, **kw: calls.append(t.shape[0]) or forward(t, **kw))
    monkeypatch.setattr(ddp, "all_max", lambda *v: [len(batches) + 1])  # another rank's count
    with torch.no_grad():
        got = micro_batched_logprobs(policy, tokens, mask, p, group_size=2, temperature=T,
                                     **plan)
        want = row_by_row_response_logprobs(model, tokens, mask, p, temperature=T)
    assert len(calls) == len(batches) + 1 and calls[-1] == calls[0]
    assert (got - want).abs().max() <= TOL


def test_logprobs_of_mini_batches_run_the_updates_packed_lengths(monkeypatch):
    # with updates_per_step > 1 and a token budget, the whole batch planned at once packed
    # lengths none of the updates' micro-batches have (graphs compiled for nothing): the
    # logprob passes plan each mini-batch as its update does, and keep the plain values
    from dualkv_compile.rl import micro_batched_logprobs

    g = torch.Generator().manual_seed(1)
    # packed sizes 60, 45, 60, 15 at a budget of 123: the whole batch packs [60+60 | 45+15],
    # its halves [60+45] and [60+15]
    tokens, mask, p = make_batch([30, 15, 30, 5], [[15, 15], [15, 15], [15, 15], [5, 5]],
                                 vocab=90, generator=g)
    model = same_dtype_numerics(tiny_model("qwen2_5", vocab=90)).double()
    policy = dk.optimize(model)
    seen = {"logprobs": [], "update": []}
    forward, loss = policy.response_logprobs, policy.response_loss
    monkeypatch.setattr(policy, "response_logprobs", lambda t, **kw: seen["logprobs"].append(
        int(kw["padding_mask"].sum())) or forward(t, **kw))
    monkeypatch.setattr(policy, "response_loss", lambda t, **kw: seen["update"].append(
        int(kw["padding_mask"].sum())) or loss(t, **kw))
    with torch.no_grad():
        got = micro_batched_logprobs(policy, tokens, mask, p, group_size=2, temperature=T,
                                     max_tokens=123, updates=2)
        want = row_by_row_response_logprobs(model, tokens, mask, p, temperature=T)
    assert (got - want).abs().max() <= TOL
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.2, kl_coef=0.0, aggregation="token")
    for rows, _ in mini_batches(4, 2, 2):
        optimizer_step(policy, loss_fn, opt, tokens[rows], mask[rows], p, got[rows], got[rows],
                       torch.ones(tokens[rows].shape[0], dtype=torch.float64), group_size=2,
                       temperature=T, max_grad_norm=1e9, max_tokens=123)
    assert seen["logprobs"] == seen["update"] and len(seen["update"]) == 2, seen


def test_mini_batches_are_runs_of_whole_groups():
    assert mini_batches(5, 3, 2) == [(slice(0, 6), True), (slice(6, 15), True)]
    # fewer groups than updates: the empty one runs the first group at weight 0
    assert mini_batches(1, 4, 2) == [(slice(0, 4), False), (slice(0, 4), True)]
