"""DualKVConfig: the frozen, versioned, JSON-serialisable settings of optimize()."""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field

from .arguments import as_index
from .attention.registry import attention_kernel
from .attention.kernel_options import validate_kernel_options
from .layout.buckets import check_bucket_growth

__all__ = ["DualKVConfig"]

_BACKENDS = ("auto", "inductor", "aot_eager", "eager")
_FALLBACKS = ("error", "dense")
_REGIONS = ("auto", "model", "layer")


@dataclass(frozen=True, kw_only=True)
class DualKVConfig:
    """Settings of `dualkv_compile.optimize`.

    enabled: False runs the plain model on the replicated batch (the baseline).
    pad_to: the packed length T is rounded up to a multiple of this (one compile per bucket);
        a multiple of 128, the FlexAttention block size.
    bucket_growth: 1 keeps every multiple of pad_to as a bucket; above 1, buckets grow
        geometrically by this factor (buckets.bucket_length), which bounds the compiles when
        lengths vary widely (1.1: about 7 buckets per doubling of T, at most
        (growth - 1) x T + pad_to tokens of padding: 11% from T = 8K on).
    attention_backend: the CUDA attention kernel: "auto" (FLASH where flash-attn-4 imports on
        sm_90/sm_100, else Triton, logged once), "flash" (raises where it cannot run),
        "triton", "regions" (no flex: dense cuDNN calls over the two KV regions, merged by
        log-sum-exp; regions.py; also on CPU with PyTorch's CPU flash kernel), or
        "flash_regions" (the same with flash-attn-4's dense kernels, two calls per layer;
        flash_regions.py; explicit math on CPU).
    kernel_options: FlexAttention kernel options over the architecture's table (validated).
    backend: "auto" (Inductor on CUDA, aot_eager elsewhere, since Inductor's CPU flex has no
        backward), "inductor", "aot_eager" or "eager".
    fallback: what a refusal of the passes does: "error" raises naming the op and its source
        line; "dense" runs the unoptimised model, logged once with the reason and counted.
    logprob_chunk_size: response positions per LM-head chunk in response_logprobs. On CUDA
        (fused kernels) a chunk holds one or two [chunk, vocab] blocks in the model dtype (1.2
        GiB each at 4096 x 151,936 in bf16); the eager path (CPU) holds a few float blocks of
        that size. Fewer chunks mean fewer float32 accumulations of the [vocab, d] weight
        gradient.
    activation_memory_budget: fraction of the activations the compiled graph keeps for the
        backward (1.0 keeps all); lower values make AOTAutograd's partitioner recompute the
        rest, PyTorch's compile-time form of gradient checkpointing. The shared-prefix
        attention and its inputs are never recomputed (passes/attention_saving.py). The model's
        own checkpointed layers work too (docs/api.md: Gradient checkpointing).
    compile_region: what one compiled graph spans. "model": embedding to LM head, one graph
        (fastest; the passes see everything). "layer": one graph per decoder layer, reused by
        every layer, with the embedding, final norm and LM head run eagerly; FSDP2's hooks
        run between the layers (torchtune decoders and transformers causal LMs). "auto":
        "layer" when the model was passed to fully_shard (FSDP2), else "model".
    """

    version: int = 1
    enabled: bool = True
    pad_to: int = 128
    bucket_growth: float = 1.0
    attention_backend: str = "auto"
    kernel_options: dict = field(default_factory=dict)
    backend: str = "auto"
    fallback: str = "error"
    logprob_chunk_size: int = 4096
    activation_memory_budget: float = 1.0
    compile_region: str = "auto"

    def __post_init__(self):
        if type(self.version) is not int or self.version != 1:
            raise ValueError(f"DualKVConfig version={self.version!r}: only version 1 (an int) "
                             f"exists")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled={self.enabled!r} must be a bool")
        pad_to = as_index(self.pad_to)  # a numpy or tensor int too, stored as an int (JSON)
        if pad_to is None or pad_to < 128 or pad_to % 128:
            raise ValueError(f"pad_to={self.pad_to!r} must be an integer, a positive multiple "
                             f"of 128")
        object.__setattr__(self, "pad_to", pad_to)
        check_bucket_growth(self.bucket_growth)
        kernel = attention_kernel(self.attention_backend)
        if not kernel.flex and self.kernel_options:
            raise ValueError(f"kernel_options={self.kernel_options!r} configure "
                             f"flex_attention; attention_backend={self.attention_backend!r} "
                             "does not use it")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {_BACKENDS}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"fallback={self.fallback!r} is not one of {_FALLBACKS}")
        if self.compile_region not in _REGIONS:
            raise ValueError(f"compile_region={self.compile_region!r} is not one of {_REGIONS}")
        chunk = as_index(self.logprob_chunk_size)  # not a bool: True read as 1 before
        if chunk is None or chunk < 1:
            raise ValueError(f"logprob_chunk_size={self.logprob_chunk_size!r} must be a positive "
                             f"integer")
        object.__setattr__(self, "logprob_chunk_size", chunk)
        budget = self.activation_memory_budget
        if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not 0 < budget <= 1:
            raise ValueError(f"activation_memory_budget={budget!r} must be in (0, 1]")
        object.__setattr__(self, "activation_memory_budget", float(budget))  # numpy's too
        if not isinstance(self.kernel_options, dict):
            raise ValueError(f"kernel_options={self.kernel_options!r} must be a dict")
        validate_kernel_options(self.kernel_options)
        # a copy: the caller's dict changing later must not change a frozen config
        object.__setattr__(self, "kernel_options", dict(self.kernel_options))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DualKVConfig":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DualKVConfig fields {unknown}; known: {sorted(known)}")
        return cls(**data)
