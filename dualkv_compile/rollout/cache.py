"""The rollout's KV cache and decode state: static buffers, allocated once per shape.

Prompt K/V are stored once per group ([G, Hkv, P, D] per layer, left padding stripped: a
group's prompt starts at index 0 and `prompt_len[g]` says how many keys are valid); response
K/V once per row ([rows, Hkv, R, D]). With `share_prompt=False` the prompt K/V are replicated
per row (G = rows, one row per "group"), which is what a decoder without cascade attention
holds: the baseline the benchmark and the recipe's off side use.

The decode state (current tokens, step counter, done flags, output tokens, sampling noise) lives
here too, so that a captured CUDA graph's inputs keep their addresses across replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RolloutCache", "prompt_bucket"]


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
    prompt_k: list[Tensor]      # per layer [G, Hkv, P, D]
    prompt_v: list[Tensor]
    prompt_len: Tensor          # [G] int64: valid prompt keys per group
    resp_k: list[Tensor]        # per layer [rows, Hkv, R, D]
    resp_v: list[Tensor]
    row_position0: Tensor       # [rows] int64: the position of a row's first response token
    tokens: Tensor              # [rows] int64: the token fed to the next decode step
    step: Tensor                # [] int64: its response index
    done: Tensor                # [rows] bool: the row has produced the stop token
    out: Tensor                 # [rows, T] int64: the sampled tokens
    logprobs: Tensor            # [rows, T] float32: their logprobs (temperature, no top-k/p)
    noise: Tensor               # [rows, vocab] float32: Exp(1) draws of the current step

    @classmethod
    def allocate(cls, *, layers: int, groups: int, rows: int, prompt_capacity: int,
                 response_capacity: int, kv_heads: int, head_dim: int, vocab: int,
                 dtype: torch.dtype, device: torch.device) -> RolloutCache:
        def kv(batch, length):
            # zeros, not empty: masked keys still meet a 0 weight in p @ v, and 0 * NaN = NaN
            return [torch.zeros(batch, kv_heads, length, head_dim, dtype=dtype, device=device)
                    for _ in range(layers)]

        long = dict(dtype=torch.long, device=device)
        return cls(prompt_k=kv(groups, prompt_capacity), prompt_v=kv(groups, prompt_capacity),
                   prompt_len=torch.ones(groups, **long),
                   resp_k=kv(rows, response_capacity), resp_v=kv(rows, response_capacity),
                   row_position0=torch.zeros(rows, **long), tokens=torch.zeros(rows, **long),
                   step=torch.zeros((), **long),
                   done=torch.zeros(rows, dtype=torch.bool, device=device),
                   out=torch.zeros(rows, response_capacity, **long),
                   logprobs=torch.zeros(rows, response_capacity, dtype=torch.float32,
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
