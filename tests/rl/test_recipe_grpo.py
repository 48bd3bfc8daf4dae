"""The GRPO recipe on CPU: dualkv on vs off, TensorBoard output, resume, the `tune run` entry."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from recipe_helpers import CONFIG, ROOT, load_recipe, run


@pytest.mark.parametrize("attention_backend", ["auto", "regions"])
def test_dualkv_on_and_off_agree_at_every_step(tmp_path, attention_backend):
    on = run(tmp_path, "on", num_steps=3, **{"dualkv.attention_backend": attention_backend})
    off = run(tmp_path, "off", num_steps=3, **{"dualkv.enabled": False})
    assert on.policy.uses_dualkv and not off.policy.uses_dualkv
    assert len(on.history) == len(off.history) == 3
    # abs=1e-6: at step 1 the policy equals the reference and each group's normalised
    # advantages sum to zero, so loss and KL are 0 up to float32 rounding (~1e-8)
    for a, b in zip(on.history, off.history):
        for key in ("loss", "kl", "grad_norm", "response_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert a["reward"] == b["reward"] and a["rho"] > 1
    assert any(h["kl"] > 0 for h in on.history[1:])  # the policy moved away from the reference


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path):
    import dualkv_compile as dk

    dk.counters.clear()
    ckpt = run(tmp_path, "ckpt", num_steps=2, enable_activation_checkpointing=True)
    assert dk.counters["checkpoints_inlined"] >= 2  # the 2 layers, inlined and recomputed
    assert ckpt.policy.uses_dualkv
    plain = run(tmp_path, "plain", num_steps=2)
    for a, b in zip(ckpt.history, plain.history):
        for key in ("loss", "kl", "grad_norm", "response_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    assert set(ckpt.model.state_dict()) == set(plain.model.state_dict())  # same keys saved


def read_scalars(folder: Path) -> dict[str, list[float]]:
    """Every scalar in the event files under `folder` (legacy simple values or tensors)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[str, list[float]] = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "text":  # the config (log_config)
                    continue
                x = v.simple_value if v.HasField("simple_value") else tensor_util.make_ndarray(v.tensor)
                out.setdefault(v.tag, []).append(float(x))
    return out


def test_tensorboard_events_name_every_metric(tmp_path):
    recipe = run(tmp_path, "tb", num_steps=2)
    scalars = read_scalars(tmp_path / "tb" / "tensorboard")
    for tag in ("reward", "loss", "kl", "response_length", "tokens_per_s", "rho",
                "step_time_s", "peak_memory_gib"):
        assert len(scalars.get(tag, [])) == 2, tag
    assert scalars["reward"] == [h["reward"] for h in recipe.history]


