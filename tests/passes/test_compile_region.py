"""compile_region="layer": one compiled graph per decoder layer (reused by every layer), the
embedding, final norm and LM head eager; torchtune decoders and transformers causal LMs (the
MoE case is in tests/models/test_moe_grouped_experts.py). CPU, fp64, against the unmodified
model row by row; the FSDP2 use of this path is tests/test_fsdp.py."""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.testing import (
    mixed_batch,
    rel_err,
    row_by_row_logits,
    row_by_row_response_logprobs,
    same_dtype_numerics,
    tiny_model,
)

TOL = 1e-10


def _checkpointed(model):
    if hasattr(model, "gradient_checkpointing_enable"):  # transformers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import set_activation_checkpointing

    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    return model


@pytest.mark.parametrize("family,checkpointed,attention_backend",
                         [("qwen2_5", False, "auto"), ("llama3_2", False, "auto"),
                          ("qwen2_5", True, "auto"), ("qwen2_5", True, "regions"),
                          ("hf_qwen3", False, "auto"), ("hf_qwen3", True, "auto"),
                          ("hf_llama", False, "regions")])
def test_layer_region_matches_row_by_row(family, checkpointed, attention_backend):
    model = same_dtype_numerics(tiny_model(family)).double()
    if checkpointed:
        model = _checkpointed(model)
    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(model, dk.DualKVConfig(compile_region="layer",
                                                 attention_backend=attention_backend))
    assert wrapper.compile_region() == "layer"

    logits = wrapper(tokens, prompt_len=p, padding_mask=mask)
    logits = getattr(logits, "logits", logits)  # transformers models return their output class
    for b, ref in enumerate(row_by_row_logits(model, tokens, mask)):
        assert rel_err(logits[b, mask[b]], ref.to(logits.dtype)) < 1e-6, b  # float32 unembed

    lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask, temperature=0.7)
    weights = torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype).view_as(lp)
    (lp * weights).sum().backward()
    ours = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    ref = row_by_row_response_logprobs(model, tokens, mask, p, temperature=0.7)
    assert rel_err(lp.detach(), ref.detach()) < TOL
    (ref * weights).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        assert rel_err(ours[name], param.grad) < TOL, name

    # one layer graph served both layers and both calls (the second call ran with grad too)
    assert dk.counters["graphs_compiled"] == 1
    assert dk.counters["attention_rewritten"] == 1
    assert dk.counters["checkpoints_inlined"] == (1 if checkpointed else 0)
    assert dk.counters["lm_head_pruned"] == 0  # the head runs eagerly, chunked


def test_auto_region_is_model_for_an_unsharded_model():
    wrapper = dk.optimize(tiny_model("qwen2_5"))
    assert wrapper.compile_region() == "model"


def test_layer_region_refuses_hooked_layers():
    model = tiny_model("qwen2_5")
    model.layers[1].register_forward_hook(lambda mod, args, out: out)
    wrapper = dk.optimize(model, dk.DualKVConfig(compile_region="layer"))
    tokens, mask, p = mixed_batch()
    with pytest.raises(ValueError, match="layer 1 has hooks"):
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_compile_region_is_validated():
    with pytest.raises(ValueError, match="compile_region='layers'"):
        dk.DualKVConfig(compile_region="layers")


class _PositionalEmbedding(torch.nn.Embedding):
    """An embedding that adds a learned table by packed index: not token-local."""

    def __init__(self, *args):
        super().__init__(*args)
        self.positions = torch.nn.Parameter(torch.randn(1024, self.embedding_dim))

    def forward(self, tokens):
        return super().forward(tokens) + self.positions[:tokens.shape[1]][None]


class _CumsumNorm(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x + 0.05 * x.cumsum(1))


@pytest.mark.parametrize("family", ["qwen2_5", "hf_qwen3"])
@pytest.mark.parametrize("part", ["embedding", "final norm"])
def test_layer_region_refuses_custom_modules_outside_the_layers(family, part):
    # the layer region runs these eagerly, outside the proof; compile_region="model" traces
    # and refuses the same code by its op
    model = tiny_model(family)
    hf = hasattr(model, "get_decoder")
    if part == "embedding":
        old = model.get_input_embeddings() if hf else model.tok_embeddings
        new = _PositionalEmbedding(old.num_embeddings, old.embedding_dim)
        model.set_input_embeddings(new) if hf else setattr(model, "tok_embeddings", new)
    else:
        owner = model.get_decoder() if hf else model
        owner.norm = _CumsumNorm(owner.norm)
    tokens, mask, p = mixed_batch()
    for region, match in (("layer", f"runs the model's {part} outside"), ("model", "token-local")):
        wrapper = dk.optimize(model, dk.DualKVConfig(compile_region=region))
        with pytest.raises(dk.Refusal, match=match):
            wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_an_lm_head_that_is_not_a_plain_linear_is_refused():
    class Scaled(torch.nn.Linear):
        def forward(self, h):
            return super().forward(h) * 0.25

    model = tiny_model("qwen2_5")
    emb = model.tok_embeddings
    model.output = Scaled(emb.embedding_dim, emb.num_embeddings, bias=False)
    with pytest.raises(ValueError, match="must be an nn.Linear"):
        dk.optimize(model)


