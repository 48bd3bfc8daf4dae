"""What optimize() needs to know about a model family: how to run its body (embedding to final
norm) on given tokens/positions/mask, its LM head, and what it refuses to share."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .hf_config import SEQUENCE_DEPENDENT_ROPE, rope_types, sliding_window
from .module_checks import (REQUIRE_GRADS_HOOK, check_head_hooks, check_library_forward,
                            check_outside_modules, own_class)

__all__ = ["HF_FAMILIES", "adapter_for", "has_dropout", "hf_decoder", "token_vocabulary",
           "torchtune_head_weight"]


_TIED_LINEAR = "torchtune.modules.tied_linear.TiedLinear"


def has_dropout(model: nn.Module) -> bool:
    """Any dropout that train mode would apply: nn.Dropout modules, or the attention dropout
    rates torchtune (attn_dropout) and transformers (attention_dropout) keep as numbers."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for name in ("attn_dropout", "attention_dropout"):
            rate = getattr(m, name, 0.0)
            if isinstance(rate, (int, float)) and rate > 0:
                return True
    return False


def token_vocabulary(embedding_rows: int, head_rows: int, *, sampling: bool = False) -> int:
    """The ids a model takes as tokens: an input (an embedding row) and a logprob's target (an
    LM-head row), so [0, min(rows)). A sampler draws over the head's rows and feeds each draw
    back as input, so `sampling` refuses a head with more rows than the embedding."""
    if sampling and head_rows > embedding_rows:
        raise ValueError(f"the LM head has {head_rows} rows but the input embedding "
                         f"{embedding_rows}: a token sampled past {embedding_rows - 1} could not "
                         "be fed back; resize the embedding to the head's vocabulary")
    return min(embedding_rows, head_rows)


def embedding_rows(embedding: nn.Module) -> int:
    """The rows of a model's input embedding: its num_embeddings, or that of the one
    nn.Embedding inside a module wrapping it (a scaled or hooked embedding)."""
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    inner = [m for m in embedding.modules() if isinstance(m, nn.Embedding)]
    if len(inner) != 1:
        raise ValueError(f"the input embedding {type(embedding).__name__} has no "
                         f"num_embeddings and holds {len(inner)} nn.Embedding modules: the "
                         f"ids it takes cannot be read; give it a num_embeddings attribute")
    return inner[0].num_embeddings


def _embed_without_require_grads_hook(model, tokens):
    """The input embeddings of `tokens` with the embedding's forward hooks applied except
    transformers' require-grads hook, or None where that hook is absent or the hooks are not
    plain forward hooks (the model then embeds the tokens itself, hooks and all).

    gradient_checkpointing_enable() hooks the embedding to call `requires_grad_(True)` on its
    output, which reentrant checkpointing needs; torch 2.11's Dynamo cannot trace that call
    (graph break gb0125), so every no-grad call of a checkpointed model in train mode failed.
    The packed graph inlines the checkpoints, so that hook has nothing to do there."""
    embed = model.get_input_embeddings()
    hooks = list(embed._forward_hooks.values())
    if (all(getattr(h, "__name__", None) != REQUIRE_GRADS_HOOK for h in hooks)
            or embed._forward_pre_hooks_with_kwargs or embed._forward_hooks_with_kwargs):
        return None
    args = (tokens,)
    for pre_hook in embed._forward_pre_hooks.values():  # as nn.Module's call applies them
        result = pre_hook(embed, args)
        if result is not None:
            args = result if isinstance(result, tuple) else (result,)
    out = embed.forward(*args)
    for hook in hooks:
        if getattr(hook, "__name__", None) != REQUIRE_GRADS_HOOK:
            result = hook(embed, args, out)
            out = out if result is None else result
    return out


def _check_head(weight_module, name: str) -> None:
    """response_logprobs applies the head's weight itself (lm_head/), so the head must be a
    plain linear map: nn.Linear or torchtune's TiedLinear as they are, without a bias."""
    kind = own_class(weight_module)
    if kind is not nn.Linear and f"{kind.__module__}.{kind.__name__}" != _TIED_LINEAR:
        raise ValueError(f"the LM head {name} is a {kind.__module__}.{kind.__name__}; "
                         f"response_logprobs applies the head as a plain linear map of its "
                         f"weight, so it must be an nn.Linear (or torchtune's TiedLinear), "
                         f"not a subclass or another module")
    bias = getattr(weight_module, "bias", None)
    if bias is not None:
        raise ValueError(f"the LM head {name} has a bias; response_logprobs' chunked head "
                         f"applies weight-only heads (Qwen, Llama)")


