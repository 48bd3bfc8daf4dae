"""RoPE types read from a config: transformers 4.x's legacy "type" key names the type (a
linear scaling is refused, not built as plain RoPE), and LongRoPE, which rescales with the
sequence length, is refused by optimize() and by the rollout engine."""

import json

import pytest
import transformers as tf

import dualkv_compile as dk
from dualkv_compile.hf_config import rope_types
from dualkv_compile.models import qwen3_from_hf_config


def test_the_legacy_type_key_names_the_rope_type(tmp_path):
    assert rope_types({"rope_scaling": {"type": "dynamic", "factor": 2.0}}) == {"dynamic"}
    assert rope_types({"rope_scaling": {"rope_type": "yarn", "type": "dynamic"}}) == {"yarn"}
    cfg = tf.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=16).to_dict()
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}  # a 4.x config.json
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type='linear' is not supported"):
        qwen3_from_hf_config(tmp_path)


def longrope_model():
    head_dim = 8
    cfg = tf.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256,
                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                          "short_factor": [1.0] * (head_dim // 2),
                                          "long_factor": [2.0] * (head_dim // 2),
                                          "original_max_position_embeddings": 64})
    return tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def test_longrope_is_refused_by_optimize():
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        dk.optimize(longrope_model(), dk.DualKVConfig(fallback="dense"))


def test_longrope_is_refused_by_the_rollout_engine():
    # its cache would keep prompt keys rotated by the short factor after the sequence passed
    # 64 positions, where a plain forward rotates every key by the long one
    from dualkv_compile.rollout import RolloutEngine

    with pytest.raises(ValueError, match="rope_type='longrope' changes every position"):
        RolloutEngine(longrope_model())