def _mix_tokens(module, args, out):  # a forward hook over the sequence axis
    return out - out.mean(1, keepdim=True)


def _halve_input(module, args):  # a token-local pre-hook
    return (args[0] * 0.5,)


def _halve_output(module, args, out):
    return out * 0.5


@pytest.mark.parametrize("family", ["hf_llama", "llama3_2"])
@pytest.mark.parametrize("part, register, model_region", [
    ("embedding", lambda m: m.register_forward_hook(_mix_tokens), "cannot prove `mean`"),
    ("final norm", lambda m: m.register_forward_hook(_mix_tokens), "cannot prove `mean`"),
    ("LM head", lambda m: m.register_forward_pre_hook(_halve_input), None),
    ("LM head", lambda m: m.register_forward_hook(_halve_output), "not produced by a linear"),
], ids=["embedding", "final-norm", "head-pre-hook", "head-hook"])
def test_layer_region_refuses_hooks_outside_the_layers(family, part, register, model_region):
    # the layer region ran the embedding's and final norm's hooks eagerly, outside the proof
    # (a token-mixing hook was taken, 0.2-20 off), and the LM head's for logits only:
    # response_logprobs applies the head's weight, so a hook on the head was skipped (0.1 off).
    # compile_region="model" traces them: it refuses the mixing and post hooks by their op and
    # keeps the pre-hook exact
    model = same_dtype_numerics(tiny_model(family)).double()
    hf = hasattr(model, "get_decoder")
    if not hf:  # an untied head (the tiny builder ties it) that can carry hooks
        model.output = torch.nn.Linear(32, 101, bias=False, dtype=torch.float64)
    module = {"embedding": model.get_input_embeddings() if hf else model.tok_embeddings,
              "final norm": (model.get_decoder() if hf else model).norm,
              "LM head": model.get_output_embeddings() if hf else model.output}[part]
    register(module)
    tokens, mask, p = mixed_batch()
    layer = dk.optimize(model, dk.DualKVConfig(compile_region="layer"))
    with pytest.raises(dk.Refusal, match=rf"runs the model's {part} .* hooks "
                                         rf"\(_(mix_tokens|halve_\w+)\)"):
        layer.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    whole = dk.optimize(model, dk.DualKVConfig(compile_region="model"))
    if model_region is not None:
        with pytest.raises(dk.Refusal, match=model_region):
            whole.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
        return
    lp = whole.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    ref = row_by_row_response_logprobs(model, tokens, mask, p)
    assert rel_err(lp, ref) < (TOL if hf else 1e-6)  # torchtune's reference: float32 logits


def test_a_hook_added_after_the_first_call_is_refused_too():
    model = tiny_model("qwen2_5")
    wrapper = dk.optimize(model, dk.DualKVConfig(compile_region="layer"))
    tokens, mask, p = mixed_batch()
    wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    model.norm.register_forward_hook(_mix_tokens)
    with pytest.raises(dk.Refusal, match=r"final norm .* \(_mix_tokens\)"):
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_a_layer_hook_added_after_the_first_call_is_refused_too():
    # the layers' hook check ran at the first call only: a later hook was skipped (2.1 off)
    model = tiny_model("qwen2_5")
    wrapper = dk.optimize(model, dk.DualKVConfig(compile_region="layer"))
    tokens, mask, p = mixed_batch()
    wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    model.layers[0].register_forward_hook(lambda mod, args, out: out + 1)
    with pytest.raises(ValueError, match=r"layer 0 has hooks \(.*<lambda>\)"):
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_transformers_inactive_capture_hooks_are_not_refused_as_skipped():
    # a forward asking for hidden states leaves an inert hook on every layer and attention
    # module (transformers 5), which the rollout engine may skip
    model = tiny_model("hf_qwen3")
    tokens, mask, p = mixed_batch()
    model(tokens[:1], output_hidden_states=True)
    assert model.model.layers[0]._forward_hooks and model.model.layers[0].self_attn._forward_hooks
    dk.rollout.RolloutEngine(model).generate(tokens[:1, :p], group_size=2,
                                             max_generated_tokens=2, pad_id=0)
