"""check_recipe_config's checks across keys (in-process): a misspelt model key beside a
checkpointer is named as a typo; an overlong penalty band no response reaches is refused; a
constant-aggregation width below the generation cap is refused."""

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


def test_a_moe_checkpoint_may_run_the_grouped_expert_op(monkeypatch):
    # refused as an override of config.json: a checkpoint could only run the per-token
    # dispatch, which cannot fit at Qwen3-30B-A3B's size
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _checked("qwen3_1_7b_grpo.yaml", "checkpoint_dir=/tmp", "device=cpu",
                    "model._component_=dualkv_compile.models.qwen3_moe_from_hf_config",
                    "model.grouped_experts=true") == []


def test_each_builder_takes_its_own_sequence_limit_beside_a_checkpointer(monkeypatch):
    # the MoE builder takes transformers' max_position_embeddings (max_seq_len passed the check
    # and failed in the builder, the name it takes was refused); the dense one has no
    # grouped_experts (it passed the check and failed in the builder)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    moe = ("model._component_=dualkv_compile.models.qwen3_moe_from_hf_config",
           "checkpoint_dir=/tmp", "device=cpu")
    warnings = _checked("qwen3_1_7b_grpo.yaml", *moe, "model.max_position_embeddings=4096")
    assert [w.split(":")[0] for w in warnings] == [  # a **kwargs override, as the builder says
        "model.max_position_embeddings (command-line override "
        "'model.max_position_embeddings=4096')"]
    with pytest.raises(ConfigError, match=r"model.max_seq_len .*overrides the checkpoint's"):
        _checked("qwen3_1_7b_grpo.yaml", *moe, "model.max_seq_len=4096")
    with pytest.raises(ConfigError, match=r"model.grouped_experts .*overrides the checkpoint's"):
        _checked("qwen3_1_7b_grpo.yaml", "checkpoint_dir=/tmp", "device=cpu",
                 "model.grouped_experts=true")


def test_the_keys_beside_a_checkpointer_are_those_the_builder_declares(monkeypatch):
    # they were matched by the builder's name, so another builder could not declare its own
    from dualkv_compile.models import qwen3_from_hf_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ("qwen3_1_7b_grpo.yaml", "checkpoint_dir=/tmp", "device=cpu", "model.rope_base=1e6")
    with pytest.raises(ConfigError, match=r"model.rope_base .*overrides the checkpoint's"):
        _checked(*args)
    monkeypatch.setattr(qwen3_from_hf_config, "overrides_beside_checkpoint",
                        ("path", "max_seq_len", "rope_base"))
    assert [w.split(":")[0] for w in _checked(*args)] == [  # a **kwargs key, warned
        "model.rope_base (command-line override 'model.rope_base=1e6')"]


def test_an_overlong_band_past_every_response_is_refused_and_one_cut_short_warned(monkeypatch):
    # tiny_dapo's band (9, 12] with max_generated_tokens=9: a penalty that can never apply, yet
    # the run was accepted and logged as DAPO
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        _checked("tiny_dapo.yaml", "max_generated_tokens=9")
    assert e.value.problems == ["overlong.max_len (tiny_dapo.yaml): 12 - overlong.cache_len=3 "
                                "must be < max_generated_tokens=9: the penalty starts past every "
                                "response"]
    assert _checked("tiny_dapo.yaml") == []  # max_len = max_generated_tokens, as in DAPO
    assert _checked("tiny_dapo.yaml", "max_generated_tokens=10") == [
        "overlong.max_len (tiny_dapo.yaml): 12 > max_generated_tokens=10: the longest "
        "response's penalty is -0.333, not -1"]
    assert _checked("tiny_dapo.yaml", "max_generated_tokens=20") == []  # -1 past max_len


def test_a_constant_aggregation_width_below_the_generation_cap_is_refused(monkeypatch):
    # accepted, then step 1 ended in GRPOLoss's "responses of width 9 exceed
    # max_response_len=8" after its whole rollout
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        _checked("tiny_grpo.yaml", "loss.aggregation=constant", "loss.max_response_len=8",
                 "max_generated_tokens=9")
    assert e.value.problems == ["loss.max_response_len (command-line override "
                                "'loss.max_response_len=8'): 8 must be >= "
                                "max_generated_tokens=9: constant aggregation divides by it, "
                                "and responses can be that long"]
    assert _checked("tiny_grpo.yaml", "loss.aggregation=constant", "loss.max_response_len=9",
                    "max_generated_tokens=9") == []
    assert _checked("tiny_grpo.yaml", "loss.max_response_len=8",  # not read by "sequence"
                    "max_generated_tokens=9") == []


def test_malformed_device_strings_and_world_size_are_named(monkeypatch):
    # 'cuda:abc' passed the check and failed later in torch.device, a traceback; a WORLD_SIZE
    # that is not a number crashed the check itself
    import torch

    from dualkv_compile.rl.recipe_schema import GRPO_SCHEMA

    check = GRPO_SCHEMA["device"].check
    for device in ("cuda:abc", "cuda:", "cuda:0:1", "cuda:-1", "gpu"):
        assert "must be 'cpu', 'cuda' or 'cuda:N'" in check(device), device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (the check alone)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check("cuda:1") is None and check("cuda") is None
    assert "past this machine's 2 CUDA device(s)" in check("cuda:2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "name only the type, 'cuda'" in check("cuda:1")
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='x' \(the environment\) must be an "):
        _checked("tiny_grpo.yaml", "device=cpu")
