"""shared_prefix_attention: the one attention op of the packed layout.

CUDA: flex_attention, compiled once per process, with the BlockMask of the PackedBatch (built
once, cached on it), lowered to FLASH (FA4) or Triton (selection.py) with the
architecture's validated kernel options. FLASH on a layout made of whole 128-token blocks per
segment calls FA4 directly in its causal form instead (flash_causal.py: the same attention,
with FA4's longest-first tile order). Dynamo's recompile limit
is raised deliberately for this call and made fatal: past it Dynamo would silently run eager
flex, which materialises [T, T] scores.
CPU (and any non-CUDA device): the SDPA reference, which supports backward; the public
flex_attention refuses backward on CPU.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..layout.packing import PackedBatch
from ..recompiles import bounded_recompiles
from .sdpa_segments import sdpa_shared_prefix_attention
from ..stats import counters, log_once
from . import flash_regions  # noqa: F401  (registers torch.ops.dualkv.flash_regions_attention)
from .block_mask import shared_prefix_block_mask
from .flash_causal import block_aligned, flash_causal_attention
from .kernel_options import kernel_options_for
from . import region_ops  # noqa: F401  (registers torch.ops.dualkv.regions_attention)
from .registry import attention_kernel
from .selection import resolve_attention_backend

__all__ = ["shared_prefix_attention", "RECOMPILE_LIMIT"]

log = logging.getLogger(__name__)

# Each length bucket (T), options set or requires_grad flip is one compile of flex_attention.
RECOMPILE_LIMIT = 64

# Compiled once per process, keyed by `dynamic`. Static shapes are the default: a kernel
# compiled for a symbolic T cannot assume T % 128 == 0 and guards every load (slower, see
# docs/results/attention_h100.md); T is already bucketed by pack(pad_to=...).
_compiled_flex: dict[bool, object] = {}


def _flex(dynamic: bool):
    if dynamic not in _compiled_flex:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex[dynamic] = torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)
    return _compiled_flex[dynamic]


def _check(q: Tensor, k: Tensor, v: Tensor, packed: PackedBatch) -> None:
    if not isinstance(packed, PackedBatch):
        raise TypeError(f"packed must be a PackedBatch from dualkv_compile.pack, got {type(packed)}")
    t = packed.seq_len
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != t:
        raise ValueError(f"q must be [1, Hq, T={t}, D], got {tuple(q.shape)}")
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != t:
        raise ValueError(
            f"k and v must both be [1, Hkv, T={t}, D], got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"head dims differ: q has D={q.shape[3]}, k/v have D={k.shape[3]}")
    if 0 in (q.shape[1], k.shape[1], q.shape[3]):
        raise ValueError(f"Hq={q.shape[1]}, Hkv={k.shape[1]} and D={q.shape[3]} must be "
                         f"positive")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"Hkv={k.shape[1]} must divide Hq={q.shape[1]} (GQA)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def _flex_attention(q, k, v, packed, scale, kernel_options, dynamic=False,
                    attention_backend="auto"):
    block_mask = shared_prefix_block_mask(packed, q.device)
    options = kernel_options_for(q.device, kernel_options, head_dim=q.shape[-1],
                                 gqa=q.shape[1] // k.shape[1], dtype=q.dtype,
                                 attention_backend=attention_backend)
    gqa = q.shape[1] != k.shape[1]
    if torch.compiler.is_compiling():  # traced into an outer graph: the HOP is captured there
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                              kernel_options=options)
    with bounded_recompiles(RECOMPILE_LIMIT, f"flex_attention (this call: T={packed.seq_len})"):
        return _flex(dynamic)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                              kernel_options=options)


def _causal_form(q, k, packed, kernel_options, attention_backend) -> bool:
    """Whether FLASH runs as FA4's causal block-sparse call (flash_causal.py) rather than flex:
    an eager call, FLASH chosen, on sm_90 (the architecture it is tested on), no
    kernel_options (they configure flex), deterministic algorithms off (FA4's deterministic
    block-sparse backward needs a dq write order that only flex builds), and a block-aligned
    layout. Each reason for skipping the causal form is logged once; traced calls (inside
    torch.compile, as in optimize()) always lower flex."""
    if torch.compiler.is_compiling():
        return False
    if resolve_attention_backend(attention_backend, q.device, q.shape[-1], q.dtype) != "FLASH":
        return False
    reason = None
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        reason = "the GPU is not sm_90, where the causal form is tested"
    elif kernel_options:
        reason = "kernel_options were given, and they configure flex"
    elif torch.are_deterministic_algorithms_enabled():
        reason = ("deterministic algorithms are on, and FA4's deterministic block-sparse "
                  "backward needs the dq write order that flex builds")
    elif not block_aligned(packed):
        reason = ("some 128-token blocks of the layout hold two segments (it needs prompts and "
                  "responses in whole blocks)")
    if reason:
        log_once(log, logging.INFO,
                 f"FLASH's causal form is skipped and flex lowers the call: {reason}")
    return reason is None


def _segment_tables(packed: PackedBatch, device) -> tuple[Tensor, Tensor]:
    """The 1-D segment tables on `device`; eagerly one pair of objects per batch (cached on
    it), so that the regions ops read their plan once per batch, not once per call. A batch
    packed under torch.inference_mode holds inference tensors, which a backward cannot save:
    outside the mode it gets copies (PackedBatch.on_device)."""
    if torch.compiler.is_compiling():
        return tuple(x[0].to(device) for x in (packed.segment_ids, packed.prefix_segment_ids))
    return packed.cached("segment_tables", lambda: tuple(
        packed.on_device(name, device)[0] for name in ("segment_ids", "prefix_segment_ids")),
        device)


def shared_prefix_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    packed: PackedBatch,
    *,
    scale: float | None = None,
    kernel_options: dict[str, object] | None = None,
    attention_backend: str = "auto",
) -> Tensor:
    """Causal attention of the packed batch, equal to causal SDPA on the replicated rows.

    q [1, Hq, T, D], k/v [1, Hkv, T, D] (Hkv divides Hq) -> [1, Hq, T, D]. A query sees earlier
    keys of its own segment and, for response tokens, its group's whole prompt. `scale`
    defaults to 1/sqrt(D). `attention_backend` ("auto", "flash", "triton") picks the CUDA flex
    kernel (see selection.py); FLASH on a block-aligned layout runs FA4's causal form
    (flash_causal.py); `kernel_options` override the architecture's table entry
    (CUDA only; validated, unknown keys raise). "regions" runs dense kernels over the two KV
    regions instead of flex, on CUDA (cuDNN, bf16/fp16) and on CPU (regions.py);
    "flash_regions" runs flash-attn-4's dense kernels over them (CUDA; explicit math on CPU;
    flash_regions.py).
    """
    _check(q, k, v, packed)
    kernel = attention_kernel(attention_backend)
    if not kernel.flex and kernel_options:
        raise ValueError(f"kernel_options={kernel_options!r} configure flex_attention; "
                         f"attention_backend={attention_backend!r} does not use it")
    if kernel.eager_call is not None and not torch.compiler.is_compiling():
        return kernel.eager()(q, k, v, packed, scale=scale)  # the batch's own plan
    if not kernel.flex:  # the region kernels' opaque ops
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return kernel.graph_op()(q, k, v, *_segment_tables(packed, q.device), scale)[0]
    if q.device.type == "cuda":
        if _causal_form(q, k, packed, kernel_options, attention_backend):
            counters["flash_causal_calls"] += 1
            return flash_causal_attention(q, k, v, packed, scale)
        return _flex_attention(q, k, v, packed, scale, kernel_options,
                               attention_backend=attention_backend)
    if kernel.cuda_only:
        raise ValueError(f"attention_backend={attention_backend!r} is a CUDA kernel; q is on "
                         f"{q.device}, which runs the reference")
    if kernel_options:
        raise ValueError(
            f"kernel_options={kernel_options!r} apply to the CUDA kernel only; q is on {q.device}"
        )
    return sdpa_shared_prefix_attention(q, k, v, packed, scale=scale)
