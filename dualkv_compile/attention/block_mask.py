"""The shared-prefix FlexAttention BlockMask, built analytically from per-token intervals.

Query q may see key kv iff kv <= q and (kv is in q's segment, or kv is in the prompt of q's
group). Equivalently q sees the union of two disjoint intervals: its group's prompt
[prefix_lo, prefix_hi) (empty for prompt and padding tokens) and [own_lo, q] of its own
segment. A (query block, key block) pair is *full* when every query of the block sees the
whole key block, *partial* when some query sees some key, and skipped otherwise. The
classification is exact and needs only O(T x T / BLOCK) work in bounded chunks; no [T, T]
table is ever built, and the mask_mod reads 1-D per-token tables only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout.packing import PackedBatch

__all__ = [
    "BLOCK_SIZE",
    "block_classes",
    "dense_mask",
    "shared_prefix_block_mask",
    "shared_prefix_mask",
    "shared_prefix_mask_mod",
]

BLOCK_SIZE = 128
_CHUNK_ELEMENTS = 1 << 24  # bound on the [q-blocks, BLOCK, kv-blocks] work tensors


def shared_prefix_mask(b, h, q_idx, kv_idx, segment_ids, prefix_segment_ids):
    """The mask, the one definition (the attention rewrite traces it into its graphs): a query
    sees an earlier key of its own segment or of its prompt (1-D tables [T])."""
    seg_kv = segment_ids[kv_idx]
    same = seg_kv == segment_ids[q_idx]
    in_prompt = seg_kv == prefix_segment_ids[q_idx]
    return (kv_idx <= q_idx) & (same | in_prompt)


def shared_prefix_mask_mod(segment_ids: Tensor, prefix_segment_ids: Tensor):
    """flex's mask_mod over the 1-D tables [T]."""

    def mask_mod(b, h, q_idx, kv_idx):
        return shared_prefix_mask(b, h, q_idx, kv_idx, segment_ids, prefix_segment_ids)

    return mask_mod


def dense_mask(packed: PackedBatch) -> Tensor:
    """[T, T] bool mask, for tests and drawings of small layouts only."""
    seg = packed.segment_ids[0].long()
    pre = packed.prefix_segment_ids[0].long()
    idx = torch.arange(packed.seq_len, device=seg.device)
    causal = idx[None, :] <= idx[:, None]
    return causal & ((seg[None, :] == seg[:, None]) | (seg[None, :] == pre[:, None]))


def _token_intervals(packed: PackedBatch, device) -> tuple[Tensor, Tensor, Tensor]:
    """Per token: prompt interval [prefix_lo, prefix_hi) and own-segment start own_lo."""
    seg = packed.segment_ids[0].to(device=device, dtype=torch.long)
    pre = packed.prefix_segment_ids[0].to(device=device, dtype=torch.long)
    t = seg.numel()
    num_segs = int(seg.max()) + 1
    idx = torch.arange(t, device=device)
    seg_lo = torch.full((num_segs,), t, dtype=torch.long, device=device)
    seg_lo = seg_lo.scatter_reduce(0, seg, idx, "amin")
    seg_hi = torch.zeros(num_segs, dtype=torch.long, device=device)
    seg_hi = seg_hi.scatter_reduce(0, seg, idx + 1, "amax")
    own_lo = seg_lo[seg]
    has_prefix = pre != seg
    prefix_lo = torch.where(has_prefix, seg_lo[pre], torch.zeros_like(seg))
    prefix_hi = torch.where(has_prefix, seg_hi[pre], torch.zeros_like(seg))
    return prefix_lo, prefix_hi, own_lo


def _classify_blocks(packed: PackedBatch, device) -> tuple[Tensor, Tensor]:
    """(partial, full) bool [Qb, Kb] over BLOCK_SIZE x BLOCK_SIZE tiles."""
    t = packed.seq_len
    nb = t // BLOCK_SIZE
    prefix_lo, prefix_hi, own_lo = (
        x.view(nb, BLOCK_SIZE, 1) for x in _token_intervals(packed, device)
    )
    q_hi = torch.arange(1, t + 1, device=device).view(nb, BLOCK_SIZE, 1)  # own segment: [own_lo, q]
    # When the prompt ends right where q's segment starts the union is one interval.
    merged_lo = torch.where((prefix_hi == own_lo) & (prefix_hi > prefix_lo), prefix_lo, own_lo)
    k_lo = torch.arange(0, t, BLOCK_SIZE, device=device).view(1, 1, nb)
    k_hi = k_lo + BLOCK_SIZE
    partial = torch.empty(nb, nb, dtype=torch.bool, device=device)
    full = torch.empty(nb, nb, dtype=torch.bool, device=device)
    step = max(1, _CHUNK_ELEMENTS // (BLOCK_SIZE * nb))
    for i in range(0, nb, step):
        s = slice(i, i + step)
        sees_prefix = (torch.maximum(prefix_lo[s], k_lo) < torch.minimum(prefix_hi[s], k_hi))
        sees_own = torch.maximum(own_lo[s], k_lo) < torch.minimum(q_hi[s], k_hi)
        covered = ((prefix_lo[s] <= k_lo) & (k_hi <= prefix_hi[s])) | (
            (merged_lo[s] <= k_lo) & (k_hi <= q_hi[s])
        )
        any_q = (sees_prefix | sees_own).any(1)
        all_q = covered.all(1)
        full[s] = all_q
        partial[s] = any_q & ~all_q
    return partial, full


def block_classes(packed: PackedBatch, device="cpu") -> Tensor:
    """[Qb, Kb] uint8: 0 = skipped, 1 = partial, 2 = full (for drawings and statistics)."""
    partial, full = _classify_blocks(packed, torch.device(device))
    return partial.to(torch.uint8) + 2 * full.to(torch.uint8)


def _to_indices(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """bool [Qb, Kb] -> (num_blocks [1, 1, Qb], indices [1, 1, Qb, Kb]) with listed blocks
    first, in ascending order."""
    num = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None].contiguous(), order[None, None].contiguous()


def shared_prefix_block_mask(packed: PackedBatch, device):
    """The BlockMask of `packed` on `device`, built once per PackedBatch and cached on it."""
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device)
    if packed.seq_len % BLOCK_SIZE:
        raise ValueError(
            f"the block mask needs T to be a multiple of {BLOCK_SIZE}, got T={packed.seq_len}: "
            f"pack with pad_to a multiple of {BLOCK_SIZE}"
        )

    def build():
        partial, full = _classify_blocks(packed, device)
        kv_num, kv_idx = _to_indices(partial)
        full_num, full_idx = _to_indices(full)
        seg = packed.segment_ids[0].to(device)
        pre = packed.prefix_segment_ids[0].to(device)
        return BlockMask.from_kv_blocks(
            kv_num,
            kv_idx,
            full_num,
            full_idx,
            BLOCK_SIZE=BLOCK_SIZE,
            mask_mod=shared_prefix_mask_mod(seg, pre),
            seq_lengths=(packed.seq_len, packed.seq_len),
        )

    return packed.cached(("block_mask", device), build)
