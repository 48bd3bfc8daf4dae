"""Helpers of the recipe tests: the repository root, loading the GRPO recipe module, and one
recipe run in-process (importable from every test folder: tests/ is on sys.path through the
top conftest.py)."""

import importlib.util
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "tiny_grpo.yaml"


def load_recipe():
    spec = importlib.util.spec_from_file_location(
        "grpo_full_finetune", ROOT / "recipes" / "grpo_full_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(tmp_path, name, config=CONFIG, **overrides):
    """Set up, train and clean up the recipe on `config` with `overrides` (dotted keys)."""
    cfg = OmegaConf.load(config)
    cfg.output_dir = str(tmp_path / name)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    recipe = load_recipe().GRPORecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    return recipe


class TorchtuneStyleCheckpointer:
    """A checkpointer as torchtune's own are (the source folder in `_checkpoint_dir`, no
    config.json there): loads a torch.save'd model state dict, records what it is asked to save."""

    def __init__(self, checkpoint_dir: str, output_dir: str):
        self._checkpoint_dir, self.output_dir, self.saved = Path(checkpoint_dir), output_dir, []

    def load_checkpoint(self):
        import torch

        return {"model": torch.load(self._checkpoint_dir / "model.pt", weights_only=True)}

    def save_checkpoint(self, state, epoch):
        self.saved.append(epoch)
