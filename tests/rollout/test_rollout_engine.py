"""The rollout engine on CPU in float64: its decode attention equals dense masked softmax, its
tokens equal the uncached sampler's for the same generator (several groups,
left-padded prompts of different lengths, a stop token, N=1, top-k, top-p) on every model
family optimize() accepts, and it sees weights, layers and a vocabulary changed between calls.
Bad input refused by name: test_rollout_engine_refusals.py; the prompt cache's sizes and held
workspaces: test_rollout_engine_workspaces.py; top-p: test_rollout_sampling.py."""

import pytest
import torch

from dualkv_compile.models import qwen3
from dualkv_compile.rollout import RolloutEngine, decode_attention, prompt_bucket
from dualkv_compile.rollout.uncached import uncached_generate
from dualkv_compile.testing import same_dtype_numerics
from engine_helpers import EOS, PAD, VOCAB, dense_reference, model_of, ragged_prompts, split

FAMILIES = ["qwen3", "qwen2_5", "llama3_2", "hf_qwen3", "hf_llama"]


@pytest.mark.parametrize("implementation", ["math", "flex"])
@pytest.mark.parametrize("groups,n,last,splits", [(3, 4, 0, 1), (3, 4, 6, 4), (2, 1, 3, 2),
                                                  (1, 5, 9, 8)])
def test_decode_attention_equals_dense_softmax(implementation, groups, n, last, splits):
    g = torch.Generator().manual_seed(groups * 10 + n + last)
    hq, hkv, d, p, r = 4, 2, 8, 16, 10
    x = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, pk, pv = x(groups * n, hq, d), x(groups, hkv, p, d), x(groups, hkv, p, d)
    rk, rv = x(groups * n, hkv, r, d), x(groups * n, hkv, r, d)
    plen = torch.tensor([11, 1, 16][:groups])  # splits past a prompt's end hold no key
    got = decode_attention(q, split(pk, splits), split(pv, splits), plen, rk, rv,
                           torch.tensor(last), scale=d ** -0.5, implementation=implementation)
    want = dense_reference(q, pk, pv, plen, rk, rv, last, d ** -0.5)
    assert (got - want).abs().max() < 1e-12


def generate_both(model, prompts, **kw):
    seed = kw.pop("seed", 5)
    engine = RolloutEngine(model, steps_per_graph=kw.pop("steps_per_graph", 4),
                           share_prompt=kw.pop("share_prompt", True))
    ours = engine.generate(prompts, pad_id=PAD, rng=torch.Generator().manual_seed(seed), **kw)
    assert engine._workspace.cache.prompt_k[0].shape[1] == 2  # split-KV exercised
    theirs = uncached_generate(model, prompts, pad_id=PAD,
                                rng=torch.Generator().manual_seed(seed), **kw)
    return ours, theirs


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_samples_what_the_reference_samples(family):
    ours, theirs = generate_both(model_of(family), ragged_prompts(), group_size=3,
                                 max_generated_tokens=11, stop_tokens=EOS, top_p=0.9)
    assert ours.shape == (9, 11)
    assert torch.equal(ours, theirs)
    assert len({tuple(r) for r in ours.tolist()}) > 3  # samples of a prompt differ


@pytest.mark.parametrize("kw", [dict(group_size=1), dict(group_size=4, top_k=5),
                                dict(group_size=2, top_k=7, top_p=0.5, temperature=0.7),
                                dict(group_size=3, share_prompt=False),
                                dict(group_size=3, steps_per_graph=1),
                                dict(group_size=3, steps_per_graph=50)])
def test_engine_options_sample_what_the_reference_samples(kw):
    ours, theirs = generate_both(model_of("qwen3", seed=2), ragged_prompts(), seed=9,
                                 max_generated_tokens=9, **kw)
    assert torch.equal(ours, theirs)


