"""One optimizer step of the GRPO/DAPO policy update on a batch of scored groups, as the recipe
runs it: gradients accumulated over micro-batches (whole groups, or a packed-token budget),
each micro-batch's loss weighted by its share of the batch, clipped, applied.

    stats = optimizer_step(policy, loss_fn, optimizer, tokens, mask, p, old, ref,
                           advantages, group_size=16, temperature=1.0,
                           micro_batch_groups=1, max_grad_norm=1.0)

Under FSDP2 every rank calls it alike; the normalisers are sums over all ranks."""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..arguments import as_index, as_real, integer_arg
from ..layout.batch_checks import as_padding_mask
from ..layout.plan import micro_batch_rows
from ..fsdp import is_sharded
from .losses import needs_reference
from . import distributed as ddp

__all__ = ["NonFiniteGradient", "StepStats", "micro_batched_logprobs", "mini_batches",
           "optimizer_step"]

log = logging.getLogger(__name__)


class NonFiniteGradient(FloatingPointError):
    """The update's gradient norm is NaN or infinite; the optimizer step was not taken."""


class StepStats(NamedTuple):
    loss: float  # this rank's share of the loss summed over ranks
    kl: float  # this rank's share of the token-mean KL estimate over all ranks
    clip_fraction: float  # likewise, of the tokens whose ratio was clipped
    grad_norm: float  # before clipping
    stepped: bool = True  # False: no rank had a response token to count, no step was taken


def optimizer_step(policy, loss_fn, optimizer: torch.optim.Optimizer, tokens: Tensor,
                   mask: Tensor, prompt_len: int, old: Tensor, ref: Tensor | None,
                   advantages: Tensor,
                   *, group_size: int, temperature: float, max_grad_norm: float,
                   micro_batch_groups: int = 1, max_tokens: int | None = None,
                   counted: bool = True, loss_mask: Tensor | None = None) -> StepStats:
    """policy: a DualKVModel; loss_fn: a GRPOLoss; tokens, mask [G*N, P+R] group-major;
    old, ref [G*N, R] logprobs (the sampling policy's and the reference's, at `temperature`;
    ref None for a loss without a KL term, kl_coef=0); advantages [G*N]. counted=False runs the rows at weight 0 (a rank with nothing to train
    on, which must still join the collectives). loss_mask [G*N, R]: the response tokens the
    loss counts, a subset of mask[:, prompt_len:] (the default); DAPO's overlong filtering
    passes it without the truncated responses, which still run through the model."""
    if not callable(getattr(policy, "response_loss", None)):
        raise TypeError(f"policy is a {type(policy).__name__}; optimizer_step needs the "
                        "wrapper dualkv_compile.optimize(model) returns (a DualKVModel)")
    _, world_size = ddp.world()
    try:
        if world_size > 1 and not is_sharded(policy.model):
            raise ValueError(f"optimizer_step in a process group of {world_size} needs an "
                             f"FSDP2-sharded model (rl.shard_decoder): each rank would step on "
                             f"its own gradient, never averaged, and the ranks would drift apart")
        if tokens.shape[0] == 0:
            raise ValueError("tokens has no rows: a rank with nothing to train on passes rows "
                             "of a group (e.g. another rank's first) with counted=False, so "
                             "that it runs the same forward and collectives at weight 0")
        policy._check_tokens(tokens)  # ids in the vocabulary, on the model's device
        if not isinstance(mask, Tensor) or mask.shape != tokens.shape:
            raise ValueError(f"mask must be a tensor of the tokens' shape {tuple(tokens.shape)}, "
                             f"got {getattr(mask, 'shape', type(mask).__name__)}")
        p = _check_rows(tokens, prompt_len, old=old, advantages=advantages,
                        **({} if ref is None else {"ref": ref}))
        if ref is None and needs_reference(loss_fn):  # before any micro-batch's gradients
            raise ValueError(f"ref is None, but the loss has a KL term (kl_coef="
                             f"{getattr(loss_fn, 'kl_coef', '?')}) that needs the reference's "
                             f"logprobs; set kl_coef=0 to train without a reference model")
        x = as_real(max_grad_norm)
        if x is None or not x > 0:  # inf: no clipping
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a number > 0 (math.inf "
                             f"for no clipping): a negative one reverses the update, 0 zeroes it")
        if not _zero_or_one(counted):  # (it scales the normalisers: 2 halved the update)
            raise ValueError(f"counted={counted!r} must be True or False (or 1 or 0)")
        counted = bool(counted)
        mask = as_padding_mask(mask)
        resp_mask = mask[:, p:] if loss_mask is None else _checked_loss_mask(loss_mask,
                                                                              mask[:, p:])
        _check_finite(resp_mask, old=old, ref=ref, advantages=advantages)
        # rows are group-major by construction (rl.rollout_batch), so tokens are not passed
        # for the check, a host sync a step
        batches = micro_batch_rows(mask, prompt_len=p, group_size=group_size,
                                   groups=micro_batch_groups, max_tokens=max_tokens)
        refused = None
    except Exception as e:  # noqa: BLE001 - agreed across ranks below, then raised as it was
        refused = e
    # (the model's own checks in response_loss run again below, on data these checks passed)
    ddp.raise_on_every_rank(refused, "optimizer_step")
    # normalisers over all ranks (uncounted rows excluded); FSDP averages gradients over
    # ranks, so scale back by the world size to get the gradient of the global loss
    total_tokens, total_rows = ddp.all_sum(resp_mask.sum() * int(counted),
                                           tokens.shape[0] * int(counted))
    if total_tokens == 0:  # every rank alike: the gradient would be 0, and AdamW would still
        # move the weights (its momentum, weight decay)
        log.warning("optimizer_step: the loss counts no response token on any rank (e.g. every "
                    "response truncated under overlong filtering); the step was skipped")
        return StepStats(0.0, 0.0, 0.0, 0.0, stepped=False)
    total_rows = max(total_rows, 1.0)
    loss_sum, kl_sum, clip_sum = 0.0, 0.0, 0.0
    for rows, real in _every_rank_batches(batches):
        real = real and counted
        if not real:
            weight = 0.0
        elif loss_fn.aggregation == "token":
            weight = float(resp_mask[rows].sum()) / total_tokens
        else:  # "sequence" and "constant" normalise per response row
            weight = resp_mask[rows].shape[0] / total_rows
        # the micro-batch's loss times its weight (and the world size) as a per-token loss:
        # the LM head computes its gradients in the forward pass (response_loss)
        token_loss = loss_fn.token_loss(old[rows], _rows(ref, rows), advantages[rows],
                                        resp_mask[rows], scale=weight * world_size)
        loss, lp = policy.response_loss(tokens[rows], prompt_len=p, padding_mask=mask[rows],
                                        token_loss=token_loss, temperature=temperature)
        loss.backward()
        loss_sum += float(loss.detach()) / world_size
        if real:
            stats = loss_fn.stats(lp, old[rows], _rows(ref, rows), resp_mask[rows])
            share = float(resp_mask[rows].sum()) / total_tokens  # of the token means
            kl_sum += float(stats["kl"]) * share
            clip_sum += float(stats["clip_fraction"]) * share
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)  # over all ranks: every rank takes the same branch
    if not math.isfinite(grad_norm):  # stepping would write NaN into every weight
        optimizer.zero_grad(set_to_none=True)
        # the whole loss, not this rank's share (every rank takes this branch)
        loss = ddp.all_sum(loss_sum)[0]
        raise NonFiniteGradient(f"the gradient norm is {grad_norm} (loss {loss:.4g}): the "
                                "optimizer step was not taken, the weights are those before it "
                                "(a learning rate too high is the usual cause)")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepStats(loss_sum, kl_sum, clip_sum, grad_norm)


