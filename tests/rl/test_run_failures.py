"""What a run does when something goes wrong while it trains (in-process, tiny CPU config): a
signal during the final save waits for it, a non-finite gradient stops the run before any
weight or checkpoint takes it, a checkpoint that cannot be written (a full disk) is named and
leaves the previous one, and the output folder's problems are config errors."""

import math
import os
import signal

import pytest
import torch
from omegaconf import OmegaConf
from recipe_helpers import CONFIG, load_recipe, run

import dualkv_compile as dk
from dualkv_compile.rl import GRPOLoss, NonFiniteGradient, StepStats, optimizer_step
from dualkv_compile.rl.recipe_config import ConfigError
from dualkv_compile.rl.run_guard import RunFailed, check_output_dir, write_checkpoint
from dualkv_compile.testing import make_batch, same_dtype_numerics, tiny_model


def recipe_for(tmp_path, name, **overrides):
    cfg = OmegaConf.load(CONFIG)
    OmegaConf.update(cfg, "output_dir", str(tmp_path / name))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return load_recipe().GRPORecipe(cfg)


def test_a_signal_during_the_final_save_waits_for_it(tmp_path):
    # the final save ran after the signal handler was removed: a Ctrl-C there raised
    # KeyboardInterrupt mid-write and left only checkpoint.tmp
    recipe = recipe_for(tmp_path, "run", num_steps=2)
    recipe.setup()
    save = recipe.save_checkpoint

    def interrupted_save():
        os.kill(os.getpid(), signal.SIGINT)  # delivered before the save starts writing
        save()

    recipe.save_checkpoint = interrupted_save
    recipe.train()
    recipe.cleanup()
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 2 and not (tmp_path / "run" / "checkpoint.tmp").exists()


def test_a_signal_during_the_last_step_ends_a_complete_run(tmp_path, capsys):
    # it exited 128 + the signal: a scheduler requeued the finished run, whose resume was then
    # refused (nothing left to train)
    recipe = recipe_for(tmp_path, "run", num_steps=2)
    recipe.setup()
    train_step = recipe.train_step

    def signalled_in_the_last_step():
        if recipe.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step()

    recipe.train_step = signalled_in_the_last_step
    recipe.train()
    recipe.cleanup()
    assert recipe.stopped_by is None and recipe.step == 2
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 2
    assert "arrived during the last step; the run is complete" in capsys.readouterr().out


def test_a_non_finite_gradient_is_not_applied():
    g = torch.Generator().manual_seed(0)
    tokens, mask, p = make_batch([5, 3], [[4, 2], [3, 1]], vocab=90, generator=g)
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    with torch.no_grad():  # a NaN the inputs do not hold (they are checked: a NaN advantage
        next(model.parameters())[0, 0] = math.nan  # is refused before any forward)
    before = [q.detach().clone() for q in model.parameters()]
    lp = torch.zeros(tokens.shape[0], tokens.shape[1] - p, dtype=torch.float64)
    adv = torch.tensor([1.0, 0.3, -1.0, 0.5], dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteGradient, match=r"the gradient norm is nan .*not taken"):
        optimizer_step(dk.optimize(model), GRPOLoss(), opt, tokens, mask, p, lp, lp, adv,
                       group_size=2, temperature=1.0, max_grad_norm=1.0)
    assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
               for a, b in zip(before, model.parameters()))
    assert all(q.grad is None for q in model.parameters()) and not opt.state


def test_a_diverging_run_stops_and_keeps_its_last_finite_checkpoint(tmp_path):
    # optimizer.lr=1e3 (for 1e-3): NaN from the second or third step on; the run used to go on
    # to the end and replace the last good checkpoint with NaN weights
    recipe = recipe_for(tmp_path, "run", num_steps=6, save_every=1, **{"optimizer.lr": 1e3})
    recipe.setup()
    with pytest.raises(RunFailed, match=r"step (\d): the gradient norm is (nan|inf).*; .*"
                                        r"checkpoint.pt holds step \d, the last good one"):
        recipe.train()
    recipe.cleanup()
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["step"] == recipe.step >= 1
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_a_diverging_run_saves_the_step_before_and_a_resume_starts_the_failed_step_again(
        tmp_path):
    # without save_every the run ended with nothing saved, though the weights in memory were
    # the last finite step's
    lr = {"optimizer.lr": 1e3}
    recipe = recipe_for(tmp_path, "run", num_steps=8, save_every=0, **lr)
    recipe.setup()
    with pytest.raises(RunFailed) as failed:
        recipe.train()
    recipe.cleanup()
    k = recipe.step
    assert f"the weights of step {k} were saved" in str(failed.value)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["step"] == k >= 1
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    # the failed step's own random states were saved: resumed unchanged, it fails alike
    again = recipe_for(tmp_path, "run", num_steps=8, save_every=0, resume_from_checkpoint=True,
                       **lr)
    again.setup()
    with pytest.raises(RunFailed) as failed_again:
        again.train()
    again.cleanup()
    first, second = (str(e.value).split("; ")[0] for e in (failed, failed_again))
    assert first == second and first.startswith(f"step {k + 1}: ")  # the same loss too
    # and the checkpoint it resumed from is kept, not written again
    assert f"checkpoint.pt holds step {k}, the last good one" in str(failed_again.value)


