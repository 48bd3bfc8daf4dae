"""GRPO (and DAPO) full fine-tune on dualkv_compile, run with torchtune:

    tune run recipes/grpo_full_finetune.py --config recipes/configs/tiny_grpo.yaml [key=value ...]

Each step: sample `groups_per_step` prompts from the task, generate `group_size` responses each
(KV-cached, temperature / top-k), score them with the task's verifiable reward, normalise
advantages within each group, then one policy update: old, reference and policy logprobs all
through `optimize(model).response_logprobs`, the clipped loss with a KL term, micro-batches of
whole groups with gradient accumulation, gradient clipping, the optimizer step. `dualkv.enabled:
false` runs the same recipe on the plain model (the baseline).

Single process for now; FSDP2 sharding and torchtune's HF checkpointers come with the
real-checkpoint configs of issue #5.
"""

from __future__ import annotations

import copy
import resource
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from torchtune import config
from torchtune.generation import generate
from torchtune.modules.common_utils import local_kv_cache
from tqdm import tqdm

import dualkv_compile as dk
from dualkv_compile.rl import group_advantages, groups_with_signal, overlong_penalty

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


class GRPORecipe:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        if cfg.dtype not in _DTYPES:
            raise ValueError(f"dtype={cfg.dtype!r} is not one of {sorted(_DTYPES)}")
        if cfg.groups_per_step % cfg.micro_batch_groups:
            raise ValueError(f"micro_batch_groups={cfg.micro_batch_groups} must divide "
                             f"groups_per_step={cfg.groups_per_step}")
        self.device = torch.device(cfg.device)
        self.dtype = _DTYPES[cfg.dtype]
        self.output_dir = Path(cfg.output_dir)
        self.history: list[dict] = []  # the logged metrics, for tests
        self.step = 0

    # ---- setup -------------------------------------------------------------------------------
    def setup(self):
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.task = config.instantiate(cfg.task, tokenizer=self.tokenizer)
        self.model = config.instantiate(cfg.model)
        # a torchtune checkpointer (e.g. dualkv_compile.models.Qwen3HFCheckpointer) loads the
        # starting weights and writes the trained ones in the source format
        self.checkpointer = config.instantiate(cfg.checkpointer) if cfg.get("checkpointer") else None
        if self.checkpointer is not None:
            self.model.load_state_dict(self.checkpointer.load_checkpoint()["model"], strict=True)
        self.model.to(device=self.device, dtype=self.dtype)
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        if cfg.get("enable_activation_checkpointing", False):
            # torchtune's per-layer checkpointing; optimize() inlines the checkpointed layers and
            # recomputes them in the backward, except the shared-prefix attention (README)
            from torchtune.modules import TransformerSelfAttentionLayer
            from torchtune.training import set_activation_checkpointing

            set_activation_checkpointing(self.model,
                                         auto_wrap_policy={TransformerSelfAttentionLayer})
        dcfg = dk.DualKVConfig(enabled=bool(cfg.dualkv.enabled), fallback=cfg.dualkv.fallback,
                               attention_backend=cfg.dualkv.get("attention_backend", "auto"))
        self.policy = dk.optimize(self.model, dcfg)
        self.reference = dk.optimize(self.ref_model, dcfg)
        self.loss_fn = config.instantiate(cfg.loss)
        self.optimizer = config.instantiate(cfg.optimizer, self.model.parameters())
        self.rng = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume_from_checkpoint:
            self._load_checkpoint()
        self.metric_logger = config.instantiate(cfg.metric_logger)
        self.metric_logger.log_config(cfg)

    # ---- checkpoints -------------------------------------------------------------------------
    def _checkpoint_path(self) -> Path:
        return self.output_dir / "checkpoint.pt"

    def save_checkpoint(self):
        torch.save({"model": self.model.state_dict(), "ref_model": self.ref_model.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "task": self.task.state_dict(), "rng": self.rng.get_state(),
                    "torch_rng": torch.get_rng_state()}, self._checkpoint_path())
        if self.checkpointer is not None:
            self.checkpointer.save_checkpoint({"model": self.model.state_dict()}, epoch=self.step)

    def _load_checkpoint(self):
        path = self._checkpoint_path()
        if not path.is_file():
            raise FileNotFoundError(f"resume_from_checkpoint=true but {path} does not exist")
        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.ref_model.load_state_dict(state["ref_model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.task.load_state_dict(state["task"])
        self.rng.set_state(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]

    # ---- rollouts ----------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, prompts: torch.Tensor):
        """prompts [G, P] -> tokens [G*N, P+T], padding mask, response lengths (eos included)."""
        cfg, tok = self.cfg, self.tokenizer
        batch = prompts.repeat_interleave(cfg.group_size, 0).to(self.device)
        p, t = batch.shape[1], cfg.max_generated_tokens
        self.model.eval()
        with local_kv_cache(self.model, batch_size=batch.shape[0], device=self.device,
                            dtype=self.dtype, decoder_max_seq_len=p + t):
            out, _ = generate(self.model, batch, max_generated_tokens=t, pad_id=tok.pad_id,
                              temperature=cfg.temperature, top_k=cfg.top_k,
                              stop_tokens=[tok.eos_id], rng=self.rng)
        self.model.train()
        response = torch.full((batch.shape[0], t), tok.pad_id, dtype=out.dtype, device=out.device)
        response[:, : out.shape[1] - p] = out[:, p:]
        is_eos = response == tok.eos_id
        # valid: everything up to and including the first eos
        before_eos = (is_eos.cumsum(1) - is_eos.long()) == 0
        lengths = before_eos.sum(1)
        tokens = torch.cat([batch, response], 1)
        mask = torch.cat([batch != tok.pad_id, before_eos], 1)  # prompts may be left-padded
        return torch.where(mask, tokens, tok.pad_id), mask, lengths

    def _scored_rollouts(self):
        """Rollouts and rewards for groups_per_step groups; with dynamic sampling, groups whose
        rewards are all equal are dropped and refilled (up to 4 rounds)."""
        cfg = self.cfg
        kept: list[tuple] = []
        for _ in range(4 if cfg.dynamic_sampling else 1):
            need = cfg.groups_per_step - len(kept)
            prompts, answers = self.task.sample_prompts(need)
            tokens, mask, lengths = self.rollout(prompts)
            rewards = self.task.rewards(tokens[:, prompts.shape[1]:],
                                        [a for a in answers for _ in range(cfg.group_size)])
            if cfg.overlong:
                rewards = rewards + overlong_penalty(lengths, max_len=cfg.overlong.max_len,
                                                     cache_len=cfg.overlong.cache_len)
            per_group = rewards.view(need, cfg.group_size)
            keep = groups_with_signal(per_group) if cfg.dynamic_sampling else torch.ones(need, dtype=torch.bool)
            n = cfg.group_size
            for g in keep.nonzero()[:, 0].tolist():
                rows = slice(g * n, (g + 1) * n)
                kept.append((tokens[rows], mask[rows], lengths[rows], per_group[g]))
            if len(kept) >= cfg.groups_per_step:
                break
        if not kept:
            raise RuntimeError("dynamic sampling found no group with differing rewards in 4 "
                               "rounds; lower the task's difficulty or disable it")
        tokens, mask, lengths, rewards = (torch.cat([k[i] if i < 3 else k[i][None] for k in kept])
                                          for i in range(4))
        return tokens, mask, lengths, rewards, prompts.shape[1]

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        tokens, mask, lengths, rewards, p = self._scored_rollouts()
        advantages = group_advantages(rewards).flatten().to(self.device)
        t_rollout = time.perf_counter()
        resp_mask = mask[:, p:]
        temp = cfg.temperature  # logprobs of the distribution that sampled (top-k aside)
        with torch.no_grad():
            old = self.policy.response_logprobs(tokens, prompt_len=p, padding_mask=mask,
                                                temperature=temp)
            ref = self.reference.response_logprobs(tokens, prompt_len=p, padding_mask=mask,
                                                   temperature=temp)
        n_groups = rewards.shape[0]
        rows_per_mb = cfg.micro_batch_groups * cfg.group_size
        total_tokens = resp_mask.sum().clamp_min(1)
        loss_sum, kl_sum = 0.0, 0.0
        for start in range(0, n_groups * cfg.group_size, rows_per_mb):
            rows = slice(start, start + rows_per_mb)
            lp = self.policy.response_logprobs(tokens[rows], prompt_len=p, padding_mask=mask[rows],
                                               temperature=temp)
            loss, stats = self.loss_fn(lp, old[rows], ref[rows], advantages[rows], resp_mask[rows])
            if self.loss_fn.aggregation == "token":
                weight = resp_mask[rows].sum() / total_tokens
            else:
                weight = torch.tensor(lp.shape[0] / tokens.shape[0])
            (loss * weight).backward()
            loss_sum += float(loss.detach() * weight)
            kl_sum += float(stats["kl"] * resp_mask[rows].sum() / total_tokens)  # token mean
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t_end = time.perf_counter()
        packed = dk.pack(tokens, prompt_len=p, padding_mask=mask)
        replicated = int(mask.sum())
        return {"reward": float(rewards.mean()), "loss": loss_sum, "kl": kl_sum,
                "grad_norm": float(grad_norm), "response_length": float(lengths.float().mean()),
                "tokens_per_s": replicated / (t_end - t_rollout), "rho": packed.rho,
                "step_time_s": t_end - t0, "policy_update_s": t_end - t_rollout,
                "peak_memory_gib": _peak_memory_gib(self.device)}

    def train(self):
        start = self.step
        bar = tqdm(range(start, self.cfg.num_steps), initial=start, total=self.cfg.num_steps,
                   desc="grpo", file=sys.stdout, dynamic_ncols=True)
        for _ in bar:
            metrics = self.train_step()
            self.step += 1
            self.history.append({"step": self.step, **metrics})
            self.metric_logger.log_dict(metrics, step=self.step)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}")
            if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                self.save_checkpoint()
        self.save_checkpoint()

    def cleanup(self):
        self.metric_logger.close()


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = GRPORecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    first, last = recipe.history[:5], recipe.history[-5:]
    mean = lambda rows: sum(r["reward"] for r in rows) / max(len(rows), 1)  # noqa: E731
    print(f"mean reward: first {len(first)} steps {mean(first):.3f}, "
          f"last {len(last)} steps {mean(last):.3f}; checkpoint in {recipe.output_dir}")


if __name__ == "__main__":
    sys.exit(recipe_main())
