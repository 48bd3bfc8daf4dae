"""Shared-prefix attention: the op (op.py), the kernels it runs (flex with a BlockMask,
block_mask.py; FLASH's causal form, flash_causal.py; dense kernels over the two KV regions,
regions.py and flash_regions.py, merged by log-sum-exp, lse_merge_kernel.py), the choice
between them (selection.py) and the flex kernel options (kernel_options.py)."""

from .op import shared_prefix_attention

__all__ = ["shared_prefix_attention"]
