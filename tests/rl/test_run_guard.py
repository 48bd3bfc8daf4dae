"""The recipe's checkpoints and config on a resume or an overwrite (in-process, tiny CPU config):
the last step is written once, a resume checks the config it continues with and applies a new
optimizer setting, an overwritten run is moved aside, and checks across keys refuse values the
run would fail on later."""

import pytest
import torch
from omegaconf import OmegaConf
from recipe_helpers import CONFIG, load_recipe, run

from dualkv_compile.rl.recipe_config import ConfigError, check_recipe_config, instantiate_checked
from dualkv_compile.rl.resume_checks import NOT_SET, check_resume_config, config_changes
from dualkv_compile.rl.run_guard import RunLock, check_output_dir, set_aside


def test_the_last_step_is_saved_once(tmp_path):
    cfg = OmegaConf.load(CONFIG)
    for key, value in {"output_dir": str(tmp_path / "run"), "num_steps": 2, "save_every": 1}.items():
        OmegaConf.update(cfg, key, value)
    recipe = load_recipe().GRPORecipe(cfg)
    recipe.setup()
    saves, save = [], recipe.save_checkpoint
    recipe.save_checkpoint = lambda: (saves.append(recipe.step), save())
    recipe.train()
    recipe.cleanup()
    assert saves == [1, 2]


def test_resume_applies_a_changed_optimizer_setting_and_says_so(tmp_path, capsys):
    run(tmp_path, "run", num_steps=1)
    capsys.readouterr()
    resumed = run(tmp_path, "run", num_steps=2, resume_from_checkpoint=True,
                  **{"optimizer.lr": 0.5, "optimizer.betas": [0.8, 0.99]})
    out = capsys.readouterr().out
    assert "resuming step 1 with settings changed" in out and "optimizer.lr: 0.001 -> 0.5" in out
    assert "num_steps: 1 -> 2" in out and "resume_from_checkpoint" not in out
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [0.5]
    assert [list(g["betas"]) for g in resumed.optimizer.param_groups] == [[0.8, 0.99]]
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.5 and saved["config"]["num_steps"] == 2


def test_resume_refuses_a_changed_model_before_building_anything(tmp_path):
    run(tmp_path, "run", num_steps=1)
    cfg = OmegaConf.load(CONFIG)
    for key, value in {"output_dir": str(tmp_path / "run"), "num_steps": 2,
                       "resume_from_checkpoint": True, "model.embed_dim": 32}.items():
        OmegaConf.update(cfg, key, value)
    recipe = load_recipe().GRPORecipe(cfg)
    with pytest.raises(ConfigError, match=r"model\.embed_dim: 64 when .* was written, 32 now"):
        recipe.setup()
    assert not hasattr(recipe, "model")


def test_overwrite_moves_the_earlier_run_aside(tmp_path):
    run(tmp_path, "run", num_steps=1)
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    run(tmp_path, "run", num_steps=1, seed=1, overwrite_output_dir=True)
    aside = list((tmp_path / "run").glob("replaced_*"))
    assert len(aside) == 1 and (aside[0] / "checkpoint.pt").read_bytes() == before
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() != before
    # its TensorBoard events too (they used to stay, shown beside the new run's steps)
    old_events = list((aside[0] / "tensorboard").rglob("events.out.tfevents.*"))
    new_events = list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(old_events) == len(new_events) == 1


