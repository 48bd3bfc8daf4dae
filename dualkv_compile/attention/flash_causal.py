"""FLASH's causal form: flash-attn-4 called with causal=True and the block mask's block lists,
no mask_mod, for layouts whose every 128-token block lies in one segment.

flex hands FA4 a mask_mod on every call, and FA4 (4.0.0b36, sm_90) then runs its forward tiles
in plain grid order (`SingleTileScheduler`). A causal call gets the longest-first
`SingleTileLPTScheduler` instead, which matters where the grid is a few waves long
(docs/performance.md has the measurements). When every block lies in one segment (prompts and
responses multiples of 128 tokens), the shared-prefix mask is exactly "causal AND the listed blocks": off the
diagonal a block pair is all-or-nothing, on it the pair is one segment, causal. The outputs
then equal flex FLASH's bit for bit; the gradients differ in FA4's atomic accumulation order
(dq, and dk/dv under GQA), as flex FLASH differs from itself.

Used by `shared_prefix_attention` for eager FLASH calls on sm_90 (op._causal_form says when),
kept for block-aligned layouts where it is faster than flex FLASH (docs/performance.md, "FLASH:
the causal form and flex"); ragged layouts and traced calls (optimize()'s graphs) keep flex.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .block_mask import BLOCK_SIZE, shared_prefix_block_mask
from ..layout.packing import PackedBatch

__all__ = ["block_aligned", "flash_causal_attention"]


def block_aligned(packed: PackedBatch) -> bool:
    """True when every BLOCK_SIZE-token block of the layout lies in one segment (prompt,
    response or padding): the condition for FLASH's causal form. Cached on the batch."""
    def build():
        if packed.seq_len % BLOCK_SIZE:  # no whole blocks (and no BlockMask either)
            return False
        seg = packed.segment_ids[0].view(-1, BLOCK_SIZE)
        return bool((seg == seg[:, :1]).all())

    return packed.cached("block_aligned", build)


class _FlashCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, fwd_blocks, bwd_blocks):
        from flash_attn.cute.interface import _flash_attn_fwd

        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True,
                                   block_sparse_tensors=fwd_blocks, return_lse=True)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.bwd_blocks = scale, bwd_blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        from flash_attn.cute.interface import _flash_attn_bwd

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=ctx.scale,
                                     causal=True, block_sparse_tensors=ctx.bwd_blocks)[:3]
        return dq, dk, dv, None, None, None


def _block_lists(packed: PackedBatch, device):
    """FA4's forward (kv blocks of each q block) and backward (q blocks of each kv block)
    lists, from the layout's BlockMask; cached on the batch."""
    def build():
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        m = shared_prefix_block_mask(packed, device)
        size = tuple(m.BLOCK_SIZE)
        return (BlockSparseTensorsTorch(m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks,
                                        m.full_kv_indices, block_size=size),
                BlockSparseTensorsTorch(m.q_num_blocks, m.q_indices, m.full_q_num_blocks,
                                        m.full_q_indices, block_size=size))

    return packed.cached(("flash_causal_blocks", device), build)


def flash_causal_attention(q: Tensor, k: Tensor, v: Tensor, packed: PackedBatch,
                           scale: float | None = None) -> Tensor:
    """q [1, Hq, T, D], k/v [1, Hkv, T, D] -> [1, Hq, T, D] on a block-aligned layout (raises
    otherwise). The output is a token-major view ([1, T, Hq, D] in memory)."""
    if not block_aligned(packed):
        raise ValueError(
            f"FLASH's causal form needs every {BLOCK_SIZE}-token block in one segment; this "
            f"layout (rows {packed.batch_shape}, prompt column {packed.prompt_len}) has blocks "
            f"that hold two")
    fwd, bwd = _block_lists(packed, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = _FlashCausal.apply(*(x.transpose(1, 2) for x in (q, k, v)), scale, fwd, bwd)
    return out.transpose(1, 2)
