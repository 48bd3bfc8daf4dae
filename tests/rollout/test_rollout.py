"""generate_groups (shared prompt prefilled once) samples exactly what torchtune's generate()
samples on the replicated batch: same tokens for the same generator, left-padded prompts
included, with and without an early stop."""

import pytest
import torch
from torchtune.generation import generate
from torchtune.modules.common_utils import local_kv_cache

from dualkv_compile.models import qwen3
from dualkv_compile.rollout import RolloutEngine, generate_groups, plan_calls

PAD, EOS = 0, 1


def tiny(seed=0):
    torch.manual_seed(seed)
    return qwen3(vocab_size=50, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                 intermediate_dim=64, head_dim=8, max_seq_len=64).to(torch.float64).eval()


def prompts():
    body = torch.randint(2, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    body[1, :3] = PAD  # the second prompt is 4 tokens, left-padded
    return body


def replicated_generate(model, batch, t, stop, seed, top_k=None):
    with local_kv_cache(model, batch_size=batch.shape[0], device=batch.device,
                        dtype=torch.float64, decoder_max_seq_len=batch.shape[1] + t):
        out, _ = generate(model, batch, max_generated_tokens=t, pad_id=PAD, top_k=top_k,
                          stop_tokens=stop, rng=torch.Generator().manual_seed(seed))
    return out[:, batch.shape[1]:]


def before_stop(x, stop):
    """Each row up to and including its first stop token; pad after (as the recipe masks)."""
    is_stop = x == stop
    keep = (is_stop.cumsum(1) - is_stop.long()) == 0
    return torch.where(keep, x, PAD)


@pytest.mark.parametrize("top_k", [None, 5])
def test_same_samples_as_generate_on_the_replicated_batch(top_k):
    model, g = tiny(), prompts()
    ours = generate_groups(model, g, group_size=3, max_generated_tokens=9, pad_id=PAD,
                           top_k=top_k, rng=torch.Generator().manual_seed(7))
    theirs = replicated_generate(model, g.repeat_interleave(3, 0), 9, None, 7, top_k=top_k)
    assert ours.shape == (6, 9)
    assert torch.equal(ours, theirs)
    assert len({tuple(r) for r in ours.tolist()}) > 2  # samples of a prompt differ


def test_early_stop_matches_up_to_each_rows_stop():
    model, g = tiny(seed=3), prompts()
    ours = generate_groups(model, g, group_size=4, max_generated_tokens=12, pad_id=PAD,
                           stop_tokens=EOS, rng=torch.Generator().manual_seed(2))
    theirs = replicated_generate(model, g.repeat_interleave(4, 0), 12, [EOS], 2)
    theirs = torch.nn.functional.pad(theirs, (0, 12 - theirs.shape[1]), value=PAD)
    assert (ours == EOS).any()  # the stop token does occur
    assert torch.equal(before_stop(ours, EOS), before_stop(theirs, EOS))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="group_size=0"):
        generate_groups(tiny(), prompts(), group_size=0, max_generated_tokens=3, pad_id=PAD)


def test_logprobs_and_a_prompt_mask_reach_the_engine():
    model, g = tiny(seed=4), prompts()
    mask = g != PAD
    mask[0, 0] = False  # a token the default rule would read: the mask decides
    kw = dict(group_size=2, max_generated_tokens=5, pad_id=PAD, return_logprobs=True,
              prompt_mask=mask)
    tokens, logprobs = generate_groups(model, g, rng=torch.Generator().manual_seed(3), **kw)
    want = RolloutEngine(model).generate(g, rng=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])
    default = generate_groups(model, g, rng=torch.Generator().manual_seed(3),
                              **{**kw, "prompt_mask": None})
    assert not torch.equal(default[1], logprobs)  # the masked-out token changed the prompt


def test_calls_hold_whole_groups_or_even_splits_of_one():
    assert plan_calls(5, 4, None) == [(0, 5, 4)]
    assert plan_calls(5, 4, 8) == [(0, 2, 4), (2, 2, 4), (4, 1, 4)]
    assert plan_calls(5, 4, 9) == [(0, 2, 4), (2, 2, 4), (4, 1, 4)]
    assert plan_calls(2, 16, 6) == [(0, 1, 6), (0, 1, 5), (0, 1, 5), (1, 1, 6), (1, 1, 5),
                                    (1, 1, 5)]
    # as equal as possible: one call shape where the groups allow it (the engine keeps one
    # workspace), where filling each call first gave 8 + 4 and 4 + 4 + 1
    assert plan_calls(12, 4, 32) == [(0, 6, 4), (6, 6, 4)]
    assert plan_calls(9, 4, 16) == [(0, 3, 4), (3, 3, 4), (6, 3, 4)]
    assert plan_calls(0, 4, 16) == []
    for groups, n, rows in [(3, 16, 6), (4, 8, 20), (1, 7, 1)]:
        calls = plan_calls(groups, n, rows)
        assert all(count * s <= rows for _, count, s in calls)
        assert sum(count * s for _, count, s in calls) == groups * n
    with pytest.raises(ValueError, match="rows_per_call=0"):
        plan_calls(2, 4, 0)


@pytest.mark.parametrize("args,match", [
    ((2, 0, 8), "group_size=0 must be an integer >= 1"),
    ((2, 4, 2.5), "rows_per_call=2.5 must be an integer >= 1"),
    ((-1, 4, 8), "num_groups=-1 must be an integer >= 0"),
    ((3, 4, True), "rows_per_call"),
])
def test_bad_plans_are_named(args, match):
    # they raised ZeroDivisionError or TypeError, or returned [] (-2 groups) or took True as 1
    with pytest.raises(ValueError, match=match):
        plan_calls(*args)
