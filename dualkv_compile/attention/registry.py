"""Every attention kernel `DualKVConfig.attention_backend` can name, declared once.

Code asks the registry what a kernel is (a flex kernel that reads the shared-prefix BlockMask
and takes kernel_options, or an opaque op over the two KV regions; whether it has a CPU form)
instead of comparing names. Each entry says where a committed benchmark shows it winning
(docs/performance.md), which is why it is kept.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

__all__ = ["AttentionKernel", "CUDNN_DTYPES", "KERNELS", "FLEX_KERNELS", "attention_kernel"]


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    flex: bool          # FlexAttention over the shared-prefix BlockMask; takes kernel_options
    cuda_only: bool     # no CPU form: refused for a model on the CPU
    op_name: str | None  # torch.ops.dualkv.<op_name>: the opaque op a region kernel runs
    runs_on: str | None  # what its CUDA form needs: "flash-attn-4", "cudnn" or nothing more
    cuda_form: str      # what runs, for the CLI
    cpu_form: str | None
    kept_because: str
    eager_call: str | None = None  # "module:function" an eager call runs instead of the op

    def graph_op(self):
        """The opaque op a region kernel runs, eagerly and in compiled graphs (registered by
        region_ops.py and flash_regions.py, which op.py imports: a caller imports op.py first;
        no import here, which a compiled caller would trace)."""
        if self.op_name is None:
            raise ValueError(f"attention_backend={self.name!r} is a flex kernel, not an op")
        return getattr(torch.ops.dualkv, self.op_name)

    def eager(self):
        """The function an eager (uncompiled) call runs, or None: the graph op."""
        if self.eager_call is None:
            return None
        module, function = self.eager_call.split(":")
        return getattr(importlib.import_module(module), function)

    def cuda_status(self, device: torch.device, head_dim: int | None = None,
                    dtype: torch.dtype | None = None) -> tuple[bool, str]:
        """(runs, reason) of this kernel's CUDA form on `device` for `head_dim` and `dtype`."""
        if self.runs_on == "flash-attn-4":
            from .selection import flash_status

            return flash_status(device, head_dim, dtype)
        if self.runs_on == "cudnn" and dtype is not None and dtype not in CUDNN_DTYPES:
            return False, f"cuDNN computes in bf16/fp16, not {dtype}"
        return True, self.cuda_form


CUDNN_DTYPES = (torch.bfloat16, torch.float16)  # what cuDNN's attention computes in

KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (
    AttentionKernel("auto", flex=True, cuda_only=False, op_name=None, runs_on=None,
                    cuda_form="flex: FLASH or Triton, from the measurements for the GPU",
                    cpu_form="in optimize(), flex's reference math under aot_eager, which holds "
                             "[heads, T, T] scores; called directly, SDPA per segment",
                    kept_because="the default: flex FLASH where flash-attn-4 runs, else "
                                 "Triton, as measured on ragged GRPO layouts (selection.py)"),
    AttentionKernel("flash", flex=True, cuda_only=True, op_name=None, runs_on="flash-attn-4",
                    cuda_form="flex lowered to flash-attn-4", cpu_form=None,
                    kept_because="flex lowered to flash-attn-4: 1.08-1.13x the ideal pair "
                                 "reduction against cuDNN dense on aligned layouts (H100), "
                                 "the flex kernel `auto` takes with flash-attn-4"),
    AttentionKernel("triton", flex=True, cuda_only=True, op_name=None, runs_on=None,
                    cuda_form="Inductor's flex template", cpu_form=None,
                    kept_because="Inductor's flex template: the flex kernel wherever "
                                 "flash-attn-4 does not run (fp32, other head dims, other GPUs); "
                                 "0.61-0.71x the ideal on ragged layouts, where regions "
                                 "reaches 0.12-0.51x (H100)"),
    AttentionKernel("regions", flex=False, cuda_only=False, op_name="regions_attention",
                    runs_on="cudnn", cuda_form="cuDNN over the two KV regions",
                    cpu_form="PyTorch's CPU flash kernel over the two KV regions",
                    eager_call="dualkv_compile.attention.regions:two_region_attention",
                    kept_because="dense cuDNN calls over the two KV regions: 0.86-0.98x the "
                                 "ideal on aligned layouts where Triton flex reaches 0.73-0.76x "
                                 "(H100, no flash-attn-4)"),
    AttentionKernel("flash_regions", flex=False, cuda_only=False,
                    op_name="flash_regions_attention", runs_on="flash-attn-4",
                    cuda_form="flash-attn-4's dense kernels over the two KV regions",
                    cpu_form="explicit math over the two KV regions, the CPU form of "
                             "flash-attn-4's calls",
                    kept_because="flash-attn-4's dense kernels over the two regions: the "
                                 "fastest policy update at (32, 8K, 1K), 1052 vs 1061 ms "
                                 "(60.3% useful MFU, H100), and the fastest kernel on ragged "
                                 "layouts: 0.78-0.95x the ideal vs flex FLASH's 0.74-0.90x "
                                 "(H100; 0.81-0.95 vs 0.70-0.87 on an H200)"),
)}
FLEX_KERNELS = tuple(name for name, k in KERNELS.items() if k.flex)


def attention_kernel(name: str) -> AttentionKernel:
    """The kernel `name` (a DualKVConfig.attention_backend value), or a ValueError naming the
    choices."""
    try:
        return KERNELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"attention_backend={name!r} is not one of {tuple(KERNELS)}") from None
