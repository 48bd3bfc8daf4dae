"""The region kernels as opaque ops, for compiled graphs (optimize(attention_backend="regions"
or "flash_regions")).

The layout enters as the 1-D segment tables the graph already has; the plan is read from them
once per micro-batch (one host synchronisation). Backward is a second op, so AOTAutograd
partitions the pair like any attention. register_autograd joins such a pair; flash_regions.py
registers its own pair the same way.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..numerics import accumulation_dtype
from .regions import empty_output, plan_of_segments, regions_backward, regions_forward

__all__ = ["plan_of_tables", "register_autograd", "regions_attention_op"]

# Every layer's call (forward and backward) gets the same segment tables of one micro-batch: the
# plan is read once per pair of table objects. An entry holds weak references, so it is found
# only while those very objects are alive and unmodified; ids of live objects are unique.
_PLANS: dict[tuple, tuple] = {}


def plan_of_tables(segment_ids: Tensor, prefix_segment_ids: Tensor, build=None):
    """build(segment_ids, prefix_segment_ids) (default: plan_of_segments), once per pair of
    live, unmodified table objects."""
    build = build or plan_of_segments
    key = (id(segment_ids), id(prefix_segment_ids), build)
    versions = (_version(segment_ids), _version(prefix_segment_ids))
    hit = _PLANS.get(key)
    if hit and hit[0]() is segment_ids and hit[1]() is prefix_segment_ids and hit[2] == versions:
        return hit[3]
    for stale in [k for k, e in _PLANS.items() if e[0]() is None or e[1]() is None]:
        del _PLANS[stale]
    plan = build(segment_ids, prefix_segment_ids)
    _PLANS[key] = (weakref.ref(segment_ids), weakref.ref(prefix_segment_ids), versions, plan)
    return plan


def _version(t: Tensor) -> int:
    """t's in-place version; an inference tensor (made under torch.inference_mode, as pack()
    inside an optimize() call there makes its tables) has no counter: 0. Its plan is then
    reused while the object lives: the tables are pack()'s, which nothing writes in place (a
    caller who edits a PackedBatch's tables inside inference_mode would get the old plan)."""
    return 0 if t.is_inference() else t._version


@torch.library.custom_op("dualkv::regions_attention", mutates_args=())
def regions_attention_op(q: Tensor, k: Tensor, v: Tensor, segment_ids: Tensor,
                         prefix_segment_ids: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, _ = regions_forward(q, k, v, plan_of_tables(segment_ids, prefix_segment_ids),
                                  scale)
    return out, lse


@regions_attention_op.register_fake
def _(q, k, v, segment_ids, prefix_segment_ids, scale):
    return empty_output(q), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("dualkv::regions_attention_backward", mutates_args=())
def regions_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                  lse: Tensor, segment_ids: Tensor, prefix_segment_ids: Tensor,
                                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    plan = plan_of_tables(segment_ids, prefix_segment_ids)
    return regions_backward(dout, q, k, v, out, lse, plan, scale)


@regions_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, segment_ids, prefix_segment_ids, scale):
    return empty_output(q), empty_output(k), empty_output(v)


def register_autograd(forward_op, backward_op) -> None:
    """forward_op(q, k, v, segment_ids, prefix_segment_ids, scale) -> (out, lse) gets the
    gradient backward_op(dout, q, k, v, out, lse, segment_ids, prefix_segment_ids, scale) ->
    (dq, dk, dv); lse is for the backward only."""
    def setup_context(ctx, inputs, output):
        q, k, v, segment_ids, prefix_segment_ids, scale = inputs
        ctx.save_for_backward(q, k, v, segment_ids, prefix_segment_ids, *output)
        ctx.mark_non_differentiable(output[1])
        ctx.scale = scale

    def backward(ctx, dout, dlse):
        q, k, v, segment_ids, prefix_segment_ids, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(dout, q, k, v, out, lse, segment_ids, prefix_segment_ids,
                                 ctx.scale)
        return dq, dk, dv, None, None, None

    forward_op.register_autograd(backward, setup_context=setup_context)


register_autograd(regions_attention_op, regions_attention_backward_op)
