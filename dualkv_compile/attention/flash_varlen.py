"""FLASH varlen: one flash-attn-4 varlen causal call, each response a row of its own.

The shared-prefix attention is FA4's varlen causal kernel (the kernel the remove-padding
baseline runs over replicated rows) with the queries left packed: every segment is one
sequence of queries, and a response's keys are its group's prompt followed by itself. Causal
masking in FA4 is bottom-right aligned, so query j of a response of length R, whose keys are
P + R long, sees keys [0, P + j]: the whole prompt and its own response up to itself. A prompt
(or the padding) is a sequence of its own, causal on itself.

Only the keys and values are gathered (per response, a copy of its prompt's K/V: [sum of
P + R, Hkv, D]); the queries, the output and the kernel's work stay the packed ones, so the
pairs computed are the packed pairs, at the per-tile speed of the varlen kernel, with no
mask_mod and no merge. The backward sums the gathered dk/dv back onto the packed tokens in
float32 (index_add).

Why: on ragged layouts flex's partial 128 x 128 tiles (segments that start inside a block) cost
per element; here partial tiles are the varlen kernel's own (docs/performance.md, "Ragged
layouts"). On CPU (and for the CPU tests) the same plan and gather run with explicit math in
the inputs' dtype, widened to at least float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..numerics import accumulation_dtype
from . import regions
from .flash_regions import _check_flash, _head_major, _like_head_major, _token_major
from .region_ops import plan_of_tables, register_autograd

__all__ = ["flash_varlen_attention_op", "plan_of_segments"]


class Plan(NamedTuple):
    cu_q: Tensor  # int32 [B + 1]: every segment's start, then T (FA4's cu_seqlens_q)
    cu_k: Tensor  # int32 [B + 1]: the same over the gathered keys (cu_seqlens_k)
    index: Tensor  # int64 [S]: the packed token of each gathered key
    max_q: int
    max_k: int
    bounds_q: tuple[int, ...]  # cu_q on the host (the CPU form's loop)
    bounds_k: tuple[int, ...]


def plan_of_segments(segment_ids: Tensor, prefix_segment_ids: Tensor) -> Plan:
    """The plan of the layout's 1-D segment tables (regions.groups_of_segments: one host
    synchronisation)."""
    device = segment_ids.device
    bounds_q, bounds_k, pieces = [0], [0], []
    for (ps, pe), spans in regions.groups_of_segments(segment_ids, prefix_segment_ids):
        for keys in [[(ps, pe)]] + [[(ps, pe), span] for span in spans]:
            pieces += keys
            bounds_q.append(bounds_q[-1] + keys[-1][1] - keys[-1][0])
            bounds_k.append(bounds_k[-1] + sum(e - s for s, e in keys))
    index = torch.cat([torch.arange(s, e) for s, e in pieces]).to(device)
    cu = lambda b: torch.tensor(b, dtype=torch.int32, device=device)  # noqa: E731
    lengths = lambda b: max(e - s for s, e in zip(b, b[1:]))  # noqa: E731
    return Plan(cu(bounds_q), cu(bounds_k), index, lengths(bounds_q), lengths(bounds_k),
                tuple(bounds_q), tuple(bounds_k))


# ---- the kernels: token-major q [T, Hq, D], gathered k/v [S, Hkv, D]; lse [Hq, T] float32 ----

def _fa4_forward(q, k, v, plan, scale):
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, cu_seqlens_q=plan.cu_q, cu_seqlens_k=plan.cu_k,
                               max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k,
                               softmax_scale=scale, causal=True, return_lse=True)[:2]
    return out, lse


def _fa4_backward(dout, q, k, v, out, lse, plan, scale):
    from flash_attn.cute.interface import _flash_attn_bwd

    return _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=True,
                           cu_seqlens_q=plan.cu_q, cu_seqlens_k=plan.cu_k,
                           max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k)[:3]


def _sequences(plan: Plan):
    """(query span, key span) of every sequence."""
    return zip(zip(plan.bounds_q, plan.bounds_q[1:]), zip(plan.bounds_k, plan.bounds_k[1:]))


def _math_probs(q, k, scale):
    """Bottom-right causal softmax of one sequence, [L, Hq, D] against [S, Hkv, D] (S >= L),
    widened: (p [Hq, L, S], lse [Hq, L], GQA group size)."""
    wide = accumulation_dtype(q.dtype)
    rep = q.shape[1] // k.shape[1]
    s = (q.to(wide).transpose(0, 1) @ k.to(wide).transpose(0, 1).repeat_interleave(rep, 0)
         .transpose(-1, -2)) * scale
    keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(k.shape[0] - q.shape[0])
    s = s.masked_fill(~keep, float("-inf"))
    lse = s.logsumexp(-1)
    return (s - lse.unsqueeze(-1)).exp(), lse, rep


def _math_forward(q, k, v, plan, scale):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=accumulation_dtype(q.dtype), device=q.device)
    for (a, b), (c, d) in _sequences(plan):
        p, lse[:, a:b], rep = _math_probs(q[a:b], k[c:d], scale)
        vh = v[c:d].to(p.dtype).transpose(0, 1).repeat_interleave(rep, 0)
        out[a:b] = (p @ vh).transpose(0, 1).to(q.dtype)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, plan, scale):
    """The exact gradient of each sequence's softmax attention (the whole row's, so
    rowsum(dO * O) is the row term)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for (a, b), (c, d) in _sequences(plan):
        p, _, rep = _math_probs(q[a:b], k[c:d], scale)
        qh, kh, vh, do = (x.to(p.dtype).transpose(0, 1)
                          for x in (q[a:b], k[c:d], v[c:d], dout[a:b]))
        kh, vh = kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)
        dp = do @ vh.transpose(-1, -2)
        ds = p * (dp - (do * (p @ vh)).sum(-1, keepdim=True))
        per_kv_head = lambda x: x.unflatten(0, (k.shape[1], rep)).sum(1)  # noqa: E731
        dq[a:b] = (ds @ kh * scale).transpose(0, 1)
        dk[c:d] = per_kv_head(ds.transpose(-1, -2) @ qh * scale).transpose(0, 1)
        dv[c:d] = per_kv_head(p.transpose(-1, -2) @ do).transpose(0, 1)
    return dq, dk, dv