def test_a_skipped_update_does_not_count_as_one_that_changed_the_weights(tmp_path):
    # an update whose loss counts no token (every response truncated under overlong
    # filtering) is skipped; it was counted as taken, so a later update's non-finite gradient
    # left the step's unchanged weights unsaved ("the step's first 1 update(s) had changed the
    # weights"), losing every step since the last save
    module = load_recipe()
    real, calls = module.optimizer_step, []

    def skipped_then_diverging(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # step 2's first update, skipped as optimizer_step skips one
            return StepStats(0.0, 0.0, 0.0, 0.0, stepped=False)
        if len(calls) == 4:
            raise NonFiniteGradient("the gradient norm is nan")
        return real(*args, **kwargs)

    module.optimizer_step = skipped_then_diverging
    cfg = OmegaConf.load(CONFIG)
    for key, value in {"output_dir": str(tmp_path / "run"), "num_steps": 3, "save_every": 0,
                       "updates_per_step": 2}.items():
        OmegaConf.update(cfg, key, value)
    recipe = module.GRPORecipe(cfg)
    recipe.setup()
    with pytest.raises(RunFailed, match="step 2: .*the weights of step 1 were saved"):
        recipe.train()
    recipe.cleanup()
    assert recipe.history[0]["updates"] == 2
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 1


def test_a_step_without_an_update_logs_no_update_means(tmp_path):
    # its loss, kl, clip_fraction and grad_norm were logged as 0, a vanished gradient
    module = load_recipe()
    real, calls = module.optimizer_step, []

    def second_skipped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # as optimizer_step skips a step that counts no token
            return StepStats(0.0, 0.0, 0.0, 0.0, stepped=False)
        return real(*args, **kwargs)

    module.optimizer_step = second_skipped
    recipe = module.GRPORecipe(OmegaConf.merge(OmegaConf.load(CONFIG), {
        "output_dir": str(tmp_path / "run"), "num_steps": 3, "save_every": 0}))
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    means = ("loss", "kl", "clip_fraction", "grad_norm")
    took, skipped, after = recipe.history
    assert skipped["updates"] == 0 and not any(k in skipped for k in means)
    assert took["updates"] == after["updates"] == 1 and all(k in after for k in means)
    assert after["grad_norm"] > 0 and "reward" in skipped


def test_a_step_without_a_group_to_train_on_saves_the_step_before(tmp_path):
    # dynamic sampling's refusal was a traceback that lost every step since the last save
    recipe = recipe_for(tmp_path, "run", num_steps=3, save_every=0, dynamic_sampling=True)
    recipe.setup()
    score = recipe._score

    def flat_after_the_first_step(responses, answers, lengths):  # as a converged run scores
        rewards = score(responses, answers, lengths)
        return rewards if recipe.step == 0 else torch.ones_like(rewards)

    recipe._score = flat_after_the_first_step
    with pytest.raises(RunFailed, match=r"step 2: dynamic sampling found no group with "
                                        r"differing rewards .*; the weights of step 1 were saved"):
        recipe.train()
    recipe.cleanup(failed=True)
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 1


def test_a_diverging_run_whose_save_fails_names_both(tmp_path):
    # the save's own RunFailed replaced the message: the non-finite gradient went unsaid
    recipe = recipe_for(tmp_path, "run", num_steps=8, save_every=0, **{"optimizer.lr": 1e3})
    recipe.setup()

    def full_disk(random_states=None):
        raise RunFailed("step 1: no space left")

    recipe.save_checkpoint = full_disk
    with pytest.raises(RunFailed, match=r"step \d: the gradient norm is .*; saving the weights "
                                        r"of step \d failed too: step 1: no space left"):
        recipe.train()
    recipe.cleanup(failed=True)


def test_non_finite_weights_are_not_written(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"previous")
    with pytest.raises(RunFailed, match=r"step 3: the weights hold non-finite values \(w\)"):
        write_checkpoint(path, {"model": {"w": torch.tensor([1.0, math.inf])}, "step": 3})
    assert path.read_bytes() == b"previous"


def test_non_finite_weights_reach_no_trained_weights_folder_either(tmp_path):
    # the checkpointer's epoch_N folder was written before checkpoint.pt's check refused the
    # weights: a diverged step was exported as trained weights (and blocked the folder)
    recipe = recipe_for(tmp_path, "run", num_steps=1)
    recipe.setup()
    written = []

    class Checkpointer:
        def save_checkpoint(self, state, epoch):
            written.append(epoch)

    recipe.checkpointer = Checkpointer()
    with torch.no_grad():
        next(recipe.model.parameters())[0] = math.inf
    with pytest.raises(RunFailed, match=r"step 0: the weights hold non-finite values"):
        recipe.save_checkpoint()
    recipe.cleanup(failed=True)
    assert written == [] and not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_checkpoint_that_cannot_be_written_is_named_and_leaves_the_previous(tmp_path,
                                                                             monkeypatch):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"previous")

    def full_disk(obj, f):  # what torch.save raises when the disk fills mid-write
        open(f, "wb").write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 2")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RunFailed, match=r"step 4: .*checkpoint.pt could not be written "
                                        r"\(RuntimeError: .*unexpected pos.*\); [0-9.]+ GiB free "
                                        r"on its disk; the partial checkpoint.tmp was removed"):
        write_checkpoint(path, {"model": {"w": torch.ones(2)}, "step": 4})
    assert path.read_bytes() == b"previous" and not (tmp_path / "checkpoint.tmp").exists()


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="resume_from_checkpoint=true and overwrite_output_dir"
                                          "=true ask for opposite things"):
        check_output_dir(tmp_path / "checkpoint.pt", resume=True, overwrite=True)


