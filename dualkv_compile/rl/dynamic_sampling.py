"""The groups a GRPO step trains on: sampled, scored and, with dynamic sampling (DAPO), refilled
until they are as many as the step asks for and each one's rewards differ (a group whose
rewards are all equal has zero advantages and teaches nothing).

    batch = scored_groups(draw, rollout, score, groups=8, group_size=16,
                          dynamic_sampling=True, pad_id=tok.pad_id)

Every call runs the same collectives on every rank of a process group (the recipe's
multi-rank run): the prompt draw and each rollout. The callbacks say how."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ..arguments import integer_arg
from . import distributed as ddp
from .losses import groups_with_signal

__all__ = ["NoGroupWithSignal", "ScoredGroups", "checked_rewards", "scored_groups",
           "REFILL_ROUNDS"]

REFILL_ROUNDS = 4  # draws of dynamic sampling before a step gives up on finding signal


class NoGroupWithSignal(RuntimeError):
    """Dynamic sampling found no group whose rewards differ in REFILL_ROUNDS rounds: the step
    has nothing to train on (raised before any update of the step)."""


class BatchRefused(ValueError):
    """draw(), rollout() or score() broke its contract (non-finite rewards, say) on this rank or
    another: raised on every rank before the next collective (raised before any update of the
    step)."""


class ScoredGroups(NamedTuple):
    tokens: Tensor  # [G * N, P + T], rows group-major, prompts left-padded to width P
    mask: Tensor  # padding mask of tokens' shape
    lengths: Tensor  # [G * N] response lengths, the stop token counted
    rewards: Tensor  # [G, N]
    prompt_len: int  # P
    sampled: Tensor  # every round's rewards, dropped groups included (the sampled reward)
    filler: bool  # this rank trains on dropped groups at weight 0 (see scored_groups)


def checked_rewards(rewards, rows: int, source: str = "score()") -> Tensor:
    """`rewards` as `source` returned them, if they are a tensor of one finite number per
    response ([rows]); BatchRefused (a ValueError) naming what is wrong otherwise (a [rows, 1]
    tensor would broadcast against the overlong penalty, a NaN from a failed grader would reach
    the loss and read as a learning rate too high)."""
    if not isinstance(rewards, Tensor) or tuple(rewards.shape) != (rows,):
        got = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise BatchRefused(f"{source} returned rewards of {got}; it must return a tensor of "
                           f"one reward per response, shape ({rows},)")
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist() if \
        rewards.is_floating_point() else []
    if bad:
        raise BatchRefused(f"{source} returned non-finite rewards for responses {bad[:8]} "
                           f"({rewards[bad[:8]].tolist()}); a grader that fails must return a "
                           f"number (e.g. 0), not NaN or inf")
    return rewards


def _tried(fn) -> tuple[Exception | None, object]:
    """(None, fn()) or (the exception fn raised, None)."""
    try:
        return None, fn()
    except Exception as e:  # noqa: BLE001 - raised again by _agree, on every rank
        return e, None


def _agree(refused: Exception | None) -> None:
    """Raise `refused` where it happened (BatchRefused from the checks here, or what draw()
    or score() raised, with its traceback) and BatchRefused on the other ranks. What draw() or
    score() raised is marked `refused_on_every_rank`: the recipe saves the step before on this
    rank too (the others' save is a collective), then lets it go on with its traceback."""
    if refused is not None and not isinstance(refused, BatchRefused):
        refused.refused_on_every_rank = True
    ddp.raise_on_every_rank(refused, "scored_groups", error=BatchRefused)


def _checked_draw(drawn, need: int) -> tuple[Tensor, list]:
    """draw(need)'s (prompts [need, P], answers [need]), or BatchRefused naming draw() (a
    mismatch surfaced as score()'s, and fewer answers than prompts were scored misaligned)."""
    prompts, answers = drawn if isinstance(drawn, tuple) and len(drawn) == 2 else (None, None)
    if not isinstance(prompts, Tensor) or prompts.dim() != 2 or prompts.shape[0] != need:
        got = (tuple(prompts.shape) if isinstance(prompts, Tensor) else
               type(prompts if prompts is not None else drawn).__name__)
        raise BatchRefused(f"draw({need}) returned prompts of {got}; it must return (prompts "
                           f"[{need}, P] tensor, answers [{need}])")
    if answers is None or not hasattr(answers, "__len__") or len(answers) != need:
        got = len(answers) if hasattr(answers, "__len__") else type(answers).__name__
        raise BatchRefused(f"draw({need}) returned {got} answers for {need} prompts")
    return prompts, list(answers)


def _checked_rollout(out, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """rollout(prompts)'s (tokens, mask, lengths) with `rows` rows, or BatchRefused naming it."""
    parts = out if isinstance(out, tuple) and len(out) == 3 else ()
    shapes = [tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__ for x in parts]
    if not parts or any(not isinstance(x, Tensor) or x.shape[0] != rows for x in parts):
        raise BatchRefused(f"rollout() returned {shapes or type(out).__name__}; it must return "
                           f"(tokens, mask, lengths) of {rows} rows (need x group_size)")
    return parts


def scored_groups(draw: Callable[[int], tuple[Tensor, Sequence]],
                  rollout: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]],
                  score: Callable[[Tensor, list, Tensor], Tensor], *, groups: int,
                  group_size: int, dynamic_sampling: bool, pad_id: int) -> ScoredGroups:
    """`groups` groups of `group_size` scored responses for this rank.

    draw(need) -> (prompts [need, P] padded with pad_id, answers [need]); every rank calls it
        in every round, with its own need (possibly 0), so it may gather over ranks.
    rollout(prompts) -> (tokens, mask, lengths) as rl.rollout_batch returns them; a rank with
        need 0 still calls it, with prompts of shape [0, 1], to join the others' collectives.
    score(responses [need * N, T], answers per row, lengths [need * N]) -> rewards [need * N].

    Without dynamic sampling one round is drawn and every group kept. With it, groups whose
    rewards are all equal are dropped and refilled, up to REFILL_ROUNDS rounds; fewer groups
    may come back if the rounds run out. A rank that kept no group while another did trains
    on its last round's groups with `filler` True (the caller weights them 0), so that it runs
    the same collectives; if no rank kept one, NoGroupWithSignal."""
    groups = integer_arg("groups", groups, 1)  # (0 read as "no group with signal")
    n = integer_arg("group_size", group_size, 1)
    kept: list[tuple] = []  # (tokens, mask, lengths, rewards, prompt width) per group
    dropped: list[tuple] = []  # the last round's dropped groups: a filler rank's batch
    sampled: list[Tensor] = []
    for _ in range(REFILL_ROUNDS if dynamic_sampling else 1):
        need = groups - len(kept)
        if ddp.all_max(need)[0] == 0:
            break
        # a refusal on one rank is raised on every rank, before the next collective
        refused, drawn = _tried(lambda: _checked_draw(draw(need), need))
        _agree(refused)
        prompts, answers = drawn
        if need == 0:
            rollout(torch.zeros(0, 1, dtype=torch.long))
            _agree(None)  # (the others' check of their scores, below)
            continue
        out = rollout(prompts)
        width = prompts.shape[1]

        def scored():
            tokens, mask, lengths = _checked_rollout(out, need * n)
            answer_rows = [a for a in answers for _ in range(n)]
            rewards = checked_rewards(score(tokens[:, width:], answer_rows, lengths), need * n)
            return tokens, mask, lengths, rewards

        refused, result = _tried(scored)
        _agree(refused)
        tokens, mask, lengths, rewards = result
        sampled.append(rewards)
        per_group = rewards.view(need, n)
        keep = (groups_with_signal(per_group) if dynamic_sampling
                else torch.ones(need, dtype=torch.bool))
        dropped = []
        for g in range(need):
            rows = slice(g * n, (g + 1) * n)
            group = (tokens[rows], mask[rows], lengths[rows], per_group[g], width)
            (kept if keep[g] else dropped).append(group)
    if ddp.all_sum(len(kept))[0] == 0:
        raise NoGroupWithSignal(
            f"dynamic sampling found no group with differing rewards in {REFILL_ROUNDS} rounds "
            f"of {groups} groups (every response of each group scored alike: the task is too "
            f"easy or too hard for the model now); change the task's difficulty or set "
            f"dynamic_sampling=false")
    filler = not kept
    if filler:
        kept = dropped
    # prompts of different rounds may differ in width: left-pad to the widest
    p = max(k[4] for k in kept)
    tokens = torch.cat([F.pad(k[0], (p - k[4], 0), value=pad_id) for k in kept])
    mask = torch.cat([F.pad(k[1], (p - k[4], 0), value=False) for k in kept])
    return ScoredGroups(tokens, mask, torch.cat([k[2] for k in kept]),
                        torch.stack([k[3] for k in kept]), p, torch.cat(sampled), filler)