class _Torchtune:
    """torchtune TransformerDecoder (qwen2_5, llama3_2 builders, our Qwen3 builder). Its
    forward refuses sequences longer than max_seq_len, which a packed batch may be; the body is
    run layer by layer instead, exactly as TransformerDecoder.forward does."""

    name = "torchtune"

    def check(self, model):
        if getattr(model, "output_hidden_states", None):
            raise ValueError("optimize() needs output_hidden_states=[] on the torchtune model, "
                             f"got {model.output_hidden_states}")
        if model.caches_are_enabled():
            raise ValueError("optimize() trains without KV caches; call model.reset_caches() / "
                             "do not set up caches on the model passed in")
        _check_head(model.output, "model.output")
        check_library_forward(model, "torchtune", "the torchtune decoder")

    def body(self, model, tokens, positions, mask=None):
        h = model.tok_embeddings(tokens)
        for layer in model.layers:
            h = layer(h, mask=mask, input_pos=positions)
        return model.norm(h)

    # the layer-region path (optimize.py, compile_region="layer"): the same body in parts
    def embed(self, model, tokens):
        return model.tok_embeddings(tokens)

    def layers(self, model):
        return list(model.layers)

    def layer_forward(self, model, layer, hidden, positions):
        """One layer's forward without its module hooks (FSDP's run outside, see fsdp.py);
        mask=None is causal attention, which the attention pass rewrites."""
        return layer.forward(hidden, mask=None, input_pos=positions)

    def final_norm(self, model, hidden):
        return model.norm(hidden)

    def check_layer_region(self, model):
        check_outside_modules(model.tok_embeddings, model.norm, model.output)

    def head(self, model, hidden):
        return model.output(hidden).float()

    def vocab_size(self, model) -> int:
        return token_vocabulary(embedding_rows(model.tok_embeddings),
                                self.lm_head_weight(model).shape[0])

    def lm_head_weight(self, model) -> Tensor:
        return torchtune_head_weight(model)

    def check_head_hooks(self, model) -> None:
        check_head_hooks(model.output)

    def replicated_mask(self, padding_mask: Tensor) -> Tensor:
        """[B, L, L] causal mask over valid tokens; padding rows see themselves (no NaN)."""
        b, l = padding_mask.shape
        causal = torch.ones(l, l, dtype=torch.bool, device=padding_mask.device).tril()
        mask = causal & padding_mask[:, None, :]
        return mask | torch.eye(l, dtype=torch.bool, device=padding_mask.device)


# transformers families whose causal LMs optimize() was tested on (tests/test_optimize_cpu.py,
# tests/models/test_moe_cpu.py)
HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
# MoE expert dispatches the token-locality proof follows: per-token expert weights gathered by the
# routing table ("batched_mm"), and the grouped dispatch as one token-local op
# (models/moe_experts.py). transformers' "grouped_mm" sorts the tokens by expert and "eager"
# loops over experts with data-dependent shapes; neither is followed.
_MOE_DISPATCH = ("batched_mm", "dualkv_grouped")
_HF_WHY_NOT = {
    "gpt2": "GPT-2's learned absolute position embeddings and Conv1D projections are not "
            "supported",
    "bert": "BERT is a bidirectional encoder, not a causal decoder",
}


def _check_moe(model, cfg) -> None:
    dispatch = getattr(cfg, "_experts_implementation", None)
    if dispatch not in _MOE_DISPATCH:
        raise ValueError(f"optimize() runs {type(model).__name__}'s experts with "
                         f"_experts_implementation in {list(_MOE_DISPATCH)} only, got "
                         f"{dispatch!r}: set model.config._experts_implementation = "
                         "'batched_mm' (it gathers each token's expert weights, so it suits "
                         "small models) or call dualkv_compile.models.use_grouped_experts(model)"
                         " (grouped GEMMs per expert, one token-local op)")
    if dispatch == "dualkv_grouped":  # registered process-wide once: check this model's experts
        from .models.moe_experts import check_grouped_experts

        check_grouped_experts(model)
    if getattr(cfg, "output_router_logits", False):
        raise ValueError("optimize() runs the decoder body only, so the router's auxiliary "
                         "load-balancing loss would not be computed; set "
                         "config.output_router_logits = False (and add the loss yourself if "
                         "you need it)")


