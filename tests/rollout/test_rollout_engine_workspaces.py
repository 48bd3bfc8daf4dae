"""The rollout engine's prompt cache on CPU in float64: how many splits the prompt keys take and
the prompt buckets' padding, and the held workspaces (cache, compiled step, graphs): reused by a
call whose prompts fit, released, and kept for calls alternating between two shapes, each call
sampling what the uncached sampler samples; no call's non-finite values reach the next."""

import pytest
import torch

from dualkv_compile.rollout import RolloutEngine, prompt_bucket
from dualkv_compile.rollout.cache import prompt_splits
from dualkv_compile.rollout.uncached import uncached_generate
from engine_helpers import EOS, PAD, model_of, ragged_prompts


def test_prompt_splits_fill_the_gpu_and_divide_the_capacity():
    assert prompt_splits(1, 8, 4096) == 64 and prompt_splits(16, 8, 4096) == 4
    assert prompt_splits(64, 8, 4096) == 1 and prompt_splits(1, 8, 48) == 2
    for groups, heads, cap in [(1, 8, 4096), (3, 2, 80), (1, 1, 16), (2, 4, 5120)]:
        s = prompt_splits(groups, heads, cap)
        assert cap % s == 0 and (s == 1 or cap // s >= 16)


def test_prompt_buckets_waste_under_a_quarter():
    for n in [1, 63, 64, 65, 100, 129, 1000, 4096, 4097, 8191, 8192]:
        b = prompt_bucket(n)
        assert n <= b and (b <= 64 or b < 1.25 * n + 1), (n, b)
    assert prompt_bucket(4096) == 4096 and prompt_bucket(8192) == 8192


def test_shorter_prompts_reuse_the_held_workspace():
    # the calls of a ragged batch vary their prompt bucket; a call whose prompts fit the held
    # capacity with at most 2x padding reuses its cache, compiled step and graphs, and samples
    # what the reference samples; a shorter one, or a longer one, makes a new workspace
    model = model_of("qwen3", seed=4)
    engine = RolloutEngine(model)
    kw = dict(group_size=2, max_generated_tokens=5, pad_id=PAD, stop_tokens=EOS)
    long, short = ragged_prompts(groups=2, width=40), ragged_prompts(groups=2, width=28, seed=2)
    shortest = ragged_prompts(groups=2, width=12, seed=3)
    assert (prompt_bucket(40), prompt_bucket(28), prompt_bucket(12)) == (48, 32, 16)
    for prompts, workspaces, capacity in [(long, 1, 48), (short, 1, 48), (shortest, 2, 16),
                                          (long, 3, 48)]:
        ours = engine.generate(prompts, rng=torch.Generator().manual_seed(5), **kw)
        theirs = uncached_generate(model, prompts, rng=torch.Generator().manual_seed(5), **kw)
        cache = engine._workspace.cache
        assert torch.equal(ours, theirs)
        assert engine.stats["workspaces"] == workspaces
        assert cache.prompt_k[0].shape[1] * cache.prompt_k[0].shape[3] == capacity
    assert cache.prompt_k[0].shape[1] > 1  # the split layout padded past the prefill's width


def test_release_frees_the_workspace_and_the_next_call_samples_the_same():
    model = model_of("qwen3", seed=4)
    engine = RolloutEngine(model)
    kw = dict(group_size=2, max_generated_tokens=5, pad_id=PAD, stop_tokens=EOS)
    prompts = ragged_prompts(groups=2)
    first = engine.generate(prompts, rng=torch.Generator().manual_seed(5), **kw)
    engine.release()
    assert engine._workspace is None and engine.kv_bytes() == 0
    again = engine.generate(prompts, rng=torch.Generator().manual_seed(5), **kw)
    assert engine.stats["workspaces"] == 2 and torch.equal(again, first)
    assert torch.equal(again, uncached_generate(model, prompts,
                                                 rng=torch.Generator().manual_seed(5), **kw))


@pytest.mark.parametrize("max_workspaces,allocated", [(2, 2), (1, 4)])
def test_calls_alternating_between_two_shapes_keep_both_workspaces(max_workspaces, allocated):
    # plan_calls' unequal last call, or a dynamic-sampling refill: calls of 2 groups and of 1
    # alternate; two held workspaces serve both without a new cache at each change
    model = model_of("qwen3", seed=4)
    engine = RolloutEngine(model, max_workspaces=max_workspaces)
    kw = dict(group_size=2, max_generated_tokens=5, pad_id=PAD, stop_tokens=EOS)
    two, one = ragged_prompts(groups=2), ragged_prompts(groups=1, seed=3)
    for i, prompts in enumerate([two, one, two, one]):
        ours = engine.generate(prompts, rng=torch.Generator().manual_seed(i), **kw)
        theirs = uncached_generate(model, prompts, rng=torch.Generator().manual_seed(i), **kw)
        assert torch.equal(ours, theirs), i
    assert engine.stats["workspaces"] == allocated
    assert len(engine._held) == min(max_workspaces, 2)
    # kv_bytes counts every held cache: the last call's (1 group, 2 rows) and, when two are
    # held, the 2-group call's (4 rows)
    caches = {ws.cache.rows: ws.cache for ws in engine._held.values()}
    assert sorted(caches) == ([2, 4] if max_workspaces == 2 else [2])
    assert all(c.kv_bytes() > 0 for c in caches.values())
    assert engine.kv_bytes() == sum(c.kv_bytes() for c in caches.values())
    engine.release()
    assert not engine._held and engine.kv_bytes() == 0


@pytest.mark.parametrize("attention", ["math", "flex"])
def test_a_non_finite_call_does_not_reach_the_next_one(attention):
    # a reused workspace held the earlier call's response values past the current step, which
    # the math and flex paths meet with weight 0: one NaN update made every later call NaN
    model = model_of("qwen3", seed=4)
    kw = dict(group_size=2, max_generated_tokens=6, pad_id=PAD, stop_tokens=EOS,
              return_logprobs=True)
    prompts = ragged_prompts(groups=2, width=12)
    engine = RolloutEngine(model, attention=attention)
    weight = next(p for n, p in model.named_parameters() if "v_proj" in n)
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("nan")  # a diverged update
    engine.generate(prompts, rng=torch.Generator().manual_seed(0), **kw)
    with torch.no_grad():
        weight.copy_(saved)
    tokens, logprobs = engine.generate(prompts, rng=torch.Generator().manual_seed(1), **kw)
    fresh, fresh_lp = RolloutEngine(model, attention=attention).generate(
        prompts, rng=torch.Generator().manual_seed(1), **kw)
    assert engine.stats["workspaces"] == 1  # the second call reused the first one's cache
    assert torch.equal(tokens, fresh) and torch.equal(logprobs, fresh_lp)
    assert not logprobs.isnan().any()
