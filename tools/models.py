"""Model names the CLI understands: the tiny test families, Qwen3 size presets, or a path to a
Hugging Face config.json (or the directory holding it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["CliError", "TINY", "PRESETS", "TINY_MAX_POSITIONS", "available_memory", "model_dims",
           "build_model"]

TINY = ("qwen2_5", "llama3_2", "hf_qwen3", "hf_llama")
# the published Qwen3 configs' max_position_embeddings (the presets' context)
QWEN3_MAX_POSITIONS = 40960



def _qwen3_presets() -> dict[str, dict]:
    from dualkv_compile.models.qwen3_sizes import QWEN3_SIZES, QWEN3_VOCAB

    return {f"qwen3-{size}": dict(hidden=d["embed_dim"], layers=d["num_layers"],
                                  heads=d["num_heads"], kv_heads=d["num_kv_heads"],
                                  head_dim=d["head_dim"], ff=d["intermediate_dim"],
                                  vocab=QWEN3_VOCAB, tied=d["tie_word_embeddings"],
                                  qk_norm=True, max_positions=QWEN3_MAX_POSITIONS)
            for size, d in QWEN3_SIZES.items()}


PRESETS = _qwen3_presets()
_TINY_DIMS = dict(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ff=64, vocab=101)
# what testing.tiny_model builds each family with: torchtune's builders tie the embeddings
# (Qwen2's attention has q/k/v biases), transformers' do not (Qwen3 normalises q and k)
_TINY_FAMILY = {"qwen2_5": dict(tied=True, qkv_bias=True), "llama3_2": dict(tied=True),
                "hf_qwen3": dict(tied=False, qk_norm=True), "hf_llama": dict(tied=False)}
# the tiny families are built with as many positions as the layout needs, up to this (inspect
# runs the CPU reference attention, whose scores grow with the square of the packed length)
TINY_MAX_POSITIONS = 8192
# fields of a decoder config.json that must be positive integers (optional ones when present)
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "vocab_size")
_OPTIONAL = ("num_key_value_heads", "head_dim", "max_position_embeddings")


class CliError(Exception):
    """A user error: the CLI prints the message on one line and exits 2."""


def _short(e: Exception) -> str:
    """An exception's message as one line of at most 200 characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _hf_config_path(name: str) -> Path | None:
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.name == "config.json":
        if not path.is_file():
            raise CliError(f"no such file: {path}")
        return path
    return None


def _read_hf_config(path: Path) -> dict:
    """The config.json as a dict whose size fields are positive integers."""
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CliError(f"{path} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read {path}: {_short(e)}") from None
    if not isinstance(cfg, dict):
        raise CliError(f"{path} holds a JSON {type(cfg).__name__}, not an object of config "
                       "fields")
    for key in _REQUIRED + _OPTIONAL:
        if key not in cfg and key in _REQUIRED:
            raise CliError(f"{path} lacks the field {key!r} of a decoder config")
        value = cfg.get(key)
        # bool is an int to Python; JSON's true is no head count
        if (key in _REQUIRED or value is not None) and (type(value) is not int or value < 1):
            raise CliError(f"{path}: {key} = {json.dumps(value)} must be a positive integer")
    filled = _transformers_defaults(cfg)
    cfg = {**cfg, **filled}
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        origin = (f" (transformers' default for {cfg['model_type']}, which the file leaves out)"
                  if "num_key_value_heads" in filled else "")
        raise CliError(f"{path}: num_attention_heads = {heads} is not a multiple of "
                       f"num_key_value_heads = {kv_heads}{origin}")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise CliError(f"{path}: hidden_size = {cfg['hidden_size']} is not a multiple of "
                       f"num_attention_heads = {heads} (and no head_dim is given)")
    return cfg


def _transformers_defaults(cfg: dict) -> dict:
    """num_key_value_heads and head_dim where config.json leaves them out, as transformers
    fills them for its model_type (Qwen3: 32 KV heads of 128, not hidden / heads); {} where
    transformers is not installed or does not know the model_type."""
    missing = [k for k in ("num_key_value_heads", "head_dim") if cfg.get(k) is None]
    if not missing or not isinstance(cfg.get("model_type"), str):
        return {}
    try:
        from transformers import AutoConfig

        built = AutoConfig.for_model(**cfg)
    except Exception:  # noqa: BLE001 - not installed, an unknown model_type, fields it refuses
        return {}
    return {k: getattr(built, k) for k in missing
            if type(getattr(built, k, None)) is int and getattr(built, k) >= 1}


# structures plan's estimate does not model, which it would otherwise leave out silently:
# shared experts (Qwen2-MoE, DeepSeek), DeepSeek's routed experts, dense first layers and
# low-rank attention (MLA)
_UNMODELLED = ("shared_expert_intermediate_size", "n_shared_experts", "n_routed_experts",
               "first_k_dense_replace", "kv_lora_rank", "q_lora_rank")