@pytest.mark.parametrize("key, value, refusal", [
    ("loss.aggregation", "nope", r"loss: .*aggregation='nope'"),
    # os.access says yes to root there: the logger's mkdir failed after the move, a traceback
    ("metric_logger.log_dir", "/proc/dualkv_logs",
     r"metric_logger.log_dir='/proc/dualkv_logs' cannot be written \(/proc: "),
])
def test_an_overwrite_refused_in_its_setup_leaves_the_earlier_run_in_place(tmp_path, key, value,
                                                                           refusal):
    # the earlier run was moved aside before the task, model and loss were checked: a refused
    # run left nothing to resume
    run(tmp_path, "run", num_steps=1)
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    cfg = OmegaConf.load(CONFIG)
    for k, v in {"output_dir": str(tmp_path / "run"), "overwrite_output_dir": True,
                 key: value}.items():
        OmegaConf.update(cfg, k, v)
    with pytest.raises(ConfigError, match=refusal):
        load_recipe().GRPORecipe(cfg).setup()
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before
    assert not list((tmp_path / "run").glob("replaced_*"))


def test_overwrite_moves_the_earlier_logs_when_log_dir_is_output_dir(tmp_path, capsys):
    # log_dir == output_dir: nothing of the logs was moved, yet the message said so, and
    # TensorBoard showed the old run's curves beside the new one's
    out = str(tmp_path / "run")
    run(tmp_path, "run", num_steps=1, **{"metric_logger.log_dir": out})
    (old,) = (tmp_path / "run").glob("run_*")
    run(tmp_path, "run", num_steps=1, overwrite_output_dir=True, **{"metric_logger.log_dir": out})
    (aside,) = (tmp_path / "run").glob("replaced_*")
    assert (aside / old.name).is_dir() and (aside / "checkpoint.pt").is_file()
    assert [p.name for p in (tmp_path / "run").glob("run_*")] != [old.name]
    assert f"the earlier run's checkpoint.pt, {old.name} were moved to {aside}" \
        in capsys.readouterr().out


def test_a_second_run_on_a_live_runs_output_dir_is_refused(tmp_path):
    # both used to pass the start-up check (no checkpoint yet), and the later save replaced
    # the other run's checkpoint
    cfg = OmegaConf.load(CONFIG)
    OmegaConf.update(cfg, "output_dir", str(tmp_path / "run"))
    first, second = load_recipe().GRPORecipe(cfg), load_recipe().GRPORecipe(cfg.copy())
    first.setup()
    with pytest.raises(ConfigError, match=r"output_dir=.*run' is in use by another run \(pid "):
        second.setup()
    assert not hasattr(second, "model")  # refused before anything was built
    first.cleanup()
    second.setup()  # the first run is over
    second.cleanup()


def test_run_lock_is_refused_while_held_and_free_after():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        held = RunLock(Path(d) / "out")  # makes the folder
        with pytest.raises(ConfigError, match="in use by another run"):
            RunLock(Path(d) / "out")
        held.release()
        RunLock(Path(d) / "out").release()


@pytest.mark.parametrize("code", ["ENOSYS", "ENOLCK"])
def test_run_lock_on_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch,
                                                                   caplog, code):
    # Lustre without flock (ENOSYS), NFSv3 without lockd (ENOLCK): every run was refused as
    # "in use by another run", naming the holder of a stale lock file
    import errno
    import fcntl
    import os

    out = tmp_path / "out"
    out.mkdir()
    (out / RunLock.NAME).write_text("pid 4242 on node17, started 2026-01-01 00:00:00\n")

    def no_locks(*args):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING"):
        lock = RunLock(out)
    assert "does not support file locks" in caplog.text, caplog.text
    assert f"pid {os.getpid()} on" in (out / RunLock.NAME).read_text()
    lock.release()


