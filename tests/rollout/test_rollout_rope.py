"""A transformers model with dynamic RoPE (rope_type "dynamic"): the engine samples the uncached
sampler's tokens with the model's own logprobs, and a decode step reads nothing back to the
host (transformers' dynamic update compares tensors in Python `if`s; the engine, which stays
within max_position_embeddings, runs the undecorated rotary forward)."""

import pytest
import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode

from dualkv_compile.rollout import RolloutEngine
from dualkv_compile.rollout.uncached import uncached_generate
from dualkv_compile.testing import same_dtype_numerics
from engine_helpers import PAD, VOCAB, ragged_prompts

CONTEXT = 128
_HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.item.default)


def dynamic_model(family, seed=0):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                  rope_scaling=dict(rope_type="dynamic", factor=4.0))
    torch.manual_seed(seed)
    if family == "hf_qwen3":
        model = tf.Qwen3ForCausalLM._from_config(tf.Qwen3Config(head_dim=8, **common),
                                                 attn_implementation="sdpa")
    else:
        model = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**common),
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return same_dtype_numerics(model.to(torch.float64).eval())


class _CountHostReads(TorchDispatchMode):
    """What a CUDA graph capture cannot contain: a tensor's value read into Python."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func in _HOST_READS
        return func(*args, **(kwargs or {}))


def sample(model, prompts, seed=5, **kw):
    kw = dict(group_size=3, max_generated_tokens=9, pad_id=PAD, top_p=0.9, **kw)
    engine = RolloutEngine(model)
    ours = engine.generate(prompts, rng=torch.Generator().manual_seed(seed), **kw)
    theirs = uncached_generate(model, prompts, rng=torch.Generator().manual_seed(seed), **kw)
    return engine, ours, theirs


@pytest.mark.parametrize("family", ["hf_qwen3", "hf_llama"])
def test_dynamic_rope_samples_what_the_reference_samples_with_no_host_read(family):
    engine, ours, theirs = sample(dynamic_model(family), ragged_prompts())
    assert torch.equal(ours, theirs)
    ws = engine._workspace
    ws.cache.step.zero_()
    with torch.no_grad(), _CountHostReads() as count:
        ws.step_fn(*ws.cache.decode_tensors())
    assert count.reads == 0  # 2 per step through transformers' dynamic_rope_update


def test_dynamic_rope_logprobs_equal_the_models_forward():
    model, temperature, t = dynamic_model("hf_qwen3"), 0.7, 7
    prompts = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    tokens, lp = RolloutEngine(model).generate(
        prompts, group_size=3, max_generated_tokens=t, pad_id=PAD, temperature=temperature,
        rng=torch.Generator().manual_seed(3), return_logprobs=True)
    batch = torch.cat([prompts.repeat_interleave(3, 0), tokens], 1)
    with torch.no_grad():
        logits = model(input_ids=batch, use_cache=False).logits[:, 11:11 + t]
    want = (logits / temperature).log_softmax(-1).gather(2, tokens[..., None])[..., 0]
    assert lp.dtype == torch.float64 and (lp - want).abs().max() < 1e-12


def test_frequencies_grown_past_the_context_are_set_back_as_transformers_does():
    model, fresh = dynamic_model("hf_qwen3"), dynamic_model("hf_qwen3")
    with torch.no_grad():  # a forward past the context scales the frequencies (NTK)
        model(input_ids=torch.randint(2, VOCAB, (1, CONTEXT + 8)), use_cache=False)
    rotary = model.model.rotary_emb
    assert rotary.max_seq_len_cached == CONTEXT + 8
    assert not torch.equal(rotary.inv_freq, rotary.original_inv_freq)
    _, ours, _ = sample(model, ragged_prompts())
    _, want, _ = sample(fresh, ragged_prompts())
    assert torch.equal(ours, want)
    assert rotary.max_seq_len_cached == CONTEXT
    assert torch.equal(rotary.inv_freq, rotary.original_inv_freq)


def test_a_dynamic_rope_whose_forward_is_not_transformers_update_is_refused():
    model = dynamic_model("hf_llama")
    rotary = model.model.rotary_emb

    class OwnRotary(type(rotary)):  # its own forward: the engine cannot tell what it updates
        def forward(self, x, position_ids):
            return super().forward(x, position_ids)

    rotary.__class__ = OwnRotary
    with pytest.raises(ValueError, match="rope_type is dynamic and its OwnRotary.forward is "
                                         "not transformers' dynamic_rope_update"):
        RolloutEngine(model)


def test_a_no_grad_over_the_dynamic_decorator_is_looked_through():
    # transformers versions that put @torch.no_grad() over @dynamic_rope_update: the engine
    # took the first wrapper down, the dynamic update itself, with its 2 host reads a step
    model = dynamic_model("hf_llama")
    rotary = model.model.rotary_emb

    class NoGradOverTheUpdate(type(rotary)):
        forward = torch.no_grad()(type(rotary).forward)

    rotary.__class__ = NoGradOverTheUpdate
    engine, ours, theirs = sample(model, ragged_prompts())
    assert torch.equal(ours, theirs)
    ws = engine._workspace
    ws.cache.step.zero_()
    with torch.no_grad(), _CountHostReads() as count:
        ws.step_fn(*ws.cache.decode_tensors())
    assert count.reads == 0


@pytest.mark.parametrize("change", ["hook", "forward"])
def test_a_hook_on_the_dynamic_rotary_is_refused_not_skipped(change):
    # the engine calls the undecorated rotary forward: a hook or instance forward on rotary_emb
    # (added after the engine was built) would be skipped, sampling another model
    model = dynamic_model("hf_llama")
    engine = RolloutEngine(model)
    rotary = model.model.rotary_emb
    if change == "hook":
        rotary.register_forward_hook(lambda mod, args, out: (out[0] * 0.5, out[1] * 0.5))
    else:
        rotary.forward = lambda x, positions: type(rotary).forward(rotary, x, positions)
    with pytest.raises(ValueError, match="dynamic RoPE's rotary_emb has (hooks|its forward)"):
        engine.generate(ragged_prompts(), group_size=2, max_generated_tokens=3, pad_id=PAD,
                        rng=torch.Generator().manual_seed(0))
