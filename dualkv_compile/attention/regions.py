"""Two-KV-region attention: the shared-prefix layout as dense attention kernels over its regions.

A response query of the packed layout sees two key regions: its group's whole prompt, and its
own response up to itself. This backend runs each region as one dense call of an existing
attention kernel (cuDNN on CUDA, PyTorch's CPU flash kernel elsewhere) and merges the two
partial softmaxes of a response row by their log-sum-exp:

    lse = logaddexp(lse_prompt, lse_own)
    out = exp(lse_prompt - lse) * out_prompt + exp(lse_own - lse) * out_own

Backward calls each region's backward kernel with the merged `out` and `lse`. That is the exact
gradient of the merged softmax: the kernels rebuild P = exp(S - lse) and D = rowsum(dO * out)
from them, and both are those of the whole row. Per group the calls are: the prompt causally on
itself; the group's responses (a contiguous run of tokens) against the prompt, not causal; the
responses as a right-padded batch [n, H, R_max, D], causal. Right padding never reaches a valid
row under a causal mask, and padded rows get dO = 0 and lse = +inf in backward, so they add
nothing. Every pair computed is one the replicated causal batch needs once (plus the padding of
ragged responses in the own region), so the work is the ideal pair count.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..layout.packing import PackedBatch
from ..numerics import accumulation_dtype
from .merge import merge_partials
from .registry import CUDNN_DTYPES

__all__ = ["empty_output", "plan_of_packed", "plan_of_segments", "regions_backward",
           "regions_forward", "two_region_attention"]



# ---- the dense kernels: forward -> (out, lse [B, H, L], aux); backward with a given out, lse ---
# aux is what a backward kernel takes besides tensors; None makes the backward find it itself.

def _cpu_forward(q, k, v, causal, scale):
    # one dtype for the kernel: CPU autocast gives fp32 q and k (after RoPE's fp32 tables) and a
    # bf16 v, which the plain model's SDPA runs
    dt = _common_dtype(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(dt), k.to(dt), v.to(dt), 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_backward(dout, q, k, v, out, lse, causal, scale, aux):
    dt = _common_dtype(q, k, v)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(dt), q.to(dt), k.to(dt), v.to(dt), out.to(dt), lse.to(accumulation_dtype(dt)),
        0.0, causal, scale=scale)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _common_dtype(q, k, v) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


# cuDNN's backward takes the forward's sequence tables, sizes and dropout seeds. They depend on
# the shapes only (no dropout), so every forward files them by shape, for backwards that run
# without the forward's own (the compiled graph's custom op, below).
_CUDNN_AUX: OrderedDict = OrderedDict()
_CUDNN_AUX_MAX = 4096


def _aux_key(q, k, causal):
    return tuple(q.shape), tuple(k.shape), causal, q.dtype, q.device


def _cudnn_forward(q, k, v, causal, scale):
    # q/k/v go in strided (slices and views of the packed tensors); cuDNN takes the strides
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    aux = (tuple(lse.shape), res[2], res[3], res[4], res[5], res[6], res[7])
    key = _aux_key(q, k, causal)
    _CUDNN_AUX[key] = aux
    _CUDNN_AUX.move_to_end(key)
    if len(_CUDNN_AUX) > _CUDNN_AUX_MAX:
        _CUDNN_AUX.popitem(last=False)
    return out, lse.reshape(q.shape[:3]), aux


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale, aux):
    if aux is None:
        key = _aux_key(q, k, causal)
        aux = _CUDNN_AUX.get(key)
        if aux is not None:
            _CUDNN_AUX.move_to_end(key)
        else:
            raise RuntimeError(f"regions attention: no cuDNN forward of q {tuple(q.shape)}, k "
                               f"{tuple(k.shape)} (causal={causal}) ran in this process before "
                               f"its backward")
    lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
    # dO and O go to cuDNN as the strided views they are (slices of [1, H, T, D] tensors)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out,
        lse.float().reshape(lse_shape).contiguous(), seed, offset, None, cum_q, cum_k, max_q,
        max_k, 0.0, causal, scale=scale)


# Regions with at most this many query-key pairs per head, or a single query or key, run the
# explicit math below on CUDA: cuDNN refuses s_q = s_kv = 1 (it reports "not supported"), and
# a fused kernel's launch costs more than the math at this size anyway.
MATH_MAX_PAIRS = 64 * 64


def _use_math(q: Tensor, k: Tensor) -> bool:
    return q.shape[2] * k.shape[2] <= MATH_MAX_PAIRS or min(q.shape[2], k.shape[2]) == 1


def _wide_dtype(*xs: Tensor) -> torch.dtype:
    """fp32, or wider if an input is (one dtype for mixed inputs: fp64 q with fp32 k, v)."""
    return accumulation_dtype(_common_dtype(*xs))


def _exact(fn):
    """Run the math in the wide dtype it casts to (_wide_dtype), autocast or not: under autocast its
    matmuls ran in bf16, and the forward's lse then did not match the scores the backward
    (usually outside autocast) recomputes in fp32 (flash_regions' CPU dv 16x the plain
    model's error)."""
    @functools.wraps(fn)
    def run(*args):
        with torch.autocast(args[1].device.type, enabled=False):
            return fn(*args)
    return run


def _math_scores(q, k, causal, scale, wide):
    rep = q.shape[1] // k.shape[1]
    s = q.to(wide) @ k.to(wide).repeat_interleave(rep, 1).transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s, rep


@_exact
def _math_forward(q, k, v, causal, scale):
    wide = _wide_dtype(q, k, v)
    s, rep = _math_scores(q, k, causal, scale, wide)
    lse = s.logsumexp(-1)
    out = (s - lse.unsqueeze(-1)).exp() @ v.to(wide).repeat_interleave(rep, 1)
    return out.to(q.dtype), lse, None


@_exact
def _math_backward(dout, q, k, v, out, lse, causal, scale, aux):
    """This region's share of the gradients of rows whose softmax (`out`, `lse`) may span the
    other region too. The row term rowsum(dO * out) is split into this region's sum(P * dP)
    and the rest of the row, dO * (out - this region's part of out), which is exactly 0 for a
    row that sees this region only (so a row that sees one key gets dq = 0 exactly, as the
    replicated reference does)."""
    wide = _wide_dtype(q, k, v)
    s, rep = _math_scores(q, k, causal, scale, wide)
    p = (s - lse.to(wide).unsqueeze(-1)).exp()
    do, qf = dout.to(wide), q.to(wide)
    vf = v.to(wide).repeat_interleave(rep, 1)
    dp = do @ vf.transpose(-1, -2)
    rest = (do * (out.to(wide) - p @ vf)).sum(-1, keepdim=True)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True) - rest)
    dq = ds @ k.to(wide).repeat_interleave(rep, 1) * scale

    def per_kv_head(x):  # [B, Hq, L, D] -> [B, Hkv, L, D], summing the GQA group
        return x.unflatten(1, (k.shape[1], rep)).sum(2)

    dk = per_kv_head(ds.transpose(-1, -2) @ qf * scale)
    dv = per_kv_head(p.transpose(-1, -2) @ do)
    return dq, dk, dv


