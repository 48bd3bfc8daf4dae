"""The rollout's KV cache and decode state: static buffers, allocated once per shape.

Prompt K/V are stored once per group, left padding stripped (a group's prompt starts at key 0
and `prompt_len[g, s]` says how many keys of split s are valid), split along the keys for
split-KV decoding by flex and math: [G, S, Hkv, C, D] per layer, S x C = the prompt capacity
(attention.py says why); the Triton kernels split the keys themselves and take S = 1.
Response K/V once per row ([rows, Hkv, R, D]). With `share_prompt=False` the prompt K/V are
replicated per row (G = rows, one row per "group"), which is what a decoder without cascade
attention holds: the baseline the benchmark and the recipe's off side use.

The decode state (current tokens, step counter, done flags, output tokens, sampling noise) lives
here too, so that a captured CUDA graph's inputs keep their addresses across replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RolloutCache", "prompt_bucket", "prompt_splits"]

# split-KV pieces (group x split x kv head) to aim for: about two per SM of a 132-SM GPU
_TARGET_PIECES = 264
_MIN_SPLIT = 16


def prompt_splits(groups: int, kv_heads: int, capacity: int) -> int:
    """How many key splits S the prompt K/V are stored in: a power of two dividing `capacity`
    into splits of at least 16 keys, the smallest that makes groups x S x kv_heads reach about
    two pieces of work per SM."""
    splits = 1
    while (groups * splits * kv_heads < _TARGET_PIECES
           and capacity % (2 * splits) == 0 and capacity // (2 * splits) >= _MIN_SPLIT):
        splits *= 2
    return splits


def prompt_bucket(length: int) -> int:
    """The prompt capacity for a longest prompt of `length`: a multiple of an eighth of the
    power of two at or above it (at least 16), so padding adds under 25% beyond 64 tokens and a
    run sees at most 8 capacities per doubling of the length (each is one compile)."""
    if length < 1:
        raise ValueError(f"prompt length {length} must be at least 1")
    quantum = max(16, 1 << max(0, length.bit_length() - 3))
    return -(-length // quantum) * quantum


@dataclass(eq=False)
class RolloutCache:
    prompt_k: list[Tensor]      # per layer [G, S, Hkv, C, D], S x C = the prompt capacity
    prompt_v: list[Tensor]
    prompt_len: Tensor          # [G, S] int64: valid prompt keys per group and split
    resp_k: list[Tensor]        # per layer [rows, Hkv, R, D]
    resp_v: list[Tensor]
    row_position0: Tensor       # [rows] int64: the position of a row's first response token
    tokens: Tensor              # [rows] int64: the token fed to the next decode step
    step: Tensor                # [] int64: its response index
    done: Tensor                # [rows] bool: the row has produced the stop token
    out: Tensor                 # [rows, T] int64: the sampled tokens
    logprobs: Tensor            # [rows, T] logits_dtype: their logprobs (temperature, no top-k/p)
    noise: Tensor               # [rows, vocab] float32: Exp(1) draws of the current step

    @classmethod
    def allocate(cls, *, layers: int, groups: int, rows: int, prompt_capacity: int,
                 response_capacity: int, kv_heads: int, head_dim: int, vocab: int,
                 dtype: torch.dtype, device: torch.device,
                 logits_dtype: torch.dtype = torch.float32,
                 splits: int | None = None) -> RolloutCache:
        """dtype: the K/V's; logits_dtype: the logprobs' (float32, float64 for a float64
        model); the noise is float32, as torchtune's generate draws it. splits: the prompt's S
        (default `prompt_splits`; the Triton kernels take 1)."""
        def kv(*lead, length):
            # zeros, not empty: masked keys still meet a 0 weight in p @ v, and 0 * NaN = NaN
            return [torch.zeros(*lead, kv_heads, length, head_dim, dtype=dtype, device=device)
                    for _ in range(layers)]

        splits = splits or prompt_splits(groups, kv_heads, prompt_capacity)
        chunk = prompt_capacity // splits
        long = dict(dtype=torch.long, device=device)
        return cls(prompt_k=kv(groups, splits, length=chunk),
                   prompt_v=kv(groups, splits, length=chunk),
                   prompt_len=torch.ones(groups, splits, **long),
                   resp_k=kv(rows, length=response_capacity),
                   resp_v=kv(rows, length=response_capacity),
                   row_position0=torch.zeros(rows, **long), tokens=torch.zeros(rows, **long),
                   step=torch.zeros((), **long),
                   done=torch.zeros(rows, dtype=torch.bool, device=device),
                   out=torch.zeros(rows, response_capacity, **long),
                   logprobs=torch.zeros(rows, response_capacity, dtype=logits_dtype,
                                        device=device),
                   noise=torch.ones(rows, vocab, dtype=torch.float32, device=device))

    @property
    def groups(self) -> int:
        return self.prompt_len.shape[0]

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    def kv_bytes(self) -> int:
        """Bytes held by the prompt and response K/V of all layers."""
        return sum(t.numel() * t.element_size()
                   for t in (*self.prompt_k, *self.prompt_v, *self.resp_k, *self.resp_v))

    def decode_tensors(self) -> list[Tensor]:
        """Everything a decode step reads or writes, flat (the compiled step's arguments)."""
        return [self.prompt_len, self.row_position0, self.tokens, self.step, self.done,
                self.out, self.logprobs, self.noise, *self.prompt_k, *self.prompt_v, *self.resp_k,
                *self.resp_v]
