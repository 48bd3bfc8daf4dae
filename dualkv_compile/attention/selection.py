"""Which kernel runs the shared-prefix attention on a CUDA device: FLASH or Triton flex.

FLASH is FlexAttention lowered to FlashAttention-4 through the CuTe DSL (the `flash` extra:
flash-attn-4), for Hopper and Blackwell; it ran the shared-prefix mask at or above the ideal pair
reduction (docs/performance.md). TRITON is Inductor's flex template, which runs everywhere.
"auto" picks from the measurements committed for the GPU it runs on (`MEASURED`: the ragged
GRPO layouts real rollouts give, and the aligned ones); on a GPU without them, FLASH where it
imports and the GPU supports it, else TRITON. The choice, the GPU and the reason are logged once
per device, head dim and dtype. Asking for "flash" where it cannot run raises.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from .registry import FLEX_KERNELS, attention_kernel

__all__ = ["describe_attention_backend", "flash_status", "resolve_attention_backend"]

log = logging.getLogger(__name__)

_FLASH_ARCHS = (9, 10)  # sm_90 (Hopper), sm_100 (Blackwell): FA4's targets
# head dims FLASH is used for: those its GPU tests passed at (FA4 4.0.0b36 returns a wrong dq at
# head dim 16: docs/results/gpu_attention_tests_h100.txt).
FLASH_HEAD_DIMS = (64, 128)


FLASH_DTYPES = (torch.bfloat16, torch.float16)


def flash_status(device: torch.device, head_dim: int | None = None,
                 dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """(available, reason) of the FLASH backend on `device` (for `head_dim` and `dtype`, if
    given)."""
    if head_dim is not None and head_dim not in FLASH_HEAD_DIMS:
        return False, f"head dim {head_dim} is not one FLASH is used for {FLASH_HEAD_DIMS}"
    if dtype is not None and dtype not in FLASH_DTYPES:
        return False, f"FLASH (FA4) computes in bf16/fp16, not {dtype}"
    if device.type != "cuda":
        return False, f"FLASH needs a CUDA device, got {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in _FLASH_ARCHS:
        return False, f"FLASH (FA4) supports sm_90 and sm_100; this GPU is sm_{major}{minor}"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # a flash_attn without the cute subpackage
        found = False
    if not found:
        return False, "flash-attn-4 is not installed (pip install 'dualkv-compile[flash]')"
    return True, f"flash-attn-4 imports and the GPU is sm_{major}{minor}"


# GPU name fragment -> (kernel "auto" takes with FA4, without FA4, the measurement behind it).
# "auto" is a flex kernel (one compiled graph form for every layout, configured by
# kernel_options); the region kernels stay opt-in: regions loses to it on ragged layouts, and
# flash_regions' gain on them is within run-to-run drift at the policy update's level
# (docs/performance.md, "flash_regions with one cross call").
MEASURED = {
    "H100": ("FLASH", "TRITON",
             "fwd+bwd on ragged GRPO micro-batches against FA4 varlen: flex FLASH ahead of "
             "flex Triton and regions on every case (docs/results/attention_ragged_h100.md; "
             "docs/performance.md, \"Ragged layouts\")"),
}


def _measured(device: torch.device) -> tuple[str, str, str] | None:
    name = torch.cuda.get_device_name(device)
    return next(((name, *row) for key, row in MEASURED.items() if key in name), None)


@functools.lru_cache(maxsize=None)
def _resolve(requested: str, device: torch.device, head_dim: int | None,
             dtype: torch.dtype | None) -> str:
    available, reason = flash_status(device, head_dim, dtype)
    if requested == "flash" and not available:
        raise ValueError(f"attention_backend='flash' cannot run: {reason}")
    if requested != "auto":
        chosen = "FLASH" if requested == "flash" else "TRITON"
        log.info("dualkv attention on %s: %s (requested %r; %s)", device, chosen, requested,
                 reason)
        return chosen
    measured = _measured(device)
    if measured is None:
        chosen = "FLASH" if available else "TRITON"
        why = f"no measurements committed for {torch.cuda.get_device_name(device)}: by capability"
    else:
        name, with_fa4, without_fa4, evidence = measured
        chosen = with_fa4 if available else without_fa4
        why = f"measured on {name}: {evidence}"
    # a fallback to Triton is worth a warning (installing flash-attn-4 would be faster)
    level = logging.INFO if available else logging.WARNING
    log.log(level, "dualkv attention on %s: auto chose %s (%s; %s)", device, chosen, reason, why)
    return chosen


def resolve_attention_backend(requested: str, device: torch.device,
                              head_dim: int | None = None, dtype: torch.dtype | None = None) -> str:
    """'FLASH' or 'TRITON' for the flex kernel `requested` on the CUDA `device`, whose
    attention has head dim `head_dim` and dtype `dtype`; "flash" raises where FLASH cannot run,
    "auto" falls back to Triton (logged once per device, head dim and dtype)."""
    device = torch.device(device)  # "cuda:0" as well
    if not attention_kernel(requested).flex:
        raise ValueError(f"attention_backend={requested!r} is not one of the flex kernels "
                         f"{FLEX_KERNELS}")
    if device.type != "cuda":
        raise ValueError(f"attention backends are CUDA kernels; got device {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _resolve(requested, device, head_dim, dtype)


def describe_attention_backend(device: torch.device, head_dim: int | None = None,
                               dtype: torch.dtype | None = None, requested: str = "auto") -> str:
    """One line for the CLI: which kernel `requested` gives on `device`, and why."""
    device = torch.device(device)
    kernel = attention_kernel(requested)
    if device.type != "cuda":
        if kernel.cpu_form is None:
            return f"{requested!r} is a CUDA kernel and cannot run on {device}"
        name = "CPU reference" if kernel.flex else kernel.name.upper()
        return f"{name} on {device} (requested {requested!r}; {kernel.cpu_form})"
    if kernel.flex:
        chosen = resolve_attention_backend(requested, device, head_dim, dtype)
        return f"{chosen} on {device} (requested {requested!r}; {flash_status(device, head_dim, dtype)[1]})"
    ok, reason = kernel.cuda_status(device, head_dim, dtype)
    state = kernel.cuda_form if ok else f"cannot run: {reason}"
    return f"{kernel.name.upper()} on {device} (requested {requested!r}; {state})"
