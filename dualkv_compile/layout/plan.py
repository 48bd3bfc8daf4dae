"""Micro-batches of a rollout batch by packed-token budget.

A GRPO batch is G groups of N rows (group-major: rows g*N .. g*N+N-1 share a prompt). Packed,
a group costs its prompt once plus its responses: P_g + sum of R_i valid tokens. Micro-batches
by a fixed count of groups are the wrong unit once lengths vary (attention grows with the
square of length, padding and recompiles follow); this packs whole groups into micro-batches of
at most `max_tokens` packed tokens, first-fit decreasing. A group larger than the budget is
split into parts of consecutive rows, each of which pays the prompt again (logged once: the
prompt is recomputed for every part); a single row over the budget gets a micro-batch of its
own (logged once).

Any partition of the rows gives the same loss and gradients: advantages are per group and the
old/reference logprobs are computed before, and the recipe weights each micro-batch by its
share of the rows (sequence aggregation) or tokens (token aggregation).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from ..arguments import integer_arg
from ..stats import counters, log_once
from .batch_checks import _contiguous_runs, as_padding_mask, checked_prompt_len, checked_runs, \
    checked_tokens
from .packing import prompt_keys

__all__ = ["MicroBatchPlan", "micro_batch_rows", "plan_micro_batches"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MicroBatchPlan:
    rows: list[list[int]]          # each micro-batch's rows of the rollout batch, in order
    packed_tokens: list[int]       # each micro-batch's packed (valid) tokens (an upper bound
                                   # where two groups share a prompt: pack() holds it once)
    split_groups: list[int]        # groups whose rows went to more than one micro-batch

    def __len__(self) -> int:
        return len(self.rows)


def _group_costs(padding_mask: Tensor, prompt_len: int, group_size: int):
    """Per group: its prompt's valid tokens and each row's valid response tokens."""
    b = padding_mask.shape[0]
    prompts = padding_mask[::group_size, :prompt_len].sum(1).tolist()
    responses = padding_mask[:, prompt_len:].sum(1).view(b // group_size, group_size).tolist()
    return prompts, responses


def _parts(group: int, prompt: int, responses: list[int], budget: int, size: int, count: bool):
    """The group as one item, or split into runs of consecutive rows within the budget:
    (packed tokens, rows) each. count: add rows over the budget to the counters."""
    first = group * size
    if prompt + sum(responses) <= budget:
        return [(prompt + sum(responses), list(range(first, first + size)))]
    parts, rows, tokens = [], [], prompt
    for i, r in enumerate(responses):
        if prompt + r > budget:  # a row alone over the budget: a micro-batch of its own
            counters["rows_over_budget"] += int(count)
            log_once(log, logging.WARNING, f"micro-batches: a row packs {prompt + r} tokens "
                     f"(prompt {prompt} + response {r}), over max_tokens={budget}; it gets a "
                     "micro-batch of its own (logged once; counters['rows_over_budget'] counts "
                     "such rows)", key="micro-batches: row over budget")
        if rows and tokens + r > budget:
            parts.append((tokens, rows))
            rows, tokens = [], prompt
        rows.append(first + i)
        tokens += r
    parts.append((tokens, rows))
    return parts


def _checked_batch(padding_mask, prompt_len, group_size) -> tuple[Tensor, int, int]:
    """The arguments every planner takes, checked as `pack` checks them: the mask as bool
    [B, L] with B > 0 a multiple of `group_size`, `prompt_len` in [1, L], `group_size` a
    positive int. Returns (mask, prompt_len, group_size)."""
    if not isinstance(padding_mask, Tensor) or padding_mask.dim() != 2:
        raise ValueError(
            f"padding_mask must be a bool or 0/1 integer tensor [B, L], got "
            f"{type(padding_mask).__name__} {tuple(getattr(padding_mask, 'shape', ()))}"
        )
    mask = as_padding_mask(padding_mask)
    b, l = mask.shape
    if b == 0:
        raise ValueError("padding_mask has no rows (B=0)")
    prompt_len = checked_prompt_len(prompt_len, l)
    group_size = integer_arg("group_size", group_size, 1)
    if b % group_size:
        raise ValueError(f"{b} rows do not split into groups of group_size={group_size}")
    checked_runs(mask, prompt_len)  # what pack() would refuse later, refused before planning
    return mask, prompt_len, group_size


def _check_group_major(tokens, mask: Tensor, prompt_len: int, group_size: int) -> None:
    """Raise unless rows g*N .. g*N+N-1 hold one valid prompt (N = group_size): the planner
    costs each group's prompt from its first row, which interleaved groups make wrong."""
    if checked_tokens(tokens).shape != mask.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and padding_mask {tuple(mask.shape)} "
                         "differ in shape")
    first, length, _ = _contiguous_runs(mask[:, :prompt_len].to(tokens.device))
    keys = prompt_keys(tokens, first, length, prompt_len)
    bad = (keys != keys[::group_size].repeat_interleave(group_size, 0)).any(1).nonzero()
    if bad.numel():
        row = int(bad[0])
        raise ValueError(f"rows must be group-major (rows g*N .. g*N+N-1 share a prompt, "
                         f"N = group_size = {group_size}): row {row}'s prompt differs from row "
                         f"{row - row % group_size}'s, the first of its group")


