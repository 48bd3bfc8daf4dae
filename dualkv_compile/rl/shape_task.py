"""A task for timing GRPO steps at real shapes with random weights: prompts of random token ids
of a fixed length, a tokenizer that is only ids, and a cheap verifiable reward.

With `IdTokenizer(..., eos=False)` no token ends a response, so every response runs to
`max_generated_tokens` and each step has the shape the config names (N samples of R tokens on
P-token prompts). With an end-of-sequence token, a random model does sample it now and then,
the packed length changes, and the step lands in a new length bucket and recompiles, which
spoils a timing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .tasks import SeededTask

__all__ = ["IdTokenizer", "EvenTokensTask"]


class IdTokenizer:
    """Token ids without text: pad 0, eos 1, bos 2; ids 3.. are ordinary tokens. With
    eos=False, eos_id is -1, an id no model samples: responses never end early."""

    pad_id, bos_id = 0, 2

    def __init__(self, vocab_size: int, eos: bool = True):
        if vocab_size < 4:
            raise ValueError(f"vocab_size={vocab_size} must be at least 4 (pad, eos, bos, one more)")
        self.vocab_size = vocab_size
        self.eos_id = 1 if eos else -1

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


class EvenTokensTask(SeededTask):
    """Prompts: bos then `prompt_len - 1` random ids. Reward: the fraction of even ids among a
    response's tokens before its eos (0 for an empty response)."""

    def __init__(self, tokenizer: IdTokenizer, *, prompt_len: int, seed: int = 0):
        if prompt_len < 2:
            raise ValueError(f"prompt_len={prompt_len} must be at least 2")
        super().__init__(seed)
        self.tokenizer, self.prompt_len = tokenizer, prompt_len

    def sample_prompts(self, n: int) -> tuple[Tensor, list[str]]:
        body = torch.randint(3, self.tokenizer.vocab_size, (n, self.prompt_len - 1),
                             generator=self.generator)
        bos = torch.full((n, 1), self.tokenizer.bos_id, dtype=body.dtype)
        return torch.cat([bos, body], 1), [""] * n

    def rewards(self, responses: Tensor, answers: list[str]) -> Tensor:
        is_eos = responses == self.tokenizer.eos_id
        valid = ((is_eos.cumsum(1) - is_eos.long()) == 0) & ~is_eos
        even = (responses % 2 == 0) & valid
        return (even.sum(1) / valid.sum(1).clamp_min(1)).float().cpu()