def _cuda_forward(q, k, v, causal, scale):
    if _use_math(q, k):
        return _math_forward(q, k, v, causal, scale)
    return _cudnn_forward(q, k, v, causal, scale)


def _cuda_backward(dout, q, k, v, out, lse, causal, scale, aux):
    if _use_math(q, k):
        return _math_backward(dout, q, k, v, out, lse, causal, scale, aux)
    return _cudnn_backward(dout, q, k, v, out, lse, causal, scale, aux)


def _kernels(q: Tensor):
    if q.device.type == "cuda":
        if q.dtype not in CUDNN_DTYPES:
            raise ValueError(f"attention_backend='regions' runs cuDNN on CUDA, which computes in "
                             f"bf16/fp16, not {q.dtype}")
        return _cuda_forward, _cuda_backward
    if q.device.type == "cpu":
        return _cpu_forward, _cpu_backward
    raise ValueError(f"attention_backend='regions' has kernels for CUDA and CPU, not {q.device}")


# ---- the plan: which token ranges are attended how --------------------------------------------

class _Responses:
    """The non-empty responses of one group, a contiguous run of tokens [start, end), seen as a
    right-padded batch [n, H, R_max, ...]. When every response has length R_max the batch is a
    view of the run; otherwise a gather (`idx`, padded rows repeat the response's first token)."""

    def __init__(self, spans: list[tuple[int, int]], device: torch.device):
        self.start, self.end = spans[0][0], spans[-1][1]
        lens = [e - s for s, e in spans]
        self.n, self.r = len(spans), max(lens)
        self.idx = self.valid = None
        if min(lens) != self.r:
            starts = torch.tensor([s for s, _ in spans], device=device)
            cols = torch.arange(self.r, device=device)
            self.valid = cols < torch.tensor(lens, device=device)[:, None]  # [n, R_max]
            self.idx = torch.where(self.valid, starts[:, None] + cols, starts[:, None])

    def run(self, x: Tensor) -> Tensor:
        """[1, H, T, ...] -> [1, H, tokens, ...], the run itself."""
        return x[:, :, self.start:self.end]

    def rows(self, x: Tensor, pad_value: float | None = None) -> Tensor:
        """[1, H, T, ...] -> [n, H, R_max, ...]; padded rows set to `pad_value` if given."""
        if self.idx is None:
            return x[0, :, self.start:self.end].unflatten(1, (self.n, self.r)).transpose(0, 1)
        rows = x[0][:, self.idx].transpose(0, 1)
        if pad_value is not None:
            keep = self.valid[:, None].reshape(self.n, 1, self.r, *([1] * (x.dim() - 3)))
            rows = rows.masked_fill(~keep, pad_value)
        return rows

    def as_rows_of(self, x: Tensor) -> Tensor:
        """A [1, H, tokens, ...] run in the layout unrows() gives: [H, n, R, ...] when uniform,
        else [H, tokens, ...]."""
        return x[0].unflatten(1, (self.n, self.r)) if self.idx is None else x[0]

    def unrows(self, x: Tensor) -> Tensor:
        """[n, H, R_max, ...] -> the valid rows, in as_rows_of()'s layout (a view if uniform)."""
        return x.transpose(0, 1) if self.idx is None else x.transpose(0, 1)[:, self.valid]


