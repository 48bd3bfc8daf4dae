"""The shared-prefix FlexAttention BlockMask, built analytically from per-token intervals.

Query q may see key kv iff kv <= q and (kv is in q's segment, or kv is in the prompt of q's
group). Equivalently q sees the union of two disjoint intervals: its group's prompt
[prefix_lo, prefix_hi) (empty for prompt and padding tokens) and [own_lo, q] of its own
segment. A (query block, key block) pair is *full* when every query of the block sees the
whole key block, *partial* when some query sees some key, and skipped otherwise. The
classification is exact and needs only O(T x T / BLOCK) work in bounded chunks; no [T, T]
table is ever built.

The mask_mod, evaluated on every element of a partial block, reads one table indexed by the
key: a key is seen by the queries from itself up to `visible_until[kv]`, the end of its group
for a prompt key (every response of the group sees it), the end of its own segment otherwise.
That holds because pack() lays each group out as its prompt then its responses, in one run
(`visible_until` checks it). One load per element instead of the segment form's three is what
makes partial blocks cheaper (docs/performance.md, "The mask per element").
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
    "visible_until",
]

BLOCK_SIZE = 128
_CHUNK_ELEMENTS = 1 << 24  # bound on the [q-blocks, BLOCK, kv-blocks] work tensors


def shared_prefix_mask(b, h, q_idx, kv_idx, visible_until):
    """The mask, the one definition flex evaluates: a query sees a key from the key's own
    position up to the end of the key's visibility (1-D table [T], `visible_until`)."""
    return (kv_idx <= q_idx) & (q_idx < visible_until[kv_idx])


def shared_prefix_mask_mod(visible_until: Tensor):
    """flex's mask_mod over the 1-D table [T] of `visible_until(packed)`."""

    def mask_mod(b, h, q_idx, kv_idx):
        return shared_prefix_mask(b, h, q_idx, kv_idx, visible_until)

    return mask_mod


def _spans(ids: Tensor, num: int) -> tuple[Tensor, Tensor]:
    """For each id in [0, num): its first token and end (one past its last); an absent id gets
    (T, 0)."""
    t = ids.numel()
    idx = torch.arange(t, device=ids.device)
    lo = torch.full((num,), t, dtype=torch.long, device=ids.device)
    hi = torch.zeros(num, dtype=torch.long, device=ids.device)
    return lo.scatter_reduce(0, ids, idx, "amin"), hi.scatter_reduce(0, ids, idx + 1, "amax")


def visible_until(packed: PackedBatch, device) -> Tensor:
    """int32 [T]: key kv is seen by queries kv..visible_until[kv]-1 (the mask_mod's table): to
    the end of its group for a prompt key, of its own segment for any other. Raises if a segment
    or a group is not one run of tokens that starts with the group's prompt, the layout the
    table relies on (every pack() layout is)."""
    def build():
        seg = packed.segment_ids[0].to(device=device, dtype=torch.long)
        group = packed.prefix_segment_ids[0].to(device=device, dtype=torch.long)  # prompt's id
        for name, ids in (("segment", seg), ("group", group)):
            runs = 1 + int((ids[1:] != ids[:-1]).sum())
            if runs != int(torch.unique(ids).numel()):
                raise ValueError(f"a {name} of this layout is split into several runs of tokens "
                                 f"({runs} runs); the shared-prefix mask needs each in one run")
        num = int(seg.max()) + 1
        seg_lo, seg_hi = _spans(seg, num)
        group_lo, group_hi = _spans(group, num)  # indexed by the group's prompt segment id
        if not torch.equal(group_lo[group], seg_lo[group]):
            raise ValueError("a group of this layout does not start with its prompt")
        # a prompt key: its group's end; a response or padding key (no group of that id, or
        # a group of one segment): its segment's end
        return torch.maximum(seg_hi[seg], group_hi[seg]).to(torch.int32)

    return packed.cached(("visible_until", torch.device(device)), build)


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
    seg_lo, seg_hi = _spans(seg, int(seg.max()) + 1)
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
        return BlockMask.from_kv_blocks(
            kv_num,
            kv_idx,
            full_num,
            full_idx,
            BLOCK_SIZE=BLOCK_SIZE,
            mask_mod=shared_prefix_mask_mod(visible_until(packed, device)),
            seq_lengths=(packed.seq_len, packed.seq_len),
        )

    return packed.cached(("block_mask", device), build)
