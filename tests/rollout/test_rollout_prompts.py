"""Which tokens are a prompt: padding is a leading and/or trailing run of pad_id; a pad_id between
a prompt's tokens is one of them (pad_id is often eos, and chat prompts hold eos); prompt_mask
says it exactly. And the engine's arguments are refused by name before they reach a kernel."""

import numpy as np
import pytest
import torch

from dualkv_compile.rollout import RolloutEngine
from dualkv_compile.rollout import prompt_mask_of
from dualkv_compile.rollout.uncached import uncached_generate
from engine_helpers import PAD, VOCAB, model_of, ragged_prompts

EOS = 7  # the pad_id below: HFTokenizer pads with eos when the tokenizer names no pad token
INSIDE = torch.tensor([[11, 12, EOS, 13, 14, EOS, 15]])  # eos inside the prompt: a token
LEFT = torch.tensor([[EOS, EOS, 11, 12, 13, 14, 15]])  # the same ids, eos as left padding


def run(model, prompts, pad_id=EOS, seed=3, **kw):
    """The engine's tokens and logprobs, and the reference's tokens, for the same draws."""
    args = dict(group_size=3, max_generated_tokens=8, pad_id=pad_id, temperature=1.5) | kw
    tokens, logprobs = RolloutEngine(model).generate(
        prompts, rng=torch.Generator().manual_seed(seed), return_logprobs=True, **args)
    theirs = uncached_generate(model, prompts, rng=torch.Generator().manual_seed(seed), **args)
    return tokens, logprobs, theirs


@pytest.mark.parametrize("family", ["qwen3", "hf_qwen3"])
def test_a_pad_id_inside_a_prompt_is_a_token(family):
    model = model_of(family)
    inside, inside_lp, inside_ref = run(model, INSIDE)
    left, left_lp, left_ref = run(model, LEFT)
    assert torch.equal(inside, inside_ref) and torch.equal(left, left_ref)
    # the prompts differ, so do their samples, in the engine and in the uncached sampler
    assert not torch.equal(inside_lp, left_lp)
    assert not torch.equal(inside_ref, left_ref)
    # as with a pad_id the prompt does not hold (no stop token: pad_id fills nothing)
    plain, plain_lp, _ = run(model, INSIDE, pad_id=PAD)
    assert torch.equal(inside, plain) and torch.equal(inside_lp, plain_lp)


def test_prompt_mask_of_strips_only_leading_and_trailing_runs():
    prompts = torch.tensor([[7, 7, 1, 7, 2, 7], [1, 7, 7, 2, 3, 4], [7, 7, 7, 7, 7, 7]])
    assert prompt_mask_of(prompts, 7).int().tolist() == [[0, 0, 1, 1, 1, 0], [1] * 6, [0] * 6]


