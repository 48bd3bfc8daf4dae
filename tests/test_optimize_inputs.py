"""optimize(model) on CPU, fp64: the calling conventions it accepts (transformers' and
torchtune's arguments, positions, masks) checked against the model run row by row, and the
models and inputs it refuses by name."""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.testing import (
    make_batch,
    mixed_batch,
    rel_err,
    row_by_row_logits,
    row_by_row_response_logprobs,
    same_dtype_numerics,
    tiny_model,
)

TOL = 1e-10


@pytest.fixture(autouse=True)
def fresh_counters():
    dk.counters.clear()
    torch._dynamo.reset()


def test_forward_accepts_the_models_own_arguments():
    model = same_dtype_numerics(tiny_model("hf_llama")).double()
    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(model)
    out = wrapper(input_ids=tokens, attention_mask=mask.long(), prompt_len=p)
    ref = row_by_row_logits(model, tokens, mask)
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    given = wrapper(input_ids=tokens, attention_mask=mask, position_ids=positions, prompt_len=p)
    for b in range(tokens.shape[0]):  # every row, shared prompts included
        assert rel_err(out.logits[b, mask[b]], ref[b]) < TOL, b
        assert rel_err(given.logits[b, mask[b]], ref[b]) < TOL, b
    with pytest.raises(ValueError, match="positions differ"):
        wrapper(input_ids=tokens, attention_mask=mask, position_ids=positions + 1, prompt_len=p)
    # a column too many, or a list, raised torch's bare size or type error
    b, length = tokens.shape
    for bad, shown in ((torch.zeros(b, length + 1, dtype=torch.long), rf"\({b}, {length + 1}\)"),
                       (positions.tolist(), "list"), (positions.double(), "torch.float64")):
        with pytest.raises(ValueError, match=rf"position_ids must be an integer tensor shaped "
                                             rf"\[{b}, {length}\] or \[1, {length}\] for the "
                                             rf"tokens .*got .*{shown}"):
            wrapper(input_ids=tokens, attention_mask=mask, position_ids=bad, prompt_len=p)
    with pytest.raises(ValueError, match=r"unsupported arguments.*'labels'"):
        wrapper(input_ids=tokens, labels=tokens, prompt_len=p)
    wrapper(input_ids=tokens, attention_mask=mask, use_cache=False, prompt_len=p)
    with pytest.raises(ValueError, match="use_cache=True: the dualkv wrapper returns no KV"):
        wrapper(input_ids=tokens, attention_mask=mask, use_cache=True, prompt_len=p)


def test_padding_between_tokens_needs_position_ids():
    """Without position_ids transformers numbers positions 0..L-1 across padding; the packed
    layout numbers valid tokens. Left padding only shifts them (RoPE sees differences: equal
    up to rounding); padding between a prompt and its responses changes the result: refused."""
    model = same_dtype_numerics(tiny_model("hf_qwen3")).double()
    wrapper = dk.optimize(model)
    tokens, mask, p = make_batch([5, 3], [[4, 4], [4, 2]], vocab=90, pad_side="left")
    with torch.no_grad():
        out = wrapper(input_ids=tokens, attention_mask=mask.long(), prompt_len=p).logits
        ref = model(input_ids=tokens, attention_mask=mask.long()).logits
    assert (out - ref)[mask].abs().max() < 1e-7  # the shift's rounding, in fp64
    tokens, mask, p = make_batch([5, 3], [[4, 4], [4, 2]], vocab=90, pad_side="right")
    with pytest.raises(ValueError, match=r"attention_mask rows \[2, 3\] have padding between"):
        wrapper(input_ids=tokens, attention_mask=mask.long(), prompt_len=p)
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    out = wrapper(input_ids=tokens, attention_mask=mask.long(), position_ids=positions,
                  prompt_len=p).logits
    ref = model(input_ids=tokens, attention_mask=mask.long(), position_ids=positions).logits
    assert rel_err(out[mask], ref[mask]) < TOL


