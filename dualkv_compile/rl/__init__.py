"""RL post-training pieces for the recipes: losses, advantages, tasks with verifiable rewards.
Configs reference them by `_component_` path (e.g. dualkv_compile.rl.GRPOLoss)."""

from .dynamic_sampling import BatchRefused, NoGroupWithSignal, ScoredGroups, scored_groups
from .flops import forward_flops, peak_bf16_tflops, policy_update_flops
from .hf_tokenizer import HFTokenizer
from .losses import (GRPOLoss, group_advantages, groups_with_signal, needs_reference,
                     overlong_penalty)
from .metric_log import TensorBoardLogger
from .math_task import MathJSONLTask, final_number
from ..rollout import generate_groups, plan_calls
from .rollout_batch import rollout_batch, truncated_responses
from .shape_task import EvenTokensTask, IdTokenizer
from .tasks import CharTokenizer, RepeatLastLetterTask
from .update import (NonFiniteGradient, StepStats, micro_batched_logprobs, mini_batches,
                     optimizer_step)

__all__ = [
    "BatchRefused",
    "CharTokenizer",
    "EvenTokensTask",
    "GRPOLoss",
    "HFTokenizer",
    "IdTokenizer",
    "MathJSONLTask",
    "NoGroupWithSignal",
    "NonFiniteGradient",
    "RepeatLastLetterTask",
    "ScoredGroups",
    "StepStats",
    "TensorBoardLogger",
    "final_number",
    "forward_flops",
    "generate_groups",
    "group_advantages",
    "groups_with_signal",
    "micro_batched_logprobs",
    "mini_batches",
    "needs_reference",
    "optimizer_step",
    "overlong_penalty",
    "peak_bf16_tflops",
    "plan_calls",
    "policy_update_flops",
    "rollout_batch",
    "scored_groups",
    "truncated_responses",
]
