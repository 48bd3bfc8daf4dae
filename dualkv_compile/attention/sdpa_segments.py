"""Shared-prefix attention by plain SDPA calls, one per group: the CPU path and the oracle.

It never builds a [T, T] mask: each group's prompt runs causal attention on itself, and the
group's responses run as one padded batch against [prompt K/V ; own K/V]. Fully differentiable
(autograd through SDPA, index_select and index_copy), any dtype, any T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout.packing import PackedBatch

__all__ = ["sdpa_shared_prefix_attention"]


def _causal(q, k, v, lo, hi, scale):
    return F.scaled_dot_product_attention(
        q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], is_causal=True, scale=scale
    )


def _responses(q, k, v, prompt: tuple[int, int], spans, scale) -> tuple[Tensor, Tensor]:
    """Outputs of all non-empty responses of one group, and their packed token indices."""
    ps, pe = prompt
    dev = q.device
    starts = torch.tensor([s for s, _ in spans], device=dev)
    lens = torch.tensor([e - s for s, e in spans], device=dev)
    r_max = max(e - s for s, e in spans)  # from the host lengths: traceable, no device read
    cols = torch.arange(r_max, device=dev)
    valid = cols < lens[:, None]  # [n, R]
    idx = torch.where(valid, starts[:, None] + cols, starts[:, None])  # [n, R]

    def rows(x):  # [1, H, T, D] -> [n, H, R, D]
        return x[0][:, idx].transpose(0, 1)

    n = len(spans)
    k_cat = torch.cat([k[:, :, ps:pe].expand(n, -1, -1, -1), rows(k)], dim=2)
    v_cat = torch.cat([v[:, :, ps:pe].expand(n, -1, -1, -1), rows(v)], dim=2)
    own = (cols[None, :] <= cols[:, None]) & valid[:, None, :]  # [n, R, R]
    prefix = torch.ones(n, r_max, pe - ps, dtype=torch.bool, device=dev)
    mask = torch.cat([prefix, own], dim=2)[:, None]  # [n, 1, R, P + R]
    out = F.scaled_dot_product_attention(rows(q), k_cat, v_cat, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)[:, valid], idx[valid]  # [H, tokens, D], [tokens]


def sdpa_shared_prefix_attention(
    q: Tensor, k: Tensor, v: Tensor, packed: PackedBatch, *, scale: float | None = None
) -> Tensor:
    """q [1, Hq, T, D], k/v [1, Hkv, T, D] -> [1, Hq, T, D]. Padding positions attend causally
    among themselves, as the FlexAttention path does."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # GQA: query head h reads key/value head h // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    pieces, where = [], []
    for ps, pe, spans in packed.group_spans:
        pieces.append(_causal(q, k, v, ps, pe, scale)[0])
        where.append(torch.arange(ps, pe, device=q.device))
        nonempty = [s for s in spans if s[1] > s[0]]
        if nonempty:
            out, idx = _responses(q, k, v, (ps, pe), nonempty, scale)
            pieces.append(out)
            where.append(idx)
    lo, hi = packed.padding_span
    if hi > lo:
        pieces.append(_causal(q, k, v, lo, hi, scale)[0])
        where.append(torch.arange(lo, hi, device=q.device))
    out = torch.zeros_like(q[0]).index_copy(1, torch.cat(where), torch.cat(pieces, dim=1))
    return out.unsqueeze(0)
