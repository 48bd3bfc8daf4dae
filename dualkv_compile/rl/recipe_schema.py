"""The GRPO recipe's config schema: each key the recipe reads, its type and its range
(`recipe_config.check_recipe_config` checks a config against it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..attention.registry import KERNELS
from ..rollout.sampling import MIN_TEMPERATURE

__all__ = ["GRPO_SCHEMA", "Key", "NULLABLE_SECTIONS", "SUPPLIED_BY_RECIPE", "not_nan"]


@dataclass(frozen=True)
class Key:
    kind: str                            # "int", "float", "bool", "str", "choice", "section"
    check: Callable[[Any], str | None] | None = None   # returns what is wrong, or None
    nullable: bool = False
    choices: tuple = ()
    required: bool = True


def _at_least(n):
    return lambda v: None if v >= n else f"must be >= {n}"


def _in_range(lo, hi):
    return lambda v: None if lo <= v <= hi else f"must be in [{lo}, {hi}]"


def _positive(v):
    return None if v > 0 else "must be > 0"


def _temperature(v):
    return None if MIN_TEMPERATURE <= v < math.inf else \
        f"must be a finite number >= {MIN_TEMPERATURE} (the rollout's sampling)"


def not_nan(v):
    return "is not a number (NaN)" if math.isnan(v) else None


def _unit_interval(v):
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _group_size(v):
    if v < 2:
        return ("must be >= 2: GRPO normalises rewards within a group, so a group of one has "
                "advantage 0 and trains nothing")
    return None


def _device(v):
    import torch

    kind, _, index = str(v).partition(":")
    if not (str(v) in ("cpu", "cuda") or (kind == "cuda" and index.isdigit())):
        return "must be 'cpu', 'cuda' or 'cuda:N' (N a device index)"
    if kind == "cuda" and not torch.cuda.is_available():
        return "needs CUDA, but torch.cuda.is_available() is False on this machine; use device=cpu"
    if index and int(index) >= torch.cuda.device_count():
        return f"names a device past this machine's {torch.cuda.device_count()} CUDA device(s)"
    if index and world_size() > 1:
        return (f"names one device, but {world_size()} processes run (WORLD_SIZE): name only "
                f"the type, 'cuda'; each rank takes cuda:LOCAL_RANK")
    return None


def world_size() -> int:
    """The processes torchrun launched (WORLD_SIZE; 1 without it)."""
    import os

    from .recipe_config import ConfigError

    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError([f"WORLD_SIZE={value!r} (the environment) must be an integer >= 1, "
                           f"as torchrun sets it"])
    return int(value)


COMPONENT = Key("section")
# the keys the recipe reads; sections hold their own keys
GRPO_SCHEMA: dict[str, Any] = {
    "output_dir": Key("str"),
    "checkpoint_dir": Key("str", required=False),  # referenced by ${checkpoint_dir} in configs
    # torch.manual_seed takes [-2**63, 2**64); rank r seeds seed + r, so the top half is kept free
    "seed": Key("int", _in_range(-2**63, 2**63 - 1)),
    "device": Key("str", _device),
    "dtype": Key("choice", choices=("fp32", "bf16", "fp64")),
    "num_steps": Key("int", _at_least(1)),
    "groups_per_step": Key("int", _at_least(1)),
    "group_size": Key("int", _group_size),
    "rollout_batch_rows": Key("int", _at_least(1), nullable=True, required=False),
    "max_generated_tokens": Key("int", _at_least(1)),
    "temperature": Key("float", _temperature),
    "top_k": Key("int", _at_least(1), nullable=True),
    "top_p": Key("float", _unit_interval, nullable=True, required=False),
    "rollout_share_prompt": Key("bool", nullable=True, required=False),
    "rollout_steps_per_graph": Key("int", _at_least(1), required=False),
    "rollout_release_cache": Key("bool", required=False),
    "micro_batch_groups": Key("int", _at_least(1)),
    "max_tokens_per_micro_batch": Key("int", _at_least(1), nullable=True, required=False),
    "max_grad_norm": Key("float", _positive),
    "updates_per_step": Key("int", _at_least(1), required=False),
    "scale_advantages": Key("bool", required=False),
    "dynamic_sampling": Key("bool"),
    "overlong_filter": Key("bool", required=False),
    "overlong": {"max_len": Key("int", _at_least(1)), "cache_len": Key("int", _at_least(0))},
    "save_every": Key("int", _at_least(0)),
    "save_final_checkpoint": Key("bool", required=False),
    "resume_from_checkpoint": Key("bool"),
    "overwrite_output_dir": Key("bool", required=False),
    "enable_activation_checkpointing": Key("bool", required=False),
    "fsdp_reshard_after_forward": Key("bool", required=False),
    "peak_tflops": Key("float", _positive, nullable=True, required=False),
    "dualkv": {"enabled": Key("bool"), "fallback": Key("choice", choices=("error", "dense")),
               "attention_backend": Key("choice", choices=tuple(KERNELS),
                                        required=False),
               "bucket_growth": Key("float", _in_range(1, 4), required=False),
               "compile_region": Key("choice", choices=("auto", "model", "layer"),
                                     required=False)},
    "tokenizer": COMPONENT, "task": COMPONENT, "model": COMPONENT, "loss": COMPONENT,
    "optimizer": COMPONENT, "metric_logger": COMPONENT,
    "checkpointer": Key("section", nullable=True, required=False),
}
NULLABLE_SECTIONS = {"overlong"}
# arguments the recipe passes itself, not the config
SUPPLIED_BY_RECIPE = {"task": {"tokenizer"}, "optimizer": {"params"}}