def mini_batches(groups: int, group_size: int, updates: int) -> list[tuple[slice, bool]]:
    """(rows, real) of each of `updates` optimizer steps over a batch of `groups` groups:
    consecutive runs of whole groups, as equal as possible (DAPO's and veRL's mini-batches). A
    mini-batch left without a group (fewer groups than updates) gets the first group's rows
    with real=False, to run at weight 0, so that every rank runs the same collectives."""
    groups = integer_arg("groups", groups, 0)
    group_size = integer_arg("group_size", group_size, 1)
    updates = integer_arg("updates", updates, 1)
    out = []
    for u in range(updates):
        lo, hi = groups * u // updates, groups * (u + 1) // updates
        out.append((slice(lo * group_size, hi * group_size), True) if hi > lo
                   else (slice(0, group_size), False))
    return out


def micro_batched_logprobs(policy, tokens: Tensor, mask: Tensor, prompt_len: int, *,
                           group_size: int, temperature: float, micro_batch_groups: int = 1,
                           max_tokens: int | None = None, updates: int = 1) -> Tensor:
    """policy.response_logprobs of the whole batch, computed micro-batch by micro-batch as
    optimizer_step plans them, over each of the `updates` mini-batches (`mini_batches`) the
    update steps on: the same packed lengths, so the graphs the update compiles (the whole
    batch planned at once packs other lengths, which the recipe's recompile budget did not
    count) and the memory bound of the token budget. Every rank runs the same number of
    forwards (FSDP2's collectives), repeating its first micro-batch where it has fewer; tokens
    must have rows (a rank with nothing to train on passes another rank's, as for
    optimizer_step). Call it under torch.no_grad() for old and reference logprobs."""
    try:  # every input check and plan before the first collective, agreed across ranks
        policy._check_tokens(tokens)
        if tokens.shape[0] == 0:
            raise ValueError("tokens has no rows: a rank with nothing to score passes rows of "
                             "a group (e.g. another rank's first), so that it runs the same "
                             "forwards and collectives")
        mask = as_padding_mask(mask)
        if mask.shape != tokens.shape:
            raise ValueError(f"mask must have the tokens' shape {tuple(tokens.shape)}, got "
                             f"{tuple(mask.shape)}")
        updates = integer_arg("updates", updates, 1)
        group_size = integer_arg("group_size", group_size, 1)
        if tokens.shape[0] % group_size:
            raise ValueError(f"tokens has {tokens.shape[0]} rows, not whole groups of "
                             f"group_size={group_size}")
        plans = []
        for mini, real_mini in mini_batches(tokens.shape[0] // group_size, group_size, updates):
            # counted by the update's plan of the same rows (counters["groups_split"])
            plans.append((mini, real_mini, micro_batch_rows(
                mask[mini], prompt_len=prompt_len, group_size=group_size,
                groups=micro_batch_groups, max_tokens=max_tokens, count=False)))
        refused = None
    except Exception as e:  # noqa: BLE001 - agreed across ranks below, then raised as it was
        refused = e
    ddp.raise_on_every_rank(refused, "micro_batched_logprobs")
    parts = []
    for mini, real_mini, batches in plans:
        mini_tokens, mini_mask = tokens[mini], mask[mini]
        out = None
        for rows, real in _every_rank_batches(batches):
            lp = policy.response_logprobs(mini_tokens[rows], prompt_len=prompt_len,
                                          padding_mask=mini_mask[rows],
                                          temperature=temperature)
            if out is None:
                out = lp.new_zeros(mini_mask.shape[0], lp.shape[1])
            if real:
                out[rows] = lp
        if real_mini:
            parts.append(out)
    return torch.cat(parts)


def _every_rank_batches(batches: list):
    """(rows, real) for each micro-batch, as many as the rank with most: a rank with fewer
    (dynamic sampling, a token budget) repeats its first with real=False, to run at weight 0,
    so that every rank runs the same FSDP collectives."""
    for i in range(int(ddp.all_max(len(batches))[0])):
        yield (batches[i], True) if i < len(batches) else (batches[0], False)


def _rows(x: Tensor | None, rows) -> Tensor | None:
    return None if x is None else x[rows]


def _check_rows(tokens: Tensor, prompt_len, **per_row: Tensor) -> int:
    """Before any micro-batch runs (a later refusal would leave its gradients in .grad): the
    batch has response columns, and old/ref [B, R] and advantages [B] are the tokens' rows.
    Returns prompt_len as an int."""
    b, length = tokens.shape
    if as_index(prompt_len) == length:
        raise ValueError(f"prompt_len={prompt_len!r} leaves no response columns in tokens of "
                         f"width {length}: nothing to train on")
    prompt_len = integer_arg("prompt_len", prompt_len, 1, length)
    want = {"old": (b, length - prompt_len), "ref": (b, length - prompt_len), "advantages": (b,)}
    for name, value in per_row.items():
        if not isinstance(value, Tensor) or tuple(value.shape) != want[name]:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{name} must be {list(want[name])} for tokens {[b, length]} with "
                             f"prompt_len={prompt_len}, got {got}")
    return prompt_len


