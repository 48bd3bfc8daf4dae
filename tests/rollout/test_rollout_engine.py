"""The rollout engine on CPU in float64: its decode attention equals dense masked softmax, its
tokens equal the uncached sampler's for the same generator (several groups,
left-padded prompts of different lengths, a stop token, N=1, top-k, top-p) on every model
family optimize() accepts, and bad input is refused by name."""

import os

import pytest
import torch

from dualkv_compile.models import qwen3
from dualkv_compile.rollout import (RolloutEngine, SamplingParams, decode_attention,
                                    prompt_bucket, sample)
from dualkv_compile.rollout.cache import prompt_splits
from dualkv_compile.rollout.uncached import uncached_generate
from dualkv_compile.testing import same_dtype_numerics, tiny_model

PAD, EOS, VOCAB = 0, 1, 101
FAMILIES = ["qwen3", "qwen2_5", "llama3_2", "hf_qwen3", "hf_llama"]


def model_of(family, seed=0, vocab=VOCAB):
    if family == "qwen3":
        torch.manual_seed(seed)
        model = qwen3(vocab_size=vocab, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                      intermediate_dim=64, head_dim=8, max_seq_len=128)
    else:
        model = tiny_model(family, vocab=vocab, seed=seed, max_seq_len=128)
    with torch.no_grad():  # torchtune's builders draw N(0, 1) embeddings: near-greedy samples
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return same_dtype_numerics(model.to(torch.float64).eval())


def ragged_prompts(groups=3, width=40, seed=1, vocab=VOCAB):
    """Left-padded prompts of 40, 30, 20, ... tokens: the cache holds them in 2 splits of 24
    keys (prompt_splits), the second empty for the 20-token prompt."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab, (groups, width), generator=g)
    for i in range(1, groups):
        prompts[i, :10 * i] = PAD
    return prompts


def dense_reference(q, pk, pv, plen, rk, rv, last, scale):
    """Each row against its group's valid prompt keys and its own keys 0..last, one softmax.
    pk/pv [G, Hkv, P, D] (unsplit)."""
    rows, hq, d = q.shape
    groups, hkv = pk.shape[:2]
    n, rep = rows // groups, hq // hkv
    out = torch.empty_like(q)
    for r in range(rows):
        g = r // n
        k = torch.cat([pk[g, :, :plen[g]], rk[r, :, :last + 1]], 1).repeat_interleave(rep, 0)
        v = torch.cat([pv[g, :, :plen[g]], rv[r, :, :last + 1]], 1).repeat_interleave(rep, 0)
        w = torch.softmax((q[r, :, None] @ k.transpose(1, 2))[:, 0] * scale, -1)
        out[r] = (w[:, None] @ v)[:, 0]
    return out


def split(kv, splits):
    """[G, Hkv, P, D] -> the cache's [G, S, Hkv, P / S, D]."""
    g, h, p, d = kv.shape
    return kv.view(g, h, splits, p // splits, d).transpose(1, 2).contiguous()


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


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    hits = set()
    for seed in range(200):
        noise = torch.empty(1, 5).exponential_(1, generator=torch.Generator().manual_seed(seed))
        hits.add(int(sample(logits, noise, SamplingParams(top_p=0.8))))
    assert hits == {0, 1, 2}  # 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15
    noise = torch.ones(1, 5)
    assert int(sample(logits, noise, SamplingParams(top_p=0.01))) == 0


def test_top_p_is_the_exact_nucleus_on_a_large_vocabulary():
    # float32 over a Qwen-sized vocabulary: the nucleus equals the float64 one and
    # transformers' TopPLogitsWarper's (summed from the tail; a sum from the top drifted
    # and kept 82,264 of 98,344 tokens at top_p = 0.99999)
    from transformers.generation.logits_process import TopPLogitsWarper

    from dualkv_compile.rollout.sampling import _top_p

    g = torch.Generator().manual_seed(0)
    for scale, top_p in ((4.0, 0.99999), (7.0, 0.9999), (1.0, 0.9)):
        logits = (scale * torch.randn(1, 151936, generator=g, dtype=torch.float64)).float()
        kept = _top_p(logits, top_p).isfinite()
        probs = torch.softmax(logits.double(), -1)[0].sort(descending=True).values
        exact = int((probs.cumsum(0) - probs < top_p).sum())
        theirs = TopPLogitsWarper(top_p)(None, logits.clone()).isfinite()
        assert int(kept.sum()) == exact and torch.equal(kept, theirs), (scale, top_p)


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


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(temperature="0.7"), "temperature='0.7' must be a finite number"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=1e-6), r"temperature=1e-06 must be a finite number >= 1e-05"),
    (dict(top_p=True), "top_p=True must be a number"),
    (dict(top_p="0.9"), "top_p='0.9' must be a number"),
    (dict(top_k=0), "top_k=0"),
    (dict(max_generated_tokens=200), "context of 128"),
    (dict(group_size=0), "group_size=0"),
    (dict(stop_tokens=VOCAB), f"stop_tokens={VOCAB}"),
    (dict(stop_tokens=[EOS, -3]), r"stop_tokens=\[1, -3\]"),
    (dict(stop_tokens=True), "stop_tokens=True"),
])
def test_bad_arguments_are_named(kw, match):
    args = dict(group_size=2, max_generated_tokens=4, pad_id=PAD) | kw
    with pytest.raises(ValueError, match=match):
        RolloutEngine(model_of("qwen3")).generate(ragged_prompts(), **args)


