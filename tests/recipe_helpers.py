"""Helpers of the recipe tests: the repository root, loading the GRPO recipe module, and one
recipe run in-process (importable from every test folder: tests/ is on sys.path through the
top conftest.py)."""

import importlib.util
import string
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


def write_tokenizer(folder: Path) -> None:
    """A character-level transformers tokenizer (WordLevel over letters, digits and some
    punctuation; <pad>, <bos>, <eos>, <unk>) saved to `folder`."""
    import transformers as tf
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    chars = string.ascii_letters + string.digits + " +-*=?.,:#\n"
    vocab = {t: i for i, t in enumerate([*specials, *dict.fromkeys(chars)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                      eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(folder)
