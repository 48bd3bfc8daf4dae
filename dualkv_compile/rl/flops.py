"""Useful FLOPs of a GRPO policy update, for MFU: the work the packed computation needs (each
prompt once, the LM head only at response tokens), whichever way it actually ran. Activation
recomputation is not counted."""

from __future__ import annotations

import torch
from torch import nn

from dualkv_compile.adapters import hf_decoder
from dualkv_compile.layout.packing import PackedBatch

__all__ = ["forward_flops", "policy_update_flops", "peak_bf16_tflops"]

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of the device name; first
# match wins
_PEAKS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0))


def _dims(model: nn.Module):
    """(matmul weights a token meets, layers, q heads, head dim, vocab, model dim) of a
    torchtune decoder or a transformers causal LM. A mixture-of-experts layer's expert weights
    (3-D: [experts, out, in]) count at the share a token meets: experts_per_token / experts."""
    if hasattr(model, "tok_embeddings"):  # torchtune
        layers, attn = model.layers, model.layers[0].attn
        heads, head_dim = attn.num_heads, attn.head_dim
        emb = model.tok_embeddings
    else:  # transformers
        cfg, layers = model.config, hf_decoder(model).layers
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        emb = model.get_input_embeddings()
    active = getattr(getattr(model, "config", None), "num_experts_per_tok", 0)
    experts = getattr(getattr(model, "config", None), "num_experts", 0)
    params = 0.0
    for p in layers.parameters():
        if p.dim() == 2:
            params += p.numel()
        elif p.dim() == 3 and experts:
            params += p.numel() * active / experts
    return params, len(layers), heads, head_dim, emb.num_embeddings, emb.embedding_dim


def forward_flops(model: nn.Module, packed: PackedBatch) -> float:
    """One forward over `packed`: the layers' matmuls on every packed token (a token's active
    experts only), attention on the shared-prefix pairs, the LM head at the response tokens."""
    matmul_params, layers, heads, head_dim, vocab, dim = _dims(model)
    _, pairs = packed.attention_pairs
    response_tokens = int(packed.response_lengths.sum())
    return (2.0 * matmul_params * packed.num_tokens
            + 4.0 * heads * head_dim * pairs * layers
            + 2.0 * vocab * dim * response_tokens)


def policy_update_flops(model: nn.Module, packed: PackedBatch, *,
                        reference: bool = True) -> float:
    """The old and reference logprob forwards and the policy's forward + backward (a backward
    costs two forwards): five forwards; four without a reference model (kl_coef=0)."""
    return (5.0 if reference else 4.0) * forward_flops(model, packed)


def peak_bf16_tflops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak, or None where this table does not know it (or on a CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAKS if key in name), None)
