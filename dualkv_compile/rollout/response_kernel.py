"""A Triton kernel for the second half of a decode step's attention: each row against its own
response keys, read only up to the current step, merged with the prompt region's split
partials, in one pass.

The prompt region (attention.py) leaves, per group and key split, a softmax-normalised output
and its log-sum-exp for each of the group's rows. This kernel runs one program per (row, kv
head): the row's query heads of that kv head against the row's response keys 0..step (an
online softmax over blocks of keys; `step` is read on the device, so a captured CUDA graph
replays it at any step), then folds in the prompt's splits one by one as further blocks of
the same online softmax, and writes the final output. It replaces flex's response call,
which reads every one of the R cache slots, and two merges that Inductor compiled to
separate kernels (docs/performance.md, "Rollout").

The explicit math in attention.py (`implementation="math"`) is the reference; on the CPU the
kernel runs only under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

__all__ = ["response_and_merge", "runs_for", "supports"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the math path runs instead
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tensors run (the tests)
_BLOCK_N = 64  # response keys per iteration
_MIN_DOT_ROWS = 16  # tl.dot's smallest M: a kv head's query heads are padded up to it
_SPLITS_A_STEP = 4  # prompt splits merged per loop step ([16, 4, D] float32 in registers)

if triton is not None:
    @triton.jit
    def _kernel(q_ptr, k_ptr, v_ptr, step_ptr, po_ptr, plse_ptr, out_ptr, scale,
                samples, splits, sq_row, sq_head, sk_row, sk_head, sk_key,
                spo_piece, spo_head, spo_sample, splse_piece, splse_head, splse_sample,
                so_row, so_head,
                REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        heads = kvh * REP + tl.arange(0, REP_PAD)  # this kv head's query heads (padded)
        live = tl.arange(0, REP_PAD) < REP
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * sq_row + heads[:, None] * sq_head + d[None, :],
                    mask=live[:, None], other=0.0)
        last = tl.load(step_ptr)
        m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        kv = row * sk_row + kvh * sk_head
        for start in range(0, last + 1, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            valid = keys <= last
            k = tl.load(k_ptr + kv + keys[:, None] * sk_key + d[None, :], mask=valid[:, None],
                        other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + kv + keys[:, None] * sk_key + d[None, :], mask=valid[:, None],
                        other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        # the prompt's splits: normalised outputs o_s with log-sum-exps lse_s are the blocks
        # (o_s * e^lse_s, e^lse_s) of the same online softmax; an empty split has lse -inf.
        # SPLITS of them a step: a load a split would leave each step waiting on memory.
        group = row // samples
        sample = row % samples
        c = tl.arange(0, SPLITS)
        for first in range(0, splits, SPLITS):
            piece = group * splits + first + c
            take = live[:, None] & (first + c < splits)[None, :]
            lse = tl.load(plse_ptr + piece[None, :] * splse_piece + heads[:, None] * splse_head
                          + sample * splse_sample, mask=take, other=float("-inf"))
            o = tl.load(po_ptr + piece[None, :, None] * spo_piece
                        + heads[:, None, None] * spo_head + sample * spo_sample
                        + d[None, None, :], mask=take[:, :, None], other=0.0)
            m_new = tl.maximum(m_i, tl.max(lse, 1))
            alpha = tl.exp(m_i - m_new)
            w = tl.exp(lse - m_new[:, None])
            acc = acc * alpha[:, None] + tl.sum(o.to(tl.float32) * w[:, :, None], 1)
            l_i = l_i * alpha + tl.sum(w, 1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + row * so_row + heads[:, None] * so_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def runs_for(head_dim: int) -> tuple[bool, str]:
    """(runs, why not) for a head dim: Triton importable, a power of two of at least 16."""
    if triton is None:
        return False, "Triton is not installed"
    if head_dim < 16 or head_dim != triton.next_power_of_2(head_dim):
        return False, f"head dim {head_dim} is not a power of two >= 16"
    return True, ""


def supports(q: Tensor, resp_k: Tensor, resp_v: Tensor) -> bool:
    """True where the kernel runs: CUDA tensors (or Triton's interpreter), runs_for(head dim),
    each row's head dim contiguous, K and V laid out alike (the engine's cache always is)."""
    return ((q.is_cuda or _INTERPRETED) and runs_for(q.shape[-1])[0] and q.stride(-1) == 1
            and resp_k.stride(-1) == 1 and resp_k.stride() == resp_v.stride())


@torch.library.custom_op("dualkv::decode_response_and_merge", mutates_args=())
def response_and_merge(q: Tensor, resp_k: Tensor, resp_v: Tensor, step: Tensor,
                       prompt_out: Tensor, prompt_lse: Tensor, scale: float) -> Tensor:
    """q [rows, Hq, D]; resp_k/v [rows, Hkv, R, D] with keys 0..step valid (`step` a 0-d
    device tensor); the prompt region's partials prompt_out [G * S, Hq, N, D] and prompt_lse
    [G * S, Hq, N] (rows group-major: row r is sample r % N of group r // N; S splits per
    group). -> the attention over both regions, [rows, Hq, D] in q's dtype. An opaque op in
    compiled graphs (the step's CUDA graph captures its launch); see `supports`."""
    rows, hq, d = q.shape
    hkv = resp_k.shape[1]
    samples = prompt_out.shape[2]
    splits = prompt_out.shape[0] * samples // rows
    rep = hq // hkv
    out = torch.empty_like(q)
    po = prompt_out if prompt_out.stride(-1) == 1 else prompt_out.contiguous()
    pl = prompt_lse
    _kernel[(rows, hkv)](
        q, resp_k, resp_v, step, po, pl, out, scale, samples, splits,
        q.stride(0), q.stride(1), resp_k.stride(0), resp_k.stride(1), resp_k.stride(2),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), pl.stride(2),
        out.stride(0), out.stride(1),
        REP=rep, REP_PAD=max(_MIN_DOT_ROWS, triton.next_power_of_2(rep)), D=d,
        BLOCK_N=_BLOCK_N, SPLITS=min(_SPLITS_A_STEP, triton.next_power_of_2(splits)),
        IEEE=q.dtype == torch.float32, num_warps=4)
    return out


@response_and_merge.register_fake
def _(q, resp_k, resp_v, step, prompt_out, prompt_lse, scale):
    return torch.empty_like(q)
