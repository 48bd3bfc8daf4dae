"""Sampling against independent references: top-p keeps the smallest set whose mass reaches
top_p, exactly as transformers' TopPLogitsWarper on ties and over a Qwen-sized vocabulary in
float32; the engine's returned logprobs equal a full forward of the plain model at the sampling
temperature (CPU, float64); a mapping as stop_tokens is refused by name."""

import re

import pytest
import torch

from dualkv_compile.models import qwen3
from dualkv_compile.rollout import RolloutEngine, SamplingParams, sample
from dualkv_compile.rollout.sampling import _top_p, stop_ids
from dualkv_compile.testing import same_dtype_numerics, tiny_model


def test_top_p_stops_at_the_set_that_reaches_top_p_exactly():
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.zeros(1, 4)  # four tokens of probability exactly 0.25
    for top_p, kept in ((0.5, 2), (0.75, 3), (0.25, 1), (1.0 - 2 ** -3, 4)):
        ours = _top_p(logits, top_p).isfinite()
        theirs = TopPLogitsWarper(top_p)(None, logits.clone()).isfinite()
        assert int(ours.sum()) == kept and int(theirs.sum()) == kept, top_p


def test_engine_logprobs_equal_a_full_forward_at_the_temperature():
    torch.manual_seed(0)
    vocab, temperature, samples, t = 61, 0.7, 3, 7
    model = qwen3(vocab_size=vocab, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                  intermediate_dim=64, head_dim=8, max_seq_len=128)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model = same_dtype_numerics(model.to(torch.float64).eval())
    prompts = torch.randint(2, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    tokens, lp = RolloutEngine(model).generate(
        prompts, group_size=samples, max_generated_tokens=t, pad_id=0, temperature=temperature,
        rng=torch.Generator().manual_seed(3), return_logprobs=True)
    batch = torch.cat([prompts.repeat_interleave(samples, 0), tokens], 1)
    p = prompts.shape[1]
    with torch.no_grad():
        logits = model(batch)[:, p - 1:p - 1 + t].double()
    want = (logits / temperature).log_softmax(-1).gather(2, tokens[..., None])[..., 0]
    # torchtune's TransformerDecoder returns float32 logits, and the engine samples what it returns
    assert lp.dtype == torch.float32
    assert (lp.double() - want).abs().max() < 1e-6  # float32 rounding of values up to ~6


def test_a_transformers_float64_models_logprobs_are_float64():
    # they were computed from float32 logits: 4.5e-7 from its float64 forward at temperature 1
    model = tiny_model("hf_qwen3", vocab=61, seed=2, max_seq_len=128)
    model = same_dtype_numerics(model.to(torch.float64).eval())
    prompts = torch.randint(2, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    prompts[1, :4] = 0  # left padding
    tokens, lp = RolloutEngine(model).generate(prompts, group_size=2, max_generated_tokens=5,
                                               pad_id=0, temperature=0.7, return_logprobs=True,
                                               rng=torch.Generator().manual_seed(0))
    rows = prompts.repeat_interleave(2, 0)
    valid = torch.cat([rows != 0, torch.ones_like(tokens, dtype=torch.bool)], 1)
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([rows, tokens], 1), attention_mask=valid.long(),
                       position_ids=positions).logits
    want = (logits[:, 11:-1] / 0.7).log_softmax(-1).gather(2, tokens[..., None])[..., 0]
    assert lp.dtype == torch.float64
    assert (lp - want).abs().max() < 1e-10


@pytest.mark.parametrize("stops", [{7: "eos"}, {"eos": 7}])
def test_a_mapping_of_stop_tokens_is_refused_by_name(stops):
    with pytest.raises(ValueError, match=f"stop_tokens={re.escape(repr(stops))} is a dict, not "
                                         "a token id or ids"):
        stop_ids(stops, 101)
    model = same_dtype_numerics(tiny_model("hf_llama").to(torch.float64).eval())
    with pytest.raises(ValueError, match="is a dict, not a token id"):
        RolloutEngine(model).generate(torch.randint(2, 101, (2, 5)), group_size=2,
                                      max_generated_tokens=3, pad_id=0, stop_tokens=stops)


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
