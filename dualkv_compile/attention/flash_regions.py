"""FLASH over the two KV regions: flash-attn-4's dense kernels, two calls per layer.

A token sees its own segment causally (a prompt itself, a response itself, the padding itself)
and, if it is a response token, its group's whole prompt. This backend runs those two regions
as dense FA4 calls on the token-major packed tensors:

- own: one varlen causal call over every segment (cu_seqlens = the segment boundaries);
- cross: every group's responses (a contiguous run of tokens) against its prompt, not causal,
  in one varlen call (cu_seqlens give each group's start, seqused its length);

and merges a response row's two partial softmaxes by their log-sum-exp, in place. The backward
calls both kernels' backward with the merged `out` and `lse` (the exact gradient of the merged
softmax, as in regions.py) and adds the cross call's dq to the responses' rows and its dk/dv to
the prompt's.

Why: FA4's dense non-causal backward tiles the cross region 80 x 128 (its non-causal sm_90
configuration), where the block-sparse call that flex makes is held to 64 x 128 by its 128-row
sparse blocks; the larger tiles make the cross region's backward faster, and no tile evaluates a
mask (docs/performance.md, "flash_regions"). On CPU (and for the CPU tests) the same plan runs
with explicit math in the inputs' dtype, widened to at least float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..numerics import accumulation_dtype
from . import lse_merge_kernel, regions
from .merge import merge_partials
from .selection import flash_status
from .region_ops import plan_of_tables, register_autograd

__all__ = ["flash_regions_attention_op", "flash_plan_of_segments"]


class Cross(NamedTuple):
    """The cross call's varlen tables, int32 on the device: per group with responses, where its
    responses (q) and its prompt (k) start, then T; and how many tokens each has."""
    cu_q: Tensor
    used_q: Tensor
    cu_k: Tensor
    used_k: Tensor
    max_q: int
    max_k: int


class Plan(NamedTuple):
    bounds: tuple[int, ...]  # every segment's start, then T
    cu: Tensor  # the same, int32 on the device: FA4's cu_seqlens
    max_len: int  # the longest segment
    cross: tuple[tuple[int, int, int, int], ...]  # per group: responses [rs, re), prompt [ps, pe)
    cross_tables: Cross | None  # None where no group has responses


def flash_plan_of_segments(segment_ids: Tensor, prefix_segment_ids: Tensor) -> Plan:
    """The plan of the layout's 1-D segment tables (regions.groups_of_segments: one host
    synchronisation)."""
    groups = regions.groups_of_segments(segment_ids, prefix_segment_ids)
    bounds = tuple(b for prompt, spans in groups for b in [prompt[0]] + [s for s, _ in spans])
    bounds += (segment_ids.shape[0],)
    cross = tuple((spans[0][0], spans[-1][1], *prompt) for prompt, spans in groups if spans)
    device = segment_ids.device
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return Plan(bounds, cu, max(b - a for a, b in zip(bounds, bounds[1:])), cross,
                _cross_tables(cross, bounds[-1], device))


def _cross_tables(cross, total: int, device) -> Cross | None:
    if not cross:
        return None
    table = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    used_q, used_k = [re - rs for rs, re, _, _ in cross], [pe - ps for _, _, ps, pe in cross]
    return Cross(table([c[0] for c in cross] + [total]), table(used_q),
                 table([c[2] for c in cross] + [total]), table(used_k), max(used_q), max(used_k))


# ---- the kernels: token-major q [L, Hq, D], k/v [S, Hkv, D]; lse [Hq, L] float32 ------------

def _fa4_own_forward(q, k, v, plan, scale, out, lse):
    from flash_attn.cute.interface import _flash_attn_fwd

    _flash_attn_fwd(q, k, v, cu_seqlens_q=plan.cu, cu_seqlens_k=plan.cu,
                    max_seqlen_q=plan.max_len, max_seqlen_k=plan.max_len, softmax_scale=scale,
                    causal=True, return_lse=True, out=out, lse=lse)


def _cross_args(x: Cross) -> dict:
    return dict(cu_seqlens_q=x.cu_q, seqused_q=x.used_q, cu_seqlens_k=x.cu_k,
                seqused_k=x.used_k, max_seqlen_q=x.max_q, max_seqlen_k=x.max_k, causal=False)


def _fa4_cross_forward(q, k, v, plan, scale):
    """Rows outside the plan's response runs are left unwritten."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True,
                               **_cross_args(plan.cross_tables))[:2]
    return out, lse


