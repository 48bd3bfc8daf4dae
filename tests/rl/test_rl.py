import pytest
import torch

from dualkv_compile.rl import (
    CharTokenizer,
    GRPOLoss,
    RepeatLastLetterTask,
    group_advantages,
    groups_with_signal,
    overlong_penalty,
)


def test_group_advantages_normalise_within_each_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = group_advantages(r)
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(a[1], torch.zeros(4))
    assert torch.allclose(group_advantages(r, scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match=r"\[groups, samples\] with at least one of each, "
                                         r"got shape \(4,\)"):
        group_advantages(r[0])
    # 0/1 rule rewards as ints or bools: the same advantages as their float form
    assert torch.equal(group_advantages(r[:1].long()), a[:1])
    assert torch.equal(group_advantages(r[:1].bool()), a[:1])


def test_groups_of_equal_rewards_get_exactly_zero_advantages():
    # 1/3 (an overlong penalty's value) is not a binary fraction: float32's mean of eight of
    # them is one ulp off, and that ulp divided by eps once gave every sample 0.03
    r = torch.full((2, 8), 1.0) / 3
    r[1, 0] = 1.0
    for scale in (True, False):
        a = group_advantages(r, scale=scale)
        assert torch.equal(a[0], torch.zeros(8)) and bool((a[1] != 0).all())


def test_dynamic_sampling_and_overlong_shaping():
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.3, 0.3]])
    assert groups_with_signal(r).tolist() == [False, True, False]
    pen = overlong_penalty(torch.tensor([5, 8, 9, 10, 12]), max_len=10, cache_len=2)
    # a list as a user's reward function has it (it raised a bare AttributeError)
    assert torch.equal(overlong_penalty([5, 8, 9, 10, 12], max_len=10, cache_len=2), pen)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache_len=0"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=0)
    # a negative length got 0, a NaN one a NaN penalty (added to rewards already checked), a
    # [1, B] tensor passed
    for bad in (torch.tensor([-5.0, 3.0]), torch.tensor([float("nan")]), torch.tensor([[9, 10]])):
        with pytest.raises(ValueError, match="lengths must be \\[B\\] finite counts >= 0"):
            overlong_penalty(bad, max_len=10, cache_len=4)


def test_a_draw_of_no_prompts_is_zero_rows():
    prompts, answers = RepeatLastLetterTask(CharTokenizer()).sample_prompts(0)
    assert prompts.shape == (0, RepeatLastLetterTask(CharTokenizer()).max_prompt_len)
    assert answers == []


def test_group_advantages_argument_forms():
    # scale="no" still scaled; a list raised a bare AttributeError
    r = torch.tensor([[1.0, 0.0, 0.5]])
    assert torch.equal(group_advantages([[1.0, 0.0, 0.5]]), group_advantages(r))
    with pytest.raises(ValueError, match="scale='no' must be True or False"):
        group_advantages(r, scale="no")
    with pytest.raises(ValueError, match="rewards must be .* got str"):
        group_advantages("1 0")


def test_grpo_loss_by_hand():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.1], [0.2, 0.4, 0.4]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.4, 0.4, 0.4]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.0)
    loss, stats = loss_fn(lp, old, lp, adv, mask)
    # ratios: row0 [2, 1], row1 [0.5, 1, 1]; clipped: [1.28, 1], [0.8, 1, 1]
    # row0 (A=+1): -min(r, clip) = [-1.28, -1]; row1 (A=-1): -min(-r, -clip) = [0.8, 1, 1]
    expect_seq = (torch.tensor(-2.28 / 2) + torch.tensor(2.8 / 3)) / 2
    assert torch.isclose(loss, expect_seq)
    token_loss, _ = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.0,
                             aggregation="token")(lp, old, lp, adv, mask)
    assert torch.isclose(token_loss, torch.tensor((-2.28 + 2.8) / 5))
    # Dr. GRPO: the token sum over responses x the width (2 x 3), whatever each one's length
    constant_loss, _ = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.0,
                                aggregation="constant")(lp, old, lp, adv, mask)
    assert torch.isclose(constant_loss, torch.tensor((-2.28 + 2.8) / 6))
    assert torch.isclose(stats["clip_fraction"], torch.tensor(2 / 5))
    assert stats["kl"] == 0
    assert torch.isclose(stats["ratio"], torch.tensor(5.5 / 5))  # over the 5 tokens in the mask


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_per_token_form_equals_the_loss(aggregation):
    # what the recipe hands to response_loss: the loss (times a scale) as a per-token function of
    # the valid tokens, gathered by flat index; value and gradient against the [B, R] loss
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 5, dtype=torch.float64, generator=g) - 2).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(3, 5, dtype=torch.float64, generator=g)
    ref = lp.detach() + 0.1 * torch.randn(3, 5, dtype=torch.float64, generator=g)
    adv = torch.randn(3, dtype=torch.float64, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.1, aggregation=aggregation)
    loss, _ = loss_fn(lp, old, ref, adv, mask)
    index = mask.flatten().nonzero().squeeze(1)
    per_token = loss_fn.token_loss(old, ref, adv, mask, scale=3.0)(lp.flatten()[index], index)
    assert per_token.shape == index.shape
    assert torch.allclose(per_token.sum(), 3 * loss, rtol=1e-14)
    (g_loss,) = torch.autograd.grad(3 * loss, lp)
    (g_tok,) = torch.autograd.grad(per_token.sum(), lp)
    assert torch.allclose(g_tok, g_loss, rtol=1e-14, atol=1e-16) and (g_tok[~mask] == 0).all()