def _kernels(q: Tensor):
    return (_fa4_forward, _fa4_backward) if q.is_cuda else (_math_forward, _math_backward)


# ---- forward and backward over the plan ---------------------------------------------------------

def _gathered(x: Tensor, plan: Plan) -> Tensor:
    return x.index_select(0, plan.index)


def _scattered(g: Tensor, like: Tensor, plan: Plan) -> Tensor:
    """The gathered keys' gradient summed back onto the packed tokens, in float32."""
    wide = accumulation_dtype(like.dtype)
    total = torch.zeros(like.shape, dtype=wide, device=like.device)
    return total.index_add_(0, plan.index, g.to(wide)).to(like.dtype)


def flash_varlen_forward(q, k, v, plan: Plan, scale: float):
    """Token-major q [T, Hq, D], k/v [T, Hkv, D] -> (out [T, Hq, D], lse [Hq, T] float32)."""
    forward, _ = _kernels(q)
    return forward(q, _gathered(k, plan), _gathered(v, plan), plan, scale)


def flash_varlen_backward(dout, q, k, v, out, lse, plan: Plan, scale: float):
    """-> (dq, dk, dv), token-major like the inputs."""
    _, backward = _kernels(q)
    dq, dk, dv = backward(dout, q, _gathered(k, plan), _gathered(v, plan), out, lse, plan,
                          scale)
    return dq, _scattered(dk, k, plan), _scattered(dv, v, plan)


# ---- the opaque op pair a compiled graph calls (optimize(attention_backend="flash_varlen")) ---

def _plan(segment_ids, prefix_segment_ids) -> Plan:
    return plan_of_tables(segment_ids, prefix_segment_ids, plan_of_segments)


@torch.library.custom_op("dualkv::flash_varlen_attention", mutates_args=())
def flash_varlen_attention_op(q: Tensor, k: Tensor, v: Tensor, segment_ids: Tensor,
                              prefix_segment_ids: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    _check_flash(q, k, v, "flash_varlen")
    out, lse = flash_varlen_forward(_token_major(q), _token_major(k), _token_major(v),
                                    _plan(segment_ids, prefix_segment_ids), scale)
    return _head_major(out), lse[None]


@flash_varlen_attention_op.register_fake
def _(q, k, v, segment_ids, prefix_segment_ids, scale):
    return _like_head_major(q), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("dualkv::flash_varlen_attention_backward", mutates_args=())
def flash_varlen_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                                       out: Tensor, lse: Tensor, segment_ids: Tensor,
                                       prefix_segment_ids: Tensor,
                                       scale: float) -> tuple[Tensor, Tensor, Tensor]:
    grads = flash_varlen_backward(
        _token_major(dout), _token_major(q), _token_major(k), _token_major(v),
        _token_major(out), lse[0], _plan(segment_ids, prefix_segment_ids), scale)
    return tuple(_head_major(g) for g in grads)


@flash_varlen_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, segment_ids, prefix_segment_ids, scale):
    return _like_head_major(q), _like_head_major(k), _like_head_major(v)


register_autograd(flash_varlen_attention_op, flash_varlen_attention_backward_op)
