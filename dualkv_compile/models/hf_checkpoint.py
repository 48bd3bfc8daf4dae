"""Qwen3 weights between transformers' layout (safetensors + config.json) and ours."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from ..hf_config import rope_types, sliding_window

__all__ = ["hf_to_ours", "ours_to_hf", "load_hf_checkpoint", "save_hf_checkpoint",
           "qwen3_from_hf_config", "read_hf_state", "write_hf_state"]

# (transformers name, our name), per layer where {i} appears
_LAYER_KEYS = [
    ("self_attn.q_proj.weight", "attn.q_proj.weight"),
    ("self_attn.k_proj.weight", "attn.k_proj.weight"),
    ("self_attn.v_proj.weight", "attn.v_proj.weight"),
    ("self_attn.o_proj.weight", "attn.output_proj.weight"),
    ("self_attn.q_norm.weight", "attn.q_norm.scale"),
    ("self_attn.k_norm.weight", "attn.k_norm.scale"),
    ("mlp.gate_proj.weight", "mlp.w1.weight"),
    ("mlp.down_proj.weight", "mlp.w2.weight"),
    ("mlp.up_proj.weight", "mlp.w3.weight"),
    ("input_layernorm.weight", "sa_norm.scale"),
    ("post_attention_layernorm.weight", "mlp_norm.scale"),
]
_TOP_KEYS = [("model.embed_tokens.weight", "tok_embeddings.weight"),
             ("model.norm.weight", "norm.scale"), ("lm_head.weight", "output.weight")]


def _rename(name: str, to_ours: bool) -> str:
    for hf, ours in _TOP_KEYS:
        if name == (hf if to_ours else ours):
            return ours if to_ours else hf
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)" if to_ours else r"layers\.(\d+)\.(.+)", name)
    if m:
        for hf, ours in _LAYER_KEYS:
            if m.group(2) == (hf if to_ours else ours):
                prefix = "layers" if to_ours else "model.layers"
                return f"{prefix}.{m.group(1)}.{ours if to_ours else hf}"
    raise KeyError(f"no {'dualkv' if to_ours else 'transformers'} name for weight {name!r}")


def hf_to_ours(state: dict, *, tied: bool) -> dict:
    """Our names for a transformers state dict. A tied model takes its LM head from the
    embedding: an lm_head.weight that differs from it is an untied checkpoint, refused."""
    if tied:
        check_tied_head(state)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return {_rename(k, True): v for k, v in state.items()}


def check_tied_head(state: dict) -> None:
    """A tied model takes its LM head from the embedding: a transformers-named state dict
    whose lm_head.weight differs from it is an untied checkpoint, refused."""
    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is not None and embed is not None and not torch.equal(head, embed):
        raise ValueError("the checkpoint's lm_head.weight differs from its "
                         "model.embed_tokens.weight, but the model ties them "
                         "(tie_word_embeddings=True): to keep the trained LM head, build it "
                         "with tie_word_embeddings=False (with Qwen3HFCheckpointer, which "
                         "reads the tying from config.json: set \"tie_word_embeddings\": "
                         "false there)")


def ours_to_hf(state: dict) -> dict:
    return {_rename(k, False): v for k, v in state.items()}


def _rope_theta(cfg: dict) -> float:
    """transformers 5 keeps it in rope_parameters, 4.x at the top level; only the default
    (unscaled) rope type is supported. rope_scaling, where present, wins over rope_parameters
    as in transformers; without either, transformers' default theta (10,000)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        # transformers' Qwen3 reads one rope_parameters dict; per-layer-type ones fail there
        raise ValueError(f"rope parameters per layer type ({sorted(params)}) are not a Qwen3 "
                         f"config: give one dict with rope_type and rope_theta")
    kinds = rope_types(cfg)
    if kinds != {"default"}:
        kind = sorted(kinds - {"default"})[0]
        raise ValueError(f"rope_type={kind!r} is not supported by this Qwen3 builder (only "
                         f"'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))


def qwen3_from_hf_config(path: str | Path, **overrides) -> nn.Module:
    """Our Qwen3 with the shape given by a transformers config.json (file or directory)."""
    from .qwen3 import qwen3

    path = Path(path)
    cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    _check_dense_qwen3(cfg, path)
    kw = dict(vocab_size=cfg["vocab_size"], num_layers=cfg["num_hidden_layers"],
              num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"] or cfg["num_attention_heads"],
              embed_dim=cfg["hidden_size"], intermediate_dim=cfg["intermediate_size"],
              head_dim=cfg.get("head_dim") or 128,  # Qwen3Config's default, not hidden / heads
              max_seq_len=cfg.get("max_position_embeddings", 32768),  # Qwen3Config's default
              rope_base=_rope_theta(cfg), norm_eps=cfg.get("rms_norm_eps", 1e-6),
              tie_word_embeddings=cfg.get("tie_word_embeddings", False),
              pad_token_id=cfg.get("pad_token_id"))  # transformers' padding_idx
    return qwen3(**{**kw, **overrides})


# what a recipe may set beside a checkpointer over config.json (models.qwen3's argument name for
# the sequence limit, which no saved weight or config depends on)
qwen3_from_hf_config.overrides_beside_checkpoint = ("path", "max_seq_len")


_SHAPE_FIELDS = ("vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "hidden_size", "intermediate_size")


def _check_dense_qwen3(cfg: dict, path: Path) -> None:
    """Refuse, by name, the config fields this builder cannot honour: another model type,
    sliding-window layers, an activation other than SiLU, attention biases or dropout, and
    the shape fields it does not guess when they are missing."""
    missing = [k for k in _SHAPE_FIELDS if k not in cfg]
    if missing:
        raise ValueError(f"{path}: config.json lacks {missing}, which this Qwen3 builder reads "
                         f"(every Qwen3 release's config.json holds them)")
    kind = cfg.get("model_type", "qwen3")
    if kind != "qwen3":
        hint = " (use models.qwen3_moe_from_hf_config)" if kind == "qwen3_moe" else ""
        raise ValueError(f"{path}: model_type={kind!r}; this builder makes dense Qwen3 "
                         f"(model_type 'qwen3'){hint}")
    window = sliding_window(cfg)
    if window:
        raise ValueError(f"{path}: sliding-window attention ({window}) is not built by this "
                         f"Qwen3 builder, which has full causal attention")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN: both are nn.SiLU
        raise ValueError(f"{path}: hidden_act={act!r}; this Qwen3 builder's MLP uses SiLU")
    if cfg.get("attention_bias", False):  # its weights would then fail to load, unnamed
        raise ValueError(f"{path}: attention_bias=true; this Qwen3 builder's q/k/v/o "
                         f"projections have no bias (Qwen3's have none)")
    if cfg.get("attention_dropout", 0.0):
        raise ValueError(f"{path}: attention_dropout={cfg['attention_dropout']!r}; this Qwen3 "
                         f"builder has no attention dropout (set it to 0.0 in a copy)")


def _tied(model: nn.Module) -> bool:
    return hasattr(model.output, "tied_module")


def load_hf_checkpoint(model: nn.Module, directory: str | Path) -> None:
    """Load model.safetensors (or the shards an index names) from `directory` into `model`."""
    model.load_state_dict(hf_to_ours(read_hf_state(directory), tied=_tied(model)), strict=True)


def read_hf_state(directory: str | Path) -> dict:
    """The transformers-named state dict of model.safetensors, or of the shards an index names."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").is_file():  # transformers' order: the single file first
        files = ["model.safetensors"]
    elif index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map (tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in "
                                f"{directory}")
    state: dict = {}
    for name in files:
        state.update(load_file(str(directory / name)))
    return state


def save_hf_checkpoint(model: nn.Module, directory: str | Path, *, config: dict) -> None:
    """Write model.safetensors and config.json (a transformers Qwen3 config dict, whose
    tie_word_embeddings must say what the model does: a tied model's file holds no LM head,
    which transformers would otherwise fill at random, with only a logged warning)."""
    said = config.get("tie_word_embeddings", False)  # Qwen3Config's default
    if said != _tied(model):
        raise ValueError(f"config has tie_word_embeddings={said}"
                         f"{'' if 'tie_word_embeddings' in config else ' (left out)'}, but the "
                         f"model {'ties' if _tied(model) else 'does not tie'} its LM head to "
                         f"the embedding; set it to {_tied(model)}")
    write_hf_state(model.state_dict(), directory)
    (Path(directory) / "config.json").write_text(json.dumps(config, indent=2))


def write_hf_state(state: dict, directory: str | Path, *, rename: bool = True) -> Path:
    """Write our state dict as transformers-named model.safetensors in `directory` (a state
    dict already in transformers' names with rename=False)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if (directory / "model.safetensors.index.json").is_file():
        raise FileExistsError(f"{directory} holds a sharded checkpoint "
                              f"(model.safetensors.index.json); write into another folder")
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(ours_to_hf(state) if rename else state, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory / "model.safetensors"


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fuse_moe_experts(state: dict) -> dict:
    """A Qwen3-MoE checkpoint's per-expert weights (experts.E.{gate,up,down}_proj.weight, the
    file format) as the model's fused parameters: experts.gate_up_proj [E, 2I, d] (gate rows,
    then up rows) and experts.down_proj [E, d, I]."""
    experts: dict[str, dict[int, dict[str, object]]] = {}
    out = {}
    for name, value in state.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
        else:
            out[name] = value
    for prefix, by_index in experts.items():
        for i in range(max(by_index) + 1):
            missing = sorted({"gate_proj", "up_proj", "down_proj"} - set(by_index.get(i, {})))
            if missing:
                raise KeyError(f"the checkpoint lacks {prefix}.{i}.{{{','.join(missing)}}}"
                               f".weight")
        order = [by_index[i] for i in range(len(by_index))]
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([e["gate_proj"], e["up_proj"]]) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([e["down_proj"] for e in order])
    return out


def split_moe_experts(state: dict) -> dict:
    """The inverse of fuse_moe_experts: the file format transformers writes and reads."""
    out = {}
    for name, value in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, half = name[: -len(".gate_up_proj")], value.shape[1] // 2
            for i, w in enumerate(value):
                out[f"{prefix}.{i}.gate_proj.weight"] = w[:half]
                out[f"{prefix}.{i}.up_proj.weight"] = w[half:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for i, w in enumerate(value):
                out[f"{prefix}.{i}.down_proj.weight"] = w
        else:
            out[name] = value
    return out
