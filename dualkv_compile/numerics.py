"""The one precision rule the exact paths share."""

import torch

__all__ = ["accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where softmax statistics, log-sum-exps and sums are accumulated: float32 for bf16, fp16
    and float32 inputs, float64 for float64 (so the CPU fp64 checks stay exact)."""
    return torch.promote_types(dtype, torch.float32)