def _plan(groups, device: torch.device) -> list:
    """[(prompt (start, end), [(response start, end), ...])] -> [(prompt span, _Responses or
    None)]. Self-only segments (the padding) are groups without responses."""
    plan = []
    for prompt, spans in groups:
        spans = [(s, e) for s, e in spans if e > s]
        plan.append((prompt, _Responses(spans, device) if spans else None))
    return plan


def plan_of_packed(packed: PackedBatch, device: torch.device) -> list:
    """The plan of a PackedBatch, cached on it."""
    key = ("two_region_plan", device)

    def build():
        groups = [((ps, pe), spans) for ps, pe, spans in packed.group_spans]
        if packed.padding_span[1] > packed.padding_span[0]:
            groups.append((packed.padding_span, []))
        return _plan(groups, device)
    return packed.cached(key, build)


def groups_of_segments(segment_ids: Tensor, prefix_segment_ids: Tensor) -> list:
    """[(prompt (start, end), [(response start, end), ...])] in token order, from the layout's
    1-D segment tables (what a compiled graph has): runs of equal segment id; a run whose prefix
    segment is itself is a prompt (or the padding), any other a response of the group whose
    prompt it names. Reads the run boundaries to the host: one device synchronisation."""
    t = segment_ids.shape[0]
    starts = torch.ones(t, dtype=torch.bool, device=segment_ids.device)
    starts[1:] = segment_ids[1:] != segment_ids[:-1]
    idx = starts.nonzero().flatten()
    rows = torch.stack([idx, segment_ids[idx].long(), prefix_segment_ids[idx].long()])
    first, seg, pre = rows.tolist()
    groups, prompt_id = [], None
    for i, (s, sid, pid) in enumerate(zip(first, seg, pre)):
        e = first[i + 1] if i + 1 < len(first) else t
        if sid == pid:  # a prompt or the padding: starts a group
            groups.append(((s, e), []))
            prompt_id = sid
        else:
            if pid != prompt_id:
                raise ValueError(f"segment tables: the response at tokens [{s}, {e}) names "
                                 f"prompt segment {pid}, which is not the prompt before it; "
                                 f"tables from dualkv_compile.pack() always put it there")
            groups[-1][1].append((s, e))
    return groups


def plan_of_segments(segment_ids: Tensor, prefix_segment_ids: Tensor) -> list:
    """The plan of the layout's 1-D segment tables (groups_of_segments)."""
    return _plan(groups_of_segments(segment_ids, prefix_segment_ids), segment_ids.device)


def _sl(x: Tensor, span: tuple[int, int]) -> Tensor:
    return x[:, :, span[0]:span[1]]


_compiled_merge = []


def _merge(o_x, l_x, o_own, l_own):
    """On CUDA one fused kernel (compiled once, dynamic shapes); eager elsewhere."""
    if o_x.device.type != "cuda" or torch.compiler.is_compiling():
        return merge_partials(o_x, l_x, o_own, l_own)
    if not _compiled_merge:
        _compiled_merge.append(torch.compile(merge_partials, dynamic=True, fullgraph=True))
    return _compiled_merge[0](o_x, l_x, o_own, l_own)


