"""Useful FLOPs of a GRPO policy update, for MFU: the work the packed computation needs (each
prompt once, the LM head only at response tokens), whichever way it actually ran. Activation
recomputation is not counted."""

from __future__ import annotations

import torch
from torch import nn

from dualkv_compile.packing import PackedBatch

__all__ = ["forward_flops", "policy_update_flops", "peak_bf16_tflops"]

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of the device name; first
# match wins
_PEAKS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0))


def forward_flops(model: nn.Module, packed: PackedBatch) -> float:
    """One forward of a torchtune decoder over `packed`: the layers' matmuls on every packed
    token, attention on the shared-prefix pairs, the LM head at the response tokens."""
    layers = model.layers
    matmul_params = sum(p.numel() for p in layers.parameters() if p.dim() == 2)
    attn = layers[0].attn
    vocab, dim = model.tok_embeddings.num_embeddings, model.tok_embeddings.embedding_dim
    _, pairs = packed.attention_pairs
    response_tokens = int(packed.response_lengths.sum())
    return (2.0 * matmul_params * packed.num_tokens
            + 4.0 * attn.num_heads * attn.head_dim * pairs * len(layers)
            + 2.0 * vocab * dim * response_tokens)


def policy_update_flops(model: nn.Module, packed: PackedBatch) -> float:
    """The old and reference logprob forwards and the policy's forward + backward (a backward
    costs two forwards): five forwards."""
    return 5.0 * forward_flops(model, packed)


def peak_bf16_tflops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak, or None where this table does not know it (or on a CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAKS if key in name), None)
