"""A synthetic task with a verifiable reward and its own tokenizer, for runs without downloads.

RepeatLastLetterTask: the prompt is a random string of letters followed by ':'; the correct
response repeats the prompt's last letter until the end-of-sequence token. Reward: the fraction
of the first `target_len` response characters equal to that letter, with no credit for anything
after them; simple enough that a tiny random model learns it in minutes on a CPU, and checked
by a rule, not a model.
"""

from __future__ import annotations

import string

import torch
from torch import Tensor

from ..arguments import integer_arg

__all__ = ["CharTokenizer", "RepeatLastLetterTask", "SeededTask"]


class CharTokenizer:
    """Characters <-> ids. 0 = pad, 1 = bos, 2 = eos, then the alphabet.

    A model may have more ids than the tokenizer (a vocabulary padded to a round size, as real
    checkpoints' are); decode turns a sampled id past the alphabet into `unknown`, one
    character that matches no letter, so such a response is read (and scored) as wrong, not
    as a crash, and the characters after it keep their positions."""

    pad_id, bos_id, eos_id = 0, 1, 2
    stop_tokens = (2,)  # the ids that end a response (torchtune's tokenizers' attribute)
    unknown = "\ufffd"  # Unicode's replacement character, as text decoders write for bad input

    def __init__(self, alphabet: str = string.ascii_lowercase + ":"):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet {alphabet!r} repeats a character")
        if self.unknown in alphabet:  # it would read an out-of-alphabet id as a letter
            raise ValueError(f"alphabet {alphabet!r} holds {self.unknown!r}, which decode "
                             "writes for ids past the alphabet")
        self.alphabet = alphabet
        self._ids = {c: i + 3 for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        bad = sorted(set(text) - set(self._ids))
        if bad:
            raise ValueError(f"characters {bad} are not in the tokenizer's alphabet")
        return ([self.bos_id] if add_bos else []) + [self._ids[c] for c in text]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if 3 <= i < self.vocab_size:
                out.append(self.alphabet[i - 3])
            elif i >= self.vocab_size:  # a padded model vocabulary's id
                out.append(self.unknown)
        return "".join(out)


class SeededTask:
    """A task that draws prompts from its own generator, so a resumed run continues the same
    data order (`state_dict` / `load_state_dict` carry the generator)."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class RepeatLastLetterTask(SeededTask):
    def __init__(self, tokenizer: CharTokenizer, *, prompt_letters: int = 6, target_len: int = 8,
                 letters: str = "abcdefgh", seed: int = 0):
        if not set(letters) <= set(tokenizer.alphabet) or not letters:
            raise ValueError(f"letters {letters!r} must be non-empty and in the tokenizer's "
                             f"alphabet")
        if ":" not in tokenizer.alphabet:  # else step 1's sample_prompts fails to encode
            raise ValueError(f"the tokenizer's alphabet {tokenizer.alphabet!r} lacks ':', "
                             "which ends every prompt")
        integer_arg("prompt_letters", prompt_letters, 1)
        integer_arg("target_len", target_len, 1)
        super().__init__(seed)
        self.tokenizer, self.prompt_letters, self.target_len = tokenizer, prompt_letters, target_len
        self.letters = letters

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_letters + 2

    def sample_prompts(self, n: int) -> tuple[Tensor, list[str]]:
        """n prompts of equal length: tokens [n, prompt_letters + 2] and their answer letters."""
        idx = torch.randint(0, len(self.letters), (n, self.prompt_letters), generator=self.generator)
        texts = ["".join(self.letters[i] for i in row) + ":" for row in idx.tolist()]
        tokens = torch.tensor([self.tokenizer.encode(t) for t in texts], dtype=torch.long)
        return tokens.reshape(n, self.max_prompt_len), [t[-2] for t in texts]  # (n = 0 too)

    def rewards(self, responses: Tensor, answers: list[str]) -> Tensor:
        """responses [B, R] token ids (generation stops at eos) -> rewards [B] in [0, 1]."""
        out = []
        tok = self.tokenizer
        for ids, answer in zip(responses.tolist(), answers):
            # a sampled pad or bos id is a wrong character in its place (decode drops them,
            # which would move the later characters up: a,<pad>,a,a,... scored in full)
            ids = [tok.vocab_size if i in (tok.pad_id, tok.bos_id) else i for i in ids]
            text = tok.decode(ids)[: self.target_len]
            out.append(sum(c == answer for c in text) / self.target_len)
        return torch.tensor(out)