def test_bad_prompts_are_named():
    engine = RolloutEngine(model_of("qwen3"))
    prompts = ragged_prompts()
    prompts[1] = PAD
    with pytest.raises(ValueError, match=r"prompts \[1\] hold only pad_id=0"):
        engine.generate(prompts, group_size=2, max_generated_tokens=3, pad_id=PAD)
    prompts = ragged_prompts()
    prompts[0, 3] = VOCAB + 4
    with pytest.raises(ValueError, match=f"token id {VOCAB + 4}"):
        engine.generate(prompts, group_size=2, max_generated_tokens=3, pad_id=PAD)


def test_unsupported_models_are_refused_by_name():
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="cannot run GPT2LMHeadModel: model_type='gpt2'"):
        RolloutEngine(gpt2)
    base = tf.Qwen3Model(tf.Qwen3Config(num_hidden_layers=1, hidden_size=16, head_dim=4,
                                        intermediate_size=32, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=50))
    with pytest.raises(ValueError, match="Qwen3Model: it has no LM head"):
        RolloutEngine(base)
    with pytest.raises(ValueError, match="cannot run Linear"):
        RolloutEngine(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="attention='fast'"):
        RolloutEngine(model_of("qwen3"), attention="fast")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="CPU kernels run there")
def test_triton_attention_on_the_cpu_is_refused_with_the_reason():
    engine = RolloutEngine(model_of("qwen3"), attention="triton")
    with pytest.raises(ValueError, match="attention='triton' cannot run: (Triton is not "
                                         "installed|the kernels run on CUDA, not cpu)"):
        engine.generate(ragged_prompts(groups=1), group_size=2, max_generated_tokens=3, pad_id=PAD)


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


@pytest.mark.parametrize("kw,match", [
    (dict(rng=0), r"rng=0 must be a torch.Generator"),
    (dict(width=0), r"prompts \(3, 0\) .* P >= 1"),
])
def test_a_seed_for_rng_and_empty_prompts_are_named(kw, match):
    prompts = ragged_prompts()[:, :kw.pop("width", None)]
    with pytest.raises(ValueError, match=match):
        RolloutEngine(model_of("qwen3")).generate(prompts, group_size=2, max_generated_tokens=4,
                                                  pad_id=PAD, **kw)


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
