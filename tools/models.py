"""Model names the CLI understands: the tiny test families, Qwen3 size presets, or a path to a
Hugging Face config.json (or the directory holding it)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CliError", "TINY", "PRESETS", "model_dims", "build_model"]

TINY = ("qwen2_5", "llama3_2", "hf_qwen3", "hf_llama")



def _qwen3_presets() -> dict[str, dict]:
    from dualkv_compile.models.qwen3 import QWEN3_SIZES, QWEN3_VOCAB

    return {f"qwen3-{size}": dict(hidden=d["embed_dim"], layers=d["num_layers"],
                                  heads=d["num_heads"], kv_heads=d["num_kv_heads"],
                                  head_dim=d["head_dim"], ff=d["intermediate_dim"],
                                  vocab=QWEN3_VOCAB, tied=d["tie_word_embeddings"])
            for size, d in QWEN3_SIZES.items()}


PRESETS = _qwen3_presets()
_TINY_DIMS = dict(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ff=64, vocab=101,
                  tied=True)


class CliError(Exception):
    """A user error: the CLI prints the message on one line and exits 2."""


def _hf_config_path(name: str) -> Path | None:
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.name == "config.json":
        if not path.is_file():
            raise CliError(f"no such file: {path}")
        return path
    return None


def _hf_dims(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CliError(f"{path} is not valid JSON: {e}") from None
    try:
        heads = cfg["num_attention_heads"]
        return dict(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                    kv_heads=cfg.get("num_key_value_heads", heads),
                    head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                    ff=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                    tied=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise CliError(f"{path} lacks the field {e.args[0]!r} of a decoder config") from None


def _unknown(name: str) -> CliError:
    return CliError(f"unknown model {name!r}: use one of {', '.join(TINY + tuple(PRESETS))} or "
                    f"a path to a Hugging Face config.json")


def model_dims(name: str) -> dict:
    """Shape of a model by name or config path (no weights are built)."""
    if name in PRESETS:
        return dict(PRESETS[name])
    if name in TINY:
        return dict(_TINY_DIMS)
    path = _hf_config_path(name)
    if path is None:
        raise _unknown(name)
    return _hf_dims(path)


def build_model(name: str, layers: int | None = None):
    """A model with random weights: a tiny family, or a transformers causal LM built from a
    preset or a config.json (attn_implementation='sdpa'), optionally with fewer layers."""
    from dualkv_compile.testing import tiny_model

    if name in TINY:
        return tiny_model(name)
    import transformers as tf

    if name in PRESETS:
        d = PRESETS[name]
        cfg = tf.Qwen3Config(vocab_size=d["vocab"], hidden_size=d["hidden"],
                             intermediate_size=d["ff"], num_hidden_layers=d["layers"],
                             num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                             head_dim=d["head_dim"], tie_word_embeddings=d["tied"])
    else:
        path = _hf_config_path(name)
        if path is None:
            raise _unknown(name)
        _hf_dims(path)  # validates the fields
        cfg = tf.AutoConfig.from_pretrained(str(path.parent))
    if layers is not None:
        cfg.num_hidden_layers = layers
    try:
        return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    except (ValueError, KeyError) as e:
        raise CliError(f"cannot build a causal LM from {name}: {e}") from None
