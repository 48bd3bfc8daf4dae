"""The GRPO recipe's rollouts: this rank's share of the step's prompts, their responses sampled
by the rollout engine (each prompt prefilled once for its samples), the task's rewards with
DAPO's overlong penalty, and dynamic sampling's refills (rl.scored_groups).

A mixin of `recipes/grpo_full_finetune.py`'s GRPORecipe, which sets the attributes it reads:
cfg, rank, device, dtype, rng, tokenizer, task, rollout_engine and groups_per_rank.
"""

from __future__ import annotations

import torch

from . import distributed as ddp
from .dynamic_sampling import checked_rewards, scored_groups
from .losses import overlong_penalty
from .rollout_batch import rollout_batch

__all__ = ["RecipeRollouts"]


class RecipeRollouts:
    def rollout(self, prompts: torch.Tensor):
        """prompts [G, P] -> tokens [G*N, P+T], padding mask, response lengths (the stop token
        included): rl.rollout_batch, each prompt prefilled once for its N samples. A sharded
        rank with G = 0 still joins the others' weight gathering."""
        cfg, tok = self.cfg, self.tokenizer
        return rollout_batch(
            self.rollout_engine, prompts.to(self.device), group_size=cfg.group_size,
            pad_id=tok.pad_id, max_generated_tokens=cfg.max_generated_tokens,
            stop_tokens=tok.stop_tokens, rows_per_call=cfg.get("rollout_batch_rows"),
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.get("top_p"), rng=self.rng,
            dtype=self.dtype)

    def _sample_prompts(self, need: int):
        """This rank's `need` prompts. Every rank draws all ranks' prompts from the task (so
        its generator stays the same everywhere, and one process sees the same order) and
        keeps its own slice."""
        needs = [int(n) for n in ddp.gather_objects(need)]
        prompts, answers = self.task.sample_prompts(sum(needs))
        start = sum(needs[: self.rank])
        return prompts[start:start + need], answers[start:start + need]

    def _scored_rollouts(self):
        """This rank's scored groups (rl.scored_groups: dynamic sampling refills groups whose
        rewards are all equal; a rank left with none trains on fillers at weight 0)."""
        cfg = self.cfg
        return scored_groups(self._sample_prompts, self.rollout, self._score,
                             groups=self.groups_per_rank, group_size=cfg.group_size,
                             dynamic_sampling=cfg.dynamic_sampling, pad_id=self.tokenizer.pad_id)

    def _score(self, responses: torch.Tensor, answers: list, lengths: torch.Tensor):
        """The task's rewards, with DAPO's overlong penalty if configured (on the CPU)."""
        rewards = checked_rewards(self.task.rewards(responses, answers), len(answers),
                                  f"{type(self.task).__name__}.rewards()")
        if self.cfg.get("overlong"):
            overlong = self.cfg.overlong
            rewards = rewards + overlong_penalty(lengths.cpu(), max_len=overlong.max_len,
                                                 cache_len=overlong.cache_len)
        return rewards
