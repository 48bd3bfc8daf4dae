"""A Triton kernel for the LM head's per-chunk statistics: log-sum-exp and the target's logprob.

`logprobs._chunk_stats` is the reference (and the CPU path). Inductor compiles its
`torch.logsumexp` over a [chunk, vocab] block into a two-pass row reduction (the max, then the
sum of exponentials), and a row of 151,936 logits is too long for the second pass to find it
in L2: it reads the logits from memory twice. This kernel reads each logit once, keeping a
running maximum and the sum of exponentials scaled to it, block by block (the online
log-sum-exp), and picks the target's logit with one load. Same math in float32; only the
order of the summation differs from the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_stats", "supports"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None


def supports(logits: Tensor) -> bool:
    """True where the kernel runs: CUDA, 16- or 32-bit floating logits, rows contiguous."""
    return (triton is not None and logits.is_cuda and logits.dim() == 2
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and logits.stride(1) == 1 and logits.shape[0] > 0 and logits.shape[1] > 0)


# Fixed, not autotuned: the block length sets the order of the summation, so autotuning in
# each process could change the low bits of the results from run to run. These are what
# Triton's autotuner picked at Qwen's vocabulary (docs/performance.md, the LM head).
_MAX_BLOCK, _WARPS = 8192, 8

if triton is not None:
    @triton.jit
    def _stats_kernel(logits_ptr, targets_ptr, temperature_ptr, logprob_ptr, lse_ptr,
                      vocab, row_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        t = tl.load(temperature_ptr)
        m = tl.full((), float("-inf"), tl.float32)  # running maximum of the row
        s = tl.zeros((), tl.float32)  # sum of exp(z - m) so far
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) / t
            m_new = tl.maximum(m, tl.max(z, 0))
            # an infinite maximum (a block of -inf logits so far, or a +inf logit) is not
            # subtracted: inf - inf would be NaN where the reference gives -inf or +inf
            shift = tl.where((m_new == float("inf")) | (m_new == float("-inf")), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), 0)
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(targets_ptr + row)
        picked = tl.load(base + target).to(tl.float32) / t
        tl.store(lse_ptr + row, lse)
        tl.store(logprob_ptr + row, picked - lse)


def chunk_stats(logits: Tensor, targets: Tensor, temperature: Tensor) -> tuple[Tensor, Tensor]:
    """logits [c, V], targets [c] (in range; the caller checks), temperature 0-d float32 on the
    same device -> (logprob of each target, logsumexp), both [c] float32. See `supports`."""
    c, vocab = logits.shape
    targets = targets.contiguous()  # read at row * 1
    logprob = torch.empty(c, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logprob)
    block = min(_MAX_BLOCK, triton.next_power_of_2(vocab))
    _stats_kernel[(c,)](logits, targets, temperature, logprob, lse, vocab, logits.stride(0),
                        BLOCK=block, num_warps=_WARPS if block >= 4096 else 4)
    return logprob, lse
