"""The Qwen3-8B-shaped timing config, shrunk to run on CPU: same components, tiny sizes, dualkv
on and off agree, and responses run to max_generated_tokens as the config promises."""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.rl import EvenTokensTask, IdTokenizer
from recipe_helpers import ROOT
from recipe_helpers import run as run_recipe

TINY = {"device": "cpu", "dtype": "fp32", "num_steps": 2, "group_size": 3,
        "max_generated_tokens": 6, "tokenizer.vocab_size": 300, "task.prompt_len": 20,
        "model.vocab_size": 300, "model.num_layers": 1, "model.embed_dim": 64,
        "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16,
        "model.intermediate_dim": 128, "model.max_seq_len": 64}


def run(tmp_path, name, **extra):
    return run_recipe(tmp_path, name, ROOT / "recipes" / "configs" / "qwen3_8b_shaped_step.yaml",
                      **{**TINY, **extra})


def test_shrunk_shape_config_runs_both_ways_and_agrees(tmp_path):
    dk.counters.clear()  # the recipe logs the process's count
    on = run(tmp_path, "on")
    off = run(tmp_path, "off", **{"dualkv.enabled": False})
    assert on.policy.uses_dualkv and not off.policy.uses_dualkv
    # one length bucket: the policy's and the reference's no-grad logprobs share one graph
    # (share_compiles_with), the loss with grad is the other
    assert [h["compiles"] for h in on.history] == [2, 2]
    # the rollout shares the prompt K/V with dualkv on, replicates it per row with it off
    assert on.rollout_engine.share_prompt and not off.rollout_engine.share_prompt
    for a, b in zip(on.history, off.history):
        for key in ("loss", "kl", "grad_norm", "response_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert a["response_length"] == 6  # the config's tokenizer has no eos: fixed shapes
        assert a["policy_update_s"] > 0 and a["peak_memory_gib"] > 0
        assert 0 < a["rollout_s"] < a["step_time_s"]
        assert a["grad_norm"] > 1e-3, a  # samples differ in reward: advantages are not all 0


def test_even_tokens_reward_counts_until_eos():
    task = EvenTokensTask(IdTokenizer(50), prompt_len=5)
    prompts, answers = task.sample_prompts(2)
    assert prompts.shape == (2, 5) and (prompts[:, 0] == 2).all() and (prompts[:, 1:] >= 3).all()
    responses = torch.tensor([[4, 6, 7, 1, 8, 8], [1, 4, 4, 4, 4, 4], [3, 5, 8, 10, 0, 0]])
    # row 3: pad (0) is even but counted; the recipe pads only after eos, which stops the count
    assert task.rewards(responses, [""] * 3).tolist() == pytest.approx([2 / 3, 0.0, 4 / 6])
    with pytest.raises(ValueError, match="prompt_len=1"):
        EvenTokensTask(IdTokenizer(50), prompt_len=1)
    # without eos every token counts, and no sampled id is ever the eos id
    no_eos = EvenTokensTask(IdTokenizer(50, eos=False), prompt_len=5)
    assert no_eos.rewards(responses, [""] * 3).tolist() == pytest.approx([4 / 6, 5 / 6, 4 / 6])


def test_stop_every_and_prompt_lengths_make_ragged_batches():
    tok = IdTokenizer(50, stop_every=16)
    assert tok.stop_tokens == (1, 17, 33, 49) and tok.eos_id == 1
    task = EvenTokensTask(tok, prompt_len=8, min_prompt_len=3, seed=1)
    prompts, _ = task.sample_prompts(40)
    lengths = (prompts != tok.pad_id).sum(1)
    assert prompts.shape == (40, 8) and lengths.min() == 3 and lengths.max() == 8
    for row, n in zip(prompts, lengths):  # left-padded, bos first, then ordinary ids
        assert (row[:8 - n] == 0).all() and row[8 - n] == 2 and (row[9 - n:] >= 3).all()
    # any stop id ends the counted tokens
    responses = torch.tensor([[4, 6, 17, 8], [33, 4, 4, 4]])
    assert task.rewards(responses, [""] * 2).tolist() == pytest.approx([1.0, 0.0])
    for bad in (dict(stop_every=2), dict(stop_every=50), dict(eos=False, stop_every=16)):
        with pytest.raises(ValueError, match="stop_every"):
            IdTokenizer(50, **bad)
    with pytest.raises(ValueError, match="min_prompt_len=9"):
        EvenTokensTask(tok, prompt_len=8, min_prompt_len=9)


def test_shrunk_ragged_config_runs_both_ways_and_agrees(tmp_path):
    # the ragged step config: prompts of drawn lengths, responses that stop at any of 1/8 ids
    config = ROOT / "recipes" / "configs" / "qwen3_8b_shaped_ragged.yaml"
    tiny = {**TINY, "tokenizer.stop_every": 8, "task.min_prompt_len": 10,
            "max_generated_tokens": 12}
    on = run_recipe(tmp_path, "on", config, **tiny)
    off = run_recipe(tmp_path, "off", config, **tiny, **{"dualkv.enabled": False})
    layer = run_recipe(tmp_path, "layer", config, **tiny, **{"dualkv.compile_region": "layer"})
    assert layer.policy.compile_region() == "layer"
    lengths = [h["response_length"] for h in on.history]
    assert any(0 < n < 12 for n in lengths), lengths  # responses stop early
    for other in (off, layer):
        for a, b in zip(on.history, other.history):
            for key in ("loss", "kl", "grad_norm", "response_logprob", "response_length"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