def plan_micro_batches(padding_mask: Tensor, *, prompt_len: int, group_size: int,
                       max_tokens: int, tokens: Tensor | None = None) -> MicroBatchPlan:
    """Micro-batches of the rollout batch `padding_mask [B, L]` (True = real token; columns
    before `prompt_len` are the prompt, B a multiple of `group_size`), each at most
    `max_tokens` packed tokens (except a row that alone exceeds it). Whole groups, first-fit
    decreasing by packed size; groups over the budget are split (their prompt computed once
    per micro-batch that holds some of their rows, logged). Bad arguments raise ValueError
    naming the value.

    Precondition: rows are group-major (rows g*N .. g*N+N-1 share a prompt). Only the mask is
    read, so interleaved groups would be planned with wrong sizes; pass `tokens [B, L]` to
    have it checked (ValueError naming the first row out of place)."""
    mask, prompt_len, group_size = _checked_batch(padding_mask, prompt_len, group_size)
    max_tokens = integer_arg("max_tokens", max_tokens, 1)
    if tokens is not None:
        _check_group_major(tokens, mask, prompt_len, group_size)
    return _plan(mask, prompt_len, group_size, max_tokens, count=True)


def _plan(mask: Tensor, prompt_len: int, group_size: int, max_tokens: int, *,
          count: bool) -> MicroBatchPlan:
    """plan_micro_batches on checked arguments; count: add the batch's split groups and rows
    over the budget to the counters (once a batch: not for a second plan of the same batch)."""
    prompts, responses = _group_costs(mask, prompt_len, group_size)
    items = [(size, rows, g, p) for g, (p, rs) in enumerate(zip(prompts, responses))
             for size, rows in _parts(g, p, rs, max_tokens, group_size, count)]
    bins: list[tuple[int, list[int], set[int]]] = []  # packed tokens, rows, groups
    for size, rows, g, p in sorted(items, key=lambda item: -item[0]):  # first-fit decreasing
        for i, (used, members, groups) in enumerate(bins):
            cost = size - p if g in groups else size  # pack() holds a group's prompt once
            if used + cost <= max_tokens:
                bins[i] = (used + cost, members + rows, groups | {g})
                break
        else:
            bins.append((size, list(rows), {g}))
    split = sorted(g for g, n in Counter(g for _, _, groups in bins for g in groups).items()
                   if n > 1)
    if split:
        counters["groups_split"] += len(split) * int(count)
        log_once(log, logging.WARNING, f"micro-batches: groups {split} exceed max_tokens="
                 f"{max_tokens} and are split; their prompt is recomputed once per micro-batch "
                 "(logged once; counters['groups_split'] counts such groups)",
                 key="micro-batches: groups split")
    return MicroBatchPlan(rows=[sorted(members) for _, members, _ in bins],
                          packed_tokens=[used for used, _, _ in bins], split_groups=split)


def micro_batch_rows(padding_mask: Tensor, *, prompt_len: int, group_size: int,
                     groups: int | None, max_tokens: int | None,
                     tokens: Tensor | None = None, count: bool = True) -> list:
    """The rows of each micro-batch, as indices into the batch: `groups` whole groups each
    (slices; the last may hold fewer), or by packed-token budget when `max_tokens` is given
    (index tensors; `groups` is then unused and may be None, but a value given is checked).
    Rows must be group-major, as in `plan_micro_batches`; `tokens`, when given, are checked
    for it. Arguments are checked as
    in `plan_micro_batches`; bad ones raise ValueError naming the value. count=False: a batch
    planned before (the recipe's logprob passes plan the update's batch again) is not counted
    again in counters["groups_split"] and ["rows_over_budget"]."""
    mask, prompt_len, group_size = _checked_batch(padding_mask, prompt_len, group_size)
    if groups is not None or max_tokens is None:
        groups = integer_arg("groups", groups, 1)
    if tokens is not None:
        _check_group_major(tokens, mask, prompt_len, group_size)
    if max_tokens is None:
        step = groups * group_size
        return [slice(s, s + step) for s in range(0, mask.shape[0], step)]
    plan = _plan(mask, prompt_len, group_size, integer_arg("max_tokens", max_tokens, 1),
                 count=count)  # tokens were checked above
    return [torch.tensor(rows, device=padding_mask.device) for rows in plan.rows]