def test_stop_token_pads_the_rest_and_ends_early():
    # a vocabulary of 6: every row meets the stop token within a few steps
    model, prompts = model_of("qwen3", seed=3, vocab=6), ragged_prompts(groups=2, vocab=6)
    engine = RolloutEngine(model, steps_per_graph=4)
    ours = engine.generate(prompts, group_size=4, max_generated_tokens=40, pad_id=PAD,
                           stop_tokens=EOS, temperature=3.0, rng=torch.Generator().manual_seed(3))
    theirs = uncached_generate(model, prompts, group_size=4, max_generated_tokens=40, pad_id=PAD,
                                stop_tokens=EOS, temperature=3.0, rng=torch.Generator().manual_seed(3))
    assert torch.equal(ours, theirs)
    assert (ours == EOS).any(1).all()
    for row in ours:
        at = int((row == EOS).nonzero()[0])
        assert (row[at + 1:] == PAD).all()
    # decoding ended at the first 4-step check after the last row stopped, not after 39 steps
    last_stop = max(int((row == EOS).nonzero()[0]) for row in ours)
    assert engine.stats["decode_steps"] == 4 * -(-last_stop // 4) < 39


def test_several_stop_tokens_end_a_row_at_the_first_of_them():
    # a vocabulary of 12 with stop ids 1 and 5 (a generation config's eos list)
    model, prompts = model_of("qwen3", seed=4, vocab=12), ragged_prompts(groups=2, vocab=12)
    kw = dict(group_size=4, max_generated_tokens=30, pad_id=PAD, stop_tokens=[5, EOS],
              temperature=3.0)
    ours = RolloutEngine(model, steps_per_graph=4).generate(
        prompts, **kw, rng=torch.Generator().manual_seed(5))
    theirs = uncached_generate(model, prompts, **kw, rng=torch.Generator().manual_seed(5))
    assert torch.equal(ours, theirs)
    is_stop = (ours == EOS) | (ours == 5)
    first = [row.nonzero()[0].item() for row in is_stop]
    assert {int(ours[i, at]) for i, at in enumerate(first)} == {EOS, 5}  # both ids end rows
    for row, at in zip(ours, first):
        assert (row[at + 1:] == PAD).all()


def test_an_empty_stop_list_is_no_stop_token():
    # a tokenizer without stop tokens gives []: the same tokens as None, no row cut early
    model, prompts = model_of("qwen3", seed=4, vocab=12), ragged_prompts(groups=2, vocab=12)
    engine = RolloutEngine(model, steps_per_graph=4)
    kw = dict(group_size=2, max_generated_tokens=12, pad_id=PAD, temperature=3.0)
    runs = [engine.generate(prompts, stop_tokens=stops, rng=torch.Generator().manual_seed(5), **kw)
            for stops in ([], (), None)]
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[2])
    assert runs[0].shape == (4, 12)  # every row ran to max_generated_tokens


def test_weights_updated_in_place_are_seen():
    model, prompts = model_of("qwen3", seed=4), ragged_prompts(groups=2)
    engine = RolloutEngine(model)
    run = lambda: engine.generate(prompts, group_size=2, max_generated_tokens=6, pad_id=PAD,  # noqa: E731
                                  rng=torch.Generator().manual_seed(0))
    before = run()
    with torch.no_grad():
        model.layers[0].mlp.w1.weight.mul_(-3.0)
    after = run()
    fresh = uncached_generate(model, prompts, group_size=2, max_generated_tokens=6, pad_id=PAD,
                               rng=torch.Generator().manual_seed(0))
    assert torch.equal(after, fresh) and not torch.equal(before, after)