def _padded(bodies, sides, width=10):
    """Each body padded with EOS to `width`: on the left, the right, or both (split evenly)."""
    rows = []
    for body, side in zip(bodies, sides):
        extra = width - len(body)
        left = {"left": extra, "right": 0, "both": extra // 2}[side]
        rows.append([EOS] * left + body + [EOS] * (extra - left))
    return torch.tensor(rows)


@pytest.mark.parametrize("family", ["qwen3", "hf_qwen3"])
def test_leading_and_trailing_padding_is_stripped(family):
    model = model_of(family, seed=1)
    bodies = [[11, 12, EOS, 13, 14, EOS, 15], [20, EOS, 21], [30, 31, 32, 33, 34, 35]]
    left, left_lp, left_ref = run(model, _padded(bodies, ["left"] * 3))
    assert torch.equal(left, left_ref)
    for sides in (["right"] * 3, ["right", "both", "left"]):
        tokens, lp, ref = run(model, _padded(bodies, sides))
        assert torch.equal(tokens, left) and torch.equal(lp, left_lp) and torch.equal(ref, left)


def test_prompt_mask_says_which_tokens_are_the_prompt():
    model = model_of("qwen3", seed=2)
    # prompts that begin or end with pad_id (eos): only a mask keeps those ids; the ids under
    # False are never read (here outside the vocabulary)
    prompts = torch.tensor([[-1, -1, EOS, 11, 12, EOS], [-100, 20, 21, 22, EOS, 23]])
    mask = prompts >= 0
    tokens, lp, ref = run(model, prompts, prompt_mask=mask)
    assert torch.equal(tokens, ref)
    # the same prompts, left-padded with an id they do not hold
    plain, plain_lp, _ = run(model, torch.where(mask, prompts, PAD), pad_id=PAD)
    assert torch.equal(tokens, plain) and torch.equal(lp, plain_lp)
    # without the mask, the leading and trailing eos are padding: other prompts
    _, rule_lp, _ = run(model, torch.where(mask, prompts, EOS))
    assert not torch.equal(lp, rule_lp)


@pytest.mark.parametrize("kw,match", [
    (dict(pad_id=-1), r"pad_id=-1 must be an integer in \[0, 101\)"),
    (dict(pad_id=VOCAB), f"pad_id={VOCAB} must be"),
    (dict(pad_id=None), "pad_id=None must be"),
    (dict(pad_id=True), "pad_id=True must be"),
    (dict(group_size=2.0), r"group_size=2.0 must be an integer >= 1"),
    (dict(group_size=True), "group_size=True must be"),
    (dict(max_generated_tokens=4.0), "max_generated_tokens=4.0 must be"),
    (dict(top_k=2.5), "top_k=2.5 must be"),
    (dict(top_k=True), "top_k=True must be"),
    (dict(dtype=torch.int64), "dtype=torch.int64 .* must be one of"),
    (dict(dtype=torch.bool), "dtype=torch.bool .* must be one of"),
    (dict(dtype="bfloat16"), "dtype='bfloat16' .* must be one of"),
    (dict(prompt_mask=torch.ones(3, 40)), r"prompt_mask \(3, 40\) torch.float32 on cpu must be"),
    (dict(prompt_mask=torch.ones(3, 39, dtype=torch.bool)), r"prompt_mask \(3, 39\)"),
    (dict(prompt_mask=[[True] * 40] * 3), r"prompt_mask \(list\) must be"),
    (dict(prompt_mask=torch.ones(3, 40, dtype=torch.bool, device="meta")), "on meta must be"),
    (dict(prompt_mask=torch.arange(40).expand(3, 40) < torch.tensor([[5], [0], [1]])),
     r"prompts \[1\] have no token: prompt_mask is False throughout"),
])
def test_bad_arguments_are_named_before_they_reach_a_kernel(kw, match):
    args = dict(group_size=2, max_generated_tokens=4, pad_id=PAD) | kw
    with pytest.raises(ValueError, match=match):
        RolloutEngine(model_of("qwen3")).generate(ragged_prompts(), **args)


def test_integer_arguments_may_be_numpy_or_tensor_integers():
    engine, prompts = RolloutEngine(model_of("qwen3")), ragged_prompts(groups=2)
    want = engine.generate(prompts, group_size=2, max_generated_tokens=3, pad_id=PAD, top_k=5,
                           rng=torch.Generator().manual_seed(0))
    got = engine.generate(prompts, group_size=np.int64(2), max_generated_tokens=torch.tensor(3),
                          pad_id=np.int32(PAD), top_k=np.int64(5),
                          rng=torch.Generator().manual_seed(0))
    assert torch.equal(got, want)


def test_prompts_on_another_device_than_the_model_are_refused_by_name():
    # CPU only: a model on the meta device stands for one on a GPU
    engine = RolloutEngine(model_of("qwen3").to("meta"))
    with pytest.raises(ValueError, match="prompts are on cpu, the model on meta"):
        engine.generate(ragged_prompts(), group_size=2, max_generated_tokens=3, pad_id=PAD)


@pytest.mark.parametrize("family", ["qwen3", "hf_qwen3"])
def test_a_one_token_left_padded_prompt_agrees_with_the_reference(family):
    # the reference picks each row's last real token; with one token after left padding, a
    # position-based pick landed on a padding column
    prompts = torch.tensor([[EOS, EOS, 11], [EOS, 12, 13], [14, EOS, EOS]])
    tokens, _, theirs = run(model_of(family), prompts)
    assert torch.equal(tokens, theirs)


def test_an_lm_head_wider_than_the_embedding_is_refused():
    """A sampled id past the embedding could not be fed back: refused before any decoding."""
    model = model_of("qwen3")
    model.output = torch.nn.Linear(32, VOCAB + 2, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"the LM head has {VOCAB + 2} rows but the input "
                                         f"embedding {VOCAB}"):
        RolloutEngine(model).generate(LEFT, group_size=2, max_generated_tokens=4, pad_id=EOS,
                                      rng=torch.Generator().manual_seed(0))


def test_cuda_graphs_where_none_can_run_are_refused():
    with pytest.raises(ValueError, match="cuda_graphs=True needs CUDA and compiled steps; the "
                                         "prompts are on cpu"):
        RolloutEngine(model_of("qwen3"), cuda_graphs=True).generate(
            LEFT, group_size=2, max_generated_tokens=2, pad_id=EOS)


def test_a_model_in_train_mode_with_dropout_is_refused():
    """The engine computes attention itself and would sample as in eval mode, while the model
    in train mode applies dropout: refused, as optimize() refuses it."""
    model = model_of("hf_qwen3")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    engine = RolloutEngine(model)
    args = dict(group_size=2, max_generated_tokens=3, pad_id=EOS, rng=torch.Generator().manual_seed(0))
    engine.generate(LEFT, **args)  # eval mode: dropout inactive
    model.train()
    with pytest.raises(ValueError, match="in train mode with dropout, which the engine does not"):
        engine.generate(LEFT, **args)
