"""Math word problems from a local JSONL file, rewarded by final-answer match.

Each line: {"question": "...", "answer": "42"} (the answer may carry GSM8K's "#### 42" form).
Reward 1 when the last number in the response equals the answer's number (as values: "10.00"
matches "10", "0.5" matches "1/2"), else 0.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

from .tasks import SeededTask

__all__ = ["MathJSONLTask", "final_number"]

# a number: optional sign (ASCII or Unicode minus); digits with thousands separators in groups
# of three, plain digits, or a leading decimal point; an optional fraction bar
_NUMBER = re.compile(r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:/\d+)?")


def final_number(text: str) -> str | None:
    """The last number in `text` (after GSM8K's "####" if present), as its value written one
    way: an integer ("1,200.0" -> "1200", "10.00" -> "10") or a reduced fraction ("0.75" and
    "3/4" -> "3/4", "-.5" -> "-1/2"), so that equal values compare equal as strings."""
    for token in reversed(_NUMBER.findall(text.split("####")[-1])):
        try:
            value = Fraction(token.replace("\u2212", "-").replace(",", ""))
        except ZeroDivisionError:  # "3/0" is no number; take the one before it
            continue
        return str(value)
    return None


class MathJSONLTask(SeededTask):
    def __init__(self, tokenizer, *, path: str,
                 prompt_template: str = "{question}\nAnswer:", seed: int = 0):
        super().__init__(seed)
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"dataset {path} does not exist")
        self.rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not JSON: {e}") from None
                if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                    raise ValueError(f"{path}:{n} needs 'question' and 'answer' fields")
                self.rows.append(row)
        if not self.rows:
            raise ValueError(f"dataset {path} is empty")
        self.tokenizer, self.template = tokenizer, prompt_template

    def _encode(self, i: int) -> list[int]:
        return self.tokenizer.encode(self.template.format(question=self.rows[i]["question"]))

    @cached_property
    def max_prompt_len(self) -> int:
        """The longest prompt in tokens (every row encoded once, on first use; only the length
        is kept): the recipe checks it plus max_generated_tokens against the model's context
        before the first step."""
        return max(len(self._encode(i)) for i in range(len(self.rows)))

    def sample_prompts(self, n: int) -> tuple[Tensor, list[str]]:
        """n prompts, left-padded with the tokenizer's pad id to one length, and their answers."""
        idx = torch.randint(0, len(self.rows), (n,), generator=self.generator).tolist()
        encoded = [self._encode(i) for i in idx]
        width = max(len(e) for e in encoded)
        tokens = torch.full((n, width), self.tokenizer.pad_id, dtype=torch.long)
        for row, e in enumerate(encoded):
            tokens[row, width - len(e):] = torch.tensor(e)
        return tokens, [final_number(str(self.rows[i]["answer"])) for i in idx]

    def rewards(self, responses: Tensor, answers: list[str]) -> Tensor:
        out = [float(final_number(self.tokenizer.decode(ids)) == answer and answer is not None)
               for ids, answer in zip(responses.tolist(), answers)]
        return torch.tensor(out)
