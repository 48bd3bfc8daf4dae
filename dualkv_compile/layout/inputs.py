"""How the packed layout enters a compiled graph: as real inputs of one marker op.

The traced function calls `torch.ops.dualkv.layout_anchor(tokens, positions, tables)` before
running the model. Dynamo records it (it is never dead-code eliminated), so the tables become
ordinary graph inputs with Dynamo's own sources and fake tensors. The attention-rewrite pass
reads them off the anchor and erases it. For flex, the tables are the mask_mod's 1-D table
(`visible_until`) and every tensor of the BlockMask, in `BlockMask.as_tuple()` order (its
length differs between torch versions, so the order is taken from the object, never
hard-coded); for the region kernels, the two 1-D segment tables.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention.block_mask import shared_prefix_block_mask, visible_until
from .packing import PackedBatch

__all__ = ["layout_tables", "ANCHOR"]


@torch.library.custom_op("dualkv::layout_anchor", mutates_args=())
def layout_anchor(tokens: Tensor, positions: Tensor, tables: list[Tensor]) -> Tensor:
    return tokens.new_empty(0)


@layout_anchor.register_fake
def _(tokens, positions, tables):
    return tokens.new_empty(0)


ANCHOR = torch.ops.dualkv.layout_anchor.default


def layout_tables(packed: PackedBatch, device,
                  block_mask: bool = True) -> tuple[list[Tensor], tuple | None]:
    """(tables, template): tables = [visible_until, *BlockMask tensors] (the flex kernels);
    template = the BlockMask's as_tuple() whose tensors the pass replaces by graph inputs.
    block_mask=False (the region kernels, which read the segment tables only): no BlockMask,
    tables = [segment_ids, prefix_segment_ids], template None."""
    if not block_mask:
        return [packed.segment_ids[0].to(device), packed.prefix_segment_ids[0].to(device)], None
    template = shared_prefix_block_mask(packed, device).as_tuple()
    return [visible_until(packed, device), *(x for x in template if isinstance(x, Tensor))], template
