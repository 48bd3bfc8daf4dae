"""Decode attention over the two KV regions: the group's prompt (stored once) and the row's own
response, merged by log-sum-exp.

One decode step has one query per row. Rows are laid out group-major: row r belongs to group
r // N. The prompt region puts a group's N rows on the query axis, so the group's prompt keys
are read once for all of them (cascade / Hydragen); the response region is each row against its
own keys. Each part returns its softmax-normalised output and log-sum-exp; the merge weights
each by its share of the total mass, which equals attention over the union of the keys.

The prompt K/V are stored split along the keys, [G, S, Hkv, C, D] (S splits of C keys), and
the S splits run as S batch entries (split-KV, as decode kernels do): one group's prompt gives
S x Hkv independent pieces of work instead of Hkv, enough to fill a GPU. A split beyond the
prompt's length has no valid key: its log-sum-exp is -inf, its output 0, its merge weight 0.

Three implementations with one meaning:
- "math": explicit einsum + masked softmax in float32 (float64 stays float64); the reference
  the tests hold the others to, and the CPU path.
- "triton": Triton kernels (kernels/): the prompt region's partials, one program reading a run
  of a group's prompt keys once for all its rows' queries; each row against runs of its
  response keys up to the step; one merge of all partials. They split the keys themselves
  (the engine stores their prompts in one split). CUDA only, and the default there (the
  fastest: docs/performance.md, "Rollout").
- "flex": FlexAttention for both regions, with the lengths as score_mods (no BlockMask),
  lowered by Inductor (its decoding kernel) inside the compiled step, and Inductor's merges.
  CUDA only; where the Triton kernels cannot run (kernels.status says why).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention.merge import merge_partials
from ..numerics import accumulation_dtype
from . import kernels
from .kernels import prompt as prompt_kernel
from .kernels import response as response_kernel

__all__ = ["decode_attention", "split_lengths", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("math", "triton", "flex")
# flex's decoding kernel puts all of a kv head's queries (rows x query heads per kv head) in
# one tile of that many rows by default, and spills registers beyond 64 rows (an order of
# magnitude slower); larger query sets are cut into tiles of 64
_PROMPT_TILE_ROWS = 64
_PROMPT_NUM_WARPS = 4


def _merge_splits(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """out [G, S, ..., D], lse [G, S, ...] -> the merge over S: [G, ..., D], [G, ...]."""
    total = torch.logsumexp(lse, dim=1)
    weight = torch.exp(lse - total.unsqueeze(1)).unsqueeze(-1)
    return (out * weight).sum(1), total


def split_lengths(prompt_len: Tensor, splits: int, chunk: int) -> Tensor:
    """[G] valid prompt keys -> [G, S] valid keys of each split of `chunk` keys."""
    starts = torch.arange(splits, device=prompt_len.device) * chunk
    return (prompt_len[:, None] - starts).clamp(0, chunk)


def _lengths(prompt_len: Tensor, splits: int, chunk: int) -> Tensor:
    return prompt_len if prompt_len.dim() == 2 else split_lengths(prompt_len, splits, chunk)


def _math_region(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float):
    """q [B, Hkv, M, D] against k, v [B, Hkv, S, D]; valid broadcasts to [B, 1, M, S].
    Scores and softmax in float32 (float64 stays float64); bf16/fp16 probabilities meet V in
    its own dtype with float32 accumulation, as flash kernels do. A row with no valid key gets
    output 0 and log-sum-exp -inf."""
    wide = accumulation_dtype(q.dtype)
    s = torch.einsum("bhmd,bhsd->bhms", q.to(wide), k.to(wide)) * scale
    s = s.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    low = v.dtype in (torch.bfloat16, torch.float16)
    out = torch.einsum("bhms,bhsd->bhmd", p.to(v.dtype) if low else p, v if low else v.to(wide))
    return out.to(wide), lse


def _math(q, prompt_k, prompt_v, prompt_len, resp_k, resp_v, last, scale):
    rows, hq, d = q.shape
    groups, splits, hkv, chunk, _ = prompt_k.shape
    n, rep = rows // groups, hq // hkv
    # prompt: the group's N rows x rep heads on the query axis of its kv head, per split
    qp = q.view(groups, n, hkv, rep, d).permute(0, 2, 1, 3, 4).reshape(groups, 1, hkv, n * rep, d)
    qp = qp.expand(groups, splits, hkv, n * rep, d).reshape(groups * splits, hkv, n * rep, d)
    lengths = _lengths(prompt_len, splits, chunk).reshape(groups * splits, 1, 1, 1)
    valid = torch.arange(chunk, device=q.device) < lengths
    out_p, lse_p = _math_region(qp, prompt_k.flatten(0, 1), prompt_v.flatten(0, 1), valid, scale)
    out_p, lse_p = _merge_splits(out_p.view(groups, splits, hkv, n, rep, d),
                                 lse_p.view(groups, splits, hkv, n, rep))
    out_p = out_p.permute(0, 2, 1, 3, 4).reshape(rows, hq, d)
    lse_p = lse_p.permute(0, 2, 1, 3).reshape(rows, hq)
    # response: each row's rep heads of a kv head against that row's keys up to `last`
    cols = torch.arange(resp_k.shape[2], device=q.device)
    out_r, lse_r = _math_region(q.view(rows, hkv, rep, d), resp_k, resp_v,
                                (cols <= last)[None, None, None, :], scale)
    return merge_partials(out_p, lse_p, out_r.reshape(rows, hq, d), lse_r.reshape(rows, hq))[0]


def _prompt_kernel_options(queries_per_kv_head: int) -> dict:
    """Inductor kernel options of the prompt region's flex call (decoding kernel)."""
    tile = min(_PROMPT_TILE_ROWS, max(16, 1 << (queries_per_kv_head - 1).bit_length()))
    return {"BLOCK_M": tile, "num_warps": _PROMPT_NUM_WARPS}