def test_constant_aggregation_divides_by_max_response_len_whatever_the_padding():
    # TRL's dr_grpo divides by max_completion_length: the same rows padded wider give the
    # same loss; without max_response_len the divisor is the width passed
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(2, 3, dtype=torch.float64, generator=g)
    old, adv = lp + 0.1, torch.tensor([1.0, -0.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    wide = [torch.cat([x, x.new_zeros(2, 4)], 1) for x in (lp, old, mask)]
    fixed = GRPOLoss(aggregation="constant", max_response_len=8)
    assert torch.equal(fixed(lp, old, lp, adv, mask)[0],
                       fixed(wide[0], wide[1], wide[0], adv, wide[2])[0])
    by_width = GRPOLoss(aggregation="constant")
    assert torch.isclose(by_width(lp, old, lp, adv, mask)[0] * 3 / 8,
                         fixed(lp, old, lp, adv, mask)[0], rtol=1e-14)


def test_padding_values_do_not_reach_the_loss_or_its_gradient():
    # padding may hold NaN or -inf old/ref logprobs (a user's buffers); a weight of 0 does
    # not cancel NaN, so the [B, R] form once returned NaN where the per-token form did not
    g = torch.Generator().manual_seed(2)
    lp = torch.randn(2, 4, dtype=torch.float64, generator=g).requires_grad_()
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    clean = lp.detach() + 0.2
    loss_fn = GRPOLoss(kl_coef=0.1, epsilon_high=0.28)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    want, want_stats = loss_fn(lp, clean, clean, adv, mask)
    for fill in (float("nan"), float("-inf"), float("inf")):
        dirty = torch.where(mask, clean, torch.full_like(clean, fill))
        loss, stats = loss_fn(lp, dirty, dirty, adv, mask)
        assert torch.equal(loss, want) and all(torch.equal(stats[k], want_stats[k]) for k in stats)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()


def test_kl_term_is_k3_and_its_gradient_pulls_to_the_reference():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = GRPOLoss(kl_coef=1.0)(lp, lp.detach(), ref, torch.zeros(1), mask)
    d = -0.5
    k3 = torch.exp(torch.tensor(d)) - d - 1
    assert torch.isclose(stats["kl"], k3 / 2)
    loss.backward()
    assert lp.grad[0, 0] > 0 and lp.grad[0, 1] == 0  # above the reference: pushed down


def test_bad_shaping_arguments_are_named():
    # each was accepted: eps < 0 gave infinite advantages, a [G, 0] batch a torch warning and an
    # empty result, fractional or negative lengths a penalty band of no meaning, updates=0 no
    # update at all
    from dualkv_compile.rl import mini_batches

    with pytest.raises(ValueError, match=r"eps=-0.5 must be a finite number >= 0.0"):
        group_advantages(torch.tensor([[0.0, 1.0]]), eps=-0.5)
    with pytest.raises(ValueError, match=r"at least one of each, got shape \(2, 0\)"):
        group_advantages(torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"cache_len=0.5 must be an integer >= 1"):
        overlong_penalty(torch.tensor([3, 9]), max_len=12, cache_len=0.5)
    with pytest.raises(ValueError, match=r"max_len=-2 must be an integer >= 1"):
        overlong_penalty(torch.tensor([3, 9]), max_len=-2, cache_len=1)
    for args, match in (((4, 2, 0), "updates=0"), ((4, 2, -1), "updates=-1"),
                        ((4, 0, 2), "group_size=0"), ((-1, 2, 2), "groups=-1")):
        with pytest.raises(ValueError, match=match + " must be an integer"):
            mini_batches(*args)


def test_bad_loss_settings():
    with pytest.raises(ValueError, match="aggregation='mean'"):
        GRPOLoss(aggregation="mean")
    with pytest.raises(ValueError, match="kl_coef=-1"):
        GRPOLoss(kl_coef=-1)
    with pytest.raises(ValueError, match="epsilon_low=-0.1"):
        GRPOLoss(epsilon_low=-0.1)
    with pytest.raises(ValueError, match="epsilon_high=-0.1"):
        GRPOLoss(epsilon_high=-0.1)
    for kw, match in [(dict(epsilon_high=float("nan")), "epsilon_high=nan"),
                      (dict(kl_coef=float("inf")), "kl_coef=inf"),
                      (dict(epsilon_low="0.2"), "epsilon_low='0.2' must be a finite number"),
                      # a lower clip bound 1 - 2.0 < 0 never clips: 2.0 was meant as 0.2
                      (dict(epsilon_low=2.0), r"epsilon_low=2.0 must be a finite number in "
                                              r"\[0.0, 1.0\]"),
                      (dict(aggregation="constant", max_response_len=0), "max_response_len=0")]:
        with pytest.raises(ValueError, match=match):
            GRPOLoss(**kw)
    lp, mask = torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool)
    for bad in (mask.double(), mask.long()):  # a weight, not a mask: refused, not renormalised
        with pytest.raises(ValueError, match="mask must be a bool tensor"):
            GRPOLoss()(lp, lp, lp, torch.ones(4), bad)
        with pytest.raises(ValueError, match="mask must be a bool tensor"):
            GRPOLoss().token_loss(lp, lp, torch.ones(4), bad)
        with pytest.raises(ValueError, match="mask must be a bool tensor"):
            GRPOLoss().stats(lp, lp, lp, bad)
    with pytest.raises(ValueError, match="old_logprobs must be a tensor, got list"):
        GRPOLoss().token_loss(lp.tolist(), lp, torch.ones(4), mask)
    with pytest.raises(ValueError, match=r"width 3 exceed max_response_len=2"):
        GRPOLoss(aggregation="constant", max_response_len=2)(lp, lp, lp, torch.ones(4), mask)
    with pytest.raises(ValueError, match=r"advantages \[B\]; got .* and \(3,\)"):
        GRPOLoss()(lp, lp, lp, torch.ones(3), mask)
    with pytest.raises(ValueError, match=r"one shape \[B, R\]"):
        GRPOLoss()(lp, lp[:, :2], lp, torch.ones(4), mask)


def test_tokenizer_and_task_reward():
    tok = CharTokenizer()
    ids = tok.encode("abc:")
    assert ids[0] == tok.bos_id and tok.decode(ids) == "abc:"
    with pytest.raises(ValueError, match=r"characters \['!'\]"):
        tok.encode("a!")
    task = RepeatLastLetterTask(tok, prompt_letters=4, target_len=4, seed=1)
    prompts, answers = task.sample_prompts(3)
    assert prompts.shape == (3, 6) and all(tok.decode(p)[-2] == a for p, a in zip(prompts, answers))
    a = answers[0]
    other = "a" if a != "a" else "b"
    responses = torch.tensor([
        tok.encode(a * 4, add_bos=False),                                   # all right
        tok.encode(a * 2 + other * 2, add_bos=False),                       # half
        tok.encode(a, add_bos=False) + [tok.eos_id, *tok.encode(a * 2, add_bos=False)],  # stops
    ])
    assert task.rewards(responses, [a, a, a]).tolist() == [1.0, 0.5, 0.25]
    # ids past the alphabet (a model vocabulary padded past the tokenizer's) decode as one
    # unknown mark each, which matches no letter: scored wrong, where they were an IndexError
    past = tok.vocab_size
    assert tok.decode([past, *tok.encode(a, add_bos=False), past + 3]) == f"\ufffd{a}\ufffd"
    assert task.rewards(torch.tensor([[past] + tok.encode(a * 3, add_bos=False)]),
                        [a]).tolist() == [0.75]
    # so are a sampled pad or bos id inside a response (decode dropped them, moving the later
    # characters up: full credit)
    for stray in (tok.pad_id, tok.bos_id):
        assert task.rewards(torch.tensor([tok.encode(a, add_bos=False) + [stray]
                                          + tok.encode(a * 2, add_bos=False)]),
                            [a]).tolist() == [0.75]
    with pytest.raises(ValueError, match=r"holds '\ufffd'"):
        CharTokenizer("ab\ufffd")
    with pytest.raises(ValueError, match=r"alphabet 'abcdefgh' lacks ':'"):
        RepeatLastLetterTask(CharTokenizer("abcdefgh"))  # was a ValueError in sample_prompts
    state = task.state_dict()
    first = task.sample_prompts(2)[0]
    task.load_state_dict(state)
    assert torch.equal(task.sample_prompts(2)[0], first)  # resumable data order


def test_tokens_the_loss_mask_leaves_out_do_not_reach_the_fused_loss():
    # the LM head evaluates every padding-mask token, and token_loss computed each one's term
    # before its weight of 0: NaN or -inf old logprobs at tokens a loss mask leaves out (DAPO's
    # filtered responses) made the loss or its gradient NaN
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(2, 4, dtype=torch.float64, generator=g).requires_grad_()
    loss_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    index = torch.arange(8)  # every token: the padding mask keeps them all
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss_fn = GRPOLoss(kl_coef=0.1, aggregation="token")
    clean = lp.detach() + 0.2
    want = loss_fn.token_loss(clean, clean, adv, loss_mask)(lp.flatten(), index).sum()
    for fill in (float("nan"), float("-inf")):
        dirty = torch.where(loss_mask, clean, torch.full_like(clean, fill))
        loss = loss_fn.token_loss(dirty, dirty, adv, loss_mask)(lp.flatten(), index).sum()
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.equal(loss, want) and torch.isfinite(grad).all()
        assert (grad[~loss_mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_ratio_past_exps_range_keeps_the_clipped_value_and_gradient(dtype):
    # exp(91) is inf in float32 (exp(751) in float64): a positive advantage takes the clipped
    # term, whose gradient is 0, and got NaN (0 * inf in exp's backward); a zero advantage got
    # a NaN loss (inf * 0). A negative one takes the ratio itself and overflows honestly
    big = 90.0 if dtype == torch.float32 else 750.0
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.2, aggregation="token")
    mask = torch.ones(1, 1, dtype=torch.bool)
    for adv, want in [(1.0, -1.2), (0.0, 0.0)]:
        lp = torch.tensor([[-1.0]], dtype=dtype, requires_grad=True)
        old = torch.tensor([[-1.0 - big]], dtype=dtype)
        loss, stats = loss_fn(lp, old, lp.detach(), torch.tensor([adv], dtype=dtype), mask)
        (grad,) = torch.autograd.grad(loss, lp)
        assert abs(loss.item() - want) < 1e-6 and grad.item() == 0, (adv, loss, grad)
        assert stats["clip_fraction"] == 1
    lp = torch.tensor([[-1.0]], dtype=dtype, requires_grad=True)
    loss, _ = loss_fn(lp, old, lp.detach(), torch.tensor([-1.0], dtype=dtype), mask)
    assert loss.item() == float("inf")


def test_stats_of_bf16_logprobs_count_in_float32():
    # the token count and sums ran in bf16: clip_fraction 0.5078 for 0.5193 over 1733 tokens
    g = torch.Generator().manual_seed(4)
    lp = torch.randn(3, 700, generator=g)
    old = lp + 0.3 * torch.randn(3, 700, generator=g)
    mask = torch.arange(700) < torch.tensor([[700], [600], [433]])
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.2)
    half = [t.to(torch.bfloat16) for t in (lp, old)]
    got = loss_fn.stats(half[0], half[1], half[0], mask)["clip_fraction"]
    want = loss_fn.stats(half[0].double(), half[1].double(), half[0].double(), mask)
    assert abs(got.item() - want["clip_fraction"].item()) < 1e-6


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_kl_coef_0_takes_no_reference(aggregation):
    # the reference's logprobs entered a KL term multiplied by 0 (TRL and veRL build no
    # reference then); None is now taken, with the same loss and gradient
    from dualkv_compile.rl import needs_reference

    g = torch.Generator().manual_seed(3)
    lp = torch.randn(4, 5, dtype=torch.float64, generator=g).requires_grad_()
    old, ref = (torch.randn(4, 5, dtype=torch.float64, generator=g) for _ in range(2))
    adv = torch.randn(4, dtype=torch.float64, generator=g)
    mask = torch.rand(4, 5, generator=g) > 0.3
    loss_fn = GRPOLoss(kl_coef=0.0, aggregation=aggregation)
    assert not needs_reference(loss_fn) and needs_reference(GRPOLoss())
    with_ref, stats = loss_fn(lp, old, ref, adv, mask)
    without, free_stats = loss_fn(lp, old, None, adv, mask)
    assert with_ref.item() == without.item() and free_stats["kl"].item() == 0.0
    assert torch.equal(*(torch.autograd.grad(x, lp)[0] for x in (with_ref, without)))
    assert free_stats["clip_fraction"] == stats["clip_fraction"]
    index = mask.flatten().nonzero()[:, 0]
    per_token = [loss_fn.token_loss(old, r, adv, mask)(lp.flatten()[index], index).sum()
                 for r in (ref, None)]
    assert per_token[0].item() == per_token[1].item() == pytest.approx(with_ref.item())
    with pytest.raises(ValueError, match=r"ref_logprobs is None, but the KL term \(kl_coef=0.04"):
        GRPOLoss()(lp, old, None, adv, mask)
    with pytest.raises(ValueError, match=r"ref_logprobs is None"):
        GRPOLoss().token_loss(old, None, adv, mask)
