"""Model builders for the recipes: a tiny decoder, Qwen3 on torchtune's modules with
transformers-format checkpoints, and Qwen3-MoE (transformers' model, set up for optimize())."""

from .checkpointer import Qwen3HFCheckpointer
from .hf_checkpoint import load_hf_checkpoint, qwen3_from_hf_config, save_hf_checkpoint
from .qwen3 import qwen3, qwen3_0_6b, qwen3_1_7b, qwen3_4b, qwen3_8b, qwen3_tiny
from .moe_experts import use_grouped_experts
from .qwen3_moe import QWEN3_30B_A3B, qwen3_moe, qwen3_moe_from_hf_config, qwen3_moe_tiny
from .tiny import tiny_decoder

__all__ = [
    "QWEN3_30B_A3B",
    "Qwen3HFCheckpointer",
    "load_hf_checkpoint",
    "qwen3",
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_from_hf_config",
    "qwen3_moe",
    "qwen3_moe_from_hf_config",
    "qwen3_moe_tiny",
    "qwen3_tiny",
    "save_hf_checkpoint",
    "tiny_decoder",
    "use_grouped_experts",
]
