"""Recipe settings checked against the model, tokenizer and task once they are built, so that
a setting the model cannot run is a config error (exit 2) before the first step, not a
traceback in it: the dualkv wrappers' and the rollout engine's refusals, the tokenizer's ids
against the model's vocabulary, a prompt plus `max_generated_tokens` against its context."""

from __future__ import annotations

from typing import Callable

from .recipe_config import ConfigError

__all__ = ["check_model_fit", "refused_as_config"]


def refused_as_config(section: str, build: Callable):
    """build(), with a ValueError (a wrapper's or engine's refusal) as a ConfigError."""
    try:
        return build()
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError([f"{section}: {e}"]) from None


# compiles of the packed model per packed length: the forward without gradients (old and
# reference logprobs) and with them (the update); the reference shares the policy's
# (optimize(..., share_compiles_with=)), tests/test_share_compiles.py counts them
COMPILES_PER_LENGTH = 2


def check_model_fit(cfg, tokenizer, task, decoder, dualkv=None) -> None:
    """decoder: the rollout engine's view of the model (vocab_size, max_seq_len); dualkv: the
    wrappers' DualKVConfig, whose length buckets must stay within their recompile limit."""
    problems = []
    vocab = refused_as_config("model", lambda: decoder.vocab_size)
    # a larger model vocabulary is accepted: real checkpoints pad theirs to a round size, and
    # the tokenizers decode a sampled id they do not know (HFTokenizer drops it, CharTokenizer
    # writes its `unknown`)
    if tokenizer.vocab_size > vocab:
        problems.append(f"model: its vocabulary holds {vocab} ids, the tokenizer's "
                        f"{tokenizer.vocab_size}: a prompt or stop token could fall outside it")
    prompt = getattr(task, "max_prompt_len", 1)  # tasks that know their longest prompt say so
    if prompt + cfg.max_generated_tokens > decoder.max_seq_len:
        problems.append(f"max_generated_tokens={cfg.max_generated_tokens}: with prompts of up to "
                        f"{prompt} tokens it exceeds the model's context of "
                        f"{decoder.max_seq_len}")
    if dualkv is not None and dualkv.enabled:
        problems += _bucket_problems(cfg, tokenizer, task, dualkv)
    if problems:
        raise ConfigError(problems)


def _bucket_problems(cfg, tokenizer, task, dualkv) -> list[str]:
    """Each packed length a micro-batch can take is a compile, fatal past the wrapper's limit:
    refuse settings whose lengths can exceed it over a long run."""
    import torch

    from dualkv_compile.layout.buckets import bucket_count

    # Dynamo's cap on the compiled variants of one function (the packed model's), past which
    # it refuses to compile again
    limit, per_length = torch._dynamo.config.accumulated_recompile_limit, COMPILES_PER_LENGTH

    gen, n = cfg.max_generated_tokens, int(cfg.group_size)
    p_hi = getattr(task, "max_prompt_len", 1)
    p_lo = getattr(task, "min_prompt_len", None) or 1
    r_lo = 1 if tokenizer.stop_tokens else gen  # no stop token: every response is full length
    budget = cfg.get("max_tokens_per_micro_batch")
    if budget is not None:  # a lone row over the budget packs alone
        lo, hi = p_lo + r_lo, max(int(budget), p_hi + gen)
        how = f"max_tokens_per_micro_batch={budget}"
    else:  # dynamic sampling may leave a micro-batch one group
        groups = int(cfg.micro_batch_groups)
        lo = (1 if cfg.get("dynamic_sampling") else groups) * (p_lo + n * r_lo)
        hi = groups * (p_hi + n * gen)
        how = f"micro_batch_groups={groups} of {n} rows, prompts of {p_lo}-{p_hi} tokens"
    count = bucket_count(hi, dualkv.pad_to, dualkv.bucket_growth, min_tokens=lo)
    if count * per_length <= limit:
        return []
    fewer = bucket_count(hi, dualkv.pad_to, 1.1, min_tokens=lo)
    return [f"dualkv.bucket_growth={dualkv.bucket_growth}: micro-batches of {lo}-{hi} packed "
            f"tokens ({how}) can take {count} packed lengths, each up to {per_length} compiles "
            f"of the model, over the {limit} Dynamo allows (then the packed run is refused); "
            f"set dualkv.bucket_growth: 1.1 ({fewer} lengths)"]
