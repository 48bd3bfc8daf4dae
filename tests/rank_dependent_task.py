"""A task for the 2-process dynamic-sampling test: which groups have a reward signal depends on
the rank and the round, so the ranks need different numbers of refill rounds and rows."""

import torch
import torch.distributed as dist

from dualkv_compile.rl import RepeatLastLetterTask

# plan -> rank -> per rewards() call, the groups (of the rows passed) whose rewards are all 0
NO_SIGNAL = {"refill": {0: [[0], []], 1: [[0, 1], [0], []]},
             # rank 1 never finds a signal in its 4 rounds (2 groups each)
             "rank1_silent": {0: [[], []], 1: [[0, 1]] * 4},
             # rank 0 keeps one group of its two, rank 1 none
             "rank0_one_rank1_silent": {0: [[0]] * 4, 1: [[0, 1]] * 4}}


class RankDependentTask(RepeatLastLetterTask):
    """Rewards 0, 1, 0, 1, ... within each group (a signal), except for the groups NO_SIGNAL
    lists for this rank and call, which get all 0 (dropped by dynamic sampling)."""

    def __init__(self, *args, group_size: int, plan: str = "refill", **kw):
        super().__init__(*args, **kw)
        self.group_size, self.calls, self.plan = group_size, 0, plan

    def rewards(self, responses, answers):
        rank = dist.get_rank() if dist.is_initialized() else 0
        plan = NO_SIGNAL[self.plan][rank]
        silent = plan[self.calls] if self.calls < len(plan) else []
        self.calls += 1
        rewards = (torch.arange(responses.shape[0]) % 2).float()
        for g in silent:
            rewards[g * self.group_size:(g + 1) * self.group_size] = 0
        return rewards
