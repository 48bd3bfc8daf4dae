"""flash-attn-4 called directly with causal=True and the shared-prefix block sparsity, no
mask_mod: an experiment for `bench attention --fa4-causal`, not a backend of the library.

Why: flex's FLASH path always hands FA4 a mask_mod, and FA4 (4.0.0b36, sm_90) then schedules
its forward tiles in plain grid order (`SingleTileScheduler`); a causal call gets the
longest-first `SingleTileLPTScheduler`. When P and R are multiples of the 128-token block, the
shared-prefix mask is exactly "causal AND the block mask's blocks" (the only partial blocks are
on the diagonal), so the same attention can be asked for as a causal block-sparse call, and the
two schedulers can be compared on the same work.
"""

from __future__ import annotations

import torch

from dualkv_compile.block_mask import BLOCK_SIZE

__all__ = ["causal_sparse_attention", "check_block_aligned"]


def check_block_aligned(packed) -> None:
    """Raise unless every 128-token block lies in one segment (prompt, response or padding).
    Then a block pair is all-or-nothing off the diagonal and causal on it, so causal AND the
    block lists equal the shared-prefix mask."""
    seg = packed.segment_ids[0].view(-1, BLOCK_SIZE)
    mixed = (seg != seg[:, :1]).any(-1).nonzero().flatten().tolist()
    if mixed:
        raise ValueError(
            f"blocks {mixed[:5]}{'...' if len(mixed) > 5 else ''} hold tokens of two segments: "
            f"causal block sparsity equals the shared-prefix mask only when prompts and "
            f"responses are multiples of {BLOCK_SIZE} tokens (shape {packed.batch_shape}, "
            f"prompt {packed.prompt_len})")


class _CausalSparse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fwd_blocks, bwd_blocks):
        from flash_attn.cute.interface import _flash_attn_fwd

        out, lse = _flash_attn_fwd(q, k, v, causal=True, block_sparse_tensors=fwd_blocks,
                                   return_lse=True)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bwd_blocks = bwd_blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        from flash_attn.cute.interface import _flash_attn_bwd

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, causal=True,
                                     block_sparse_tensors=ctx.bwd_blocks)[:3]
        return dq, dk, dv, None, None


def causal_sparse_attention(block_mask):
    """(q, k, v) [B, H, T, D] -> out [B, H, T, D] through FA4 with causal=True and the block
    mask's kv-block lists (forward) and q-block lists (backward); the block mask's mask_mod is
    not used."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    size = tuple(block_mask.BLOCK_SIZE)
    fwd = BlockSparseTensorsTorch(block_mask.kv_num_blocks, block_mask.kv_indices,
                                  block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                  block_size=size)
    bwd = BlockSparseTensorsTorch(block_mask.q_num_blocks, block_mask.q_indices,
                                  block_mask.full_q_num_blocks, block_mask.full_q_indices,
                                  block_size=size)

    def attend(q, k, v):
        out = _CausalSparse.apply(*(x.transpose(1, 2) for x in (q, k, v)), fwd, bwd)
        return out.transpose(1, 2)

    return attend
