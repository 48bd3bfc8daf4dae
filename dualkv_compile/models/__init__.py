"""Model builders for the recipes: a tiny decoder, and Qwen3 on torchtune's modules with
transformers-format checkpoints."""

from .checkpointer import Qwen3HFCheckpointer
from .hf_checkpoint import load_hf_checkpoint, qwen3_from_hf_config, save_hf_checkpoint
from .qwen3 import qwen3, qwen3_0_6b, qwen3_1_7b, qwen3_4b, qwen3_8b, qwen3_tiny
from .tiny import tiny_decoder

__all__ = [
    "Qwen3HFCheckpointer",
    "load_hf_checkpoint",
    "qwen3",
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_from_hf_config",
    "qwen3_tiny",
    "save_hf_checkpoint",
    "tiny_decoder",
]