def _write(dst: Tensor, a: Tensor, b: Tensor | None = None) -> None:
    """dst = a (+ b), summed in fp32 and rounded to dst's dtype once."""
    if b is None:
        dst.copy_(a)
    else:
        torch.add(a, b, out=dst)


def empty_output(like: Tensor) -> Tensor:
    """Outputs are contiguous whatever the inputs' strides, so the compiled graph's fake outputs
    (region_ops.py) have the real outputs' strides."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def regions_forward(q, k, v, plan, scale):
    """-> (out [1, Hq, T, D], lse [1, Hq, T], aux: one entry per kernel call, for backward)."""
    fwd, _ = _kernels(q)
    out = empty_output(q)
    lse = torch.empty(q.shape[:3], dtype=accumulation_dtype(q.dtype), device=q.device)
    aux = []
    for prompt, resp in plan:
        has_prompt = prompt[1] > prompt[0]
        if has_prompt:
            o, l, a = fwd(_sl(q, prompt), _sl(k, prompt), _sl(v, prompt), True, scale)
            _sl(out, prompt).copy_(o)
            _sl(lse, prompt).copy_(l)
            aux.append(a)
        if resp is None:
            continue
        o_own, l_own, a_own = fwd(resp.rows(q), resp.rows(k), resp.rows(v), True, scale)
        o_own, l_own = resp.unrows(o_own), resp.unrows(l_own)
        a_x = None
        if has_prompt:
            o_x, l_x, a_x = fwd(resp.run(q), _sl(k, prompt), _sl(v, prompt), False, scale)
            o_own, l_own = _merge(resp.as_rows_of(o_x), resp.as_rows_of(l_x), o_own, l_own)
        resp.as_rows_of(resp.run(out)).copy_(o_own)
        resp.as_rows_of(resp.run(lse)).copy_(l_own)
        aux += [a_own, a_x]
    return out, lse, aux


def regions_backward(dout, q, k, v, out, lse, plan, scale, aux=None):
    """-> (dq, dk, dv). `aux` from regions_forward, or None (the kernels find it themselves)."""
    _, bwd = _kernels(q)
    aux = iter(aux) if aux is not None else None
    take = (lambda: next(aux)) if aux is not None else (lambda: None)
    dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
    for prompt, resp in plan:
        has_prompt = prompt[1] > prompt[0]
        g_p = g_x = None
        if has_prompt:
            g_p = bwd(_sl(dout, prompt), _sl(q, prompt), _sl(k, prompt), _sl(v, prompt),
                      _sl(out, prompt), _sl(lse, prompt), True, scale, take())
        if resp is not None:
            a_own, a_x = take(), take()
            # padded rows (ragged responses only) take dO = 0 and lse = +inf: P = 0 there
            g_own = bwd(resp.rows(dout, 0.0), resp.rows(q), resp.rows(k), resp.rows(v),
                        resp.rows(out, 0.0), resp.rows(lse, float("inf")), True, scale, a_own)
            if has_prompt:
                g_x = bwd(resp.run(dout), resp.run(q), _sl(k, prompt), _sl(v, prompt),
                          resp.run(out), resp.run(lse), False, scale, a_x)
            for grad, i in ((dq, 0), (dk, 1), (dv, 2)):
                cross = resp.as_rows_of(g_x[0]) if (g_x is not None and i == 0) else None
                _write(resp.as_rows_of(resp.run(grad)), resp.unrows(g_own[i]), cross)
        if has_prompt:
            _write(_sl(dq, prompt), g_p[0])
            for grad, i in ((dk, 1), (dv, 2)):
                _write(_sl(grad, prompt), g_p[i], None if g_x is None else g_x[i])
    return dq, dk, dv


class _TwoRegionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, packed, scale):
        plan = plan_of_packed(packed, q.device)
        out, lse, aux = regions_forward(q, k, v, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.aux = plan, scale, aux
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = regions_backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.aux)
        return dq, dk, dv, None, None


def two_region_attention(q: Tensor, k: Tensor, v: Tensor, packed: PackedBatch,
                         scale: float | None = None) -> Tensor:
    """Shared-prefix attention of the packed batch by dense kernels over the two KV regions.

    q [1, Hq, T, D], k/v [1, Hkv, T, D] -> [1, Hq, T, D]; equal to causal SDPA on the
    replicated rows. Differentiable in q, k and v. CUDA needs bf16 or fp16 (cuDNN)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _TwoRegionAttention.apply(q, k, v, packed, scale)