def test_resume_continues_the_step_count_and_data_order(tmp_path):
    full = run(tmp_path, "full", num_steps=4)
    run(tmp_path, "part", num_steps=2)
    resumed = run(tmp_path, "part", num_steps=4, resume_from_checkpoint=True)
    assert [h["step"] for h in resumed.history] == [3, 4]
    for a, b in zip(full.history[2:], resumed.history):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path, capsys):
    """A run killed after logging step 3 but before its checkpoint (here: checkpoint at 2, no
    final save) and resumed: TensorBoard reads one run with steps 1-4, step 3 as re-run."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    run(tmp_path, "killed", num_steps=3, save_every=2, save_final_checkpoint=False)
    resumed = run(tmp_path, "killed", num_steps=4, resume_from_checkpoint=True)
    runs = sorted((tmp_path / "killed" / "tensorboard").glob("run_*"))
    assert len(runs) == 1, runs  # the resumed run continued the interrupted one's folder
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    # TensorBoard's Python reader (the plugin accumulator: new-style scalars are tensors)
    rewards = {e.step: float(e.tensor_proto.float_val[0]) for e in events.Tensors("reward")}
    assert [e.step for e in events.Tensors("reward")] == [1, 2, 3, 4]
    assert rewards[3] == resumed.history[0]["reward"] and rewards[4] == resumed.history[1]["reward"]
    assert "metric_logger: a new run" not in capsys.readouterr().out


def test_a_logger_that_cannot_continue_a_run_says_so_on_resume(tmp_path, capsys):
    tb = {"_component_": "torchtune.training.metric_logging.DiskLogger",
          "log_dir": str(tmp_path / "disk")}
    run(tmp_path, "disk", num_steps=1, metric_logger=tb)
    run(tmp_path, "disk", num_steps=2, metric_logger=tb, resume_from_checkpoint=True)
    out = capsys.readouterr().out
    assert "metric_logger: a new run from step 2 (DiskLogger cannot continue a run" in out


def test_dapo_config_on_and_off_agree(tmp_path):
    config = ROOT / "recipes" / "configs" / "tiny_dapo.yaml"
    on = run(tmp_path, "dapo_on", config=config, num_steps=3)
    off = run(tmp_path, "dapo_off", config=config, num_steps=3, **{"dualkv.enabled": False})
    cfg = on.cfg
    # the overlong band (max_len - cache_len, max_len] lies past the task's answer (8 letters
    # + eos): the right answer is not penalised
    assert cfg.dynamic_sampling and cfg.overlong.max_len - cfg.overlong.cache_len >= 9
    assert cfg.updates_per_step > 1  # without several updates the ratio is 1: nothing to clip
    assert cfg.loss.aggregation == "token" and cfg.loss.epsilon_high > cfg.loss.epsilon_low
    assert on.policy.uses_dualkv and not off.policy.uses_dualkv
    assert len(on.history) == len(off.history) == 3
    for a, b in zip(on.history, off.history):
        assert a.keys() == b.keys() and "kl" not in a  # kl_coef 0: no reference model
        for key in ("loss", "clip_fraction", "grad_norm", "response_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert a["reward"] == b["reward"]
    assert any(h["grad_norm"] > 1e-3 for h in on.history)


def test_overlong_filtering_takes_truncated_responses_out_of_the_loss(tmp_path):
    """overlong_filter=true (DAPO's overlong filtering): dualkv on and off agree, and the step
    differs from the unfiltered one on the same samples (rl.optimizer_step's loss mask is
    checked against the plain computation in test_optimizer_step.py)."""
    config = ROOT / "recipes" / "configs" / "tiny_dapo.yaml"
    on = run(tmp_path, "filter_on", config=config, num_steps=2, overlong_filter=True)
    off = run(tmp_path, "filter_off", config=config, num_steps=2, overlong_filter=True,
              **{"dualkv.enabled": False})
    unfiltered = run(tmp_path, "unfiltered", config=config, num_steps=1)
    for a, b in zip(on.history, off.history):
        assert a.keys() == b.keys() and "kl" not in a  # kl_coef 0: no reference model
        for key in ("loss", "clip_fraction", "grad_norm", "truncated_fraction"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    first, plain = on.history[0], unfiltered.history[0]
    assert 0 < first["truncated_fraction"] < 1  # some responses stop, some are cut at 12
    assert first["reward"] == plain["reward"]  # the same samples...
    assert first["truncated_fraction"] == plain["truncated_fraction"]
    assert abs(first["loss"] - plain["loss"]) > 1e-4  # ...with the cut ones left out


def test_the_overlong_penalty_is_added_to_the_task_reward(tmp_path):
    # dualkv on/off share _score, so the comparisons above cannot see its sign: the exact
    # rewards of responses below, inside and past the band (10-12 tokens, tiny_dapo.yaml)
    recipe = load_recipe().GRPORecipe(OmegaConf.merge(
        OmegaConf.load(ROOT / "recipes" / "configs" / "tiny_dapo.yaml"),
        {"output_dir": str(tmp_path / "run")}))
    recipe.setup()
    tok = recipe.tokenizer
    answer = tok.encode("aaaaaaaa")[1:] + [tok.eos_id]  # the right answer, 9 tokens
    responses = torch.tensor([answer + [tok.pad_id] * 3] * 3)
    rewards = recipe._score(responses, ["a"] * 3, torch.tensor([9, 11, 12]))
    recipe.cleanup()
    assert rewards.tolist() == pytest.approx([1.0, 1.0 - 2 / 3, 0.0])


def test_overlong_filtering_needs_stop_tokens(tmp_path):
    from dualkv_compile.rl.recipe_config import ConfigError

    # the shaped step config's tokenizer has no eos; the refusal comes before the 8B model
    with pytest.raises(ConfigError, match="overlong_filter=true needs a tokenizer with stop "):
        run(tmp_path, "no_stops", config=ROOT / "recipes" / "configs" / "qwen3_8b_shaped_step.yaml",
            overlong_filter=True, device="cpu")


def test_tune_run_entry_point(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "tune"), "run", "recipes/grpo_full_finetune.py", "--config", str(CONFIG),
         "num_steps=2", f"output_dir={tmp_path / 'cli'}", "device=cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mean reward:" in done.stdout
    assert f"checkpoint of step 2 in {tmp_path / 'cli'}" in done.stdout
    assert (tmp_path / "cli" / "checkpoint.pt").is_file()


@pytest.mark.parametrize("config", sorted((ROOT / "recipes" / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_config_has_the_switch_and_the_overrides(config):
    cfg = OmegaConf.load(config)
    assert isinstance(cfg.dualkv.enabled, bool), config.name
    for key in ("num_steps", "output_dir", "device"):  # the overrides every config takes
        assert key in cfg, (config.name, key)


def test_micro_batches_by_token_budget_train_the_same(tmp_path):
    """max_tokens_per_micro_batch (groups packed first-fit decreasing, here 20 tokens: some
    groups split) gives the metrics of whole-group micro-batches; compiles are reported."""
    by_groups = run(tmp_path, "groups", num_steps=2)
    by_tokens = run(tmp_path, "tokens", num_steps=2, max_tokens_per_micro_batch=20)
    for a, b in zip(by_groups.history, by_tokens.history):
        for key in ("loss", "kl", "grad_norm", "response_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert b["compiles"] >= 1


def test_releasing_the_rollout_cache_changes_nothing_but_memory(tmp_path):
    """rollout_release_cache: the engine drops its workspace after each step's rollouts and
    allocates a new one at the next; the samples and the training are the same."""
    held = run(tmp_path, "held", num_steps=2)
    released = run(tmp_path, "released", num_steps=2, rollout_release_cache=True)
    assert held.rollout_engine.stats["workspaces"] == 1
    assert released.rollout_engine.stats["workspaces"] == 2
    assert released.rollout_engine._workspace is None
    for a, b in zip(held.history, released.history):
        for key in ("reward", "loss", "kl", "grad_norm", "response_logprob", "response_length"):
            assert a[key] == b[key], (a["step"], key)


def test_several_updates_per_step_clip_and_agree_on_and_off(tmp_path):
    """updates_per_step=2: two optimizer steps on halves of the batch; the second half's ratio
    to the sampling policy leaves 1, so the clipping bites (it never does with one update),
    and dualkv on and off still agree at every step."""
    fast = {"optimizer.lr": 0.05, "loss.epsilon_low": 0.05, "loss.epsilon_high": 0.05}
    one = run(tmp_path, "one", num_steps=2, **fast)
    on = run(tmp_path, "on", num_steps=2, updates_per_step=2, **fast)
    off = run(tmp_path, "off", num_steps=2, updates_per_step=2, **fast,
              **{"dualkv.enabled": False})
    assert all(h["clip_fraction"] == 0 for h in one.history)
    assert any(h["clip_fraction"] > 0 for h in on.history)
    assert [h["loss"] for h in on.history] != [h["loss"] for h in one.history]
    for a, b in zip(on.history, off.history):
        for key in ("loss", "kl", "clip_fraction", "grad_norm", "response_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_updates_are_capped_at_the_groups_a_step_kept(tmp_path, monkeypatch):
    """Dynamic sampling may keep fewer groups than updates_per_step: an update with no group
    anywhere would step AdamW on zero gradients (moving the weights by its momentum) and dilute
    the metrics. With one group kept, two updates train as one."""
    from dualkv_compile.rl import recipe_rollouts
    from dualkv_compile.rl.dynamic_sampling import ScoredGroups

    real = recipe_rollouts.scored_groups

    def one_group(*args, **kwargs):
        s, n = real(*args, **kwargs), kwargs["group_size"]
        return ScoredGroups(s.tokens[:n], s.mask[:n], s.lengths[:n], s.rewards[:1],
                            s.prompt_len, s.sampled, s.filler)

    monkeypatch.setattr(recipe_rollouts, "scored_groups", one_group)
    one = run(tmp_path, "one", num_steps=2, updates_per_step=1)
    two = run(tmp_path, "two", num_steps=2, updates_per_step=2)
    for a, b in zip(one.history, two.history):
        for key in ("loss", "kl", "clip_fraction", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    state = next(iter(two.optimizer.state.values()))
    assert float(state["step"]) == 2  # one optimizer step a training step


def test_dr_grpo_settings_agree_on_and_off_and_change_the_update(tmp_path):
    """Dr. GRPO: advantages not divided by the group's std, the constant normaliser."""
    dr = {"loss.aggregation": "constant", "scale_advantages": False}
    on = run(tmp_path, "dr_on", num_steps=2, **dr)
    off = run(tmp_path, "dr_off", num_steps=2, **dr, **{"dualkv.enabled": False})
    grpo = run(tmp_path, "grpo", num_steps=2)
    for a, b in zip(on.history, off.history):
        for key in ("loss", "kl", "grad_norm", "response_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    assert on.history[0]["grad_norm"] != pytest.approx(grpo.history[0]["grad_norm"], rel=1e-3)


def test_the_tiny_moe_config_trains_and_dualkv_on_and_off_agree(tmp_path):
    """recipes/configs/tiny_moe_grpo.yaml: transformers' Qwen3-MoE through the whole recipe
    (rollout engine, optimize(), the fused loss), on vs off at every step."""
    config = ROOT / "recipes" / "configs" / "tiny_moe_grpo.yaml"
    on = run(tmp_path, "on", config=config, num_steps=3)
    off = run(tmp_path, "off", config=config, num_steps=3, **{"dualkv.enabled": False})
    assert on.policy.uses_dualkv and not off.policy.uses_dualkv
    for a, b in zip(on.history, off.history):
        for key in ("loss", "kl", "grad_norm", "response_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert a["reward"] == b["reward"] and a["rho"] > 1
    assert all(h["grad_norm"] > 0 for h in on.history)


def test_kl_coef_0_trains_the_same_without_a_reference_model(tmp_path, monkeypatch):
    # the reference was built, sharded, checkpointed and run for a KL term times 0, and its
    # forward counted in mfu_useful (TRL and veRL build none then)
    from dualkv_compile import rl

    free = run(tmp_path, "free", num_steps=3, **{"loss.kl_coef": 0.0})
    assert free.ref_model is None and free.reference is None
    monkeypatch.setattr(rl, "needs_reference", lambda loss_fn: True)  # the old recipe's way
    kept = run(tmp_path, "kept", num_steps=3, **{"loss.kl_coef": 0.0})
    assert kept.reference is not None
    for a, b in zip(free.history, kept.history):
        for key in ("loss", "grad_norm", "response_logprob", "reward", "clip_fraction"):
            assert a[key] == b[key], (a["step"], key)
        assert "kl" not in a and (b["kl"] > 0 or a["step"] == 1)  # not logged: not measured
    saved = torch.load(tmp_path / "free" / "checkpoint.pt", weights_only=True)
    assert saved["ref_model"] is None
    from dualkv_compile.rl.recipe_config import ConfigError

    with pytest.raises(ConfigError, match="kl_coef=0, which kept no reference model"):
        run(tmp_path, "free", num_steps=4, resume_from_checkpoint=True,
            **{"loss.kl_coef": 0.02})