def _fa4_own_backward(dout, q, k, v, out, lse, plan, scale):
    from flash_attn.cute.interface import _flash_attn_bwd

    return _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=True,
                           cu_seqlens_q=plan.cu, cu_seqlens_k=plan.cu,
                           max_seqlen_q=plan.max_len, max_seqlen_k=plan.max_len)[:3]


def _fa4_cross_backward(dout, q, k, v, out, lse, plan, scale):
    """dq on the response runs, dk/dv on the prompts; other rows are not to be read."""
    from flash_attn.cute.interface import _flash_attn_bwd

    return _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale,
                           **_cross_args(plan.cross_tables))[:3]


# CPU: regions.py's explicit math (head-major [1, H, L, D]) on the token-major tensors

def _math_forward(q, k, v, scale, causal):
    out, lse, _ = regions._math_forward(_head_major(q), _head_major(k), _head_major(v), causal,
                                        scale)
    return _token_major(out), lse[0]


def _math_backward(dout, q, k, v, out, lse, scale, causal):
    grads = regions._math_backward(*(_head_major(x) for x in (dout, q, k, v, out)), lse[None],
                                   causal, scale, None)
    return tuple(_token_major(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _math_own_forward(q, k, v, plan, scale, out, lse):
    for a, b in zip(plan.bounds, plan.bounds[1:]):
        o, l = _math_forward(q[a:b], k[a:b], v[a:b], scale, True)
        out[a:b], lse[:, a:b] = o, l


def _math_cross_forward(q, k, v, plan, scale):
    out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0],
                                                dtype=accumulation_dtype(q.dtype))
    for rs, re, ps, pe in plan.cross:
        out[rs:re], lse[:, rs:re] = _math_forward(q[rs:re], k[ps:pe], v[ps:pe], scale, False)
    return out, lse


