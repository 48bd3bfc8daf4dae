"""The one-call sampler and the split of a rollout batch into engine calls."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..arguments import integer_arg
from .engine import RolloutEngine

__all__ = ["generate_groups", "plan_calls"]


def generate_groups(model, prompts: Tensor, *, group_size: int, max_generated_tokens: int,
                    pad_id: int, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None, stop_tokens: int | Sequence[int] | None = None,
                    rng: torch.Generator | None = None, dtype: torch.dtype | None = None,
                    return_logprobs: bool = False,
                    prompt_mask: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """prompts [G, P] (left- or right-padded with pad_id) -> responses [G * group_size, T]:
    `group_size` continuations of each prompt, rows in prompt order, T = max_generated_tokens,
    pad_id after a row's stop token (with return_logprobs, their logprobs [G * group_size, T]
    too). Every argument is RolloutEngine.generate's. A new RolloutEngine per call: hold one to
    reuse its compiled steps."""
    return RolloutEngine(model).generate(
        prompts, group_size=group_size, max_generated_tokens=max_generated_tokens, pad_id=pad_id,
        temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, rng=rng,
        dtype=dtype, return_logprobs=return_logprobs, prompt_mask=prompt_mask)


def plan_calls(num_groups: int, group_size: int,
               rows_per_call: int | None) -> list[tuple[int, int, int]]:
    """Split the sampling of `num_groups` groups x `group_size` into generate calls of at most
    `rows_per_call` decode rows (None: one call): (first group, groups, responses per prompt in
    the call) each, whole groups per call, or one group's responses over several calls. The
    fewest calls, as equal as possible (larger first): calls of one shape reuse the engine's
    workspace (its cache and CUDA graphs), so 12 groups at 8 a call are 6 + 6, not 8 + 4."""
    num_groups = integer_arg("num_groups", num_groups, 0)
    group_size = integer_arg("group_size", group_size, 1)
    if rows_per_call is None:
        return [(0, num_groups, group_size)]
    rows_per_call = integer_arg("rows_per_call", rows_per_call, 1)
    if rows_per_call >= group_size:
        calls, first = [], 0
        for count in _even_parts(num_groups, rows_per_call // group_size):
            calls.append((first, count, group_size))
            first += count
        return calls
    parts = _even_parts(group_size, rows_per_call)
    return [(g, 1, n) for g in range(num_groups) for n in parts]


def _even_parts(total: int, most: int) -> list[int]:
    """`total` in the fewest parts of at most `most`, as equal as possible, larger first."""
    if total == 0:
        return []
    parts = -(-total // most)
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)