def test_unsupported_models_are_named():
    with pytest.raises(TypeError, match="got torch.nn.modules.linear.Linear"):
        dk.optimize(torch.nn.Linear(2, 2))
    import transformers as tf

    cfg = tf.MistralConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           sliding_window=8)
    model = tf.MistralForCausalLM._from_config(cfg, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="sliding windows"):
        dk.optimize(model)
    # Qwen3 with the window switched on but no layer past max_window_layers: every layer is
    # full attention (layer_types), which optimize() takes
    cfg = tf.Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, head_dim=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert cfg.layer_types == ["full_attention"] * 2
    dk.optimize(tf.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa"))
    # Qwen3-MoE's attention reads config.sliding_window itself, whatever layer_types says
    from dualkv_compile.hf_config import sliding_window

    assert sliding_window({"model_type": "qwen3_moe", "layer_types": ["full_attention"],
                           "use_sliding_window": True, "sliding_window": 3})
    assert not sliding_window({"model_type": "qwen3", "layer_types": ["full_attention"],
                               "use_sliding_window": True, "sliding_window": 3})
    # a window set after the config's post-init (from_pretrained(path, sliding_window=4)
    # does that): Qwen3-MoE's model uses it though use_sliding_window stays False; the
    # layer-by-layer path and the rollout engine once ran it as full attention
    from dualkv_compile.rollout import RolloutEngine
    from dualkv_compile.testing import tiny_model

    model = tiny_model("hf_qwen3_moe")
    assert not model.config.use_sliding_window and model.config.sliding_window is None
    model.config.sliding_window = 4
    for region in ("model", "layer"):
        with pytest.raises(ValueError, match="sliding windows \\(sliding_window=4\\)"):
            dk.optimize(model, dk.DualKVConfig(compile_region=region))
    with pytest.raises(ValueError, match="sliding_window=4"):
        RolloutEngine(model)
    cfg = tf.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'.*'eager'"):
        dk.optimize(model)
    cfg = tf.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                          "rope_theta": 10000.0})
    model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="rope_type='dynamic'"):  # was a Dynamo traceback
        dk.optimize(model, dk.DualKVConfig(fallback="dense"))


class _ArangePositions(torch.nn.Module):
    """Adds a signal built from arange over the sequence: positions not fed from the layout."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=x.dtype)
        return self.inner(x) + 0.01 * pos[None, :, None]


@pytest.mark.parametrize("wrapper,message", [
    (lambda mlp: _ArangePositions(mlp), r"own sequence axis.*feed packed positions"),
    (lambda mlp: _PositionMatmul(mlp), r"matmul.*own sequence axis"),
], ids=["added", "matmul"])
def test_positions_made_inside_the_model_are_refused(wrapper, message):
    from dualkv_compile.passes._common import Refusal

    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    model.layers[0].mlp = wrapper(model.layers[0].mlp)
    tokens, mask, p = mixed_batch()
    with pytest.raises(Refusal, match=message):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_attention_dropout_is_refused():
    from dualkv_compile.passes._common import Refusal

    model = same_dtype_numerics(tiny_model("qwen2_5")).double().train()
    for layer in model.layers:
        layer.attn.attn_dropout = 0.1
    tokens, mask, p = mixed_batch()
    with pytest.raises(Refusal, match="dropout_p=0.1"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


class _PositionMatmul(torch.nn.Module):
    """Rotates each token by a per-position matrix built from arange: positions not fed from
    the packed layout, in matmul form."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        t, d = x.shape[1], x.shape[2]
        angle = torch.arange(t, dtype=x.dtype)[:, None, None] * 0.01
        rot = torch.eye(d, dtype=x.dtype) * torch.cos(angle)  # [T, d, d]
        return self.inner(torch.matmul(rot, x.unsqueeze(-1)).squeeze(-1))


def test_no_response_columns_give_an_empty_result():
    model = tiny_model("qwen2_5").double()
    tokens, mask, p = make_batch([5, 3], [[0, 0], [0]], vocab=90,
                                 generator=torch.Generator().manual_seed(2))
    assert tokens.shape[1] == p
    lp = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert lp.shape == (3, 0) and lp.dtype == torch.float64
    loss, lp = dk.optimize(model).response_loss(tokens, prompt_len=p, padding_mask=mask,
                                                token_loss=lambda lp, i: lp)
    assert lp.shape == (3, 0) and loss.item() == 0 and loss.dtype == torch.float64


