"""GRPO and DAPO objectives over response logprobs [B, R] with a padding mask.

GRPO (Shao et al. 2024): group-normalised advantages, PPO-style clipped ratio, a KL penalty to
the reference policy (the k3 estimator exp(ref - pi) - (ref - pi) - 1), tokens averaged per
sequence then over sequences. DAPO (Yu et al. 2025): clip-higher (epsilon_high > epsilon_low),
token-level aggregation (all tokens of the batch weigh the same), dynamic sampling (groups whose
rewards are all equal carry no signal) and overlong reward shaping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GRPOLoss", "group_advantages", "groups_with_signal", "overlong_penalty"]


def group_advantages(rewards: Tensor, *, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """rewards [G, N] (N samples of each of G prompts) -> advantages [G, N]: reward minus its
    group's mean, divided by the group's standard deviation (+eps) when `scale`."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(1, keepdim=True, unbiased=False) + eps)


def groups_with_signal(rewards: Tensor) -> Tensor:
    """DAPO dynamic sampling: bool [G], False for groups whose rewards are all equal (zero
    advantage for every sample, so no gradient)."""
    return (rewards != rewards[:, :1]).any(1)


def overlong_penalty(lengths: Tensor, *, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment: 0 up to max_len - cache_len tokens, then falling linearly
    to -1 at max_len, -1 beyond."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, "
                         f"max_len={max_len}")
    start = max_len - cache_len
    ramp = (start - lengths.float()) / cache_len
    return torch.where(lengths <= start, torch.zeros_like(ramp), ramp.clamp(min=-1.0))


@dataclass(kw_only=True)
class GRPOLoss:
    """Clipped policy-gradient loss with a KL penalty.

    epsilon_low / epsilon_high: the ratio is clipped to [1 - low, 1 + high] (DAPO's clip-higher
    when high > low). kl_coef: weight of the KL penalty to the reference policy.
    aggregation: "sequence" (GRPO: mean over each response's tokens, then over responses) or
    "token" (DAPO: mean over all response tokens of the batch).
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    kl_coef: float = 0.04
    aggregation: str = "sequence"

    def __post_init__(self):
        if self.aggregation not in ("sequence", "token"):
            raise ValueError(f"aggregation={self.aggregation!r} must be 'sequence' or 'token'")
        if self.epsilon_low < 0 or self.epsilon_high < 0 or self.kl_coef < 0:
            raise ValueError(f"epsilon_low={self.epsilon_low}, epsilon_high={self.epsilon_high} "
                             f"and kl_coef={self.kl_coef} must be >= 0")

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor,
                 advantages: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """logprobs/old/ref [B, R], advantages [B], mask [B, R] (True = response token).
        Returns (loss, stats) with stats kl, clip_fraction and ratio (detached means)."""
        m = mask.to(logprobs.dtype)
        ratio = torch.exp(logprobs - old_logprobs)
        adv = advantages[:, None].to(logprobs.dtype)
        clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        policy = -torch.minimum(ratio * adv, clipped * adv)
        diff = ref_logprobs - logprobs
        kl = torch.exp(diff) - diff - 1
        per_token = policy + self.kl_coef * kl
        if self.aggregation == "token":
            loss = (per_token * m).sum() / m.sum().clamp_min(1)
        else:
            per_seq = (per_token * m).sum(1) / m.sum(1).clamp_min(1)
            loss = per_seq.mean()
        with torch.no_grad():
            n = m.sum().clamp_min(1)
            stats = {"kl": (kl * m).sum() / n,
                     "clip_fraction": ((ratio != clipped).to(m.dtype) * m).sum() / n,
                     "ratio": (ratio * m).sum() / n}
        return loss, stats