def _hf_dims(cfg: dict, path: Path) -> dict:
    unmodelled = {k: cfg[k] for k in _UNMODELLED if cfg.get(k)}
    if unmodelled:
        raise CliError(f"{path}: {json.dumps(unmodelled)} describe a structure plan does not "
                       "model (shared or DeepSeek experts, low-rank attention); its figures "
                       "would leave them out")
    heads = cfg["num_attention_heads"]
    dims = dict(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                ff=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                tied=bool(cfg.get("tie_word_embeddings", False)),
                qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe"),
                qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias")),
                o_bias=bool(cfg.get("attention_bias")),  # Llama's and Qwen3's: o_proj's too
                max_positions=cfg.get("max_position_embeddings"),
                model_type=cfg.get("model_type"))
    # a mixture of experts: Qwen3-MoE's fields (Mixtral's num_local_experts, whose
    # intermediate_size is the expert's)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise CliError(f"{path}: layers without experts (decoder_sparse_step, "
                           "mlp_only_layers) are not modelled; plan takes every layer sparse")
        for key in ("num_experts_per_tok",):
            if type(cfg.get(key)) is not int or not 1 <= cfg[key] <= experts:
                raise CliError(f"{path}: {key} = {json.dumps(cfg.get(key))} must be an integer "
                               f"in [1, {experts}] for a config with {experts} experts")
        dims |= dict(experts=experts, active=cfg["num_experts_per_tok"],
                     ff=cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    return dims


def _unknown(name: str) -> CliError:
    return CliError(f"unknown model {name!r}: use one of {', '.join(TINY + tuple(PRESETS))} or "
                    f"a path to a Hugging Face config.json")


def model_dims(name: str) -> dict:
    """Shape of a model by name or config path (no weights are built)."""
    if name in PRESETS:
        return dict(PRESETS[name])
    if name in TINY:
        return dict(_TINY_DIMS, **_TINY_FAMILY[name], max_positions=TINY_MAX_POSITIONS)
    path = _hf_config_path(name)
    if path is None:
        raise _unknown(name)
    return _hf_dims(_read_hf_config(path), path)


def _check_positions(name: str, positions: int | None, limit: int | None) -> None:
    if positions is not None and limit is not None and positions > limit:
        raise CliError(f"prompt + response = {positions} positions, more than {name}'s "
                       f"maximum of {limit}")


def build_model(name: str, layers: int | None = None, positions: int | None = None):
    """A model with random weights: a tiny family, or a transformers causal LM built from a
    preset or a config.json (attn_implementation='sdpa'), optionally with fewer layers.
    `positions` (prompt + response tokens) is checked against the model's maximum before
    anything is built."""
    from dualkv_compile.testing import tiny_model

    if name in TINY:
        if layers is not None and layers != _TINY_DIMS["layers"]:
            raise CliError(f"--layers {layers}: the tiny family {name} has "
                           f"{_TINY_DIMS['layers']} layers; --layers applies to the presets "
                           "and config.json models")
        _check_positions(name, positions, TINY_MAX_POSITIONS)
        return tiny_model(name, max_seq_len=max(512, positions or 0))
    import transformers as tf

    if name in PRESETS:
        d = PRESETS[name]
        cfg = tf.Qwen3Config(vocab_size=d["vocab"], hidden_size=d["hidden"],
                             intermediate_size=d["ff"], num_hidden_layers=d["layers"],
                             num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                             head_dim=d["head_dim"], tie_word_embeddings=d["tied"],
                             max_position_embeddings=d["max_positions"])
    else:
        path = _hf_config_path(name)
        if path is None:
            raise _unknown(name)
        if "model_type" not in _read_hf_config(path):
            raise CliError(f"{path} lacks the field 'model_type', which names the transformers "
                           "class to build")
        try:
            cfg = tf.AutoConfig.from_pretrained(str(path))
        except (ValueError, KeyError, OSError) as e:
            raise CliError(f"transformers cannot read {path}: {_short(e)}") from None
    _check_positions(name, positions, getattr(cfg, "max_position_embeddings", None))
    if layers is not None:
        cfg.num_hidden_layers = layers
    _check_memory(name, layers)
    # (on stderr: stdout may be piped) building a preset's random weights takes up to a minute
    n = cfg.num_hidden_layers
    print(f"building {name} with random weights ({n} layer{'s' * (n != 1)})...",
          file=sys.stderr, flush=True)
    try:
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    except (ValueError, KeyError, AssertionError) as e:  # (transformers asserts, e.g. padding_idx)
        raise CliError(f"cannot build a causal LM from {name}: {_short(e)}") from None
    if any(hasattr(m, "gate_up_proj") for m in model.modules()):  # a mixture of experts
        from dualkv_compile.models import use_grouped_experts

        use_grouped_experts(model)  # the token-local expert op optimize() takes
    return model


def _check_memory(name: str, layers: int | None) -> None:
    """Refuse, before building, a model that does not fit the memory this machine has available
    (the allocator's own error is a long traceback). Building takes the fp32 weights, a second
    copy of a tied embedding (transformers makes the LM head before tying it) and about 0.2 GiB
    of imports."""
    from .plan_cmd import estimate

    try:
        dims = model_dims(name)
    except CliError:  # a structure plan does not model: let the build try
        return
    if layers is not None:
        dims["layers"] = layers
    weights = estimate(dims, 1, 1, 1)["params"] * 4
    tied = dims["vocab"] * dims["hidden"] * 4 if dims["tied"] else 0
    need = weights + tied + _BUILD_OVERHEAD
    available = available_memory()
    if available is not None and need > available:
        held = f"{weights / 2**30:.1f} GiB of fp32 weights" + (
            f" and {tied / 2**30:.1f} GiB for its tied embedding's second copy" if tied else "")
        n = dims["layers"]
        raise CliError(f"{name} with {n} layer{'s' * (n != 1)} needs about {need / 2**30:.1f} GiB "
                       f"to build ({held}), more than the {available / 2**30:.1f} GiB this "
                       f"machine has available; use --layers 1 (the graphs repeat per layer)")


_BUILD_OVERHEAD = 2**28  # what building imports and allocates besides the weights, rounded up


def available_memory() -> int | None:
    """MemAvailable in bytes (None where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
