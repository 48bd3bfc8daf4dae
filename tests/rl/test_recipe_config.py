"""check_recipe_config's checks across keys (in-process): a misspelt model key beside a
checkpointer is named as a typo."""

import pytest
from omegaconf import OmegaConf
from recipe_helpers import ROOT

from dualkv_compile.rl.recipe_config import ConfigError, check_recipe_config


def _checked(config: str, *overrides: str) -> list[str]:
    """check_recipe_config over recipes/configs/<config> with `overrides` (key=value)."""
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "recipes" / "configs" / config),
                          OmegaConf.from_dotlist(list(overrides)))
    return check_recipe_config(OmegaConf.to_container(cfg, resolve=True), config_file=config,
                               overrides=list(overrides))


@pytest.mark.parametrize("override,near", [("model.max_seq_lenn=4096", "max_seq_len"),
                                           ("model.pth=/x", "path")])
def test_a_misspelt_model_key_beside_a_checkpointer_names_the_near_miss(override, near,
                                                                         monkeypatch):
    # was refused as "overrides the checkpoint's config.json", the hint dropped with the warning
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        _checked("qwen3_1_7b_grpo.yaml", override, "checkpoint_dir=/tmp", "device=cpu")
    key = override.split("=")[0]
    assert e.value.problems == [f"{key} (command-line override {override!r}): unknown key; did "
                                f"you mean {near!r}? (with a checkpointer the model section sets "
                                "only path and max_seq_len over the checkpoint's config.json)"]