def test_a_resume_tells_changes_from_the_same_setting_written_otherwise():
    # a default written out, or a class under another import path, was refused as a model or
    # optimizer change, with a key the checkpoint did not set shown as None
    tiny = {"_component_": "dualkv_compile.models.tiny.tiny_decoder", "vocab_size": 40}
    adamw = {"_component_": "torch.optim.AdamW", "lr": 1e-3}
    saved = {"model": tiny, "optimizer": adamw}
    same = {"model": tiny | {"num_heads": 4, "max_seq_len": 256},  # tiny_decoder's defaults
            "optimizer": adamw | {"_component_": "torch.optim.adamw.AdamW"}}
    assert config_changes(saved, same) == {}
    changed = {"model": tiny | {"num_heads": 2}, "optimizer": adamw | {"amsgrad": True}}
    assert config_changes(saved, changed) == {"model.num_heads": (NOT_SET, 2),
                                              "optimizer.amsgrad": (NOT_SET, True)}
    with pytest.raises(ConfigError, match=r"model.num_heads: not set when ck.pt was written, 2 "
                                          r"now; a resumed run must keep it"):
        check_resume_config("ck.pt", config_changes(saved, changed))
    # an optimizer key stated at its default is a change: the checkpoint's param groups hold
    # what its run used (a weight_decay of 0 kept by a resume that left the key out)
    assert config_changes(saved, {"model": tiny, "optimizer": adamw | {"weight_decay": 0.01}}) \
        == {"optimizer.weight_decay": (NOT_SET, 0.01)}
    # a changed dtype cast the saved fp32 weights and AdamW moments to bf16 for good
    with pytest.raises(ConfigError, match=r"dtype: 'fp32' when ck.pt was written, 'bf16' now"):
        check_resume_config("ck.pt", config_changes(saved | {"dtype": "fp32"},
                                                    same | {"dtype": "bf16"}))
    # the default of another component is no default of this one
    other = {"model": tiny | {"_component_": "dualkv_compile.models.qwen3.qwen3",
                              "num_heads": 4}, "optimizer": adamw}
    assert "model.num_heads" in config_changes(saved, other)


def test_a_new_run_may_not_replace_an_earlier_runs_trained_weights(tmp_path):
    # the checkpointer's epoch_N folders were replaced (and deleted) by a new run writing to
    # the same checkpointer.output_dir, with no error
    weights = tmp_path / "exports"
    (weights / "epoch_1").mkdir(parents=True)
    ck = tmp_path / "run" / "checkpoint.pt"
    with pytest.raises(ConfigError, match=r"checkpointer.output_dir=.*exports' holds an earlier "
                                          r"run's trained weights \(epoch_1\)"):
        check_output_dir(ck, resume=False, overwrite=False, weight_dirs=(weights,))
    check_output_dir(ck, resume=True, overwrite=False, weight_dirs=(weights,))
    check_output_dir(ck, resume=False, overwrite=True, weight_dirs=(weights,))
    check_output_dir(ck, resume=False, overwrite=False, weight_dirs=(tmp_path / "absent",))


