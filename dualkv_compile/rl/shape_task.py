"""A task for timing GRPO steps at real shapes with random weights: prompts of random token ids
of a fixed length, a tokenizer that is only ids, and a cheap verifiable reward.

With `IdTokenizer(..., eos=False)` no token ends a response, so every response runs to
`max_generated_tokens` and each step has the shape the config names (N samples of R tokens on
P-token prompts). A random model samples one eos id among a large vocabulary almost never;
`IdTokenizer(..., stop_every=k)` makes every k-th id a stop token, so that responses end after
about k tokens (geometrically distributed, as long as the model's distribution is near
uniform): ragged batches, as real rollouts are. `EvenTokensTask(min_prompt_len=...)` draws
prompt lengths too (left-padded).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..rollout.sampling import stop_mask
from .tasks import SeededTask

__all__ = ["IdTokenizer", "EvenTokensTask"]


class IdTokenizer:
    """Token ids without text: pad 0, eos 1, bos 2; ids 3.. are ordinary tokens. With
    eos=False, eos_id is -1, an id no model samples: responses never end early. stop_every=k:
    ids 1, 1 + k, 1 + 2k, ... all end a response (`stop_tokens`), eos_id stays 1."""

    pad_id, bos_id = 0, 2

    def __init__(self, vocab_size: int, eos: bool = True, stop_every: int | None = None):
        if vocab_size < 4:
            raise ValueError(f"vocab_size={vocab_size} must be at least 4 (pad, eos, bos, one more)")
        if stop_every is not None and (not eos or isinstance(stop_every, bool)
                                       or not 3 <= stop_every < vocab_size):
            raise ValueError(f"stop_every={stop_every} needs eos=True and must be in "
                             f"[3, vocab_size={vocab_size}): ids 1, 1 + k, ... end a response")
        self.vocab_size = vocab_size
        self.eos_id = 1 if eos else -1
        self.stop_tokens = (() if not eos else (1,) if stop_every is None
                            else tuple(range(1, vocab_size, stop_every)))

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


class EvenTokensTask(SeededTask):
    """Prompts: bos then random ids, `prompt_len` tokens, or with min_prompt_len a length drawn
    uniformly from [min_prompt_len, prompt_len] per prompt, left-padded to prompt_len.
    Reward: the fraction of even ids among a response's tokens before its first stop token
    (0 for an empty response)."""

    def __init__(self, tokenizer: IdTokenizer, *, prompt_len: int,
                 min_prompt_len: int | None = None, seed: int = 0):
        if prompt_len < 2:
            raise ValueError(f"prompt_len={prompt_len} must be at least 2")
        if min_prompt_len is not None and not 2 <= min_prompt_len <= prompt_len:
            raise ValueError(f"min_prompt_len={min_prompt_len} must be in [2, prompt_len="
                             f"{prompt_len}]")
        super().__init__(seed)
        self.tokenizer, self.prompt_len = tokenizer, prompt_len
        self._drawn = min_prompt_len is not None  # lengths drawn (the RNG stream depends on it)
        self.min_prompt_len = prompt_len if min_prompt_len is None else min_prompt_len

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_len

    def sample_prompts(self, n: int) -> tuple[Tensor, list[str]]:
        tok = self.tokenizer
        body = torch.randint(3, tok.vocab_size, (n, self.prompt_len - 1), generator=self.generator)
        prompts = torch.cat([torch.full((n, 1), tok.bos_id, dtype=body.dtype), body], 1)
        if self._drawn:
            lengths = torch.randint(self.min_prompt_len, self.prompt_len + 1, (n,),
                                    generator=self.generator)
            start = self.prompt_len - lengths  # bos moves to each prompt's first position
            cols = torch.arange(self.prompt_len)
            prompts = torch.where(cols < start[:, None], tok.pad_id, prompts)
            prompts[torch.arange(n), start] = tok.bos_id
        return prompts, [""] * n

    def rewards(self, responses: Tensor, answers: list[str]) -> Tensor:
        is_stop = stop_mask(responses, tuple(self.tokenizer.stop_tokens))
        valid = ((is_stop.cumsum(1) - is_stop.long()) == 0) & ~is_stop
        even = (responses % 2 == 0) & valid
        return (even.sum(1) / valid.sum(1).clamp_min(1)).float().cpu()
