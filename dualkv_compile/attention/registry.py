"""Every attention kernel `DualKVConfig.attention_backend` can name, declared once.

Code asks the registry what a kernel is (a flex kernel that reads the shared-prefix BlockMask
and takes kernel_options, or an opaque op over the two KV regions; whether it has a CPU form)
instead of comparing names. Each entry says where a committed benchmark shows it winning
(docs/performance.md), which is why it is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionKernel", "KERNELS", "FLEX_KERNELS", "attention_kernel"]


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    flex: bool          # FlexAttention over the shared-prefix BlockMask; takes kernel_options
    cuda_only: bool     # no CPU form: refused for a model on the CPU
    op_name: str | None  # torch.ops.dualkv.<op_name>: the opaque op a region kernel runs
    kept_because: str

    def graph_op(self):
        """The opaque op a region kernel runs, eagerly and in compiled graphs (registered by
        regions.py and flash_regions.py, which the package imports)."""
        if self.op_name is None:
            raise ValueError(f"attention_backend={self.name!r} is a flex kernel, not an op")
        return getattr(torch.ops.dualkv, self.op_name)


KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (
    AttentionKernel("auto", flex=True, cuda_only=False, op_name=None,
                    kept_because="the default: FLASH where flash-attn-4 runs, else Triton; the "
                                 "CPU reference on the CPU"),
    AttentionKernel("flash", flex=True, cuda_only=True, op_name=None,
                    kept_because="flex lowered to flash-attn-4: 1.08-1.13x the ideal pair "
                                 "reduction against cuDNN dense on aligned layouts (H100)"),
    AttentionKernel("triton", flex=True, cuda_only=True, op_name=None,
                    kept_because="Inductor's flex template: the flex kernel wherever "
                                 "flash-attn-4 does not run (fp32, other head dims, other GPUs)"),
    AttentionKernel("regions", flex=False, cuda_only=False, op_name="regions_attention",
                    kept_because="dense cuDNN calls over the two KV regions: 0.86-0.98x the "
                                 "ideal where Triton flex reaches 0.73-0.76x (H100, no FA4)"),
    AttentionKernel("flash_regions", flex=False, cuda_only=False,
                    op_name="flash_regions_attention",
                    kept_because="flash-attn-4's dense kernels over the two regions: the "
                                 "fastest policy update at (32, 8K, 1K), 1052 vs 1061 ms "
                                 "(60.3% useful MFU, H100)"),
)}
FLEX_KERNELS = tuple(name for name, k in KERNELS.items() if k.flex)


def attention_kernel(name: str) -> AttentionKernel:
    """The kernel `name` (a DualKVConfig.attention_backend value), or a ValueError naming the
    choices."""
    try:
        return KERNELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"attention_backend={name!r} is not one of {tuple(KERNELS)}") from None