def _triton(q, prompt_k, prompt_v, prompt_len, resp_k, resp_v, last, scale):
    groups, splits, hkv, chunk = prompt_k.shape[:4]
    run = prompt_kernel.keys_per_program(groups, splits, chunk, hkv,
                                         q.shape[0] // groups * (q.shape[1] // hkv))
    out_p, lse_p = prompt_kernel.prompt_partials_op(
        q, prompt_k, prompt_v, _lengths(prompt_len, splits, chunk), scale, run)
    return response_kernel.response_and_merge_op(q, resp_k, resp_v, last, out_p, lse_p, scale)


def _flex(q, prompt_k, prompt_v, prompt_len, resp_k, resp_v, last, scale):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    rows, hq, d = q.shape
    groups, splits, hkv, chunk, _ = prompt_k.shape
    n = rows // groups
    lengths = _lengths(prompt_len, splits, chunk).flatten()

    def in_prompt(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx < lengths[b], score, float("-inf"))

    def in_response(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= last, score, float("-inf"))

    # [G * S, Hq, N, D]: the group's rows as queries, once per split
    qp = q.view(groups, 1, n, hq, d).expand(groups, splits, n, hq, d).reshape(
        groups * splits, n, hq, d).transpose(1, 2)
    out_p, aux_p = flex_attention(qp, prompt_k.flatten(0, 1), prompt_v.flatten(0, 1),
                                  score_mod=in_prompt, scale=scale, enable_gqa=True,
                                  return_aux=AuxRequest(lse=True),
                                  kernel_options=_prompt_kernel_options(n * hq // hkv))
    wide = accumulation_dtype(q.dtype)
    out_p, lse_p = _merge_splits(out_p.view(groups, splits, hq, n, d).to(wide),
                                 aux_p.lse.view(groups, splits, hq, n).to(wide))
    out_r, aux_r = flex_attention(q.unsqueeze(2), resp_k, resp_v, score_mod=in_response,
                                  scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return merge_partials(out_p.transpose(1, 2).reshape(rows, hq, d),
                          lse_p.transpose(1, 2).reshape(rows, hq),
                          out_r[:, :, 0].to(wide), aux_r.lse[:, :, 0].to(wide))[0]


_IMPLEMENTATION = {"math": _math, "triton": _triton, "flex": _flex}


def decode_attention(q: Tensor, prompt_k: Tensor, prompt_v: Tensor, prompt_len: Tensor,
                     resp_k: Tensor, resp_v: Tensor, last: Tensor, *, scale: float,
                     implementation: str = "math") -> Tensor:
    """One decode step's attention.

    q [rows, Hq, D] (rows group-major, N = rows / G per group); prompt_k/v [G, S, Hkv, C, D]
    (the group's prompt keys in S splits of C: key j at split j // C, index j % C) with
    prompt_len [G] valid keys each, or [G, S] valid keys per split (split_lengths; the engine
    passes these, computed once per rollout: computed inside the compiled step, Inductor
    inlined them into flex's score_mod and failed to compile it for some shapes on torch
    2.11); resp_k/v [rows, Hkv, R, D] with keys 0..last valid (`last` a 0-d tensor: the index
    the current token was just written at). Returns [rows, Hq, D] in q's dtype.
    """
    if implementation not in _IMPLEMENTATION:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    if implementation == "triton" and not kernels.supports(q, prompt_k, prompt_v, resp_k, resp_v):
        runs, why = kernels.status(q.device, q.shape[-1], q.dtype)
        raise ValueError("implementation='triton' cannot run here: " + (
            why if not runs else "q and the K/V caches differ in dtype or layout"))
    attend = _IMPLEMENTATION[implementation]
    return attend(q, prompt_k, prompt_v, prompt_len, resp_k, resp_v, last, scale).to(q.dtype)
