"""GRPO and DAPO objectives over response logprobs [B, R] with a padding mask.

GRPO (Shao et al. 2024): group-normalised advantages, PPO-style clipped ratio, a KL penalty to
the reference policy (the k3 estimator exp(ref - pi) - (ref - pi) - 1), tokens averaged per
sequence then over sequences. Dr. GRPO (Liu et al. 2025): no std scaling of the advantages
and a constant normaliser (aggregation="constant"). DAPO (Yu et al. 2025): clip-higher (epsilon_high > epsilon_low),
token-level aggregation (all tokens of the batch weigh the same), dynamic sampling (groups whose
rewards are all equal carry no signal) and overlong reward shaping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..arguments import integer_arg, real_arg

__all__ = ["GRPOLoss", "group_advantages", "groups_with_signal", "needs_reference",
           "overlong_penalty"]


def group_advantages(rewards: Tensor, *, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """rewards [G, N] (N samples of each of G prompts) -> advantages [G, N]: reward minus its
    group's mean, divided by the group's population standard deviation (+eps) when `scale`
    (TRL and veRL divide by the sample standard deviation, sqrt(N / (N - 1)) larger). A group
    whose rewards are all equal gets exactly 0: its mean's rounding (rewards such as 1/3) would
    otherwise be divided by eps."""
    if not isinstance(scale, bool):  # "no" is true
        raise ValueError(f"scale={scale!r} must be True or False")
    if isinstance(rewards, list):  # as overlong_penalty takes its lengths
        rewards = torch.as_tensor(rewards)
    if not isinstance(rewards, Tensor) or rewards.dim() != 2 or 0 in rewards.shape:
        got = (f"shape {tuple(rewards.shape)}" if isinstance(rewards, Tensor)
               else type(rewards).__name__)
        raise ValueError(f"rewards must be [groups, samples] with at least one of each, "
                         f"got {got}")
    eps = real_arg("eps", eps, 0.0)  # a negative eps divided a group's spread by ~0 or < 0
    if not rewards.is_floating_point():  # 0/1 rule rewards as bool or int
        rewards = rewards.to(torch.get_default_dtype())
    if not torch.isfinite(rewards).all():  # NaN != NaN would also count as signal
        raise ValueError(f"rewards hold non-finite values in groups "
                         f"{(~torch.isfinite(rewards)).any(1).nonzero().flatten().tolist()}")
    centred = rewards - rewards.mean(1, keepdim=True)
    if scale:
        centred = centred / (rewards.std(1, keepdim=True, unbiased=False) + eps)
    return torch.where(groups_with_signal(rewards)[:, None], centred, torch.zeros_like(centred))


def groups_with_signal(rewards: Tensor) -> Tensor:
    """DAPO dynamic sampling: bool [G], False for groups whose rewards are all equal (zero
    advantage for every sample, so no gradient)."""
    return (rewards != rewards[:, :1]).any(1)


def needs_reference(loss_fn) -> bool:
    """Whether a loss needs the reference model's logprobs: not with kl_coef=0 (a loss without
    a KL term, DAPO's), which takes ref_logprobs=None. A loss without kl_coef does."""
    return getattr(loss_fn, "kl_coef", None) != 0


def _at_tokens(mask: Tensor, *values: Tensor | None) -> list[Tensor | None]:
    """Each [B, R] value with 0 at padding: padding may hold anything (NaN, -inf), which a
    weight of 0 would not cancel (NaN * 0), in the loss or in its gradient. (None: no
    reference, passed on.)"""
    return [None if v is None else torch.where(mask, v, torch.zeros_like(v)) for v in values]


def _check_tensors(**named) -> None:
    for name, value in named.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")


def _given(**values) -> dict:
    """The values that are not None (an optional tensor checked only when given)."""
    return {k: v for k, v in values.items() if v is not None}


def _check_mask(mask) -> None:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor (True = a response token), got {got}")


def overlong_penalty(lengths: Tensor, *, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment: 0 up to max_len - cache_len tokens, then falling linearly
    to -1 at max_len, -1 beyond. lengths: a tensor, or a list of lengths, [B], each >= 0."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.is_complex() or lengths.dtype == torch.bool or not bool(
            (torch.isfinite(lengths) & (lengths >= 0)).all()):  # (NaN reached the rewards)
        raise ValueError(f"lengths must be [B] finite counts >= 0, got {lengths.dtype} "
                         f"{tuple(lengths.shape)}: {lengths.tolist()[:8]}")
    max_len, cache_len = integer_arg("max_len", max_len, 1), integer_arg("cache_len", cache_len, 1)
    if not cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, "
                         f"max_len={max_len}")
    start = max_len - cache_len
    ramp = (start - lengths.float()) / cache_len
    return torch.where(lengths <= start, torch.zeros_like(ramp), ramp.clamp(min=-1.0))


