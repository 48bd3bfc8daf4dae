"""rl.rollout_batch (CPU, float64): the engine's responses in planned calls, joined to their
prompts with a padding mask that ends at each response's first stop token; a rank without
prompts gets empty tensors."""

import pytest
import torch

from dualkv_compile.rl import rollout_batch
from dualkv_compile.rollout import RolloutEngine, plan_calls
from dualkv_compile.testing import same_dtype_numerics, tiny_model

PAD, EOS, VOCAB = 0, 1, 8


def model():
    m = tiny_model("qwen2_5", vocab=VOCAB, seed=0)
    with torch.no_grad():  # torchtune's N(0, 1) embeddings sample near-greedily
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return same_dtype_numerics(m.double().eval())


def test_rollout_batch_joins_the_planned_calls_responses_to_their_prompts():
    torch.manual_seed(0)
    model_ = model()
    prompts = torch.randint(2, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    prompts[1, :3] = PAD  # left padding
    prompts[2, -2:] = PAD  # right padding
    kw = dict(group_size=4, pad_id=PAD, max_generated_tokens=12, temperature=2.0)
    tokens, mask, lengths = rollout_batch(RolloutEngine(model_), prompts, stop_tokens=[EOS],
                                          rows_per_call=8, rng=torch.Generator().manual_seed(1),
                                          **kw)
    # the same calls made by hand: groups (0, 1) together, then group 2
    assert plan_calls(3, 4, 8) == [(0, 2, 4), (2, 1, 4)]
    engine, gen = RolloutEngine(model_), torch.Generator().manual_seed(1)
    response = torch.cat([engine.generate(prompts[a:a + n], stop_tokens=(EOS,), rng=gen, **kw)
                          for a, n, _ in plan_calls(3, 4, 8)])
    assert tokens.shape == mask.shape == (12, 7 + 12)
    is_stop = response == EOS
    assert is_stop.any() and not is_stop.any(1).all()  # some rows stop, some reach the cap
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, 12)
    assert torch.equal(lengths, first)
    assert torch.equal(mask[:, 7:], torch.arange(12)[None] < first[:, None])
    assert torch.equal(tokens[:, 7:], torch.where(mask[:, 7:], response, PAD))
    rows = prompts.repeat_interleave(4, 0)
    assert torch.equal(mask[:, :7], rows != PAD) and torch.equal(tokens[:, :7], rows)


def test_a_rank_without_prompts_gets_empty_tensors():
    none = torch.zeros(0, 5, dtype=torch.long)
    tokens, mask, lengths = rollout_batch(RolloutEngine(model()), none, group_size=4, pad_id=PAD,
                                          max_generated_tokens=6)
    assert tokens.shape == mask.shape == (0, 11) and lengths.shape == (0,)
    assert mask.dtype == torch.bool


@pytest.mark.parametrize("family", ["qwen2_5", "hf_qwen3"])
def test_a_rank_without_prompts_gets_logprobs_in_the_dtype_of_one_with_prompts(family):
    # they were float32 for every model; a transformers model in float64 samples float64
    model_ = same_dtype_numerics(tiny_model(family, vocab=VOCAB).double().eval())
    kw = dict(group_size=2, pad_id=PAD, max_generated_tokens=3, return_logprobs=True)
    with_prompts = rollout_batch(RolloutEngine(model_), torch.full((1, 4), 3), **kw)[3]
    without = rollout_batch(RolloutEngine(model_), torch.zeros(0, 4, dtype=torch.long), **kw)[3]
    assert without.shape == (0, 3) and without.dtype == with_prompts.dtype
    assert with_prompts.dtype == (torch.float64 if family == "hf_qwen3" else torch.float32)


