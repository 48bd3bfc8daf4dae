"""Model builders for the recipes. The Qwen3 builder (QK-norm before RoPE) lands with issue #5."""

from .tiny import tiny_decoder

__all__ = ["tiny_decoder"]
