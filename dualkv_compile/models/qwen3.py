"""Qwen3 on torchtune's modules: QK-norm before RoPE, tied or untied embeddings.

torchtune 0.6.1 has no Qwen3, and its MultiHeadAttention normalises q and k *after* RoPE;
Qwen3 normalises each head's q and k *before* RoPE. Qwen3Attention keeps torchtune's module
(projections, KV cache, SDPA dispatch) and only orders the two steps the Qwen3 way.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)

from .presets import preset
from .qwen3_sizes import QWEN3_SIZES, QWEN3_VOCAB

__all__ = ["Qwen3Attention", "qwen3", "qwen3_tiny", "qwen3_0_6b", "qwen3_1_7b",
           "qwen3_4b", "qwen3_8b"]


class Qwen3Attention(MultiHeadAttention):
    """Self-attention with per-head RMSNorm of q and k applied before the rotary embedding."""

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        q = self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim)
        q = self.pos_embeddings(self.q_norm(q), input_pos=input_pos).transpose(1, 2)
        if y is None:
            if self.kv_cache is None or not self.cache_enabled:
                raise ValueError("self-attention needs y (the input) unless a KV cache is set up")
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
        else:
            s_y = y.shape[1]
            k = self.k_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim)
            v = self.v_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim)
            k = self.pos_embeddings(self.k_norm(k), input_pos=input_pos).transpose(1, 2)
            v = v.transpose(1, 2)
            if self.kv_cache is not None and self.cache_enabled:
                k, v = self.kv_cache.update(k, v)
        if self.num_heads != self.num_kv_heads:  # GQA: each kv head serves q_per_kv q heads
            rep = self.num_heads // self.num_kv_heads
            k = k.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)
            v = v.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)
        out = self._attention_call(
            q, k, v, mask=mask, dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s_x, -1))


def qwen3(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
          embed_dim: int, intermediate_dim: int, head_dim: int, max_seq_len: int = 40960,
          rope_base: float = 1_000_000.0, norm_eps: float = 1e-6,
          tie_word_embeddings: bool = False, init_std: float = 0.02,
          pad_token_id: int | None = None) -> TransformerDecoder:
    """A Qwen3 decoder; parameter names map one to one onto transformers' Qwen3ForCausalLM
    (see dualkv_compile.models.hf_checkpoint). Random weights are drawn as transformers draws
    them (`initializer_range`): projections and embeddings N(0, init_std), norms 1. PyTorch's
    default N(0, 1) embedding would dominate the residual stream, and with tied embeddings a
    random model would then repeat its input token almost surely (every sample of a group
    alike, so GRPO would see no reward signal). `pad_token_id` is the embedding's padding_idx,
    as transformers builds it: that row starts at 0 and no lookup of it gets a gradient."""
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(
            pad_token_id, int) or not 0 <= pad_token_id < vocab_size):
        raise ValueError(f"pad_token_id={pad_token_id!r} must be an id in [0, {vocab_size}) "
                         f"(vocab_size) or None")
    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = Qwen3Attention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
            k_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            v_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            output_proj=nn.Linear(num_heads * head_dim, embed_dim, bias=False),
            pos_embeddings=rope, q_norm=RMSNorm(head_dim, eps=norm_eps),
            k_norm=RMSNorm(head_dim, eps=norm_eps), max_seq_len=max_seq_len)
        mlp = FeedForward(gate_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
                          down_proj=nn.Linear(intermediate_dim, embed_dim, bias=False),
                          up_proj=nn.Linear(embed_dim, intermediate_dim, bias=False))
        layers.append(TransformerSelfAttentionLayer(
            attn=attn, mlp=mlp, sa_norm=RMSNorm(embed_dim, eps=norm_eps),
            mlp_norm=RMSNorm(embed_dim, eps=norm_eps)))
    embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_token_id)
    output = TiedLinear(embeddings) if tie_word_embeddings else nn.Linear(embed_dim, vocab_size,
                                                                          bias=False)
    model = TransformerDecoder(tok_embeddings=embeddings, layers=layers, max_seq_len=max_seq_len,
                               num_heads=num_heads, head_dim=head_dim,
                               norm=RMSNorm(embed_dim, eps=norm_eps), output=output)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=init_std)
    if pad_token_id is not None:
        with torch.no_grad():
            embeddings.weight[pad_token_id].zero_()
    return model


qwen3_tiny = preset(qwen3, "qwen3_tiny", "A 2-layer Qwen3 of 64 dims (tied embeddings), for "
                    "tests and CPU runs.", vocab_size=QWEN3_VOCAB, num_layers=2, num_heads=4,
                    num_kv_heads=2, embed_dim=64, intermediate_dim=128, head_dim=16,
                    tie_word_embeddings=True)
qwen3_0_6b, qwen3_1_7b, qwen3_4b, qwen3_8b = (
    preset(qwen3, f"qwen3_{size.replace('.', '_')}", f"Qwen3-{size.upper()}'s shape (random "
           "weights; any argument may be overridden, e.g. num_layers).", vocab_size=QWEN3_VOCAB,
           **QWEN3_SIZES[size])
    for size in ("0.6b", "1.7b", "4b", "8b"))
