"""The GRPO recipe's checkpoints: what one holds, writing it (the trained weights first), reading
it back on resume, and the save after a step that failed before its first update.

A mixin of `recipes/grpo_full_finetune.py`'s GRPORecipe, which sets the attributes it reads:
cfg, rank, step, saved_step, output_dir, model, ref_model, optimizer, rng, task, checkpointer,
model_config (the transformers config.json a checkpointer built the model from), plain_cfg
(the resolved config), resume_state and config_changes (from prepare_output_dir), and
updates_taken (optimizer steps of the current step).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import distributed as ddp
from .recipe_config import ConfigError
from .resume_checks import apply_config_changes, check_resume_model
from .run_guard import RunFailed, check_finite_weights, write_checkpoint

__all__ = ["RecipeCheckpoints"]


class RecipeCheckpoints:
    def _checkpoint_path(self) -> Path:
        return self.output_dir / "checkpoint.pt"

    def _random_states(self) -> tuple:
        """What a checkpoint restores besides the weights: this rank's sampling and torch RNG
        states and the task's prompt order."""
        return self.rng.get_state(), torch.get_rng_state(), self.task.state_dict()

    def save_checkpoint(self, random_states: tuple | None = None):
        """Full (unsharded) states, written by rank 0; every rank's sampling RNG. random_states:
        those of the start of a step that failed (default: the current ones). A write that
        fails raises RunFailed on every rank (rank 0 alone left the others in a collective)."""
        rng, torch_rng, task = random_states or self._random_states()
        model, optimizer = ddp.full_state_dicts(self.model, self.optimizer)
        # (no reference model with kl_coef=0: saved as None)
        ref = None if self.ref_model is None else ddp.full_state_dicts(self.ref_model, None)[0]
        rngs = ddp.gather_objects((rng, torch_rng))
        self.saved_step = self.step  # on every rank: they decide alike whether to save again
        failed = None
        if self.rank == 0:
            try:
                self._write(model, ref, optimizer, task, rngs)
            except RunFailed as e:
                failed = str(e)
        # every rank waits for rank 0's write and takes its outcome
        failed = ddp.gather_objects(failed)[0]
        if failed is not None:
            raise RunFailed(failed)

    def _write(self, model, ref, optimizer, task, rngs) -> None:
        """Rank 0: the trained weights (the checkpointer's), then checkpoint.pt."""
        # nothing is written from weights that are not finite (neither file below)
        check_finite_weights(model, self.step, self._checkpoint_path())
        # the trained weights first: a crash (or a full disk) between the two writes leaves the
        # previous checkpoint.pt, so a resumed run trains this step again and writes both; the
        # other order left a checkpoint at this step whose weights no epoch_* folder held
        if self.checkpointer is not None:
            try:
                self.checkpointer.save_checkpoint({"model": model}, epoch=self.step)
            except OSError as e:  # a full disk (durable.write_failed says so)
                raise RunFailed(f"step {self.step}: {e}") from e
        write_checkpoint(self._checkpoint_path(), {
            "model": model, "ref_model": ref, "optimizer": optimizer, "step": self.step,
            "task": task, "rngs": rngs, "config": self.plain_cfg,
            "model_config": self.model_config})

    def check_reference_kept(self, needed: bool) -> None:
        """Before the models are built: a checkpoint written without a reference model
        (kl_coef=0) cannot resume a run whose loss needs one."""
        if needed and self.resume_state is not None and self.resume_state["ref_model"] is None:
            raise ConfigError([f"loss.kl_coef: {self._checkpoint_path()} was written by a run "
                               f"with kl_coef=0, which kept no reference model (the starting "
                               f"weights); a resumed run cannot add the KL term (keep "
                               f"kl_coef=0, or start a new run)"])

    def _load_checkpoint(self):
        state, self.resume_state = self.resume_state, None  # read and checked in setup()
        check_resume_model(self._checkpoint_path(), state, ddp.weight_shapes(self.model),
                           self.model_config)
        ddp.load_full_state_dicts(self.model, self.optimizer, state["model"], state["optimizer"])
        apply_config_changes(self.optimizer, self.config_changes, step=state["step"],
                             announce=self.rank == 0)
        if self.ref_model is not None:  # (check_reference_kept refused a checkpoint without)
            ddp.load_full_state_dicts(self.ref_model, None, state["ref_model"], None)
        self.task.load_state_dict(state["task"])
        rng, torch_rng = state["rngs"][self.rank]
        self.rng.set_state(rng)
        torch.set_rng_state(torch_rng)
        self.step = self.saved_step = state["step"]  # (a failure before the next step keeps it)

    def _save_before(self, random_states: tuple) -> str:
        """After a step failed before its first optimizer step: the weights are still the last
        step's, so they are saved (unless they were), with the random states of the failed
        step's start: a resumed run (with a lower lr, say) starts that step again."""
        if self.updates_taken == 0 and self.saved_step != self.step:
            try:  # (every rank takes rank 0's outcome: the others left at once, claiming a
                # save that a full disk, or torchrun ending rank 0, then lost)
                self.save_checkpoint(random_states)
                failed = None
            except RunFailed as e:  # (the caller's message, the failed step's, comes first)
                failed = str(e)
            if failed is not None:
                return f"saving the weights of step {self.step} failed too: {failed}"
            return (f"the weights of step {self.step} were saved in {self._checkpoint_path()} "
                    "(resume_from_checkpoint=true starts the failed step again)")
        if self.updates_taken == 0:
            return f"{self._checkpoint_path()} holds step {self.step}, the last good one"
        return (f"the step's first {self.updates_taken} update(s) had changed the weights, which "
                f"were not saved; {self._checkpoint_path()}, if any, is the last good checkpoint")

    def _weight_dirs(self) -> list[Path]:
        """Where the checkpointer writes the trained weights (its epoch_* folders), if any."""
        return [Path(d) for d in [(self.cfg.get("checkpointer") or {}).get("output_dir")] if d]