AGGREGATIONS = ("sequence", "token", "constant")


@dataclass(kw_only=True)
class GRPOLoss:
    """Clipped policy-gradient loss with a KL penalty.

    epsilon_low / epsilon_high: the ratio is clipped to [1 - low, 1 + high] (DAPO's clip-higher
    when high > low). kl_coef: weight of the KL penalty to the reference policy.
    aggregation: "sequence" (GRPO: mean over each response's tokens, then over responses),
    "token" (DAPO: mean over all response tokens of the batch) or "constant" (Dr. GRPO: the
    sum over response tokens divided by responses x max_response_len, so that no response's
    tokens weigh more for its being short; TRL's loss_type="dr_grpo", whose divisor is
    max_completion_length). max_response_len: that constant; None takes the width R of the
    responses passed, which rl.rollout_batch pads to max_generated_tokens (the recipe's case),
    but a batch trimmed to its longest response would change the divisor.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    kl_coef: float = 0.04
    aggregation: str = "sequence"
    max_response_len: int | None = None

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r} must be one of {AGGREGATIONS}")
        for name in ("epsilon_high", "kl_coef"):
            setattr(self, name, real_arg(name, getattr(self, name), 0.0))
        # the lower bound 1 - epsilon_low: past 1 it is negative, a no-op clip (2.0 for 0.2)
        self.epsilon_low = real_arg("epsilon_low", self.epsilon_low, 0.0, 1.0)
        if self.max_response_len is not None:
            self.max_response_len = integer_arg("max_response_len", self.max_response_len, 1)

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor,
                 advantages: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """logprobs/old/ref [B, R], advantages [B], mask [B, R] (True = response token); ref
        None with kl_coef=0 (no reference model). Returns (loss, stats) with stats kl (0 without
        a reference), clip_fraction and ratio (detached means)."""
        self._check_reference(ref_logprobs)
        _check_tensors(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                       mask=mask, **_given(ref_logprobs=ref_logprobs))
        shapes = [tuple(t.shape) for t in (logprobs, old_logprobs,
                                           logprobs if ref_logprobs is None else ref_logprobs,
                                           mask)]
        if len(set(shapes)) > 1 or advantages.shape != logprobs.shape[:1]:
            raise ValueError(f"GRPOLoss needs logprobs, old, ref and mask of one shape [B, R] and "
                             f"advantages [B]; got {shapes[:3]}, {shapes[3]} and "
                             f"{tuple(advantages.shape)}")
        _check_mask(mask)
        adv = advantages[:, None].expand_as(logprobs)
        per_token = self._per_token(*_at_tokens(mask, logprobs, old_logprobs, ref_logprobs), adv)
        loss = (per_token * self.token_weights(mask).to(per_token.dtype)).sum()
        return loss, self.stats(logprobs, old_logprobs, ref_logprobs, mask)

    def _check_reference(self, ref_logprobs) -> None:
        if ref_logprobs is None and self.kl_coef != 0:
            raise ValueError(f"ref_logprobs is None, but the KL term (kl_coef={self.kl_coef}) "
                             f"needs the reference's logprobs; set kl_coef=0 to train without "
                             f"a reference model")

    def token_weights(self, mask: Tensor) -> Tensor:
        """[B, R]: the loss is the sum of the per-token terms times these (the aggregation)."""
        m = mask.to(torch.float64)
        if self.aggregation == "token":
            return m / m.sum().clamp_min(1)
        if self.aggregation == "constant":
            width = m.shape[1] if self.max_response_len is None else self.max_response_len
            if m.shape[1] > width:
                raise ValueError(f"responses of width {m.shape[1]} exceed "
                                 f"max_response_len={width}")
            return m / (m.shape[0] * width)
        return m / (m.sum(1, keepdim=True).clamp_min(1) * m.shape[0])

    def token_loss(self, old_logprobs: Tensor, ref_logprobs: Tensor, advantages: Tensor,
                   mask: Tensor, *, scale: float = 1.0):
        """This loss (times `scale`) as the per-token function that
        `DualKVModel.response_loss` takes: (logprobs [M], flat index [M] into [B, R]) -> [M].
        old/ref/mask are [B, R] (mask: the response mask, not the [B, L] padding mask) and
        advantages [B], of the rows response_loss gets. The function carries `response_shape`
        = (B, R) and `response_mask`, which response_loss checks against its tokens'
        (B, L - prompt_len) and their padding mask. ref None with kl_coef=0."""
        self._check_reference(ref_logprobs)
        _check_tensors(old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                       **_given(ref_logprobs=ref_logprobs))
        shapes = {name: tuple(x.shape) for name, x in [
            ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
            ("advantages", advantages), ("mask", mask)] if x is not None}
        br = shapes["mask"]  # (B, R)
        if (len(br) != 2 or shapes["old_logprobs"] != br
                or shapes.get("ref_logprobs", br) != br or shapes["advantages"] != br[:1]):
            raise ValueError(f"token_loss needs old_logprobs, ref_logprobs and mask of one "
                             f"shape [B, R] and advantages [B]; got {shapes}")
        _check_mask(mask)
        weights = (self.token_weights(mask) * scale).flatten()
        old, flat_mask = old_logprobs.flatten(), mask.flatten()
        ref = None if ref_logprobs is None else ref_logprobs.flatten()
        adv = advantages[:, None].expand_as(old_logprobs).flatten()

        def loss(logprobs: Tensor, index: Tensor) -> Tensor:
            # the LM head evaluates every token of the padding mask; those the loss mask leaves
            # out (DAPO's filtered responses) may hold NaN or -inf old logprobs, which their
            # weight of 0 would not cancel
            per_token = self._per_token(*_at_tokens(flat_mask[index], logprobs, old[index],
                                                    None if ref is None else ref[index]),
                                        adv[index])
            return per_token * weights[index].to(per_token.dtype)

        # response_loss checks both against its tokens: a flat index into another shape
        # would read other tokens' values, and a mask token the padding mask leaves out would
        # count in the normaliser while the LM head never evaluates it
        loss.response_shape, loss.response_mask = br, mask
        return loss

    def _ratio_kl(self, logprobs, old_logprobs, ref_logprobs, advantages=None):
        """Elementwise: the ratio to the sampling policy, it clipped, the k3 KL estimate. Given
        the advantages, a log-ratio past log(1 + epsilon_high) + 1 is capped where the
        advantage is >= 0: the loss takes the clipped term there (or none, at 0), so value and
        gradient are unchanged, and exp cannot overflow into inf * 0 = NaN (a log-ratio above
        88.7 in float32). A negative advantage takes the ratio itself: left to overflow."""
        log_ratio = logprobs - old_logprobs
        if advantages is not None:
            cap = math.log1p(self.epsilon_high) + 1.0
            log_ratio = torch.where(advantages >= 0, log_ratio.clamp_max(cap), log_ratio)
        ratio = torch.exp(log_ratio)
        if ref_logprobs is None:  # no reference (kl_coef=0): no KL term
            kl = torch.zeros_like(ratio)
        else:
            diff = ref_logprobs - logprobs
            kl = torch.exp(diff) - diff - 1
        return ratio, ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high), kl

    def _per_token(self, logprobs, old_logprobs, ref_logprobs, advantages):
        """The clipped policy term plus the KL term of each token; elementwise."""
        adv = advantages.to(logprobs.dtype)
        ratio, clipped, kl = self._ratio_kl(logprobs, old_logprobs, ref_logprobs, adv)
        return -torch.minimum(ratio * adv, clipped * adv) + self.kl_coef * kl

    @torch.no_grad()
    def stats(self, logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor,
              mask: Tensor) -> dict[str, Tensor]:
        """Token means of the KL estimate, the clipped fraction (tokens whose ratio lies
        outside [1 - epsilon_low, 1 + epsilon_high], whether or not the clipped term is the one
        the loss takes for its advantage's sign) and the ratio; kl 0 without a reference."""
        self._check_reference(ref_logprobs)
        _check_mask(mask)
        acc = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 sums skew the means
        m = mask.to(acc)
        n = m.sum().clamp_min(1)
        ratio, clipped, kl = self._ratio_kl(*_at_tokens(
            mask, logprobs.to(acc), old_logprobs.to(acc),
            None if ref_logprobs is None else ref_logprobs.to(acc)))
        return {"kl": (kl * m).sum() / n,
                "clip_fraction": ((ratio != clipped).to(m.dtype) * m).sum() / n,
                "ratio": (ratio * m).sum() / n}