@pytest.mark.parametrize("family", ["qwen3", "hf_llama"])
def test_a_replaced_or_removed_layer_is_seen(family):
    # the engine listed the layers once and kept sampling with the replaced one
    model, prompts = model_of(family, seed=4), ragged_prompts(groups=2)
    layers = model.layers if family == "qwen3" else model.model.layers
    engine = RolloutEngine(model)
    kw = dict(group_size=2, max_generated_tokens=6, pad_id=PAD)
    engine.generate(prompts, **kw)
    changed = model_of(family, seed=9)
    layers[1] = (changed.layers if family == "qwen3" else changed.model.layers)[1]
    ours = engine.generate(prompts, rng=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(ours, uncached_generate(model, prompts, rng=torch.Generator().manual_seed(0),
                                                **kw))
    del layers[1]
    if family == "hf_llama":
        model.config.num_hidden_layers = 1
    ours = engine.generate(prompts, rng=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(ours, uncached_generate(model, prompts, rng=torch.Generator().manual_seed(0),
                                                **kw))
    assert engine.stats["model_reads"] == 2


def test_logprobs_after_an_early_stop_are_zero_on_a_reused_engine():
    model, prompts = model_of("qwen3", seed=3, vocab=6), ragged_prompts(groups=2, vocab=6)
    engine = RolloutEngine(model, steps_per_graph=4)
    args = dict(group_size=4, max_generated_tokens=40, pad_id=PAD, temperature=3.0,
                return_logprobs=True)
    engine.generate(prompts, rng=torch.Generator().manual_seed(1), **args)  # no stop: all set
    tokens, lp = engine.generate(prompts, stop_tokens=EOS, rng=torch.Generator().manual_seed(3),
                                 **args)
    is_stop = tokens == EOS
    after = (is_stop.cumsum(1) - is_stop.long()) > 0
    assert after.any() and (lp[after] == 0).all() and (lp[~after] < 0).all()


def test_a_prompt_bucket_past_the_context_is_harmless():
    """98 prompt tokens + 2 generated fit a 100-token context; the bucket (112) does not."""
    torch.manual_seed(0)
    model = same_dtype_numerics(qwen3(vocab_size=VOCAB, num_layers=1, num_heads=4,
                                      num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                                      head_dim=8, max_seq_len=100).double().eval())
    prompts = torch.randint(2, VOCAB, (2, 98), generator=torch.Generator().manual_seed(0))
    ours = RolloutEngine(model).generate(prompts, group_size=2, max_generated_tokens=2,
                                         pad_id=PAD, rng=torch.Generator().manual_seed(1))
    theirs = uncached_generate(model, prompts, group_size=2, max_generated_tokens=2, pad_id=PAD,
                                rng=torch.Generator().manual_seed(1))
    assert prompt_bucket(98) > 100 and torch.equal(ours, theirs)


@pytest.mark.parametrize("steps_per_graph", [1, 16])
def test_a_call_leaves_the_generator_where_the_reference_does(steps_per_graph):
    # every row stops at eos before the cap; the steps skipped after that once drew no noise,
    # so the next call on the same generator sampled other tokens than the reference's next
    # call, and than with another steps_per_graph
    model = model_of("qwen3", vocab=6)  # eos is likely
    prompts = ragged_prompts(groups=2, vocab=6)
    kw = dict(group_size=2, max_generated_tokens=40, pad_id=PAD, stop_tokens=EOS, temperature=3.0)
    engine = RolloutEngine(model, steps_per_graph=steps_per_graph)
    ours, theirs = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for _ in range(2):
        a = engine.generate(prompts, rng=ours, **kw)
        b = uncached_generate(model, prompts, rng=theirs, **kw)
        assert torch.equal(a, b) and torch.equal(ours.get_state(), theirs.get_state())
    assert engine.stats["decode_steps"] < 2 * 39  # decoding stopped early


def test_a_call_under_inference_mode_leaves_the_engine_usable():
    engine, prompts = RolloutEngine(model_of("hf_qwen3")), ragged_prompts()
    kw = dict(group_size=2, max_generated_tokens=4, pad_id=PAD)
    with torch.inference_mode():
        engine.generate(prompts, rng=torch.Generator().manual_seed(0), **kw)
    again = engine.generate(prompts, rng=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(again, uncached_generate(model_of("hf_qwen3"), prompts,
                                                 rng=torch.Generator().manual_seed(0), **kw))


def test_a_resized_vocabulary_is_seen_by_the_next_call():
    model = model_of("hf_qwen3")
    engine, prompts = RolloutEngine(model), ragged_prompts()
    kw = dict(group_size=2, max_generated_tokens=4, pad_id=PAD)
    engine.generate(prompts, **kw)
    model.resize_token_embeddings(VOCAB + 27, mean_resizing=False)
    out = engine.generate(prompts, rng=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(out, uncached_generate(model, prompts,
                                               rng=torch.Generator().manual_seed(0), **kw))