def _config(**changes) -> dict:
    cfg = OmegaConf.load(CONFIG)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("changes,message", [
    ({"overlong": {"max_len": 9, "cache_len": 0}}, "overlong.cache_len (x): 0 must be in (0, "),
    ({"overlong": {"max_len": 4, "cache_len": 5}},
     "overlong.cache_len (x): 5 must be in (0, overlong.max_len=4]"),
    ({"dualkv.bucket_growth": 0.5}, "dualkv.bucket_growth (x): 0.5 must be in [1, 4]"),
    ({"micro_batch_groups": 3}, "groups_per_step (x): 8 must split into 1 rank(s) x "
                                "updates_per_step=1 x whole micro-batches of micro_batch_groups=3"),
    ({"updates_per_step": 3}, "groups_per_step (x): 8 must split into 1 rank(s) x "
                              "updates_per_step=3 x whole micro-batches"),
    ({"temperature": float("inf")}, "temperature (x): inf must be a finite number >= 1e-05"),
    ({"top_p": 0.0}, "top_p (x): 0.0 must be in (0, 1]"),
    ({"max_grad_norm": 0.0}, "max_grad_norm (x): 0.0 must be > 0"),
    ({"max_grad_norm": -1.0}, "max_grad_norm (x): -1.0 must be > 0"),
    ({"checkpointer": {"_component_": "dualkv_compile.models.Qwen3HFCheckpointer",
                       "checkpoint_dir": "c", "output_dir": "o"},
      "model": {"_component_": "dualkv_compile.models.qwen3_from_hf_config", "path": "c",
                "rope_base": 5e5}},
     # (merged into the tiny config's model section, whose keys stay: one line each)
     "model.rope_base (x): overrides the checkpoint's config.json"),
])
def test_values_that_fail_together_are_refused_up_front(changes, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        check_recipe_config(_config(**changes), config_file="x", overrides=[])
    assert any(line.startswith(message) for line in e.value.problems), e.value.problems


def test_a_model_override_of_a_checkpoint_names_the_command_line(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = _config(**{"checkpointer": {"_component_": "dualkv_compile.models.Qwen3HFCheckpointer",
                                         "checkpoint_dir": "c", "output_dir": "o"}})
    config["model"] = {"_component_": "dualkv_compile.models.qwen3_from_hf_config", "path": "c",
                       "rope_base": 5e5}
    with pytest.raises(ConfigError) as e:
        check_recipe_config(config, config_file="x", overrides=["model.rope_base=500000"])
    assert e.value.problems == [
        "model.rope_base (command-line override 'model.rope_base=500000'): overrides the "
        "checkpoint's config.json, which the checkpointer copies into every saved folder "
        "(transformers would load another model); edit a copy of config.json and point "
        "checkpoint_dir at it instead"]


def test_a_required_key_left_out_is_named():
    config = _config()
    del config["num_steps"], config["loss"]["epsilon_low"]  # a default: may be left out
    with pytest.raises(ConfigError) as e:
        check_recipe_config(config, config_file="x", overrides=[])
    assert e.value.problems == ["num_steps (required by the recipe, not in x): missing"]


def test_a_key_a_kwargs_component_does_not_name_is_warned_about():
    torchtune_logger = "torchtune.training.metric_logging.TensorBoardLogger"  # takes **kwargs
    warnings = check_recipe_config(_config(**{"metric_logger._component_": torchtune_logger,
                                              "metric_logger.organize_log": False}),
                                   config_file="x", overrides=[])
    assert len(warnings) == 1 and warnings[0].startswith("metric_logger.organize_log (x): not a")
    assert "did you mean 'organize_logs'?" in warnings[0]
    assert check_recipe_config(_config(), config_file="x", overrides=[]) == []


def test_a_missing_file_of_a_component_names_its_section(tmp_path):
    node = OmegaConf.create({"_component_": "dualkv_compile.rl.HFTokenizer",
                             "path": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"^tokenizer: tokenizer directory .*nope does not exist"):
        instantiate_checked("tokenizer", node)
    (tmp_path / "empty").mkdir()  # transformers' own error blamed sentencepiece / tiktoken
    node.path = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"^tokenizer: tokenizer directory .*empty holds none "
                                          r"of the tokenizer files tokenizer.json"):
        instantiate_checked("tokenizer", node)


def test_a_missing_task_file_names_its_section(tmp_path):
    cfg = OmegaConf.load(CONFIG)
    OmegaConf.update(cfg, "output_dir", str(tmp_path / "run"))
    OmegaConf.update(cfg, "task", {"_component_": "dualkv_compile.rl.MathJSONLTask",
                                   "path": str(tmp_path / "nope.jsonl")}, merge=False)
    with pytest.raises(ConfigError, match=r"^task: .*nope\.jsonl"):
        load_recipe().GRPORecipe(cfg).setup()


def test_a_resume_may_find_the_same_files_at_another_path():
    check_resume_config("ck.pt", {"model.path": ("/data/qwen3", "/nvme/qwen3"),
                                  "tokenizer.path": ("/data/qwen3", "/nvme/qwen3"),
                                  "checkpointer.checkpoint_dir": ("/data/qwen3", "/nvme/qwen3")})
    with pytest.raises(ConfigError, match="tokenizer.alphabet: 'ab' when ck.pt was written"):
        check_resume_config("ck.pt", {"tokenizer.alphabet": ("ab", "abc")})


def test_set_aside_moves_within_each_folder_and_names_what_it_cannot_move(tmp_path, monkeypatch):
    run_dir, weights = tmp_path / "run", tmp_path / "elsewhere" / "hf"
    (weights / "epoch_2").mkdir(parents=True)
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"x")
    made = set_aside([run_dir / "checkpoint.pt", weights / "epoch_2", run_dir / "absent"])
    assert [m.parent for m in made] == [run_dir, weights]  # each beside what it holds
    assert (made[0] / "checkpoint.pt").read_bytes() == b"x" and (made[1] / "epoch_2").is_dir()
    (weights / "epoch_3").mkdir()

    def refuse(self, target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(type(weights), "rename", refuse)
    with pytest.raises(ConfigError, match=r"cannot move .*epoch_3 aside .*cross-device link"):
        set_aside([weights / "epoch_3"])


def test_preset_builders_name_every_argument_so_a_typo_is_refused():
    # qwen3_8b and qwen3_moe_tiny took **kwargs: every model key of the 8B-shaped and MoE
    # configs was warned about ("known keys: []") and a misspelled one only warned; and
    # qwen3_tiny(num_layers=3) raised "got multiple values"
    from dualkv_compile.models import qwen3_tiny

    for config in ("tiny_moe_grpo.yaml", "tiny_grpo.yaml"):
        cfg = OmegaConf.to_container(OmegaConf.load(CONFIG.parent / config), resolve=True)
        assert check_recipe_config(cfg, config_file="x", overrides=[]) == []
    cfg = _config(**{"model._component_": "dualkv_compile.models.qwen3_8b",
                     "model.num_layerz": 2})
    del cfg["model"]["vocab_size"], cfg["model"]["embed_dim"], cfg["model"]["num_layers"]
    with pytest.raises(ConfigError) as e:
        check_recipe_config(cfg, config_file="x", overrides=[])
    assert any(p.startswith("model.num_layerz (x): ") and "did you mean 'num_layers'" in p
               for p in e.value.problems), e.value.problems
    assert len(qwen3_tiny(num_layers=3, vocab_size=16).layers) == 3


def test_checkpoints_are_flushed_to_the_disk_before_they_take_their_name(tmp_path, monkeypatch):
    # torch.save then rename, without an fsync: a power loss just after the rename could leave
    # checkpoint.pt empty and the previous one gone
    import os

    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, type(tmp_path).replace
    monkeypatch.setattr(os, "fsync", lambda fd: (
        synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(type(tmp_path), "replace",
                        lambda self, target: (renamed.append((str(self), len(synced))),
                                              real_replace(self, target))[1])
    run(tmp_path, "run", num_steps=1)
    (tmp, synced_before), = [r for r in renamed if r[0].endswith("checkpoint.tmp")]
    assert tmp in synced[:synced_before]  # the data, before the rename
    assert str(tmp_path / "run") in synced[synced_before:]  # the directory entry, after it


def test_the_reference_model_reshards_after_its_forward(tmp_path, monkeypatch):
    # with fsdp_reshard_after_forward=false the reference, which runs no backward (where FSDP
    # reshards), stayed gathered on every rank for the whole run
    module = load_recipe()
    calls = []
    monkeypatch.setattr(module.ddp, "shard_decoder",
                        lambda model, reshard_after_forward: calls.append(reshard_after_forward))
    cfg = OmegaConf.load(CONFIG)
    OmegaConf.update(cfg, "output_dir", str(tmp_path / "run"))
    OmegaConf.update(cfg, "fsdp_reshard_after_forward", False, force_add=True)
    recipe = module.GRPORecipe(cfg)
    recipe.setup()
    recipe.cleanup()
    assert calls == [False, True]  # the policy as configured, the reference always
