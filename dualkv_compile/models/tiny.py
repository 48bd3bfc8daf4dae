"""A tiny decoder for CPU runs and tests: torchtune's Qwen2 components, tied embeddings."""

from __future__ import annotations

__all__ = ["tiny_decoder"]


def tiny_decoder(*, vocab_size: int, embed_dim: int = 64, num_layers: int = 2,
                 num_heads: int = 4, num_kv_heads: int = 2, intermediate_dim: int = 128,
                 max_seq_len: int = 256):
    import torch
    from torchtune.models.qwen2._component_builders import qwen2

    from ..arguments import integer_arg

    for name, value in [("vocab_size", vocab_size), ("embed_dim", embed_dim),
                        ("num_layers", num_layers), ("num_heads", num_heads),
                        ("num_kv_heads", num_kv_heads), ("intermediate_dim", intermediate_dim),
                        ("max_seq_len", max_seq_len)]:
        integer_arg(name, value, 1)
    if embed_dim % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"embed_dim={embed_dim} must split into num_heads={num_heads} heads, "
                         f"and num_heads into num_kv_heads={num_kv_heads} groups")
    model = qwen2(vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, embed_dim=embed_dim,
                  intermediate_dim=intermediate_dim, max_seq_len=max_seq_len,
                  tie_word_embeddings=True)
    # nn.Embedding's N(0, 1) with tied weights gives each token a logit of ~embed_dim for
    # itself: sampling becomes greedy and RL never explores. Use the usual LM init instead.
    with torch.no_grad():
        model.tok_embeddings.weight.normal_(0.0, 0.02)
    return model
