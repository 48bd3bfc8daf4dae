"""Triton kernels of the decode step's attention (rollout/attention.py, implementation
"triton"): `prompt.py` computes the prompt region's split partials, reading each group's prompt
K/V once for all of its rows; `response.py` runs each row against its own response keys and
folds the prompt's partials in. Both are opaque ops (torch.library.custom_op) in the compiled
step, whose CUDA graph captures their launches.

The explicit math in attention.py (`implementation="math"`) is the reference; on the CPU the
kernels run only under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

__all__ = ["status", "supports", "triton"]

try:
    import triton
except ImportError:  # CPU-only installs: the math path runs instead
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tensors run (the tests)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_DOT_ROWS = 16  # tl.dot's smallest M: query tiles are padded up to it
# head dims the tiles are sized and tested for (blocks of 64 keys, 3 pipeline stages: K/V of
# D = 256 in fp32 would pass an H100's shared memory)
MAX_HEAD_DIM = 128


def status(device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """(runs, reason) of the kernels for q/K/V of `dtype` and `head_dim` on `device`."""
    if triton is None:
        return False, "Triton is not installed"
    if device.type != "cuda" and not INTERPRETED:
        return False, f"the kernels run on CUDA, not {device}"
    if dtype not in DTYPES:
        return False, f"the kernels compute bf16, fp16 or fp32, not {dtype}"
    if not 16 <= head_dim <= MAX_HEAD_DIM or head_dim != triton.next_power_of_2(head_dim):
        return False, f"head dim {head_dim} is not a power of two in [16, {MAX_HEAD_DIM}]"
    if (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) < (8, 0)):
        return False, "the kernels' bf16 dots need compute capability 8.0 or newer"
    return True, "Triton kernels"


def supports(q: Tensor, *kv: Tensor) -> bool:
    """True where the kernels run on q and these K/V tensors: `status`, one dtype throughout,
    each head dim contiguous, and K/V pairs laid out alike (the engine's cache always is)."""
    pairs = list(zip(kv[::2], kv[1::2]))
    return (status(q.device, q.shape[-1], q.dtype)[0] and q.stride(-1) == 1
            and all(k.dtype == v.dtype == q.dtype and k.stride(-1) == 1
                    and k.stride() == v.stride() for k, v in pairs))
