"""Logprobs of chosen tokens through the LM head, in chunks.

Per chunk of positions: logits = h @ W.T in the model's dtype, upcast to float32 (float64 for a
float64 model), divided by the temperature; logprob = logit[target] - logsumexp. The backward
recomputes each chunk's logits instead of storing them, so the peak extra memory is one
[chunk, vocab] block, never [positions, vocab].
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunked_logprobs"]


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):
        wide = _wide(hidden.dtype)
        out = torch.empty(hidden.shape[0], dtype=wide, device=hidden.device)
        lse = torch.empty_like(out)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s:s + chunk] @ weight.T).to(wide) / temperature
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[s:s + chunk, None])[:, 0]
            out[s:s + chunk] = picked - lse[s:s + chunk]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        wide = lse.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=wide, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            logits = (h @ weight.T).to(wide) / t
            # d logprob / d logits = onehot(target) - softmax, scaled by 1/temperature
            g = -torch.exp(logits - lse[s:s + chunk, None])
            g.scatter_add_(1, targets[s:s + chunk, None], torch.ones_like(g[:, :1]))
            # the matmuls run in the model's dtype (tensor cores for bf16; they accumulate in
            # fp32), the per-chunk weight gradients are summed in the wide dtype
            g = (g * (grad_out[s:s + chunk, None] / t)).to(weight.dtype)
            if grad_h is not None:
                grad_h[s:s + chunk] = (g @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (g.T @ h.to(weight.dtype)).to(wide)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                     temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """hidden [M, d], weight [V, d], targets [M] -> log softmax(hidden @ weight.T / t)[target],
    [M] in float32 (float64 for float64 inputs)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [M, d] and weight [V, d] expected, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk_size))