class _HuggingFace:
    """transformers causal LMs that call SDPA (attn_implementation="sdpa")."""

    name = "transformers"

    def check(self, model):
        cfg = model.config
        kind = getattr(cfg, "model_type", None)
        if kind not in HF_FAMILIES:
            why = _HF_WHY_NOT.get(kind, "its layers are not among those the token-locality proof "
                                        "and the attention rewrite were tested on")
            raise ValueError(f"optimize() cannot run {type(model).__name__} "
                             f"(model_type={kind!r}): {why}. Supported: torchtune "
                             "TransformerDecoder, and transformers causal LMs of model_type "
                             f"{list(HF_FAMILIES)}")
        if model.get_output_embeddings() is None:
            raise ValueError(f"optimize() needs a causal LM with an LM head; "
                             f"{type(model).__name__} has none (load the *ForCausalLM class)")
        if getattr(cfg, "num_experts", 0):
            _check_moe(model, cfg)
        impl = getattr(cfg, "_attn_implementation", None)
        if impl != "sdpa":
            raise ValueError(f"optimize() needs attn_implementation='sdpa', the model uses "
                             f"{impl!r}; load it with attn_implementation='sdpa'")
        window = sliding_window(cfg)
        if window:
            raise ValueError(f"optimize() supports full causal attention only; this model uses "
                             f"sliding windows ({window})")
        rescaled = rope_types(cfg) & set(SEQUENCE_DEPENDENT_ROPE)
        if rescaled:
            raise ValueError(f"optimize() needs position embeddings that depend on positions "
                             f"only; this model's rope_type={rescaled.pop()!r} rescales them "
                             f"with the sequence length, which differs between the packed "
                             f"sequence and each row")
        for key in ("logit_scale", "logits_scaling", "final_logit_softcapping"):
            value = getattr(cfg, key, None)
            if value not in (None, 1, 1.0):
                raise ValueError(f"optimize() applies the LM head as a plain linear map; this "
                                 f"model's config sets {key}={value}")
        _check_head(model.get_output_embeddings(), "get_output_embeddings()")
        check_library_forward(model, "transformers", "the causal LM")

    def body(self, model, tokens, positions, mask=None):
        base = hf_decoder(model)
        embeds = _embed_without_require_grads_hook(model, tokens)
        inputs = {"input_ids": tokens} if embeds is None else {"inputs_embeds": embeds}
        # output_hidden_states=True in the config set up transformers' capture hooks under a
        # lock Dynamo cannot enter (the refusal named the lock, not the field)
        out = base(**inputs, attention_mask=mask, position_ids=positions, use_cache=False,
                   output_hidden_states=False)
        return out.last_hidden_state

    def head(self, model, hidden):
        return model.get_output_embeddings()(hidden)

    def vocab_size(self, model) -> int:
        return token_vocabulary(embedding_rows(model.get_input_embeddings()),
                                self.lm_head_weight(model).shape[0])

    def lm_head_weight(self, model) -> Tensor:
        return model.get_output_embeddings().weight

    def check_head_hooks(self, model) -> None:
        check_head_hooks(model.get_output_embeddings())

    def replicated_mask(self, padding_mask: Tensor) -> Tensor:
        return padding_mask.long()

    # the layer-region path (optimize.py, compile_region="layer"; FSDP2): the body in parts
    def embed(self, model, tokens):
        embeds = _embed_without_require_grads_hook(model, tokens)
        return model.get_input_embeddings()(tokens) if embeds is None else embeds

    def layers(self, model):
        return list(hf_decoder(model).layers)

    def layer_forward(self, model, layer, hidden, positions):
        """One decoder layer's forward without its module hooks (FSDP's run outside, see
        fsdp.py): the rotary tables from the packed positions, attention_mask=None (causal
        SDPA, which the attention pass rewrites). A layer under transformers' gradient
        checkpointing is checkpointed by its forward (where transformers wraps forward) or
        else here, as its __call__ would."""
        import functools

        position_embeddings = hf_decoder(model).rotary_emb(hidden, positions)
        forward = functools.partial(layer.forward, attention_mask=None, position_ids=positions,
                                    position_embeddings=position_embeddings, use_cache=False)
        wraps_forward = type(layer).forward.__code__.co_name == "forward_with_checkpointing"
        if getattr(layer, "gradient_checkpointing", False) and layer.training and (
                torch.is_grad_enabled() and not wraps_forward):
            from torch.utils.checkpoint import checkpoint

            return checkpoint(forward, hidden, use_reentrant=False)
        return forward(hidden)

    def final_norm(self, model, hidden):
        return hf_decoder(model).norm(hidden)

    def check_layer_region(self, model):
        check_outside_modules(model.get_input_embeddings(), hf_decoder(model).norm,
                               model.get_output_embeddings())
        check_library_forward(hf_decoder(model), "transformers",
                              "compile_region='layer' runs the decoder by layer:")


def torchtune_head_weight(model) -> Tensor:
    """A torchtune decoder's LM-head weight: its output's, or the tied embedding's."""
    out = model.output
    return out.tied_module.weight if hasattr(out, "tied_module") else out.weight


def hf_decoder(model):
    """A transformers causal LM's decoder (embeddings, layers, rotary tables, final norm)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def adapter_for(model: nn.Module):
    try:
        from torchtune.modules import TransformerDecoder

        if isinstance(model, TransformerDecoder):
            return _Torchtune()
    except ImportError:  # torchtune is a dependency, but keep transformers usable without it
        pass
    try:
        from transformers import PreTrainedModel

        if isinstance(model, PreTrainedModel):
            return _HuggingFace()
    except ImportError:
        pass
    raise TypeError(f"optimize() supports torchtune TransformerDecoder and transformers causal "
                    f"LMs; got {type(model).__module__}.{type(model).__name__}")
