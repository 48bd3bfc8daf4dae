"""Qwen3-MoE for the recipes: transformers' Qwen3MoeForCausalLM built from sizes, random
weights, set up the way optimize() runs it (SDPA attention, the per-token expert dispatch or
the grouped expert op, no auxiliary router loss in the forward).

torchtune 0.6.1 has no mixture-of-experts Qwen; transformers' model is used as is (optimize()
and the rollout engine both take transformers causal LMs).
"""

from __future__ import annotations

import torch

from .presets import preset

__all__ = ["QWEN3_30B_A3B", "qwen3_moe", "qwen3_moe_from_hf_config", "qwen3_moe_tiny"]

# transformers' published Qwen3-30B-A3B shape
QWEN3_30B_A3B = dict(num_layers=48, num_heads=32, num_kv_heads=4, embed_dim=2048, head_dim=128,
                     moe_intermediate_dim=768, num_experts=128, experts_per_token=8)


def qwen3_moe(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
              embed_dim: int, head_dim: int, moe_intermediate_dim: int, num_experts: int,
              experts_per_token: int, max_seq_len: int = 40960, norm_topk_prob: bool = True,
              rope_base: float = 1_000_000.0, norm_eps: float = 1e-6, init_std: float = 0.02,
              tie_word_embeddings: bool = False, grouped_experts: bool = False):
    """A Qwen3-MoE causal LM (every layer sparse) with random weights drawn N(0, init_std); its
    experts run transformers' per-token dispatch, or with `grouped_experts` our grouped op
    (models.use_grouped_experts: grouped GEMMs, for real model sizes)."""
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=embed_dim, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        moe_intermediate_size=moe_intermediate_dim, intermediate_size=moe_intermediate_dim,
        num_experts=num_experts, num_experts_per_tok=experts_per_token,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=max_seq_len,
        rope_theta=rope_base, rms_norm_eps=norm_eps, initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings, output_router_logits=False)
    cfg._experts_implementation = "batched_mm"  # the dispatch optimize() proves token-local
    model = tf.Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="sdpa")
    if grouped_experts:
        from .moe_experts import use_grouped_experts

        use_grouped_experts(model)
    return model


qwen3_moe_tiny = preset(qwen3_moe, "qwen3_moe_tiny", "A 2-layer Qwen3-MoE of 64 dims (4 "
                        "experts, 2 per token), for tests and CPU runs.", vocab_size=151936,
                        num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, head_dim=16,
                        moe_intermediate_dim=32, num_experts=4, experts_per_token=2)


def qwen3_moe_from_hf_config(path: str, *, grouped_experts: bool = False, **overrides):
    """A Qwen3-MoE with the shape of a transformers config.json (file or directory), set up as
    qwen3_moe sets it up; the weights come from the checkpointer (Qwen3HFCheckpointer).
    `grouped_experts`: our grouped expert op (grouped GEMMs; the per-token dispatch gathers
    every token's expert weights, beyond any GPU at real sizes), which changes no weight.
    `overrides` are Qwen3MoeConfig fields (transformers' names: num_hidden_layers, ...); any
    other name is refused."""
    import transformers as tf

    cfg, unused = tf.AutoConfig.from_pretrained(str(path), return_unused_kwargs=True,
                                                **overrides)
    if unused:
        hint = (" (transformers 5 keeps rope_theta in rope_parameters: pass "
                "rope_parameters={'rope_type': 'default', 'rope_theta': ...})"
                if "rope_theta" in unused else "")
        raise ValueError(f"qwen3_moe_from_hf_config: {sorted(unused)} are not fields of "
                         f"{type(cfg).__name__}; overrides take transformers' names (e.g. "
                         f"num_hidden_layers, num_experts_per_tok){hint}")
    if cfg.model_type != "qwen3_moe":
        raise ValueError(f"{path} holds a {cfg.model_type!r} config, not 'qwen3_moe'")
    if cfg.output_router_logits:  # was set to False silently: the loss would not be trained
        raise ValueError("output_router_logits=True (the router's load-balancing loss) is not "
                         "supported: optimize() runs the decoder body only and computes no "
                         "router loss; set it to False in config.json or the model overrides")
    cfg._experts_implementation = "batched_mm"
    # in float32 as the dense builder, not config.json's dtype: the checkpointer's weights are
    # loaded into it before the recipe casts, and a bf16 build rounded fp32 weights for good
    model = tf.Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                                dtype=torch.float32)
    if grouped_experts:
        from .moe_experts import use_grouped_experts

        use_grouped_experts(model)
    return model


# what a recipe may set beside a checkpointer over config.json: transformers' field name for
# the sequence limit, and the expert op (neither changes a saved weight or config)
qwen3_moe_from_hf_config.overrides_beside_checkpoint = (
    "path", "max_position_embeddings", "grouped_experts")
