"""The rollout engine refuses bad input by name (CPU): sampling arguments, prompts, models it
cannot run, Triton attention on the CPU, a seed given as rng and empty prompts."""

import os

import numpy as np
import pytest
import torch

from dualkv_compile.rollout import RolloutEngine
from engine_helpers import EOS, PAD, VOCAB, model_of, ragged_prompts


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
    # a 0-dim float tensor or array: a bare TypeError (iteration over a 0-d tensor)
    (dict(stop_tokens=torch.tensor(1.0)), r"stop_tokens=tensor\(1.\) is not a token id"),
    (dict(stop_tokens=np.array(1.5)), r"stop_tokens=array\(1.5\) is not a token id"),
    # "no" is true: logprobs were returned
    (dict(return_logprobs="no"), "return_logprobs='no' must be True or False"),
])
def test_bad_arguments_are_named(kw, match):
    args = dict(group_size=2, max_generated_tokens=4, pad_id=PAD) | kw
    with pytest.raises(ValueError, match=match):
        RolloutEngine(model_of("qwen3")).generate(ragged_prompts(), **args)


@pytest.mark.parametrize("kw", [dict(compile="no"), dict(cuda_graphs=1), dict(share_prompt="False"),
                                dict(share_prompt=None)])
def test_engine_switches_are_bools(kw):
    # compile="no" compiled; share_prompt="False" shared the prompt (a baseline measured wrong)
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=f"{name}={value!r} must be True or False"):
        RolloutEngine(model_of("qwen3"), **kw)


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


@pytest.mark.parametrize("kw,match", [
    (dict(rng=0), r"rng=0 must be a torch.Generator"),
    (dict(width=0), r"prompts \(3, 0\) .* P >= 1"),
])
def test_a_seed_for_rng_and_empty_prompts_are_named(kw, match):
    prompts = ragged_prompts()[:, :kw.pop("width", None)]
    with pytest.raises(ValueError, match=match):
        RolloutEngine(model_of("qwen3")).generate(prompts, group_size=2, max_generated_tokens=4,
                                                  pad_id=PAD, **kw)


def _hook(module):
    module.register_forward_hook(lambda mod, args, out: out)


def _instance_forward(module):  # as accelerate's autocast wrapper sets model.forward
    module.forward = module.forward


def _steered_layer(model):  # a layer subclass whose forward adds a steering vector
    layer = model.layers[0]

    class Steered(type(layer)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) + 5.0

    layer.__class__ = Steered


@pytest.mark.parametrize("family,change,match", [
    ("qwen2_5", _hook, r"the torchtune decoder TransformerDecoder has hooks"),
    ("hf_qwen3", _hook, r"the causal LM Qwen3ForCausalLM has hooks"),
    ("hf_qwen3", lambda m: _hook(m.model), r"the decoder Qwen3Model has hooks"),
    ("qwen2_5", _instance_forward, r"TransformerDecoder has its forward replaced"),
    ("hf_qwen3", lambda m: _instance_forward(m.model.layers[1]),
     r"layer 1 has its forward replaced on the instance, which the engine"),
    ("qwen2_5", _steered_layer, r"layer 0 Steered overrides forward"),
], ids=["torchtune-model-hook", "hf-model-hook", "hf-decoder-hook", "model-forward",
        "layer-forward", "layer-subclass"])
def test_code_the_engine_would_skip_is_refused_at_the_next_call(family, change, match):
    # checked only when the engine was built: a hook on the model, or a forward override,
    # added after it was silently skipped, and the rollout sampled another model
    from dualkv_compile.testing import tiny_model

    model = tiny_model(family).eval()
    engine = RolloutEngine(model)
    prompts = torch.randint(3, 50, (1, 5))
    engine.generate(prompts, group_size=2, max_generated_tokens=2, pad_id=0)
    change(model)
    with pytest.raises(ValueError, match=r"rollout engine cannot run .*" + match):
        engine.generate(prompts, group_size=2, max_generated_tokens=2, pad_id=0)
    with pytest.raises(ValueError, match=match):
        RolloutEngine(model)


@pytest.mark.parametrize("dispatch", ["eager", None])
def test_a_moe_dispatch_the_compiled_step_cannot_trace_is_named(dispatch):
    # transformers' eager experts loop over the experts hit (nonzero): compiled on CUDA (the
    # default there) the call died with a bare Dynamo UserError
    from dualkv_compile.testing import tiny_model

    model = tiny_model("hf_qwen3_moe").eval()
    model.config._experts_implementation = dispatch
    engine = RolloutEngine(model, compile=True, attention="math")
    with pytest.raises(ValueError, match=rf"_experts_implementation={dispatch!r} loops over .*"
                                         r"or pass compile=False"):
        engine.generate(torch.randint(3, 50, (1, 5)), group_size=2, max_generated_tokens=2,
                        pad_id=0)
    RolloutEngine(model, compile=False).generate(torch.randint(3, 50, (1, 5)), group_size=2,
                                                 max_generated_tokens=2, pad_id=0)


@pytest.mark.parametrize("family", ["hf_qwen3", "qwen2_5"])
def test_compiled_and_checkpointed_layers_are_run_by_their_parts(family):
    # torch.compile's wrapper sets forward on its instance: refused as an override when the
    # instance check came in (torchtitan compiles each layer)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from dualkv_compile.testing import tiny_model

    model = tiny_model(family).eval()
    layers = model.model.layers if family.startswith("hf") else model.layers
    prompts = torch.randint(3, 50, (1, 5))

    def sample():
        return RolloutEngine(model).generate(prompts, group_size=2, max_generated_tokens=4,
                                             pad_id=0, rng=torch.Generator().manual_seed(0))

    plain = sample()
    name = "self_attn" if family.startswith("hf") else "attn"  # layer 0's attention wrapped too
    setattr(layers[0], name, torch.compile(getattr(layers[0], name), backend="eager"))
    layers[0] = torch.compile(checkpoint_wrapper(layers[0]), backend="eager")
    layers[1] = checkpoint_wrapper(layers[1])
    assert torch.equal(sample(), plain)
    layers[0]._orig_mod.register_forward_hook(lambda mod, args, out: out)  # a level inside
    with pytest.raises(ValueError, match=r"layer 0 has hooks"):
        sample()
