"""Gathering the rows that feed the LM head, with a backward that copies instead of adding.

`x.index_select(0, src)` has a backward that adds every gradient row into a zero [T, d] with
atomics (ATen's index_add_), because src may repeat. In the packed layout it repeats only in a
known way: the first response token of every member of a group is predicted by the group's
prompt's last token. So the backward copies every row to its place (a plain indexed copy), then
overwrites each such shared row with the sum of its members' rows, summed in float32 (float64
for float64) and rounded once. That is what index_add_ computes, rounded once instead of once
per addition, and without atomics on the whole [M, d] gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..numerics import accumulation_dtype

__all__ = ["SharedRows", "gather_rows"]


@dataclass(frozen=True)
class SharedRows:
    """Where `src` repeats: the gathered rows `members` [K] all come from source rows
    `rows[slot]` ([S] distinct source rows, `slot` [K] into them). Every other entry of src
    is unique and differs from each of `rows`."""

    rows: Tensor
    members: Tensor
    slot: Tensor


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, shared):
        ctx.num_rows, ctx.src, ctx.shared = x.shape[0], src, shared
        return x.index_select(0, src)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        src, shared = ctx.src, ctx.shared
        out = grad.new_zeros(ctx.num_rows, *grad.shape[1:])
        out.index_copy_(0, src, grad)  # a shared row gets one of its members: replaced below
        sums = torch.zeros(shared.rows.shape[0], *grad.shape[1:], dtype=accumulation_dtype(grad.dtype),
                           device=grad.device)
        sums.index_add_(0, shared.slot, grad.index_select(0, shared.members).to(sums.dtype))
        out.index_copy_(0, shared.rows, sums.to(grad.dtype))
        return out, None, None


def gather_rows(x: Tensor, src: Tensor, shared: SharedRows) -> Tensor:
    """x[src] (x [T, ...], src [M]); differentiable in x, where the gradient of a source row
    is the sum of its gathered rows' gradients (see the module docstring)."""
    return _GatherRows.apply(x, src, shared)
