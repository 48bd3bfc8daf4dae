"""The log-sum-exp merge: attention over keys A and B from attention over A and over B.

One definition for every path that splits a row's keys into regions: the region kernels
(regions.py; flash_regions.py on its token-major layout, where lse_merge_kernel.py is its fused
CUDA form) and the rollout's decode attention (the prompt region and the response region).
"""

import torch
from torch import Tensor

from ..numerics import accumulation_dtype

__all__ = ["merge_partials"]


def merge_partials(o_x: Tensor, l_x: Tensor, o_own: Tensor,
                   l_own: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmaxes of the same rows -> (out, lse), the softmax over both key regions.
    o_* [..., D], l_* [...] one per row of o_*; computed in float32 (float64 for float64), out
    rounded to o_x's dtype once. One of the two must hold a key (a finite lse)."""
    wide = accumulation_dtype(o_x.dtype)
    l_x, l_own = l_x.to(wide), l_own.to(wide)
    lse = torch.logaddexp(l_x, l_own)
    out = (o_x.to(wide) * (l_x - lse).exp().unsqueeze(-1)
           + o_own.to(wide) * (l_own - lse).exp().unsqueeze(-1))
    return out.to(o_x.dtype), lse
