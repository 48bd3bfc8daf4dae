"""Helpers shared by the tests, the GPU checks and the benchmarks: synthetic GRPO batches and
the replicated-batch oracle (plain causal SDPA on each row)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "make_batch",
    "packed_forward_backward",
    "random_qkv",
    "rel_err",
    "replicated_causal_attention",
    "replicated_forward_backward",
]


def make_batch(
    prompt_lengths: list[int],
    response_lengths: list[list[int]],
    *,
    prompt_len: int | None = None,
    pad_side: str = "left",
    shuffle: bool = False,
    vocab: int = 1000,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Tensor, Tensor, int]:
    """A GRPO batch: group g has a prompt of prompt_lengths[g] valid tokens and one row per entry
    of response_lengths[g]. Returns (tokens [B, L], padding_mask [B, L], prompt_len)."""
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError("one list of response lengths per prompt is needed")
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side={pad_side!r} must be 'left' or 'right'")
    prompt_len = prompt_len or max(prompt_lengths)
    resp_len = max([r for rs in response_lengths for r in rs] + [0])
    rows, masks = [], []
    for g, (p, responses) in enumerate(zip(prompt_lengths, response_lengths)):
        # distinct groups: the first token encodes the group, the rest are random
        prompt = torch.randint(1, vocab, (p,), generator=generator)
        prompt[0] = g + 1 + vocab
        for r in responses:
            row = torch.zeros(prompt_len + resp_len, dtype=torch.long)
            m = torch.zeros(prompt_len + resp_len, dtype=torch.bool)
            lo = prompt_len - p if pad_side == "left" else 0
            row[lo:lo + p], m[lo:lo + p] = prompt, True
            row[prompt_len:prompt_len + r] = torch.randint(1, vocab, (r,), generator=generator)
            m[prompt_len:prompt_len + r] = True
            rows.append(row), masks.append(m)
    tokens, mask = torch.stack(rows), torch.stack(masks)
    if shuffle:
        perm = torch.randperm(tokens.shape[0], generator=generator)
        tokens, mask = tokens[perm], mask[perm]
    return tokens.to(device), mask.to(device), prompt_len


def replicated_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, padding_mask: Tensor, *, scale: float | None = None
) -> Tensor:
    """The oracle: q [B, Hq, L, D], k/v [B, Hkv, L, D] in the row layout; each row's valid tokens
    run F.scaled_dot_product_attention(is_causal=True) on their own. Padding cells are zero."""
    rep = q.shape[1] // k.shape[1]
    rows = []
    for b in range(q.shape[0]):
        cols = padding_mask[b].nonzero()[:, 0]
        qb = q[b:b + 1, :, cols]
        kb = k[b:b + 1, :, cols].repeat_interleave(rep, dim=1)
        vb = v[b:b + 1, :, cols].repeat_interleave(rep, dim=1)
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        rows.append(torch.zeros_like(q[b:b + 1]).index_copy(2, cols, ob))
    return torch.cat(rows)


def rel_err(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _leaves(*xs: Tensor) -> list[Tensor]:
    return [x.detach().clone().requires_grad_(True) for x in xs]


def packed_forward_backward(op, q, k, v, packed, cotangent: Tensor, **kwargs):
    """op(q, k, v, packed) on packed leaves [1, H, T, D]; loss = <out, cotangent> in fp32 or
    wider. Returns (out, dq, dk, dv), `out` cut to the valid tokens."""
    q, k, v = _leaves(q, k, v)
    out = op(q, k, v, packed, **kwargs)
    (out.to(cotangent.dtype) * cotangent).sum().backward()
    return out.detach()[:, :, : packed.num_tokens], q.grad, k.grad, v.grad


def replicated_forward_backward(q, k, v, packed, padding_mask, cotangent: Tensor, scale=None):
    """The same function computed the plain way: unpack the leaves to the [B, L] rows, run the
    oracle, pack the output (each prompt from its group's first row). Gradients of a prompt
    position sum over its group, through unpack."""
    q, k, v = _leaves(q, k, v)
    q_rows, k_rows, v_rows = (packed.unpack(x, dim=2) for x in (q, k, v))
    out_rows = replicated_causal_attention(q_rows, k_rows, v_rows, padding_mask, scale=scale)
    out = packed.pack(out_rows, dim=2)
    (out.to(cotangent.dtype) * cotangent).sum().backward()
    return out.detach()[:, :, : packed.num_tokens], q.grad, k.grad, v.grad


def random_qkv(packed, hq: int, hkv: int, d: int, *, dtype, device, generator=None):
    """q [1, hq, T, D], k/v [1, hkv, T, D] and a cotangent [1, hq, T, D] that is zero on padding."""
    t = packed.seq_len
    q, k, v = (torch.randn(1, h, t, d, generator=generator, dtype=torch.float64)
               for h in (hq, hkv, hkv))
    cot = torch.randn(1, hq, t, d, generator=generator, dtype=torch.float64)
    cot[:, :, packed.num_tokens:] = 0
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (*(x.to(device=device, dtype=dtype) for x in (q, k, v)), cot.to(device=device, dtype=wide))
