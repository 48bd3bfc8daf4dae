"""Math word problems from a local JSONL file, rewarded by final-answer match.

Each line: {"question": "...", "answer": "42"} (the answer may carry GSM8K's "#### 42" form,
MATH's \\boxed{...}, or be a JSON number; a line whose answer holds no number is refused).
Reward 1 when the response's number (final_number: the last \\boxed{} if any, else the last
number) equals the answer's as a value ("10.00" matches "10", "0.5" matches "1/2" and
"\\frac{1}{2}"), else 0.
"""

from __future__ import annotations

import json
import re
import string
from fractions import Fraction
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

from .tasks import SeededTask

__all__ = ["MathJSONLTask", "final_number"]

# a number: a sign (ASCII or Unicode minus) unless it follows a digit or letter ("10-5",
# "2023-10-05" are no negative numbers); digits with thousands separators in groups of three,
# plain digits, or a leading decimal point; an exponent ("3.14e2") or a fraction bar
_NUMBER = re.compile(r"(?:(?<!\w)[-\u2212])?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
                     r"(?:[eE][-+]?\d+|/\d+)?")
# LaTeX fractions of two numbers, as MATH writes answers: \frac{3}{4}, \dfrac{-1}{2}, \tfrac
_MAX_EXPONENT = 100
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\{\s*([-\u2212]?[\d.,]+)\s*\}\{\s*([\d.,]+)\s*\}")


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def final_number(text: str) -> str | None:
    """The answer's number in `text`: within the last \\boxed{...} if there is one, else after
    GSM8K's "####" if present, the last number; as its value written one way: an integer
    ("1,200.0" -> "1200", "10.00" -> "10", "3.14e2" -> "314") or a reduced fraction ("0.75",
    "3/4" and "\\frac{3}{4}" -> "3/4", "-.5" -> "-1/2"), so that equal values compare equal
    as strings."""
    text = text.split("####")[-1]
    boxed = _last_boxed(text)
    text = _LATEX_FRACTION.sub(r" \1/\2 ", text if boxed is None else boxed)
    for token in reversed(_NUMBER.findall(text)):
        exponent = token.lower().partition("e")[2]
        if exponent and abs(int(exponent)) > _MAX_EXPONENT:  # 1e999999999: no answer, no hang
            continue
        try:
            value = Fraction(token.replace("\u2212", "-").replace(",", ""))
        except (ZeroDivisionError, ValueError):  # "3/0" is no number; take the one before it
            continue
        return str(value)
    return None


def _check_template(template) -> None:
    """A str.format template whose only field is {question}; literal braces doubled."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except (TypeError, ValueError, AttributeError):
        fields = None
    if not fields or set(fields) != {"question"}:
        raise ValueError(f"prompt_template={template!r} must be a str.format template whose only "
                         f"field is {{question}}; write literal braces doubled (\\boxed{{{{}}}})")


def _answer_of(raw, where: str) -> str:
    """A dataset answer (a string, or a JSON number) as final_number's value; a ValueError
    naming the line for anything without a number (it would score every response 0)."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ValueError(f"{where}: answer {raw!r} must be a string or a number")
    value = final_number(raw if isinstance(raw, str) else repr(raw))
    if value is None:
        raise ValueError(f"{where}: answer {raw!r} holds no number to match responses against")
    return value


class MathJSONLTask(SeededTask):
    def __init__(self, tokenizer, *, path: str,
                 prompt_template: str = "{question}\nAnswer:", seed: int = 0):
        super().__init__(seed)
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"dataset {path} does not exist")
        _check_template(prompt_template)
        self.questions, self.answers = [], []
        # JSON lines end at "\n" only: str.splitlines() also breaks at U+2028 and U+0085,
        # which json.dumps(ensure_ascii=False) leaves inside strings
        for n, line in enumerate(path.read_text().split("\n"), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not JSON: {e}") from None
                if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                    raise ValueError(f"{path}:{n} needs 'question' and 'answer' fields")
                if not isinstance(row["question"], str) or not row["question"].strip():
                    raise ValueError(f"{path}:{n}: question {row['question']!r} must be a "
                                     f"non-empty string")
                self.questions.append(row["question"])
                self.answers.append(_answer_of(row["answer"], f"{path}:{n}"))
        if not self.questions:
            raise ValueError(f"dataset {path} is empty")
        self.tokenizer, self.template = tokenizer, prompt_template

    def _encode(self, i: int) -> list[int]:
        return self.tokenizer.encode(self.template.format(question=self.questions[i]))

    @cached_property
    def max_prompt_len(self) -> int:
        """The longest prompt in tokens (every row encoded once, on first use; only the length
        is kept): the recipe checks it plus max_generated_tokens against the model's context
        before the first step."""
        return max(len(self._encode(i)) for i in range(len(self.questions)))

    def sample_prompts(self, n: int) -> tuple[Tensor, list[str]]:
        """n prompts, left-padded with the tokenizer's pad id to one length, and their answers."""
        idx = torch.randint(0, len(self.questions), (n,), generator=self.generator).tolist()
        encoded = [self._encode(i) for i in idx]
        width = max(len(e) for e in encoded)
        tokens = torch.full((n, width), self.tokenizer.pad_id, dtype=torch.long)
        for row, e in enumerate(encoded):
            tokens[row, width - len(e):] = torch.tensor(e)
        return tokens, [self.answers[i] for i in idx]

    def rewards(self, responses: Tensor, answers: list[str]) -> Tensor:
        out = [float(final_number(self.tokenizer.decode(ids)) == answer and answer is not None)
               for ids, answer in zip(responses.tolist(), answers)]
        return torch.tensor(out)
