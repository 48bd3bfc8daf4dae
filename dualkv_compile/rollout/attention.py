"""Decode attention over the two KV regions: the group's prompt (stored once) and the row's own
response, merged by log-sum-exp.

One decode step has one query per row. Rows are laid out group-major: row r belongs to group
r // N. The prompt region puts a group's N rows on the query axis, so the group's prompt keys
are read once for all of them (cascade / Hydragen); the response region is each row against its
own keys. Both return the softmax-normalised output and its log-sum-exp; the merge weights each
by its share of the total mass, which equals attention over the union of the keys.

Two implementations with one meaning:
- "math": explicit einsum + masked softmax in float32 (float64 stays float64); the CPU path and
  the reference the tests hold the other to.
- "flex": FlexAttention with length masks as score_mods (no BlockMask); inside the compiled
  decode step Inductor lowers it to its split-KV decoding kernel. The GPU path.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["decode_attention", "merge_regions", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("math", "flex")


def _wide(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def merge_regions(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Attention over keys A ∪ B from attention over A and over B: out [..., D], lse [...]."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m).unsqueeze(-1), torch.exp(lse_b - m).unsqueeze(-1)
    return (out_a * wa + out_b * wb) / (wa + wb)


def _math_region(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float):
    """q [B, Hkv, M, D] against k, v [B, Hkv, S, D]; valid broadcasts to [B, 1, M, S]."""
    wide = _wide(q)
    s = torch.einsum("bhmd,bhsd->bhms", q.to(wide), k.to(wide)) * scale
    s = s.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhms,bhsd->bhmd", torch.exp(s - lse.unsqueeze(-1)), v.to(wide)), lse


def _math(q, prompt_k, prompt_v, prompt_len, resp_k, resp_v, last, scale):
    rows, hq, d = q.shape
    groups, hkv, p, _ = prompt_k.shape
    n, rep = rows // groups, hq // hkv
    # prompt: the group's N rows x rep heads on the query axis of its kv head
    qp = q.view(groups, n, hkv, rep, d).permute(0, 2, 1, 3, 4).reshape(groups, hkv, n * rep, d)
    cols = torch.arange(p, device=q.device)
    out_p, lse_p = _math_region(qp, prompt_k, prompt_v,
                                (cols < prompt_len[:, None])[:, None, None, :], scale)
    out_p = out_p.view(groups, hkv, n, rep, d).permute(0, 2, 1, 3, 4).reshape(rows, hq, d)
    lse_p = lse_p.view(groups, hkv, n, rep).permute(0, 2, 1, 3).reshape(rows, hq)
    # response: each row's rep heads of a kv head against that row's keys up to `last`
    cols = torch.arange(resp_k.shape[2], device=q.device)
    out_r, lse_r = _math_region(q.view(rows, hkv, rep, d), resp_k, resp_v,
                                (cols <= last)[None, None, None, :], scale)
    return merge_regions(out_p, lse_p, out_r.reshape(rows, hq, d), lse_r.reshape(rows, hq))


def _flex(q, prompt_k, prompt_v, prompt_len, resp_k, resp_v, last, scale):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    rows, hq, d = q.shape
    groups = prompt_k.shape[0]
    n = rows // groups

    def in_prompt(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx < prompt_len[b], score, float("-inf"))

    def in_response(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= last, score, float("-inf"))

    qp = q.view(groups, n, hq, d).transpose(1, 2)  # [G, Hq, N, D]: the group's rows as queries
    out_p, aux_p = flex_attention(qp, prompt_k, prompt_v, score_mod=in_prompt, scale=scale,
                                  enable_gqa=True, return_aux=AuxRequest(lse=True))
    out_r, aux_r = flex_attention(q.unsqueeze(2), resp_k, resp_v, score_mod=in_response,
                                  scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    wide = _wide(q)
    out_p = out_p.transpose(1, 2).reshape(rows, hq, d).to(wide)
    lse_p = aux_p.lse.transpose(1, 2).reshape(rows, hq).to(wide)
    return merge_regions(out_p, lse_p, out_r[:, :, 0].to(wide), aux_r.lse[:, :, 0].to(wide))


def decode_attention(q: Tensor, prompt_k: Tensor, prompt_v: Tensor, prompt_len: Tensor,
                     resp_k: Tensor, resp_v: Tensor, last: Tensor, *, scale: float,
                     implementation: str = "math") -> Tensor:
    """One decode step's attention.

    q [rows, Hq, D] (rows group-major, N = rows / G per group); prompt_k/v [G, Hkv, P, D] with
    prompt_len [G] valid keys each; resp_k/v [rows, Hkv, R, D] with keys 0..last valid (`last`
    a 0-d tensor: the index the current token was just written at). Returns [rows, Hq, D] in
    q's dtype.
    """
    if implementation == "math":
        out = _math(q, prompt_k, prompt_v, prompt_len, resp_k, resp_v, last, scale)
    elif implementation == "flex":
        out = _flex(q, prompt_k, prompt_v, prompt_len, resp_k, resp_v, last, scale)
    else:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    return out.to(q.dtype)
