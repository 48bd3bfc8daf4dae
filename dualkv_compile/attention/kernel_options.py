"""FlexAttention kernel options per GPU architecture, validated before they reach Inductor.

Inductor silently ignores unknown keys, so a typo would quietly run the default kernel. Every
options dict that this package passes to flex_attention goes through `validate_kernel_options`.
"""

from __future__ import annotations

import typing

import torch

__all__ = ["TRITON_OPTIONS_BY_ARCH", "kernel_options_for", "validate_kernel_options"]

# Triton flex options: (major, minor) compute capability -> (head dim, GQA ratio) -> options,
# written by tools/tune_kernel_options.py (its JSON output is committed under docs/results). A
# missing architecture or shape runs Inductor's defaults. The FLASH backend takes none of these.
# Never set ROWS_GUARANTEED_SAFE: although every query sees itself, a query's first visited
# (partial) block can be fully masked for that row when a query block spans two groups or a
# response and the padding; the unguarded online softmax then gives NaN.
TRITON_OPTIONS_BY_ARCH: dict[tuple[int, int], dict[tuple[int, int], dict[str, object]]] = {
    # the winners of docs/results/tune_sm90_h100.md: Inductor's defaults at head dim 128,
    # 64x64 tiles at head dim 64, a 64x64 forward at head dim 256
    (9, 0): {
        (64, 1): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
        (64, 4): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
        (256, 1): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
        (256, 4): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
        (256, 8): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
        (64, 8): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
                  "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                  "bwd_num_warps": 4, "bwd_num_stages": 3},
    },
}

_PHASE_PREFIXES = ("fwd_", "bwd_")
_SPARSE_BLOCK = 128


def _known_options() -> dict[str, object]:
    from torch.nn.attention.flex_attention import FlexKernelOptions

    return typing.get_type_hints(FlexKernelOptions)


def _check_value(key: str, base: str, value, hint) -> None:
    if typing.get_origin(hint) is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ValueError(f"kernel option {key}={value!r} is not one of {allowed}")
    elif hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"kernel option {key}={value!r} must be a bool")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"kernel option {key}={value!r} must be a positive int")
        if base.startswith("BLOCK_") and value & (value - 1):
            raise ValueError(f"kernel option {key}={value} must be a power of two")
        if base == "num_warps" and value not in (1, 2, 4, 8, 16):
            raise ValueError(f"kernel option {key}={value} must be one of 1, 2, 4, 8, 16")


def validate_kernel_options(options: dict[str, object] | None) -> dict[str, object]:
    """Return a copy of `options` after checking every key and value; raise ValueError naming
    the first bad one. Keys may carry a fwd_/bwd_ prefix, as flex_attention accepts."""
    options = dict(options or {})
    known = _known_options()
    for key, value in options.items():
        base = key
        for prefix in _PHASE_PREFIXES:
            if key.startswith(prefix) and key[len(prefix):] in known:
                base = key[len(prefix):]
        if base not in known:
            raise ValueError(
                f"unknown kernel option {key!r}; torch {torch.__version__} accepts "
                f"{sorted(known)} (optionally prefixed fwd_ or bwd_)"
            )
        _check_value(key, base, value, known[base])
        if base.startswith("BLOCK_") and _SPARSE_BLOCK % value:
            raise ValueError(f"kernel option {key}={value} must divide the block size 128")
    # the backward kernel's tile pairs, as it sees them (a bwd_ key overrides the plain one;
    # its template asserts the multiples, which would fail only at compile time)
    (k_m1, m1), (k_n1, n1), (k_m2, m2), (k_n2, n2) = (
        _backward_value(options, name) for name in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
                                                     "BLOCK_N2"))
    if m1 and n1 and n1 % m1:
        raise ValueError(f"{k_n1}={n1} must be a multiple of {k_m1}={m1}")
    if m2 and n2 and m2 % n2:
        raise ValueError(f"{k_m2}={m2} must be a multiple of {k_n2}={n2}")
    return options


def _backward_value(options: dict, name: str) -> tuple[str, object]:
    """(key, value) of option `name` as the backward kernel takes it."""
    key = "bwd_" + name if "bwd_" + name in options else name
    return key, options.get(key)


def kernel_options_for(device: torch.device, overrides: dict[str, object] | None = None, *,
                       head_dim: int | None = None, gqa: int | None = None,
                       dtype: torch.dtype | None = None,
                       attention_backend: str = "auto") -> dict[str, object]:
    """The validated options for attention of `head_dim`, GQA ratio `gqa` and `dtype` on
    `device`: on CUDA, the resolved backend (BACKEND="FLASH" or "TRITON") plus, for Triton, the
    architecture's tuned entry; `overrides` on top. Elsewhere just `overrides`. A BACKEND in
    `overrides` is treated as an `attention_backend` request, with the same checks."""
    overrides = validate_kernel_options(overrides)
    if "BACKEND" in overrides:
        asked = {"FLASH": "flash", "TRITON": "triton", "AUTO": "auto"}.get(overrides["BACKEND"])
        if asked is None:
            raise ValueError(f"kernel option BACKEND={overrides['BACKEND']!r}: use FLASH, TRITON "
                             f"or AUTO, or set attention_backend")
        if attention_backend not in ("auto", asked):
            raise ValueError(f"kernel_options BACKEND={overrides['BACKEND']!r} and "
                             f"attention_backend={attention_backend!r} both choose the kernel; "
                             f"set one")
        attention_backend = asked
        overrides = {k: v for k, v in overrides.items() if k != "BACKEND"}
    if device.type != "cuda":
        if attention_backend == "flash":
            raise ValueError(f"attention_backend='flash' is a CUDA kernel; the device is {device}")
        return overrides
    from .selection import resolve_attention_backend

    backend = resolve_attention_backend(attention_backend, device, head_dim, dtype)
    base: dict[str, object] = {"BACKEND": backend}
    if backend == "TRITON":
        table = TRITON_OPTIONS_BY_ARCH.get(torch.cuda.get_device_capability(device), {})
        base.update(table.get((head_dim, gqa), {}))
    return validate_kernel_options({**base, **overrides})
