"""Reading a transformers config, as an object (model.config) or as config.json's dict: the
fields that decide whether a model's attention is full causal attention with RoPE that depends
on positions only. One reading for optimize(), the rollout engine and the Qwen3 builder."""

from __future__ import annotations

__all__ = ["SEQUENCE_DEPENDENT_ROPE", "rope_types", "sliding_window"]

# RoPE variants whose frequencies depend on the sequence length (transformers'
# modeling_rope_utils): dynamic NTK scaling and LongRoPE's short/long factor switch
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")
# families whose attention takes the window from layer_types alone (transformers 5: a layer's
# sliding_window is set only if its type is "sliding_attention"); Mistral and Qwen3-MoE read
# config.sliding_window itself
_WINDOW_BY_LAYER_TYPE = ("qwen2", "qwen3")


def _field(cfg, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def rope_types(cfg) -> set[str]:
    """The rope types of `rope_scaling` (4.x, "rope_type" or "type"; transformers reads it
    first where both are present) or `rope_parameters` (transformers 5; one entry per layer
    type in some models); {"default"} when unscaled."""
    params = _field(cfg, "rope_scaling") or _field(cfg, "rope_parameters") or {}  # transformers
    if not isinstance(params, dict):
        return {"default"}
    per_type = params.values() if params and all(isinstance(v, dict) for v in params.values()) \
        else [params]
    return {p.get("rope_type", p.get("type", "default")) for p in per_type}


def sliding_window(cfg) -> str | None:
    """How the config's attention uses sliding windows ("layer_types=[...], sliding_window=N"),
    or None where every layer has full causal attention."""
    kinds = sorted(set(_field(cfg, "layer_types") or []))
    window = _field(cfg, "sliding_window")
    by_layer_type = _field(cfg, "model_type") in _WINDOW_BY_LAYER_TYPE
    if by_layer_type and isinstance(cfg, dict) and not cfg.get("use_sliding_window", False):
        window = None  # the post-init drops the window unless use_sliding_window is set
    if set(kinds) - {"full_attention"} and not (by_layer_type and window is None):
        return f"layer_types={kinds}, sliding_window={window}"
    if kinds and by_layer_type:
        # every layer full, or sliding layers without a window (they read it only when set)
        return None
    if isinstance(cfg, dict) and by_layer_type:
        # config.json without layer_types: the post-init makes layers from max_window_layers
        # on sliding, where use_sliding_window is set (default False, max_window_layers 28)
        start = cfg.get("max_window_layers", 28)
        if window and cfg.get("use_sliding_window", False) and \
                start < cfg.get("num_hidden_layers", start + 1):
            return f"use_sliding_window=True, sliding_window={window}, max_window_layers={start}"
        return None
    if not isinstance(cfg, dict):
        # a model's config after its post-init: Mistral's and Qwen3-MoE's attention read
        # config.sliding_window itself (a value set after the post-init, as from_pretrained's
        # keyword overrides do, is used whatever use_sliding_window says)
        return f"sliding_window={window}" if window else None
    uses = _field(cfg, "use_sliding_window", window is not None)  # config.json: the post-init's
    if window and uses:
        return f"use_sliding_window={uses}, sliding_window={window}"
    return None