@pytest.mark.parametrize("bad,message", [
    (dict(pad_id=None), r"pad_id=None must be an integer in \[0, "),  # a Llama tokenizer's
    (dict(pad_id=-1), r"pad_id=-1 must be an integer"),
    (dict(temperature=0), r"temperature=0 must be a finite number >= 1e-05"),
    (dict(top_p=1.5), r"top_p=1.5"),
    (dict(max_generated_tokens=0), r"max_generated_tokens=0 must be an integer >= 1"),
    (dict(rows_per_call=0), r"rows_per_call=0 must be an integer >= 1"),
    (dict(dtype=torch.int64), r"dtype=torch.int64 \(the KV cache's"),
])
@pytest.mark.parametrize("groups", [0, 2])
def test_settings_are_checked_on_every_rank_before_anything_runs(groups, bad, message):
    # a rank with no prompts (G = 0) made no engine call, so it accepted what the ranks with
    # prompts refused, and left them in a collective; pad_id=None reached prompt_mask_of's
    # bare AttributeError first
    prompts = torch.randint(2, VOCAB, (groups, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(group_size=2, pad_id=PAD, max_generated_tokens=3) | bad
    with pytest.raises(ValueError, match=message):
        rollout_batch(RolloutEngine(model()), prompts, **kw)


@pytest.mark.parametrize("prompts", [torch.tensor([5, 6, 7]), [[5, 6, 7]],
                                     torch.tensor([[5.0, 6.0]])])
def test_prompts_that_are_not_a_token_matrix_are_named(prompts):
    # a 1-D tensor raised a bare IndexError, a list an AttributeError
    with pytest.raises(ValueError, match=r"must be \[G, P\] integer token ids"):
        rollout_batch(RolloutEngine(model()), prompts, group_size=2, pad_id=PAD,
                      max_generated_tokens=3)


def test_an_empty_prompt_is_named_by_its_row_in_the_batch():
    prompts = torch.randint(2, VOCAB, (4, 5), generator=torch.Generator().manual_seed(0))
    prompts[3] = PAD
    with pytest.raises(ValueError, match=r"prompts \[3\] hold only pad_id=0"):
        rollout_batch(RolloutEngine(model()), prompts, group_size=2, pad_id=PAD,
                      max_generated_tokens=3, rows_per_call=4)  # calls of 2 groups each


def test_stop_tokens_take_the_engines_forms_and_logprobs_are_joined():
    # stop_tokens=1 or None raised TypeError ("not iterable"); return_logprobs=True raised from
    # torch.cat over the engine's (tokens, logprobs) pairs
    model_ = model()
    prompts = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(group_size=4, pad_id=PAD, max_generated_tokens=8, rows_per_call=8)
    run = lambda stop, **more: rollout_batch(  # noqa: E731
        RolloutEngine(model_), prompts, stop_tokens=stop, rng=torch.Generator().manual_seed(3),
        **kw, **more)
    tokens, mask, lengths = run([EOS])
    assert (lengths < 8).any()  # EOS does stop some rows
    for same in (EOS, (EOS,), torch.tensor(EOS)):
        assert all(torch.equal(a, b) for a, b in zip(run(same), (tokens, mask, lengths)))
    for none in (None, ()):
        assert run(none)[2].tolist() == [8] * 12
    *joined, logprobs = run(EOS, return_logprobs=True)
    assert all(torch.equal(a, b) for a, b in zip(joined, (tokens, mask, lengths)))
    engine, gen = RolloutEngine(model_), torch.Generator().manual_seed(3)
    by_hand = torch.cat([engine.generate(prompts[a:a + n], group_size=4, pad_id=PAD,
                                         max_generated_tokens=8, stop_tokens=EOS, rng=gen,
                                         return_logprobs=True)[1]
                         for a, n, _ in plan_calls(3, 4, 8)])
    assert torch.equal(logprobs, by_hand)
    with pytest.raises(ValueError, match="stop_tokens=99 is not a token id"):
        run(99)


def test_a_prompt_mask_keeps_a_prompts_own_pad_id_tokens():
    # rollout_batch took no prompt_mask: a prompt whose own first token is pad_id lost it
    model_ = model()
    prompts = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    prompts[0, 0] = PAD  # the prompt's own token
    prompts[1, :2] = PAD  # left padding
    given = torch.ones_like(prompts, dtype=torch.bool)
    given[1, :2] = False
    kw = dict(group_size=3, pad_id=PAD, max_generated_tokens=6, stop_tokens=EOS)
    tokens, mask, _, logprobs = rollout_batch(
        RolloutEngine(model_), prompts, prompt_mask=given, rng=torch.Generator().manual_seed(5),
        return_logprobs=True, **kw)
    assert torch.equal(mask[:, :5], given.repeat_interleave(3, 0))
    assert tokens[0, 0] == PAD and mask[0, 0]  # kept, where the default strips it
    by_hand = RolloutEngine(model_).generate(prompts, prompt_mask=given, return_logprobs=True,
                                             rng=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(tokens[:, 5:], torch.where(mask[:, 5:], by_hand[0], PAD))
    assert torch.equal(logprobs, by_hand[1])
    default = rollout_batch(RolloutEngine(model_), prompts, rng=torch.Generator().manual_seed(5),
                            **kw)
    assert not default[1][0, 0]  # without the mask, its first token read as padding
    with pytest.raises(ValueError, match=r"prompt_mask \(2, 4\) torch.bool"):
        rollout_batch(RolloutEngine(model_), prompts, prompt_mask=given[:, :4], **kw)
    holed = given.clone()
    holed[0, 2] = False  # generate compacts it; the update refused it after the rollout
    with pytest.raises(ValueError, match=r"prompt_mask rows \[0\] have a False between"):
        rollout_batch(RolloutEngine(model_), prompts, prompt_mask=holed, **kw)
    with pytest.raises(ValueError, match=r"prompts \[1\] have no token"):
        rollout_batch(RolloutEngine(model_), prompts,
                      prompt_mask=given & torch.tensor([[True], [False]]), **kw)