def _math_own_backward(dout, q, k, v, out, lse, plan, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for a, b in zip(plan.bounds, plan.bounds[1:]):
        dq[a:b], dk[a:b], dv[a:b] = _math_backward(dout[a:b], q[a:b], k[a:b], v[a:b],
                                                   out[a:b], lse[:, a:b], scale, True)
    return dq, dk, dv


def _math_cross_backward(dout, q, k, v, out, lse, plan, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rs, re, ps, pe in plan.cross:
        dq[rs:re], dk[ps:pe], dv[ps:pe] = _math_backward(
            dout[rs:re], q[rs:re], k[ps:pe], v[ps:pe], out[rs:re], lse[:, rs:re], scale, False)
    return dq, dk, dv


_FA4 = (_fa4_own_forward, _fa4_cross_forward, _fa4_own_backward, _fa4_cross_backward)
_MATH = (_math_own_forward, _math_cross_forward, _math_own_backward, _math_cross_backward)


def _kernels(q: Tensor):
    return _FA4 if q.is_cuda else _MATH


# ---- the merge: a response row's two partial softmaxes, in place ------------------------------

def _merge_into_eager(out: Tensor, lse: Tensor, out_x: Tensor, lse_x: Tensor) -> None:
    """out [L, H, D] and lse [H, L] (views into the results) become the softmax over both
    regions: out_x/lse_x are the cross call's (merge.merge_partials, written in place)."""
    merged_out, merged_lse = merge_partials(out_x, lse_x.T, out, lse.T)
    out.copy_(merged_out)
    lse.copy_(merged_lse.T)


def _merge_into(out, lse, out_x, lse_x) -> None:
    """One Triton kernel on CUDA (lse_merge_kernel.py; head dims of FA4 always qualify), the
    eager reference elsewhere."""
    if lse_merge_kernel.supports(out, lse, out_x, lse_x):
        return lse_merge_kernel.merge_into(out, lse, out_x, lse_x)
    return _merge_into_eager(out, lse, out_x, lse_x)


# ---- forward and backward over the plan ---------------------------------------------------------

def _token_major(x: Tensor) -> Tensor:
    """[1, H, T, D] -> [T, H, D], contiguous (a view when it already is token-major)."""
    return x[0].transpose(0, 1).contiguous()


def _head_major(x: Tensor) -> Tensor:
    """[T, H, D] -> the [1, H, T, D] view of it."""
    return x.transpose(0, 1)[None]


def flash_regions_forward(q, k, v, plan: Plan, scale: float):
    """Token-major q [T, Hq, D], k/v [T, Hkv, D] -> (out [T, Hq, D], lse [Hq, T] float32)."""
    own, cross, _, _ = _kernels(q)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=accumulation_dtype(q.dtype), device=q.device)
    own(q, k, v, plan, scale, out, lse)
    if plan.cross:
        out_x, lse_x = cross(q, k, v, plan, scale)
        for rs, re, _, _ in plan.cross:
            _merge_into(out[rs:re], lse[:, rs:re], out_x[rs:re], lse_x[:, rs:re])
    return out, lse


def flash_regions_backward(dout, q, k, v, out, lse, plan: Plan, scale: float):
    """-> (dq, dk, dv), token-major like the inputs."""
    _, _, own, cross = _kernels(q)
    dq, dk, dv = own(dout, q, k, v, out, lse, plan, scale)
    if plan.cross:
        gq, gk, gv = cross(dout, q, k, v, out, lse, plan, scale)
        for rs, re, ps, pe in plan.cross:
            dq[rs:re] += gq[rs:re]
            dk[ps:pe] += gk[ps:pe]
            dv[ps:pe] += gv[ps:pe]
    return dq, dk, dv


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    # (mixed float dtypes run on the CPU, where the math is fp32, with autocast off inside:
    # CPU autocast gives fp32 q/k after RoPE and a bf16 v; flash_status refuses them on CUDA)
    if not all(t.is_floating_point() for t in (q, k, v)) or (
            q.is_cuda and not q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention_backend='flash_regions' needs floating q, k and v (one "
                         f"dtype on CUDA), got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"head dims q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]} differ")
    if q.is_cuda:
        ok, reason = flash_status(q.device, q.shape[-1], q.dtype)
        if not ok:
            raise ValueError(f"attention_backend='flash_regions' cannot run: {reason}")


# ---- the opaque op pair a compiled graph calls (optimize(attention_backend="flash_regions")) --

def _plan(segment_ids, prefix_segment_ids) -> Plan:
    return plan_of_tables(segment_ids, prefix_segment_ids, flash_plan_of_segments)


@torch.library.custom_op("dualkv::flash_regions_attention", mutates_args=())
def flash_regions_attention_op(q: Tensor, k: Tensor, v: Tensor, segment_ids: Tensor,
                               prefix_segment_ids: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    _check(q, k, v)
    out, lse = flash_regions_forward(_token_major(q), _token_major(k), _token_major(v),
                                     _plan(segment_ids, prefix_segment_ids), scale)
    return _head_major(out), lse[None]


def _like_head_major(x: Tensor) -> Tensor:
    return _head_major(x.new_empty(x.shape[2], x.shape[1], x.shape[3]))


@flash_regions_attention_op.register_fake
def _(q, k, v, segment_ids, prefix_segment_ids, scale):
    return _like_head_major(q), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("dualkv::flash_regions_attention_backward", mutates_args=())
def flash_regions_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                                        out: Tensor, lse: Tensor, segment_ids: Tensor,
                                        prefix_segment_ids: Tensor,
                                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    grads = flash_regions_backward(
        _token_major(dout), _token_major(q), _token_major(k), _token_major(v),
        _token_major(out), lse[0], _plan(segment_ids, prefix_segment_ids), scale)
    return tuple(_head_major(g) for g in grads)


@flash_regions_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, segment_ids, prefix_segment_ids, scale):
    return _like_head_major(q), _like_head_major(k), _like_head_major(v)


register_autograd(flash_regions_attention_op, flash_regions_attention_backward_op)

