"""The first kernel of a decode step's attention: the prompt region, each group's prompt K/V
read once for all of the group's rows.

The cache stores a group's prompt K/V as [G, S, Hkv, C, D] (S splits of C keys; the engine
allocates S = 1 for these kernels, which split the keys themselves). One program takes a run of
`keys_per_program` keys of one split, one group and one kv head, and puts all the queries that
meet them on one tile: the group's N rows x the kv head's query heads (N = 32 rows x 4 heads =
128 queries at Qwen3-8B's GQA), so the keys are read once where flex's decoding kernel, whose
tiles spill beyond 64 queries, reads them once per 64. It writes a softmax-normalised output
and its log-sum-exp per query, one partial per program, which response.py folds into each
row's output. A run past the prompt's end holds no valid key: its program writes output 0 and
log-sum-exp -inf (merge weight 0).

The run length trades programs for partials: longer runs write fewer partials for the merge
to read, more programs fill the GPU (`keys_per_program`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import MIN_DOT_ROWS, supports, triton

__all__ = ["keys_per_program", "prompt_partials_op"]

if triton is not None:
    import triton.language as tl

    from .softmax import fold_keys, normalise

_BLOCK_N = 64  # keys per iteration
_NUM_STAGES = 3  # Triton's software pipelining depth of the key loop (its default on CUDA)
_MAX_TILE = 128  # queries per program (more: further programs on the grid's third axis)
# runs grow while the grid keeps this many programs: half an H100's SMs, each of 8 warps at
# 128 queries (fewer, longer runs leave fewer partials to merge; measured: performance.md)
_MIN_PROGRAMS = 66

if triton is not None:
    @triton.jit
    def _kernel(q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, lse_ptr, scale,
                samples, splits, runs_per_split, run_keys,
                sq_row, sq_head, sk_group, sk_split, sk_head, sk_key, sl_group,
                so_piece, so_head, so_sample, se_piece, se_head, se_sample,
                REP: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        piece = tl.program_id(0).to(tl.int64)  # (group, split, run of the split), row-major
        kvh = tl.program_id(1).to(tl.int64)
        group = piece // (splits * runs_per_split)
        split = piece // runs_per_split % splits
        lo = piece % runs_per_split * run_keys
        hi = tl.minimum(lo + run_keys, tl.load(len_ptr + group * sl_group + split))
        # query m of the tile: sample m // REP of the group, query head m % REP of the kv head
        m = tl.program_id(2) * TILE + tl.arange(0, TILE)
        sample = m // REP
        head = kvh * REP + m % REP
        live = sample < samples
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (group * samples + sample)[:, None] * sq_row
                    + head[:, None] * sq_head + d[None, :], mask=live[:, None], other=0.0)
        m_i = tl.full([TILE], float("-inf"), tl.float32)
        l_i = tl.zeros([TILE], tl.float32)
        acc = tl.zeros([TILE, D], tl.float32)
        base = group * sk_group + split * sk_split + kvh * sk_head
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            valid = keys < hi
            kv = base + keys * sk_key
            k = tl.load(k_ptr + kv[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = fold_keys(q, k, v_ptr + kv[:, None] + d[None, :], valid, scale,
                                      m_i, l_i, acc, IEEE)
        out, lse = normalise(m_i, l_i, acc)
        tl.store(out_ptr + piece * so_piece + head[:, None] * so_head
                 + sample[:, None] * so_sample + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(lse_ptr + piece * se_piece + head * se_head + sample * se_sample, lse, mask=live)


def _tile(queries: int) -> int:
    return min(_MAX_TILE, max(MIN_DOT_ROWS, triton.next_power_of_2(queries)))


def keys_per_program(groups: int, splits: int, chunk: int, kv_heads: int, queries: int) -> int:
    """The longest run of keys (64 x a power of two, at most the first that covers a whole
    split) whose grid (groups x splits x runs a split x kv heads x query tiles) keeps
    _MIN_PROGRAMS programs."""
    tiles = -(-queries // _tile(queries))
    run = _BLOCK_N
    while run < chunk and groups * splits * -(-chunk // (2 * run)) * kv_heads * tiles \
            >= _MIN_PROGRAMS:
        run *= 2
    return run


@torch.library.custom_op("dualkv::prompt_partials", mutates_args=())
def prompt_partials_op(q: Tensor, prompt_k: Tensor, prompt_v: Tensor, prompt_len: Tensor,
                       scale: float, run_keys: int) -> tuple[Tensor, Tensor]:
    """q [rows, Hq, D] (rows group-major); prompt_k/v [G, S, Hkv, C, D]; prompt_len [G, S]
    valid keys per split (a prefix of each, at most C: `attention.split_lengths`), on q's
    device; runs of `run_keys` keys a program. -> the prompt
    region's partials: outputs [G * S', Hq, N, D] in q's dtype and log-sum-exps [G * S', Hq,
    N] float32, S' = S x ceil(C / run_keys), the layout response.py takes."""
    rows, hq, d = q.shape
    groups, splits, hkv, chunk, _ = prompt_k.shape
    torch._check(supports(q, prompt_k, prompt_v), lambda: "see rollout.kernels.supports")
    torch._check(prompt_len.device == q.device,
                 lambda: f"prompt_len is on {prompt_len.device}, q on {q.device}")
    torch._check(hq % hkv == 0 and rows % groups == 0 and run_keys >= 1
                 and prompt_len.shape == (groups, splits),
                 lambda: f"q {tuple(q.shape)}, prompt_k {tuple(prompt_k.shape)}, prompt_len "
                         f"{tuple(prompt_len.shape)} and run_keys={run_keys} do not describe "
                         f"one layout")
    samples, rep = rows // groups, hq // hkv
    runs = -(-chunk // run_keys)
    out = q.new_empty(groups * splits * runs, hq, samples, d)
    lse = torch.empty(out.shape[:3], dtype=torch.float32, device=q.device)
    tile = _tile(samples * rep)
    lens = prompt_len.contiguous()
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _kernel[(out.shape[0], hkv, -(-samples * rep // tile))](
            q, prompt_k, prompt_v, lens, out, lse, scale, samples, splits, runs, run_keys,
            q.stride(0), q.stride(1), *prompt_k.stride()[:4], lens.stride(0),
            *out.stride()[:3], *lse.stride(),
            REP=rep, TILE=tile, D=d, BLOCK_N=_BLOCK_N, IEEE=q.dtype == torch.float32,
            num_warps=8 if tile >= 128 else 4, num_stages=_NUM_STAGES)
    return out, lse


@prompt_partials_op.register_fake
def _(q, prompt_k, prompt_v, prompt_len, scale, run_keys):
    rows, hq, d = q.shape
    groups, splits, _, chunk, _ = prompt_k.shape
    pieces = groups * splits * -(-chunk // run_keys)
    return (q.new_empty(pieces, hq, rows // groups, d),
            q.new_empty(pieces, hq, rows // groups, dtype=torch.float32))
