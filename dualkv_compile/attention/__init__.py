"""Shared-prefix attention: the op (op.py), the kernels it runs (flex with a BlockMask,
block_mask.py; FLASH's causal form, flash_causal.py; dense kernels over the two KV regions,
regions.py and flash_regions.py, merged by log-sum-exp, lse_merge_kernel.py), the choice
between them (selection.py) and the flex kernel options (kernel_options.py).

`shared_prefix_attention` is imported when first read, so that the kernel registry
(registry.py) can be read without importing the kernels."""

from .._lazy import lazy_package as _lazy_package

__all__ = ["shared_prefix_attention"]

_lazy_package(__name__, {"shared_prefix_attention": ".op"})
