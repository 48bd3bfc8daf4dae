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


def check_model_fit(cfg, tokenizer, task, decoder) -> None:
    """decoder: the rollout engine's view of the model (vocab_size, max_seq_len)."""
    problems = []
    vocab = refused_as_config("model", lambda: decoder.vocab_size)
    if tokenizer.vocab_size > vocab:
        problems.append(f"model: its vocabulary holds {vocab} ids, the tokenizer's "
                        f"{tokenizer.vocab_size}: a prompt or stop token could fall outside it")
    prompt = getattr(task, "max_prompt_len", 1)  # tasks that know their longest prompt say so
    if prompt + cfg.max_generated_tokens > decoder.max_seq_len:
        problems.append(f"max_generated_tokens={cfg.max_generated_tokens}: with prompts of up to "
                        f"{prompt} tokens it exceeds the model's context of "
                        f"{decoder.max_seq_len}")
    if problems:
        raise ConfigError(problems)
