"""The second half of a decode step's attention: each row against its own response keys,
read only up to the current step, and the merge of everything into each row's output.

Two kernels. The response kernel runs one program per (row, kv head, run of response keys):
the row's query heads of that kv head against the run's keys up to `last` (an online softmax
over blocks of keys; `last` is read on the device, so a captured CUDA graph replays it at any
step, and runs past it exit at once), leaving a softmax-normalised output and its log-sum-exp.
Runs put more programs on the GPU than rows x kv heads, which alone left it latency-bound. The
merge kernel folds the response runs' and the prompt region's partials (prompt.py) per (row,
query head) as blocks of one online softmax: a partial o_s with log-sum-exp lse_s is the block
(o_s * e^lse_s, e^lse_s); an empty one has lse -inf and weight 0. Where the grid is full
without runs (many rows), one run takes all the keys and the response kernel folds the prompt
partials itself: no merge kernel, no response partials.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import MIN_DOT_ROWS, supports, triton

__all__ = ["response_and_merge_op", "keys_per_program"]

if triton is not None:
    import triton.language as tl

    from .softmax import fold_keys, normalise

_BLOCK_N = 64  # response keys per iteration
_NUM_STAGES = 3  # Triton's software pipelining depth of the key loop (its default on CUDA)
_MAX_PROGRAMS = 1024  # runs shorten (from the whole capacity) down to this many programs
_PARTIALS_A_STEP = 8  # partials merged per loop step (their loads overlap)
_FOLDED_A_STEP = 4  # the same in the response kernel ([REP_PAD, 4, D] float32 in registers)

if triton is not None:
    @triton.jit
    def _response_kernel(q_ptr, k_ptr, v_ptr, last_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
                         final_ptr, scale, run_keys, samples, pieces,
                         sq_row, sq_head, sk_row, sk_head, sk_key,
                         so_row, so_run, so_head, se_row, se_run, se_head,
                         spo_piece, spo_head, spo_sample, spl_piece, spl_head, spl_sample,
                         sf_row, sf_head,
                         REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr,
                         BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FINAL: tl.constexpr,
                         PARTIALS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        run = tl.program_id(2).to(tl.int64)
        heads = kvh * REP + tl.arange(0, REP_PAD)  # this kv head's query heads (padded)
        live = tl.arange(0, REP_PAD) < REP
        d = tl.arange(0, D)
        lo = run * run_keys
        hi = tl.minimum(lo + run_keys, tl.load(last_ptr) + 1)
        m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        if lo < hi:
            q = tl.load(q_ptr + row * sq_row + heads[:, None] * sq_head + d[None, :],
                        mask=live[:, None], other=0.0)
            kv = row * sk_row + kvh * sk_head
            for start in range(lo, hi, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)
                valid = keys < hi
                k = tl.load(k_ptr + kv + keys[:, None] * sk_key + d[None, :],
                            mask=valid[:, None], other=0.0)
                m_i, l_i, acc = fold_keys(q, k, v_ptr + kv + keys[:, None] * sk_key + d[None, :],
                                          valid, scale, m_i, l_i, acc, IEEE)
        if FINAL:
            # one run of all the keys: fold the group's prompt partials in here, as blocks of
            # the same online softmax (m_i is finite: key 0 is valid), and write the output;
            # the merge kernel does not run
            group = row // samples
            sample = row % samples
            c = tl.arange(0, PARTIALS)
            for first in range(0, pieces, PARTIALS):
                piece = group * pieces + first + c
                take = live[:, None] & (first + c < pieces)[None, :]
                lse = tl.load(plse_ptr + piece[None, :] * spl_piece + heads[:, None] * spl_head
                              + sample * spl_sample, mask=take, other=float("-inf"))
                o = tl.load(po_ptr + piece[None, :, None] * spo_piece
                            + heads[:, None, None] * spo_head + sample * spo_sample
                            + d[None, None, :], mask=take[:, :, None], other=0.0)
                m_new = tl.maximum(m_i, tl.max(lse, 1))
                alpha = tl.exp(m_i - m_new)
                w = tl.exp(lse - m_new[:, None])
                acc = acc * alpha[:, None] + tl.sum(o.to(tl.float32) * w[:, :, None], 1)
                l_i = l_i * alpha + tl.sum(w, 1)
                m_i = m_new
            tl.store(final_ptr + row * sf_row + heads[:, None] * sf_head + d[None, :],
                     (acc / l_i[:, None]).to(final_ptr.dtype.element_ty), mask=live[:, None])
        else:
            out, lse = normalise(m_i, l_i, acc)
            tl.store(out_ptr + row * so_row + run * so_run + heads[:, None] * so_head
                     + d[None, :], out, mask=live[:, None])
            tl.store(lse_ptr + row * se_row + run * se_run + heads * se_head, lse, mask=live)

    @triton.jit
    def _fold(m_i, l_i, acc, lse, o):
        """Blocks (o * e^lse, e^lse), lse [PARTIALS] and o [PARTIALS, D], into an online
        softmax (scalars m_i, l_i; acc [D])."""
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet
        alpha = tl.exp(m_i - shift)
        w = tl.exp(lse - shift)
        acc = acc * alpha + tl.sum(o.to(tl.float32) * w[:, None], 0)
        return m_new, l_i * alpha + tl.sum(w, 0), acc

    @triton.jit
    def _merge_kernel(ro_ptr, rlse_ptr, po_ptr, plse_ptr, out_ptr, samples, runs, pieces,
                      sro_row, sro_run, sro_head, srl_row, srl_run, srl_head,
                      spo_piece, spo_head, spo_sample, spl_piece, spl_head, spl_sample,
                      so_row, so_head, D: tl.constexpr, PARTIALS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, D)
        c = tl.arange(0, PARTIALS)
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.zeros([], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for first in range(0, runs, PARTIALS):  # the row's response runs
            take = first + c < runs
            at = row * srl_row + (first + c) * srl_run + head * srl_head
            lse = tl.load(rlse_ptr + at, mask=take, other=float("-inf"))
            o = tl.load(ro_ptr + row * sro_row + (first + c)[:, None] * sro_run
                        + head * sro_head + d[None, :], mask=take[:, None], other=0.0)
            m_i, l_i, acc = _fold(m_i, l_i, acc, lse, o)
        group = row // samples
        sample = row % samples
        for first in range(0, pieces, PARTIALS):  # the group's prompt partials
            piece = group * pieces + first + c
            take = first + c < pieces
            lse = tl.load(plse_ptr + piece * spl_piece + head * spl_head + sample * spl_sample,
                          mask=take, other=float("-inf"))
            o = tl.load(po_ptr + piece[:, None] * spo_piece + head * spo_head
                        + sample * spo_sample + d[None, :], mask=take[:, None], other=0.0)
            m_i, l_i, acc = _fold(m_i, l_i, acc, lse, o)
        out = acc / l_i  # l_i > 0: response key 0 is always valid
        tl.store(out_ptr + row * so_row + head * so_head + d, out.to(out_ptr.dtype.element_ty))


def keys_per_program(rows: int, kv_heads: int, capacity: int) -> int:
    """The shortest run of response keys (64 x a power of two) whose grid (rows x kv heads x
    runs over the capacity) stays within _MAX_PROGRAMS."""
    run = _BLOCK_N
    while run < capacity and rows * kv_heads * -(-capacity // run) > _MAX_PROGRAMS:
        run *= 2
    return run


@torch.library.custom_op("dualkv::response_and_merge", mutates_args=())
def response_and_merge_op(q: Tensor, resp_k: Tensor, resp_v: Tensor, last: Tensor,
                          prompt_out: Tensor, prompt_lse: Tensor, scale: float) -> Tensor:
    """q [rows, Hq, D]; resp_k/v [rows, Hkv, R, D] with keys 0..last valid (`last` a 0-d
    device tensor, >= 0); the prompt region's partials prompt_out [G * S, Hq, N, D] and
    prompt_lse [G * S, Hq, N] (rows group-major: row r is sample r % N of group r // N; S
    partials per group). -> the attention over both regions, [rows, Hq, D] in q's dtype. An
    opaque op in compiled graphs (the step's CUDA graph captures its launches); see
    kernels.supports."""
    rows, hq, d = q.shape
    hkv, capacity = resp_k.shape[1], resp_k.shape[2]
    pieces_all, _, samples = prompt_lse.shape
    torch._check(supports(q, resp_k, resp_v), lambda: "see rollout.kernels.supports")
    torch._check(last.device == q.device and prompt_lse.device == q.device,
                 lambda: f"last ({last.device}) and the prompt partials "
                         f"({prompt_lse.device}) must be on q's device {q.device}")
    torch._check(hq % hkv == 0 and rows % samples == 0 and (pieces_all * samples) % rows == 0,
                 lambda: f"q {tuple(q.shape)}, resp_k {tuple(resp_k.shape)} and prompt_lse "
                         f"{tuple(prompt_lse.shape)} do not describe one layout")
    torch._check(prompt_out.shape == (*prompt_lse.shape[:2], samples, d),
                 lambda: f"prompt_out {tuple(prompt_out.shape)} does not match prompt_lse")
    pieces = pieces_all * samples // rows
    rep = hq // hkv
    run_keys = keys_per_program(rows, hkv, capacity)
    runs = -(-capacity // run_keys)
    final = runs == 1  # the response kernel merges, where one run takes all the keys
    # the response partials (none are written when the response kernel merges)
    ro = torch.empty((rows, runs, hq, d) if not final else (1, 1, 1, 1), dtype=torch.float32,
                     device=q.device)
    rl = torch.empty((rows, runs, hq) if not final else (1, 1, 1), dtype=torch.float32,
                     device=q.device)
    out = torch.empty_like(q)
    po = prompt_out if prompt_out.stride(-1) == 1 else prompt_out.contiguous()
    pl = prompt_lse
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _response_kernel[(rows, hkv, runs)](
            q, resp_k, resp_v, last, ro, rl, po, pl, out, scale, run_keys, samples, pieces,
            q.stride(0), q.stride(1), *resp_k.stride()[:3], *ro.stride()[:3], *rl.stride(),
            *po.stride()[:3], *pl.stride(), out.stride(0), out.stride(1),
            REP=rep, REP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(rep)), D=d,
            BLOCK_N=_BLOCK_N, IEEE=q.dtype == torch.float32, FINAL=final,
            PARTIALS=min(_FOLDED_A_STEP, triton.next_power_of_2(pieces)),
            num_warps=4, num_stages=_NUM_STAGES)
        if not final:
            _merge_kernel[(rows, hq)](
                ro, rl, po, pl, out, samples, runs, pieces, *ro.stride()[:3], *rl.stride(),
                *po.stride()[:3], *pl.stride(), out.stride(0), out.stride(1), D=d,
                PARTIALS=min(_PARTIALS_A_STEP, triton.next_power_of_2(max(runs, pieces))),
                num_warps=2)
    return out


@response_and_merge_op.register_fake
def _(q, resp_k, resp_v, last, prompt_out, prompt_lse, scale):
    return torch.empty_like(q)