def test_an_unusable_output_dir_is_a_config_error_and_a_refused_run_leaves_no_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"output_dir=.*file' cannot be created or written"):
        recipe_for(tmp_path, "file").setup()
    # resume refused (no checkpoint): the folder the lock made is gone again
    with pytest.raises(ConfigError, match="resume_from_checkpoint=true but .* does not exist"):
        recipe_for(tmp_path, "new", resume_from_checkpoint=True).setup()
    assert not (tmp_path / "new").exists()


def test_a_changed_seed_on_resume_is_said_to_do_nothing(tmp_path, capsys):
    run(tmp_path, "run", num_steps=1)
    capsys.readouterr()
    run(tmp_path, "run", num_steps=2, resume_from_checkpoint=True, seed=5)
    out = capsys.readouterr().out
    assert "seed: 0 -> 5 (no effect: the checkpoint's random states are restored)" in out


def test_a_metric_log_that_cannot_be_written_ends_the_logging_not_the_run(tmp_path, capsys):
    # a full disk under log_dir raised OSError out of the step: the run died with a traceback
    # and its steps since the last checkpoint were lost
    recipe = recipe_for(tmp_path, "run", num_steps=3)
    recipe.setup()
    log = recipe.metric_logger.log_dict

    def full_disk(metrics, step):
        if step == 2:
            raise OSError(28, "No space left on device")
        log(metrics, step=step)

    recipe.metric_logger.log_dict = full_disk
    recipe.train()
    recipe.cleanup()

    class ClosesOnAFullDisk:  # TensorBoard's writer raises a failed write again at its close
        def close(self):
            full_disk({}, 2)

    recipe.metric_logger = ClosesOnAFullDisk()
    recipe.cleanup()
    assert [h["step"] for h in recipe.history] == [1, 2, 3]
    err = capsys.readouterr().err
    assert "warning: step 2: the metric log could not be written ([Errno 28] No space left" in err
    assert "warning: the metric log could not be written at its close ([Errno 28]" in err
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 3


def test_a_log_dir_that_is_a_file_is_a_config_error_before_the_model_is_built(tmp_path):
    (tmp_path / "afile").write_text("x")
    for log_dir, why in [(tmp_path / "afile", "is a file"),
                         (tmp_path / "afile" / "tb", "lies under the file")]:
        recipe = recipe_for(tmp_path, "run", **{"metric_logger.log_dir": str(log_dir)})
        with pytest.raises(ConfigError, match=f"metric_logger.log_dir=.* {why}"):
            recipe.setup()
        assert not hasattr(recipe, "model")


def _run_with_torchtune_style_checkpointer(tmp_path, weights_dir):
    """One step of a run whose weights a torchtune-style checkpointer loads from a saved
    state dict and writes to `weights_dir`; returns the recipe."""
    first = recipe_for(tmp_path, "first", num_steps=1)
    first.setup()
    (tmp_path / "source").mkdir()
    torch.save(first.model.state_dict(), tmp_path / "source" / "model.pt")
    first.cleanup()
    recipe = recipe_for(tmp_path, "run", num_steps=1, checkpointer={
        "_component_": "recipe_helpers.TorchtuneStyleCheckpointer",
        "checkpoint_dir": str(tmp_path / "source"), "output_dir": str(weights_dir)})
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    return recipe


def test_a_torchtune_checkpointer_without_checkpoint_dir_works(tmp_path):
    # torchtune's checkpointers keep the folder in _checkpoint_dir: the recipe read
    # .checkpoint_dir and failed with an AttributeError at setup
    recipe = _run_with_torchtune_style_checkpointer(tmp_path, tmp_path / "weights")
    assert recipe.checkpointer.saved == [1] and recipe.model_config is None


def test_a_checkpointer_writing_into_output_dir_itself_is_not_refused_as_another_run(tmp_path):
    # torchtune's configs write checkpointer.output_dir: ${output_dir}; the recipe locked the
    # folder twice and refused itself as "in use by another run (pid <its own>)"
    recipe = _run_with_torchtune_style_checkpointer(tmp_path, tmp_path / "run")
    assert recipe.checkpointer.saved == [1]
