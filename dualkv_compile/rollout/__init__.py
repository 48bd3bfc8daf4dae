"""The rollout engine: shared-prompt decoding for GRPO groups (prompt K/V stored and read once
per group, response K/V per row, log-sum-exp merge), compiled and replayed as CUDA graphs.

`generate_groups` is the one-call form; hold a `RolloutEngine` to keep its compiled steps and
graphs across calls (the recipe does)."""

from .attention import decode_attention
from .cache import RolloutCache, prompt_bucket
from .engine import RolloutEngine
from .forward import SUPPORTED_FAMILIES, decoder_for
from .plan import generate_groups, plan_calls
from .prompts import prompt_mask_of
from .sampling import SamplingParams, sample

__all__ = [
    "RolloutCache",
    "RolloutEngine",
    "SUPPORTED_FAMILIES",
    "SamplingParams",
    "decode_attention",
    "decoder_for",
    "generate_groups",
    "plan_calls",
    "prompt_bucket",
    "prompt_mask_of",
    "sample",
]