def _zero_or_one(x) -> bool:
    """x is a bool, numpy bool, one-element tensor or number equal to 0 or 1."""
    try:
        return not isinstance(x, str) and any(bool(x == v) for v in (0, 1))
    except (TypeError, RuntimeError, ValueError):  # a tensor of several values
        return False


def _check_finite(resp_mask: Tensor, **values: Tensor | None) -> None:
    """old/ref [B, R] at the tokens the loss counts and advantages [B] of rows with one are
    finite: a NaN old logprob with a positive advantage is masked out of the gradient by the
    clipping (loss NaN, step taken); elsewhere NaN reached the gradient norm, blamed on the
    learning rate. One host sync."""
    bad = {}
    for name, x in values.items():
        if x is None:
            continue
        counts = resp_mask if x.dim() == 2 else resp_mask.any(1)
        bad[name] = ~torch.isfinite(x) & counts.to(x.device)
    flags = torch.stack([b.any() for b in bad.values()]).tolist()
    for (name, b), found in zip(bad.items(), flags):
        if found:
            where = b.nonzero()[0].tolist()
            raise ValueError(f"{name} is not finite at {'row, token' if b.dim() == 2 else 'row'} "
                             f"{', '.join(map(str, where))}, which the loss counts")


def _checked_loss_mask(loss_mask: Tensor, response_mask: Tensor) -> Tensor:
    """loss_mask as the loss takes it, refused unless it is a bool subset of the response mask
    (a token outside it has no logprob, but would count in the token normaliser)."""
    if loss_mask.shape != response_mask.shape or loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be bool of the responses' shape "
                         f"{tuple(response_mask.shape)}, got {loss_mask.dtype} "
                         f"{tuple(loss_mask.shape)}")
    outside = loss_mask & ~response_mask
    if outside.any():
        row = int(outside.any(1).nonzero()[0])
        raise ValueError(f"loss_mask marks tokens outside the padding mask's responses "
                         f"(row {row}): a padding token has no logprob")
    return loss_mask
