"""GRPO (and DAPO) full fine-tune on dualkv_compile, run with torchtune:

    tune run recipes/grpo_full_finetune.py --config recipes/configs/tiny_grpo.yaml [key=value ...]

Each step: sample `groups_per_step` prompts, generate `group_size` responses each
(rollout.RolloutEngine: each prompt's K/V computed and stored once for its samples), score
them with the task's reward, normalise advantages within each group, then the policy update:
old and reference logprobs (`optimize(model).response_logprobs`, by the update's
micro-batches), and `updates_per_step` optimizer steps over mini-batches of the groups, each
the clipped loss with a KL term (`response_loss`, the LM head's backward fused into its
forward) over micro-batches (`micro_batch_groups` whole groups, or packed to
`max_tokens_per_micro_batch` tokens) with gradient accumulation and clipping. `dualkv.enabled: false` runs the same recipe on the plain
model (the baseline).

Data parallel with FSDP2: `tune run --nproc_per_node K ...` (NCCL on CUDA, gloo on CPU) shards
each decoder layer and the model (dualkv_compile.rl.distributed.shard_decoder); each rank
samples its own share of the step's groups, the loss is normalised over all ranks' tokens, and
optimize() drives the FSDP hooks layer by layer (compile_region "auto" -> "layer").

The recipe's rollouts (prompts, sampling, rewards) are the mixin
dualkv_compile.rl.recipe_rollouts.RecipeRollouts, its checkpoints
dualkv_compile.rl.recipe_checkpoints.RecipeCheckpoints.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import dualkv_compile as dk
from dualkv_compile.rl import (BatchRefused, NoGroupWithSignal, group_advantages,
                               needs_reference, peak_bf16_tflops, policy_update_flops)
from dualkv_compile.rl import distributed as ddp
from dualkv_compile.rl.metric_log import close_logger, log_step, open_metric_logger
from dualkv_compile.rl.model_checks import check_model_fit, refused_as_config
from dualkv_compile.rl.recipe_config import (ConfigError, instantiate_checked, parse_checked,
                                             split_problem)
from dualkv_compile.rl.recipe_checkpoints import RecipeCheckpoints
from dualkv_compile.rl.recipe_rollouts import RecipeRollouts
from dualkv_compile.rl.run_guard import (RunFailed, RunLock, StopOnSignal, prepare_output_dir,
                                         replace_earlier_run)
from dualkv_compile.rl.rollout_batch import truncated_responses
from dualkv_compile.rl.update import (NonFiniteGradient, micro_batched_logprobs, mini_batches,
                                      optimizer_step)
from dualkv_compile.rollout import RolloutEngine

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


class GRPORecipe(RecipeRollouts, RecipeCheckpoints):
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        if cfg.dtype not in _DTYPES:
            raise ValueError(f"dtype={cfg.dtype!r} is not one of {sorted(_DTYPES)}")
        self.device = ddp.init_distributed(cfg.device)
        self.rank, self.world_size = ddp.world()
        problem = split_problem(cfg.groups_per_step, self.world_size, cfg.micro_batch_groups,
                                by_groups=cfg.get("max_tokens_per_micro_batch") is None,
                                updates=cfg.get("updates_per_step", 1))
        if problem:  # (the config check says so first under `tune run`)
            raise ConfigError([f"groups_per_step={cfg.groups_per_step} {problem}"])
        self.groups_per_rank = cfg.groups_per_step // self.world_size
        self.dtype = _DTYPES[cfg.dtype]
        self.output_dir = Path(cfg.output_dir)
        self.history: list[dict] = []  # the logged metrics, for tests
        self.step = 0
        self.saved_step: int | None = None  # output_dir's checkpoint's step (written or resumed)
        self.run_locks: list[RunLock] = []  # rank 0's, from setup() to cleanup()
        self.stopped_by: int | None = None  # the signal that ended the run early
        self.updates_taken = 0  # optimizer steps taken in the current step

    # ---- setup -------------------------------------------------------------------------------
    def setup(self):
        # before any work: output_dir and a checkpointer's output_dir (inside it or not: another
        # run may name this one's) serve one live run (rank 0 holds their locks until cleanup()
        # or the end of the process; a setup that fails lets them go)
        try:
            if self.rank == 0:
                self.run_locks.append(RunLock(self.output_dir))
                for folder in self._weight_dirs():  # (torchtune's configs often name output_dir)
                    if folder.resolve() != self.output_dir.resolve():  # locked just above
                        self.run_locks.append(RunLock(folder, key="checkpointer.output_dir"))
            self._setup()
        except BaseException:
            self._release_lock(failed_setup=True)
            raise

    def _release_lock(self, failed_setup: bool = False):
        for lock in reversed(self.run_locks):
            lock.release(failed_setup=failed_setup)
        self.run_locks = []

    def _setup(self):
        cfg = self.cfg
        # a checkpoint or trained weights in output_dir are continued or replaced only when
        # asked, and one to continue is read (memory-mapped) and checked against the config
        self.plain_cfg = OmegaConf.to_container(cfg, resolve=True)
        self.resume_state, self.config_changes = prepare_output_dir(
            self._checkpoint_path(), resume=bool(cfg.resume_from_checkpoint),
            overwrite=bool(cfg.get("overwrite_output_dir", False)), num_steps=cfg.num_steps,
            world_size=self.world_size, config=self.plain_cfg, weight_dirs=self._weight_dirs(),
            log_dir=(cfg.get("metric_logger") or {}).get("log_dir"))
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.tokenizer = instantiate_checked("tokenizer", cfg.tokenizer)
        self.task = instantiate_checked("task", cfg.task, tokenizer=self.tokenizer)
        if cfg.get("overlong_filter") and not self.tokenizer.stop_tokens:
            raise ConfigError(["overlong_filter=true needs a tokenizer with stop tokens: "
                               "without one every response is truncated"])
        self.loss_fn = instantiate_checked("loss", cfg.loss)
        self.check_reference_kept(needs_reference(self.loss_fn))
        with self.device:  # initialise on the device: random init of GPU-sized models is fast there
            self.model = instantiate_checked("model", cfg.model)
        # a torchtune checkpointer (e.g. dualkv_compile.models.Qwen3HFCheckpointer) loads the
        # starting weights and writes the trained ones in the source format
        self.checkpointer = (instantiate_checked("checkpointer", cfg.checkpointer)
                             if cfg.get("checkpointer") else None)
        self.model_config = None  # the transformers config.json a checkpointer built it from
        if self.checkpointer is not None:
            weights = instantiate_checked("checkpointer", self.checkpointer.load_checkpoint)
            self.model.load_state_dict(weights["model"], strict=True)
            # (torchtune's own checkpointers name the folder _checkpoint_dir)
            folder = getattr(self.checkpointer, "checkpoint_dir",
                             getattr(self.checkpointer, "_checkpoint_dir", None))
            source = Path(folder) / "config.json" if folder is not None else None
            self.model_config = (json.loads(source.read_text())
                                 if source is not None and source.is_file() else None)
        self.model.to(device=self.device, dtype=self.dtype)
        # a loss without a KL term (kl_coef=0, DAPO's) needs no reference model: neither its
        # memory nor its forward (TRL and veRL skip it too)
        self.ref_model = (ddp.reference_copy(self.model)  # shaped like the policy: shared compiles
                          if needs_reference(self.loss_fn) else None)
        if self.ref_model is None and self.rank == 0:
            print("loss.kl_coef=0: no reference model is built or run (kl is not logged)",
                  flush=True)
        references = [] if self.ref_model is None else [self.ref_model]
        if cfg.get("enable_activation_checkpointing", False):
            # per-layer checkpointing (torchtune's, or transformers' own); optimize() inlines the
            # checkpointed layers and recomputes them in the backward, except the shared-prefix
            # attention (docs/api.md)
            for model in [self.model, *references]:
                ddp.checkpoint_layers(model)
        reshard = bool(cfg.get("fsdp_reshard_after_forward", True))
        ddp.shard_decoder(self.model, reshard_after_forward=reshard)
        # the reference runs no backward, which is where FSDP reshards what a forward left
        # gathered: it always reshards after its forward, or it would stay whole on every rank
        for model in references:
            ddp.shard_decoder(model, reshard_after_forward=True)
        dcfg = dk.DualKVConfig(enabled=bool(cfg.dualkv.enabled), fallback=cfg.dualkv.fallback,
                               attention_backend=cfg.dualkv.get("attention_backend", "auto"),
                               bucket_growth=float(cfg.dualkv.get("bucket_growth", 1.0)),
                               compile_region=cfg.dualkv.get("compile_region", "auto"))
        # the rollout reads the live weights; sharing the prompt K/V follows dualkv.enabled
        # unless `rollout_share_prompt` says otherwise (off: the prompt K/V replicated per row,
        # as a decoder without cascade attention holds it)
        share = cfg.get("rollout_share_prompt")
        self.rollout_engine = refused_as_config("model", lambda: RolloutEngine(
            self.model, share_prompt=bool(cfg.dualkv.enabled) if share is None else bool(share),
            steps_per_graph=int(cfg.get("rollout_steps_per_graph", 16))))
        check_model_fit(cfg, self.tokenizer, self.task, self.rollout_engine.decoder, dcfg)
        self.policy = refused_as_config("dualkv", lambda: dk.optimize(self.model, dcfg))
        self.reference = (None if self.ref_model is None else
                          dk.optimize(self.ref_model, dcfg, share_compiles_with=self.policy))
        self.optimizer = instantiate_checked("optimizer", cfg.optimizer, self.model.parameters())
        # sampling differs per rank; the task's prompt order is shared (see _sample_prompts)
        self.rng = torch.Generator(device=self.device).manual_seed(cfg.seed + self.rank)
        if cfg.get("overwrite_output_dir", False) and self.rank == 0:  # every check passed
            replace_earlier_run(self._checkpoint_path(), weight_dirs=self._weight_dirs(),
                                log_dir=(cfg.get("metric_logger") or {}).get("log_dir"))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume_from_checkpoint:
            self._load_checkpoint()
        # useful-FLOP MFU needs the GPU's peak: `peak_tflops` in the config, else a known GPU's
        self.peak_tflops = cfg.get("peak_tflops") or peak_bf16_tflops(self.device)
        if self.peak_tflops is None and self.device.type == "cuda" and self.rank == 0:
            print(f"mfu_useful is not logged: the bf16 peak of {torch.cuda.get_device_name()} "
                  "is not in dualkv_compile.rl.flops; set peak_tflops=<TFLOP/s>", flush=True)
        resumed = self.step if cfg.resume_from_checkpoint else None
        self.metric_logger = open_metric_logger(
            cfg.metric_logger, cfg, output_dir=self.output_dir,
            resume_step=resumed) if self.rank == 0 else None

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        tokens, mask, lengths, rewards, p, sampled, filler = self._scored_rollouts()
        if cfg.get("rollout_release_cache"):  # its memory goes to the update; recaptured next step
            self.rollout_engine.release()
        rollout_peak = _peak_memory_gib(self.device, reset=True)
        # in float64 (rewards come as float32), then the logprobs' dtype
        advantages = group_advantages(
            rewards.double(), scale=cfg.get("scale_advantages", True)).flatten().to(
            self.device, torch.promote_types(torch.float32, self.dtype))
        t_rollout = time.perf_counter()
        resp_mask = mask[:, p:]
        truncated = truncated_responses(tokens, mask, prompt_len=p,
                                        stop_tokens=self.tokenizer.stop_tokens)
        # DAPO's overlong filtering (TRL's mask_truncated_completions): a truncated response
        # leaves the loss, its reward still counts in its group's advantages
        loss_mask = resp_mask & ~truncated[:, None] if cfg.get("overlong_filter") else resp_mask
        # logprobs of softmax(logits / T), the sampling distribution before top-k / top-p
        temp = cfg.temperature
        counted = 0 if filler else 1  # a filler rank's rows count in no normaliser or metric
        groups, n = rewards.shape[0], cfg.group_size
        # no more updates than the most groups a rank has (dynamic sampling may keep fewer):
        # an update with no rows anywhere would step the optimizer on zero gradients
        # (a filler rank's groups are another rank's, run at weight 0: not counted here)
        most = int(ddp.all_max(groups * counted)[0])
        updates = min(cfg.get("updates_per_step", 1), max(most, 1))
        # by the update's micro-batches of each mini-batch: its packed lengths (graphs) and its
        # memory bound
        plan = dict(group_size=n, temperature=temp, micro_batch_groups=cfg.micro_batch_groups,
                    max_tokens=cfg.get("max_tokens_per_micro_batch"), updates=updates)
        with torch.no_grad():
            old = micro_batched_logprobs(self.policy, tokens, mask, p, **plan)
            ref = (None if self.reference is None else
                   micro_batched_logprobs(self.reference, tokens, mask, p, **plan))
        taken = []  # the StepStats of the updates that stepped the optimizer
        # the groups in `updates` consecutive mini-batches, an optimizer step each (DAPO's and
        # veRL's mini-batches): `old` stays the sampling policy's, so from the second on the
        # ratio leaves 1 and the clipping bounds it. A rank with fewer groups than updates runs
        # its first group at weight 0 where it has none.
        for rows, real in mini_batches(groups, n, updates):
            stats = optimizer_step(
                self.policy, self.loss_fn, self.optimizer, tokens[rows], mask[rows], p,
                old[rows], None if ref is None else ref[rows], advantages[rows],
                group_size=n, temperature=temp,
                micro_batch_groups=cfg.micro_batch_groups, max_grad_norm=cfg.max_grad_norm,
                max_tokens=cfg.get("max_tokens_per_micro_batch"), counted=bool(counted and real),
                loss_mask=loss_mask[rows])
            if stats.stepped:  # (a skipped update left the weights as they were)
                self.updates_taken += 1
                taken.append(stats[:4])
        # loss, kl, clip_fraction, grad_norm: means over the updates taken
        means = [sum(s) / len(taken) for s in zip(*taken)] if taken else [0.0] * 4
        loss_sum, kl_sum, clip_sum, grad_norm = means
        t_end = time.perf_counter()
        packed = dk.pack(tokens, prompt_len=p, padding_mask=mask)
        # the sampling policy's mean response-token logprob: a whole forward pass in one number
        # (with sequence aggregation the step-1 loss is ~0 by construction: ratio 1 and
        # zero-mean advantages per group; token aggregation weighs longer responses more)
        (loss_sum, kl_sum, clip_sum, logprob_sum, total_tokens, reward_sum, n_groups,
         sampled_sum, n_sampled, length_sum, truncated_sum, replicated, packed_tokens,
         flops) = ddp.all_sum(
            loss_sum, kl_sum, clip_sum, (old * resp_mask).sum() * counted,
            resp_mask.sum() * counted, rewards.sum() * counted, rewards.shape[0] * counted,
            sampled.sum(), sampled.numel(), lengths.sum() * counted,
            truncated.sum() * counted, packed.replicated_tokens,
            packed.num_tokens,
            policy_update_flops(self.model, packed, reference=self.reference is not None))
        step_time, rollout_time, update_time, rollout_peak, update_peak = ddp.all_max(
            t_end - t0, t_rollout - t0, t_end - t_rollout, rollout_peak,
            _peak_memory_gib(self.device, reset=True))
        peaks = {"peak_memory_gib": max(rollout_peak, update_peak)}
        if self.device.type == "cuda":  # on the CPU both read the process's peak RSS
            peaks.update(rollout_peak_memory_gib=rollout_peak, update_peak_memory_gib=update_peak)
        # reward: over the groups trained on; sampled_reward: over every response sampled
        # (they differ only with dynamic sampling, which drops groups whose rewards are equal)
        # the update's means, over the updates taken: none, none logged (a 0 would read as a
        # vanished gradient); kl only with a KL term, which a reference model measures (TRL's)
        update = {} if not taken else {
            "loss": loss_sum, **({} if self.reference is None else {"kl": kl_sum}),
            "clip_fraction": clip_sum, "grad_norm": grad_norm}
        return {"reward": reward_sum / (n_groups * cfg.group_size),
                "sampled_reward": sampled_sum / max(n_sampled, 1), **update,
                "updates": float(len(taken)),
                "response_logprob": logprob_sum / max(total_tokens, 1.0),
                "response_length": length_sum / (n_groups * cfg.group_size),
                "truncated_fraction": truncated_sum / (n_groups * cfg.group_size),
                "tokens_per_s": replicated / update_time, "rho": replicated / packed_tokens,
                "step_time_s": step_time, "rollout_s": rollout_time,
                "policy_update_s": update_time,
                **peaks, "compiles": float(dk.counters["graphs_compiled"]),
                **self._mfu(flops, update_time)}

    def _mfu(self, flops: float, seconds: float) -> dict:
        """Useful-FLOP MFU of the policy update over all ranks (rl/flops.py says what counts)."""
        if self.peak_tflops is None:
            return {}
        return {"mfu_useful": flops / (seconds * self.world_size * self.peak_tflops * 1e12)}

    def train(self):
        """Train to num_steps. SIGINT/SIGTERM end the run after the current step with a
        checkpoint; `stopped_by` then holds the signal (recipe_main exits 128 + it)."""
        with StopOnSignal() as stop:  # also over the final save: a signal waits for it
            self._train(stop)
            if (self.stopped_by is None and self.cfg.get("save_final_checkpoint", True)
                    and self.saved_step != self.step):  # (unless this step's was just written)
                self.save_checkpoint()

    def _train(self, stop: StopOnSignal):
        start = self.step
        bar = tqdm(range(start, self.cfg.num_steps), initial=start, total=self.cfg.num_steps,
                   desc="grpo", file=sys.stdout, dynamic_ncols=True, disable=self.rank != 0)
        for _ in bar:
            before = self._random_states()
            self.updates_taken = 0  # optimizer steps of this step so far
            try:
                metrics = self.train_step()
            except (NonFiniteGradient, NoGroupWithSignal, BatchRefused) as e:  # weights whole
                raise RunFailed(f"step {self.step + 1}: {e}; {self._save_before(before)}") from e
            except Exception as e:  # the user's draw() or score() raised: its traceback stays
                if not getattr(e, "refused_on_every_rank", False):
                    raise
                e.add_note(f"step {self.step + 1}: {self._save_before(before)}")
                raise
            self.step += 1
            self.history.append({"step": self.step, **metrics})
            if self.metric_logger is not None:
                self.metric_logger = log_step(self.metric_logger, metrics, self.step)
            bar.set_postfix({k: f"{metrics[k]:.4g}" for k in ("reward", "kl") if k in metrics})
            if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                self.save_checkpoint()
            if self.world_size > 1:  # every rank stops after the same step
                stop.signum = int(ddp.all_max(stop.signum or 0)[0]) or None
            if stop.signum is not None and self.step == self.cfg.num_steps:
                if self.rank == 0:  # nothing is left to stop: the run ends as a complete one
                    print(f"signal {stop.signum} arrived during the last step; the run is "
                          "complete", flush=True)
            elif stop.signum is not None:
                self.stopped_by = stop.signum
                if self.saved_step != self.step:  # (unless this step's was just written)
                    self.save_checkpoint()
                bar.update()  # this step is done: the bar says so before the loop is left
                bar.close()
                if self.rank == 0:
                    print(f"stopped by signal {stop.signum} after step {self.step}; "
                          f"checkpoint in {self._checkpoint_path()}", flush=True)
                return

    def cleanup(self, failed: bool = False):
        """failed: a RunFailed ended the run, on this rank perhaps alone (a save is rank 0's):
        no collective, which the other ranks might never join; torchrun ends them."""
        if self.metric_logger is not None:
            close_logger(self.metric_logger)
            self.metric_logger = None
        self._release_lock()
        if self.world_size > 1 and not failed:
            # no rank may still hold collective work (or tensors it references) when the process
            # group goes: gloo aborted at interpreter exit now and then without this
            torch.distributed.barrier()
            for name in ("policy", "reference", "model", "ref_model", "optimizer"):
                setattr(self, name, None)
            gc.collect()
            torch.distributed.destroy_process_group()


def _peak_memory_gib(device: torch.device, reset: bool = False) -> float:
    """The CUDA allocator's peak since the last reset (reset=True starts a new one), or the
    process's peak RSS on the CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@parse_checked
def recipe_main(cfg: DictConfig) -> None:
    recipe = GRPORecipe(cfg)
    recipe.setup()
    try:
        recipe.train()
    except RunFailed as e:
        # one write, line and newline: every rank prints it, and print's two writes let
        # another rank's line fall between them
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        recipe.cleanup(failed=True)
        return 1
    recipe.cleanup()
    if recipe.stopped_by is not None:
        return 128 + recipe.stopped_by  # the exit code of a process ended by that signal
    if recipe.rank != 0:
        return
    saved = (f"checkpoint of step {recipe.saved_step} in {recipe.output_dir}"
             if recipe.saved_step is not None else "no checkpoint written")
    # the steps by number: a resumed run's first steps are not the training's first
    spans = [recipe.history[:5]] + ([recipe.history[-5:]] if len(recipe.history) > 5 else [])
    print(f"mean reward: {', '.join(map(_mean_reward, spans))}; {saved}")


def _mean_reward(rows: list[dict]) -> str:
    if not rows:
        return "no steps"
    return (f"steps {rows[0]['step']}-{rows[-1]['step']} "
            f"{sum(r['reward'] for r in rows) / len(rows):.3f}")


if __name__ == "__main__":
    sys.exit(recipe_main())
