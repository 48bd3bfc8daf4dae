"""A Triton kernel that merges two partial softmaxes of the same rows by log-sum-exp, in place.

`flash_regions._merge_into_eager` is the reference (and the CPU path). The rows' outputs are
token-major ([L, H, D]) and their log-sum-exps head-major ([H, L], FA4's layout, a strided view
into the [H, T] buffer). Inductor's version of the merge reads the log-sum-exps transposed
and writes the views back in separate passes; this kernel reads each log-sum-exp once per
(row block, head) and each output row once (docs/performance.md has the timings).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_into", "supports"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the SDPA-per-segment path runs instead
    triton = None

_ROWS, _WARPS = 32, 4

if triton is not None:
    @triton.jit
    def _merge_kernel(out_ptr, lse_ptr, out_x_ptr, lse_x_ptr, rows, out_row_stride,
                      out_x_row_stride, lse_head_stride, lse_x_head_stride,
                      D: tl.constexpr, ROWS: tl.constexpr):
        h = tl.program_id(1).to(tl.int64)
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = r < rows
        l_own = tl.load(lse_ptr + h * lse_head_stride + r, mask=live, other=0.0)
        l_x = tl.load(lse_x_ptr + h * lse_x_head_stride + r, mask=live, other=0.0)
        m = tl.maximum(l_own, l_x)
        merged = m + tl.log(tl.exp(l_own - m) + tl.exp(l_x - m))
        w_own = tl.exp(l_own - merged)[:, None]
        w_x = tl.exp(l_x - merged)[:, None]
        d = tl.arange(0, D)[None, :]
        own = out_ptr + r[:, None] * out_row_stride + h * D + d
        cross = out_x_ptr + r[:, None] * out_x_row_stride + h * D + d
        o = (tl.load(own, mask=live[:, None]).to(tl.float32) * w_own
             + tl.load(cross, mask=live[:, None]).to(tl.float32) * w_x)
        tl.store(own, o.to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(lse_ptr + h * lse_head_stride + r, merged, mask=live)


def supports(out: Tensor, lse: Tensor, out_x: Tensor, lse_x: Tensor) -> bool:
    """True where the kernel runs: CUDA; outputs [L, H, D] with each row's heads contiguous
    (D a power of two), float32 log-sum-exps [H, L] contiguous along the rows."""
    d = out.shape[-1]
    return (triton is not None and out.is_cuda and out.dim() == 3 and d == triton.next_power_of_2(d)
            and out.stride()[1:] == (d, 1) and out_x.stride()[1:] == (d, 1)
            and lse.dtype == lse_x.dtype == torch.float32
            and lse.stride(1) == 1 and lse_x.stride(1) == 1)


def merge_into(out: Tensor, lse: Tensor, out_x: Tensor, lse_x: Tensor) -> None:
    """out [L, H, D], lse [H, L] become the softmax over both parts; out_x, lse_x are the other
    part's. Rows must have a finite log-sum-exp in at least one part. See `supports`."""
    rows, heads, d = out.shape
    grid = (triton.cdiv(rows, _ROWS), heads)
    _merge_kernel[grid](out, lse, out_x, lse_x, rows, out.stride(0), out_x.stride(0),
                        lse.stride(0), lse_x.stride(0), D=d, ROWS=_ROWS, num_warps=_WARPS)
