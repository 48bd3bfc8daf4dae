"""A torchtune checkpointer for Qwen3 in transformers' format.

torchtune 0.6.1's FullModelHFCheckpointer has no Qwen3 weight conversion, so this class
implements torchtune's checkpointer interface (`load_checkpoint`, `save_checkpoint`) over our
conversion in hf_checkpoint.py. Recipes reference it by `_component_`. Saved checkpoints are
"state-dict invariant" in torchtune's sense: `output_dir/epoch_{N}/` holds a model.safetensors
with transformers' names plus the source directory's config and tokenizer files, so
transformers (or this checkpointer) can load it back.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..durable import sync, sync_entry, write_failed
from .hf_checkpoint import (check_tied_head, fuse_moe_experts, hf_to_ours, ours_to_hf,
                            read_hf_state, split_moe_experts, write_hf_state)

__all__ = ["Qwen3HFCheckpointer"]

log = logging.getLogger(__name__)

MODEL_KEY = "model"  # torchtune.training.MODEL_KEY


class Qwen3HFCheckpointer:
    """load_checkpoint() -> {"model": state dict in our names}; save_checkpoint(state, epoch)."""

    def __init__(self, checkpoint_dir: str, output_dir: str):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.output_dir = Path(output_dir)
        config = self.checkpoint_dir / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"checkpoint_dir={str(self.checkpoint_dir)!r} has no "
                                    f"config.json")
        cfg = json.loads(config.read_text())
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        # Qwen3-MoE runs as transformers' own model (models.qwen3_moe): its names as they are
        self.native = cfg.get("model_type") == "qwen3_moe"

    def load_checkpoint(self) -> dict:
        state = read_hf_state(self.checkpoint_dir)
        if self.native:
            state = fuse_moe_experts(state)
            if self.tied:  # the file holds the shared embedding once
                check_tied_head(state)
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
            return {MODEL_KEY: state}
        return {MODEL_KEY: hf_to_ours(state, tied=self.tied)}

    def save_checkpoint(self, state_dict: dict, epoch: int,
                        intermediate_checkpoint: bool = False) -> Path:
        """Write state_dict["model"] to output_dir/epoch_{epoch}/ with the source's config and
        tokenizer files. Recipe state (optimizer, step, RNG) is the recipe's own file."""
        if MODEL_KEY not in state_dict:
            raise KeyError(f"save_checkpoint needs the model weights under {MODEL_KEY!r}; got "
                           f"keys {sorted(state_dict)}")
        folder = self.output_dir / f"epoch_{epoch}"
        # written into a folder beside the final one, then renamed into place: a crash mid-write
        # leaves no half-written folder under the final name (nor a half-replaced one)
        partial, replaced = (folder.with_name(f"{folder.name}.{s}") for s in ("partial", "replaced"))
        if replaced.exists() and not folder.exists():
            # a crash between the two renames below left the previous copy only under this
            # name: it goes back before anything is removed (a failed save then keeps it)
            replaced.rename(folder)
        for stale in (partial, replaced):
            shutil.rmtree(stale, ignore_errors=True)
        state = state_dict[MODEL_KEY]
        state = split_moe_experts(state) if self.native else ours_to_hf(state)
        head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
        # tied as the source says, or a model whose state holds no head (our tied Qwen3)
        tied = head is None or (self.tied and embed is not None and torch.equal(head, embed))
        if tied:  # the file holds the shared embedding once, as transformers writes it
            state.pop("lm_head.weight", None)
        if tied != self.tied:  # a model (un)tied against its source config: saved as it is
            log.warning("the model %s its LM head and embedding, but %s/config.json says "
                        "otherwise: saved with tie_word_embeddings=%s",
                        "ties" if tied else "does not tie", self.checkpoint_dir,
                        str(tied).lower())
        try:
            path = write_hf_state(state, partial, rename=False)
            for src in self.checkpoint_dir.iterdir():  # config, generation config, tokenizer
                if src.is_file() and not src.name.startswith("model") and src.suffix in (
                        ".json", ".txt", ".model", ".jinja"):
                    shutil.copy2(src, partial / src.name)
            _set_saved_config(partial / "config.json", state, tied=tied)
            sync(partial)  # on the disk before it takes the final name
        except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: no partial left
            raise write_failed(folder, partial, e) from e
        if folder.exists():  # this step saved before (a resumed run): the new one replaces it
            folder.rename(replaced)
        partial.rename(folder)
        sync_entry(folder)
        shutil.rmtree(replaced, ignore_errors=True)
        path = folder / path.name
        log.info("saved %s (%.2f GiB)", path, path.stat().st_size / 2**30)
        return folder


def _set_saved_config(config: Path, state: dict, *, tied: bool) -> None:
    """The copied config.json names the dtype the weights were saved in (a bf16 source trained
    and saved in fp32 would otherwise be loaded by from_pretrained() in bf16, rounded) and
    whether they are tied (transformers would tie a saved, trained head back to the embedding)."""
    if not config.is_file():
        return
    cfg = json.loads(config.read_text())
    if cfg.get("tie_word_embeddings", False) != tied:
        cfg["tie_word_embeddings"] = tied
    dtypes = {v.dtype for v in state.values() if torch.is_floating_point(v)}
    if len(dtypes) == 1:
        name = str(dtypes.pop()).removeprefix("torch.")
        for key in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
            cfg[key] = name
    config.write_text(json.dumps(cfg, indent=2))
