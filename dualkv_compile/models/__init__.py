"""Model builders for the recipes: a tiny decoder, Qwen3 on torchtune's modules with
transformers-format checkpoints, and Qwen3-MoE (transformers' model, set up for optimize()).

The names are imported when first read (`.._lazy`): the builders import torchtune or
transformers, which the CLI's model list (qwen3_sizes.py) does not need."""

from .._lazy import lazy_package as _lazy_package

_EXPORTS = {
    "QWEN3_30B_A3B": ".qwen3_moe",
    "Qwen3HFCheckpointer": ".checkpointer",
    "load_hf_checkpoint": ".hf_checkpoint",
    "qwen3": ".qwen3",
    "qwen3_0_6b": ".qwen3",
    "qwen3_1_7b": ".qwen3",
    "qwen3_4b": ".qwen3",
    "qwen3_8b": ".qwen3",
    "qwen3_from_hf_config": ".hf_checkpoint",
    "qwen3_moe": ".qwen3_moe",
    "qwen3_moe_from_hf_config": ".qwen3_moe",
    "qwen3_moe_tiny": ".qwen3_moe",
    "qwen3_tiny": ".qwen3",
    "save_hf_checkpoint": ".hf_checkpoint",
    "tiny_decoder": ".tiny",
    "use_grouped_experts": ".moe_experts",
}
__all__ = list(_EXPORTS)

_lazy_package(__name__, _EXPORTS)
