"""A Triton kernel for the second half of a decode step's attention: each row against its own
response keys, read only up to the current step, merged with the prompt region's split
partials, in one pass.

The prompt region (attention.py) leaves, per group and key split, a softmax-normalised output
and its log-sum-exp for each of the group's rows. This kernel runs one program per (row, kv
head): the row's query heads of that kv head against the row's response keys 0..last (an
online softmax over blocks of keys; `last` is read on the device, so a captured CUDA graph
replays it at any step), then folds in the prompt's splits as further blocks of the same
online softmax, and writes the final output. attention.py's other form of this half, a second
flex call and two merges, reads all R cache slots and runs as three kernels
(docs/performance.md, "Rollout").

The explicit math in attention.py (`implementation="math"`) is the reference; on the CPU the
kernel runs only under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

__all__ = ["response_and_merge_op", "status", "supports"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the math path runs instead
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tensors run (the tests)
_BLOCK_N = 64  # response keys per iteration
_MIN_DOT_ROWS = 16  # tl.dot's smallest M: a kv head's query heads are padded up to it
_SPLITS_A_STEP = 4  # prompt splits merged per loop step ([REP_PAD, 4, D] float32 in registers)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:
    @triton.jit
    def _kernel(q_ptr, k_ptr, v_ptr, last_ptr, po_ptr, plse_ptr, out_ptr, scale,
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
        last = tl.load(last_ptr)
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
        # (o_s * e^lse_s, e^lse_s) of the same online softmax. An empty split has lse -inf and
        # weight 0, as m_i is finite here (key 0 of the response is always valid). SPLITS
        # splits a loop step, so that their loads overlap.
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


def status(device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """(runs, reason) of the kernel for q/K/V of `dtype` and `head_dim` on `device`."""
    if triton is None:
        return False, "Triton is not installed"
    if device.type != "cuda" and not _INTERPRETED:
        return False, f"the kernel runs on CUDA, not {device}"
    if dtype not in DTYPES:
        return False, f"the kernel computes bf16, fp16 or fp32, not {dtype}"
    if head_dim < 16 or head_dim != triton.next_power_of_2(head_dim):
        return False, f"head dim {head_dim} is not a power of two >= 16"
    return True, "Triton kernel"


def supports(q: Tensor, resp_k: Tensor, resp_v: Tensor) -> bool:
    """True where the kernel runs on these tensors: `status`, one dtype, each row's head dim
    contiguous, K and V laid out alike (the engine's cache always is)."""
    return (status(q.device, q.shape[-1], q.dtype)[0] and q.dtype == resp_k.dtype == resp_v.dtype
            and q.stride(-1) == 1 and resp_k.stride(-1) == 1 and resp_k.stride() == resp_v.stride())


@torch.library.custom_op("dualkv::response_and_merge", mutates_args=())
def response_and_merge_op(q: Tensor, resp_k: Tensor, resp_v: Tensor, last: Tensor,
                          prompt_out: Tensor, prompt_lse: Tensor, scale: float) -> Tensor:
    """q [rows, Hq, D]; resp_k/v [rows, Hkv, R, D] with keys 0..last valid (`last` a 0-d
    device tensor, >= 0); the prompt region's partials prompt_out [G * S, Hq, N, D] and
    prompt_lse [G * S, Hq, N] (rows group-major: row r is sample r % N of group r // N; S
    splits per group). -> the attention over both regions, [rows, Hq, D] in q's dtype. An
    opaque op in compiled graphs (the step's CUDA graph captures its launch); see `supports`."""
    rows, hq, d = q.shape
    hkv = resp_k.shape[1]
    pieces, _, samples = prompt_lse.shape
    torch._check(supports(q, resp_k, resp_v), lambda: "see response_kernel.supports")
    torch._check(hq % hkv == 0 and rows % samples == 0 and (pieces * samples) % rows == 0,
                 lambda: f"q {tuple(q.shape)}, resp_k {tuple(resp_k.shape)} and prompt_lse "
                         f"{tuple(prompt_lse.shape)} do not describe one layout")
    torch._check(prompt_out.shape == (*prompt_lse.shape[:2], samples, d),
                 lambda: f"prompt_out {tuple(prompt_out.shape)} does not match prompt_lse")
    splits = pieces * samples // rows
    rep = hq // hkv
    out = torch.empty_like(q)
    po = prompt_out if prompt_out.stride(-1) == 1 else prompt_out.contiguous()
    pl = prompt_lse
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _kernel[(rows, hkv)](
            q, resp_k, resp_v, last, po, pl, out, scale, samples, splits,
            q.stride(0), q.stride(1), resp_k.stride(0), resp_k.stride(1), resp_k.stride(2),
            po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), pl.stride(2),
            out.stride(0), out.stride(1),
            REP=rep, REP_PAD=max(_MIN_DOT_ROWS, triton.next_power_of_2(rep)), D=d,
            BLOCK_N=_BLOCK_N, SPLITS=min(_SPLITS_A_STEP, triton.next_power_of_2(splits)),
            IEEE=q.dtype == torch.float32, num_warps=4)
    return out


@response_and_merge_op.register_fake
def _(q, resp_k, resp_v, last, prompt_out, prompt_lse, scale):
    return torch.empty_like(q)