def test_heads_that_are_not_a_plain_linear_map_are_rejected():
    from dualkv_compile.models import tiny_decoder

    model = tiny_decoder(vocab_size=12)
    model.output = torch.nn.Linear(64, 12, bias=True)
    with pytest.raises(ValueError, match="LM head model.output has a bias"):
        dk.optimize(model)
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    hf = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    hf.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        dk.optimize(hf)


def test_a_token_must_be_both_an_embedding_row_and_an_lm_head_row():
    from dualkv_compile.models import tiny_decoder

    model = tiny_decoder(vocab_size=12)
    model.output = torch.nn.Linear(64, 10, bias=False)  # a head narrower than the embedding
    tokens, mask, p = make_batch([4], [[3, 3]], vocab=10, generator=torch.Generator().manual_seed(0))
    tokens[0, -1] = 11  # an input the embedding takes, but no logprob target
    with pytest.raises(ValueError, match=r"id 11, outside the model's vocabulary \[0, 10\)"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_torchtune_mask_and_input_pos_are_accepted():
    from torchtune.generation import (
        get_causal_mask_from_padding_mask,
        get_position_ids_from_padding_mask,
    )

    model = same_dtype_numerics(tiny_model("llama3_2")).double()
    tokens, mask, p = mixed_batch()
    assert not mask[:, -1].all() and mask[:, -1].any()  # the last column is ambiguous in the mask
    tt_mask = get_causal_mask_from_padding_mask(mask)
    input_pos = get_position_ids_from_padding_mask(mask)
    wrapper = dk.optimize(model)
    logits = wrapper(tokens, mask=tt_mask, input_pos=input_pos, prompt_len=p)
    for b, ref in enumerate(row_by_row_logits(model, tokens, mask)):  # the plain model's rows
        assert rel_err(logits[b, mask[b]], ref.to(logits.dtype)) < 1e-6, b  # float32 logits
    assert torch.equal(logits, wrapper(tokens, padding_mask=mask, prompt_len=p))
    with pytest.raises(ValueError, match="pass input_pos as well"):
        wrapper(tokens, mask=tt_mask, prompt_len=p)
    # positions right at every token but not 0 at padding: the last column reads as a token
    cumsum_pos = (mask.long().cumsum(1) - 1).clamp_min(0)
    with pytest.raises(ValueError, match="input_pos must also be 0 at padding"):
        wrapper(tokens, mask=tt_mask, input_pos=cumsum_pos, prompt_len=p)
    with pytest.raises(ValueError, match="not a causal padding mask"):
        wrapper(tokens, mask=torch.ones_like(tt_mask), input_pos=input_pos, prompt_len=p)
    # input_pos [L], as torchtune's forward takes it, for rows without padding
    full = tokens[:, :4]
    assert torch.equal(wrapper(full, input_pos=torch.arange(4), prompt_len=2),
                       wrapper(full, prompt_len=2))
    # and beside torchtune's mask (an IndexError)
    full_mask = get_causal_mask_from_padding_mask(torch.ones_like(full, dtype=torch.bool))
    assert torch.equal(wrapper(full, mask=full_mask, input_pos=torch.arange(4), prompt_len=2),
                       wrapper(full, prompt_len=2))
    # a row whose one token is in the last column has the mask and positions of padding: it
    # was refused as having no prompt token; the error now says why and what to pass
    lone = torch.zeros_like(mask[:1])
    lone[0, -1] = True
    with pytest.raises(ValueError, match=r"rows \[0\] of torchtune's mask .* pass padding_mask="):
        wrapper(tokens[:1], mask=get_causal_mask_from_padding_mask(lone),
                input_pos=get_position_ids_from_padding_mask(lone), prompt_len=tokens.shape[1])


def _softcap_unembed(model):
    """The torchtune decoder as a subclass that soft-caps its logits in unembed, which
    TransformerDecoder.forward calls for the final norm and the LM head."""
    base = type(model)

    def unembed(self, h):
        return 3 * torch.tanh(base.unembed(self, h) / 3)

    model.__class__ = type(f"Capped{base.__name__}", (base,), {"unembed": unembed})


def _halve_logits(module, args, out):
    if hasattr(out, "logits"):
        out.logits = out.logits * 0.5
        return out
    return out * 0.5


@pytest.mark.parametrize("family, change, match", [
    ("llama3_2", _softcap_unembed, r"CappedTransformerDecoder overrides unembed"),
    ("llama3_2", lambda m: m.register_forward_hook(_halve_logits),
     r"TransformerDecoder has hooks \(_halve_logits\)"),
    ("llama3_2", lambda m: m.register_forward_pre_hook(lambda mod, a, kw: None, with_kwargs=True),
     r"TransformerDecoder has hooks \(.*<lambda>\)"),
    ("hf_llama", lambda m: m.register_forward_hook(_halve_logits),
     r"LlamaForCausalLM has hooks \(_halve_logits\)"),
], ids=["torchtune-unembed", "torchtune-hook", "torchtune-pre-hook-kwargs", "hf-hook"])
@pytest.mark.parametrize("region", ["model", "layer"])
def test_what_the_wrapper_never_calls_is_refused(family, change, match, region):
    # the wrapper runs the model's parts, never its __call__ or torchtune's unembed: a
    # soft-capping unembed (10 off) and forward hooks on the model (0.1-20 off) were skipped
    # silently, in either region and in the rollout engine
    model = same_dtype_numerics(tiny_model(family)).double()
    change(model)
    tokens, mask, p = mixed_batch()
    with pytest.raises(ValueError, match=match + ".* would not run"):
        dk.optimize(model, dk.DualKVConfig(compile_region=region))
    with pytest.raises(ValueError, match=r"rollout engine cannot run .*" + match):
        dk.rollout.RolloutEngine(model)


def test_a_hook_on_the_transformers_decoder_runs_in_the_model_region_only():
    # the model region calls the decoder (its hooks are traced); the layer region runs its
    # layers one by one and would skip them
    model = same_dtype_numerics(tiny_model("hf_llama")).double()
    calls = []
    model.get_decoder().register_forward_hook(lambda mod, args, out: calls.append(1))
    tokens, mask, p = mixed_batch()
    dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert calls
    layer = dk.optimize(model, dk.DualKVConfig(compile_region="layer"))
    with pytest.raises(ValueError, match=r"runs the decoder by layer: LlamaModel has hooks "
                                         r"\(.*<lambda>\)"):
        layer.response_logprobs(tokens, prompt_len=p, padding_mask=mask)


@pytest.mark.parametrize("family,part", [("hf_qwen3", lambda m: m.model.layers[0]),
                                         ("hf_qwen3", lambda m: m.model.layers[1].self_attn),
                                         ("qwen2_5", lambda m: m.layers[0].attn)],
                         ids=["hf-layer", "hf-attention", "torchtune-attention"])
def test_the_rollout_engine_refuses_hooks_on_the_modules_it_runs_by_parts(family, part):
    # it runs each layer's parts, not the layer or its attention module: a steering hook there
    # was skipped, and the rollout sampled another model than the one trained
    model = tiny_model(family)
    engine = dk.rollout.RolloutEngine(model)
    part(model).register_forward_hook(lambda mod, args, out: out)
    prompts = torch.randint(3, 50, (1, 5))
    with pytest.raises(ValueError, match=r"rollout engine cannot run .* has hooks \(.*<lambda>\)"):
        engine.generate(prompts, group_size=2, max_generated_tokens=2, pad_id=0)
    with pytest.raises(ValueError, match=r"has hooks \(.*<lambda>\), which the engine"):
        dk.rollout.RolloutEngine(model)


def test_the_dense_path_refuses_hooks_on_the_lm_head():
    # the dense path (enabled=False, or fallback="dense" after a refusal) applies the head's
    # weight itself: a pre-hook halving the head's input was skipped there (0.11 off in
    # float64), while the packed path traces it
    model = same_dtype_numerics(tiny_model("hf_llama")).double()
    model.get_output_embeddings().register_forward_pre_hook(lambda mod, args: (args[0] / 2,))
    tokens, mask, p = mixed_batch()
    wrapped = dk.optimize(model, dk.DualKVConfig(enabled=False))
    with pytest.raises(ValueError, match=r"LM head \(Linear\) has hooks "
                                         r"\(.*<lambda>\); the dense path"):
        wrapped.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    # a backward hook too (one zeroing the head's input gradient was skipped)
    model = same_dtype_numerics(tiny_model("hf_llama")).double()
    model.get_output_embeddings().register_full_backward_pre_hook(
        lambda mod, grad: (torch.zeros_like(grad[0]),))
    with pytest.raises(ValueError, match=r"LM head \(Linear\) has hooks"):
        dk.optimize(model, dk.DualKVConfig(enabled=False)).response_logprobs(
            tokens, prompt_len=p, padding_mask=mask)


def test_a_config_asking_for_hidden_states_runs_exact():
    # transformers set up its output-capture hooks under a lock Dynamo cannot enter: refused
    # at the first call unless the plain model had run once before
    model = same_dtype_numerics(tiny_model("hf_llama")).double()
    model.config.output_hidden_states = True
    tokens, mask, p = mixed_batch()
    ours = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    model.config.output_hidden_states = False
    theirs = row_by_row_response_logprobs(model, tokens, mask, p)
    assert (ours - theirs).abs().max() < 1e-10


@pytest.mark.parametrize("family", ["llama3_2", "hf_llama"])
def test_an_embedding_inside_a_wrapper_module_is_read_and_exact(family):
    # optimize() took the model, then every call raised AttributeError: no num_embeddings
    class Scaled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(ids) * 2.0

    model = same_dtype_numerics(tiny_model(family)).double()
    if family == "hf_llama":
        model.model.embed_tokens = Scaled(model.model.embed_tokens)
    else:
        model.tok_embeddings = Scaled(model.tok_embeddings)
    tokens, mask, p = make_batch([9, 5], [[6, 1], [3, 3]], vocab=99,
                                 generator=torch.Generator().manual_seed(1))
    ours = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    theirs = row_by_row_response_logprobs(model, tokens, mask, p)
    assert (ours - theirs).abs().max() < 1e-10
    from dualkv_compile.adapters import embedding_rows

    with pytest.raises(ValueError, match=r"Sequential has no num_embeddings and holds 2"):
        embedding_rows(torch.nn.Sequential(torch.nn.Embedding(3, 2), torch.nn.Embedding(3, 2)))


def test_a_model_whose_attention_is_written_by_hand_is_refused_as_such():
    # the refusal read "no scaled_dot_product_attention ...; nothing to share", as if the model
    # had no attention
    from torchtune.models.gemma2._component_builders import gemma2

    torch.manual_seed(0)
    model = gemma2(vocab_size=101, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32,
                   intermediate_dim=64, max_seq_len=512, head_dim=8).double()
    tokens, mask, p = make_batch([9, 5], [[6, 1], [3, 3]], vocab=99,
                                 generator=torch.Generator().manual_seed(1))
    with pytest.raises(dk.Refusal, match=r"its attention is written by hand \(matmul and "
                                         r"softmax, as Gemma2's"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_an_embedding_pre_hook_beside_the_require_grads_hook_is_applied_and_exact():
    # the pre-hook made the embedding run inside the graph with transformers' require-grads
    # hook, which Dynamo refused ("returning intermediate with requires_grad_()")
    model = same_dtype_numerics(tiny_model("hf_llama")).double()
    model.get_input_embeddings().requires_grad_(False)  # frozen, as under PEFT
    model.enable_input_require_grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: (args[0] % 50,))
    model.train()
    tokens, mask, p = make_batch([9, 5], [[6, 1], [3, 3]], vocab=99,
                                 generator=torch.Generator().manual_seed(1))
    weights = torch.randn(tokens.shape[0], tokens.shape[1] - p, dtype=torch.float64)
    ours = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    (ours * weights).sum().backward()
    trained = [q for q in model.parameters() if q.requires_grad]
    got = [q.grad.clone() for q in trained]
    model.zero_grad()
    theirs = row_by_row_response_logprobs(model, tokens, mask, p)
    (theirs * weights).sum().backward()
    assert (ours - theirs).abs().max() < 1e-10
    assert all((a - q.grad).abs().max() < 1e-10 for a, q in zip(got, trained))
