"""Math word problems from a local JSONL file, rewarded by final-answer match.

Each line: {"question": "...", "answer": "42"} (the answer may carry GSM8K's "#### 42" form,
MATH's \\boxed{...}, or be a JSON number; a line whose answer is not one number, such as
"\\sqrt{2}", is refused). Reward 1 when the response's number (final_number: the last
\\boxed{} if any, which must hold one number, else the number of GSM8K's "#### 42" line, else
the last number) equals the answer's as a value ("10.00" matches "10", "0.5" matches "1/2" and
"\\frac{1}{2}"), else 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import string
from fractions import Fraction
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

from .tasks import SeededTask

__all__ = ["MathJSONLTask", "final_number"]

log = logging.getLogger(__name__)

# minus signs: ASCII's, Unicode's, an en dash and a full-width one (a sign lost would credit
# -5 as 5); each reads as "-"
_MINUS = "-\u2212\u2013\uff0d"
_SIGN = f"[{_MINUS}]"  # one of them, in a regular expression ("-" first: itself)
_AS_HYPHEN = str.maketrans({c: "-" for c in _MINUS[1:]})
# a number: a sign (one of _MINUS) unless it follows a digit or letter ("10-5",
# "2023-10-05" are no negative numbers); digits with thousands separators in groups of three,
# plain digits, or a leading decimal point; an exponent ("3.14e2") or a fraction bar
_NUMBER = re.compile(r"(?:(?<!\w)" + _SIGN + r")?"
                     r"(?:[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
                     r"(?:[eE][-+]?\d+|/\d+)?")
# LaTeX fractions, as MATH writes answers: \frac{3}{4}, \dfrac{-1}{2}, \tfrac, -\frac{3}{4},
# and the brace-free \frac12 (each argument in braces or one digit)
_MAX_EXPONENT = 100
# (an argument's spaces are stripped after the match: "\{\s*([^{}]*?)\s*\}" backtracked in
# quadratic time over the spaces of an unclosed brace)
_LATEX_FRACTION = re.compile(r"(" + _SIGN + r"\s*)?\\[dt]?frac\s*(?:\{([^{}]*)\}|(\d))"
                             r"\s*(?:\{([^{}]*)\}|(\d))")
_PLAIN = re.compile(_SIGN + r"?[\d.,]+")
# what a boxed number may carry besides it: spacing, sizing, $, %, degrees, a unit in \text{}
# (squared or cubed: "25\text{ cm}^2")
_DECORATION = re.compile(r"\\(?:left|right|[,;: ]|[dt]extstyle|displaystyle)|~|\\?[$%]|"
                         r"\^\{?\\circ\}?|\u00b0|\\degree\b|"
                         r"\\(?:text|textbf|textrm|mbox|mathrm)\{[^{}\d]*\}(?:\^\{?\d\}?)?")
# a number set in a font (digits inside: a unit's \text{ cm} is decoration, above)
_FONT = re.compile(r"\\(?:text|textbf|textrm|mathbf|mathrm|mbox|boldsymbol)\{([^{}]*\d[^{}]*)\}")
# digits past which a number is no answer (int() refuses 4300: the number before it is not
# the answer either)
_MAX_DIGITS = 4000
# a word in \text{} between two numbers: the box holds no one number (its removal as a unit
# would leave "7 125", read as seven thousand)
_WORD_BETWEEN = re.compile(r"(?<=[\d}])\s*\\(?:text|textbf|mbox|mathrm)\{[^{}\d]*[A-Za-z][^{}\d]*\}"
                           r"\s*(?=[\d\\])")
_MIXED = re.compile(r"(" + _SIGN + r"?)(\d+) (\d+)/(\d+)")
# the whole part of a mixed number in running text: an integer standing alone (after a space,
# a line break or the start; not a time's "10:30", a ratio's "3:1", a date's "10-05" or an
# exponent's "x^2"), spaces before the fraction (not a tab: a table's column)
_WHOLE_BEFORE = re.compile(r"(?<!\S)" + _SIGN + r"?\d+ +$")
# GSM8K's answer line: "#### 42" and nothing else on it (not a heading "#### Step 2: ...")
_GSM8K_LINE = re.compile(r"^[ \t]*####[ \t]*\$?[ \t]*(" + _SIGN + r"?[\d.,/]+)"
                         r"[ \t]*\.?[ \t]*$",
                         re.MULTILINE)
_BOXED = re.compile(r"\\boxed\s*(?=\{)")
_SPACED_THOUSANDS = re.compile(_SIGN + r"?[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?")
# in running text, spaced groups ending a string, one of them after the first starting with 0:
# thousands ("1 000 000"; "1 500" may be two numbers and stays 500)
_SPACED_WITH_ZERO_GROUP = re.compile(r"(?:(?<!\w)" + _SIGN + r")?(?<![\w.,])[1-9]\d{0,2}"
                                     r"(?: \d{3})*(?: 0\d\d)(?: \d{3})*(?:\.\d+)?$")
# a word in \text{} before a box's number that is no label ("Answer:", "x =", "... is"):
# "\text{not } 5", "\text{about } 5" state no number
_QUALIFIER = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm)\{([^{}\d]*[A-Za-z][^{}\d]*)\}")


def _fraction(m: re.Match) -> str:
    """A LaTeX fraction of two plain numbers as "a/b" (spaced, signs combined); anything else
    unchanged."""
    sign = m.group(1)
    num = (m.group(2) if m.group(2) is not None else m.group(3)).strip()
    den = (m.group(4) if m.group(4) is not None else m.group(5)).strip()
    if not (num and den):  # \frac{}{2}
        return m.group(0)
    if not (_PLAIN.fullmatch(num) and _PLAIN.fullmatch(den)):
        return m.group(0)
    if den[0] in _MINUS:  # \frac{1}{-2}: the sign moves to the numerator
        if len(den) == 1 or den[1] in _MINUS:
            return m.group(0)
        den, sign = den[1:], not sign
    if sign:
        num = num[1:] if num[0] in _MINUS else "-" + num
    return f" {num}/{den} "


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} or \\boxed {...} (braces balanced), "" for a last
    box left open (a response cut off inside it: no answer, not the digits in it), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 0, starts[-1]
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return ""


def _value(token: str) -> str | None:
    """A number token's value as a reduced fraction string, or None (a zero denominator, an
    exponent past +-100, which would take unbounded time)."""
    exponent = token.lower().partition("e")[2].lstrip("+-").lstrip("0")
    if exponent and (len(exponent) > 3 or int(exponent) > _MAX_EXPONENT):
        return None
    try:
        return str(Fraction(token.translate(_AS_HYPHEN).replace(",", "")))
    except (ZeroDivisionError, ValueError):
        return None


def _unbraced(text: str) -> str:
    """text without braces that enclose all of it: "{{5}}" -> "5" ("{1}{2}" stays); one pass."""
    text = text.strip()
    close, opened = {}, []
    for j, c in enumerate(text):
        if c == "{":
            opened.append(j)
        elif c == "}" and opened:
            close[opened.pop()] = j
    lo, hi = 0, len(text) - 1
    while lo < hi and close.get(lo) == hi:
        lo, hi = lo + 1, hi - 1
        while lo <= hi and text[lo].isspace():
            lo += 1
        while hi >= lo and text[hi].isspace():
            hi -= 1
    return text[lo:hi + 1]


def _boxed_number(boxed: str) -> str | None:
    """The value of a box that holds one number (a sign, a fraction, a mixed number "1 1/2" or
    "1\\frac{1}{2}", "x = 5", with $, %, degrees or a \\text{} unit around it); None for any
    other box (\\sqrt{2}, 2\\pi, 10^{3}, (1,2)): its digits are not its value."""
    text = _LATEX_FRACTION.sub(_fraction, boxed).replace("\\!", "")  # MATH's 10,\\!000
    text = re.sub(r"(?<=\d)\{,\}(?=\d)", ",", text)  # LaTeX's 1{,}000 (not \text{,})
    text = _WORD_BETWEEN.sub(" \\nonumber ", text)  # "7 \text{ R } 125": not one number
    text = _FONT.sub(r"\1", text)  # \text{5}, \mathbf{5}: the number in a font
    text = _unbraced(text)  # {5}, {{5}}
    text = re.sub(r"^\s*\+\s*(?=[\d.])", "", text)  # +5
    text = re.sub(r"^\s*(?:[A-Za-z]\w*|\\(?:text|textrm|mathrm|mbox)\{[A-Za-z ]+\})\s*=", "", text)
    first_digit = re.search(r"\d", text)
    for m in _QUALIFIER.finditer(text, 0, first_digit.start() if first_digit else len(text)):
        words = m.group(1).strip().lower()
        if not (words.endswith(":") or words.endswith("=") or re.search(r"\bis$", words)):
            return None
    text = " ".join(_DECORATION.sub(" ", text).split()).rstrip(". ")
    text = re.sub(r"^(" + _SIGN + r") (?=[\d.])", r"\1", text)  # "- 5"
    mixed = _MIXED.fullmatch(text)
    if mixed:
        sign, whole, num, den = mixed.groups()
        try:  # past Python's 4300-digit limit for int() or str(): no number to compare
            value = int(whole) + Fraction(int(num), int(den)) if int(den) else None
            return None if value is None else str(-value if sign else value)
        except ValueError:
            return None
    if _SPACED_THOUSANDS.fullmatch(text):  # 1 000 000, 1\\,000
        text = text.replace(" ", "")
    return _value(text) if _NUMBER.fullmatch(text) else None


def final_number(text: str) -> str | None:
    """The answer's number in `text`: the last \\boxed{...} if there is one (None unless it
    holds one number: a box of \\sqrt{2} is not the answer 2), else the number of GSM8K's
    last "#### 42" line (a line of "####" and one number only: a Markdown heading such as
    "#### Step 2" is none), else the last number; as its value written one way: an integer ("1,200.0" -> "1200",
    "10.00" -> "10", "3.14e2" -> "314") or a reduced fraction ("0.75", "3/4" and
    "\\frac{3}{4}" -> "3/4", "-.5" -> "-1/2", the mixed number "1 1/2" -> "3/2"), so that
    equal values compare equal as strings."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return _boxed_number(boxed)
    gsm8k = _GSM8K_LINE.findall(text)
    if gsm8k:
        value = _last_number(gsm8k[-1])
        if value is not None:
            return value
    return _last_number(text)


def _last_number(text: str) -> str | None:
    """The value of the last number in running text (final_number's rule without boxes)."""
    text = _LATEX_FRACTION.sub(_fraction, text)
    for m in reversed(list(_NUMBER.finditer(text))):
        if sum(c.isdigit() for c in m.group(0)) > _MAX_DIGITS:
            return None
        value = _value(m.group(0))  # "3/0" is no number: take the one before it
        if value is not None:
            whole = _WHOLE_BEFORE.search(text, 0, m.start())
            if whole and re.fullmatch(r"\d+/\d+", m.group(0)):  # a mixed number, "1 1/2"
                value = _boxed_number(text[whole.start():m.end()])
            spaced = _SPACED_WITH_ZERO_GROUP.search(text, max(0, m.start() - 400), m.end())
            if spaced:
                value = _value(spaced.group(0).replace(" ", ""))
            return value
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
    text = (raw if isinstance(raw, str) else repr(raw)).split("####")[-1]
    boxed = _last_boxed(text)
    # the answer itself, read as a box is: one number or none (a response's last number is
    # a guess at the answer; an answer's digits are not its value when it is \\sqrt{2})
    value = _boxed_number(text if boxed is None else boxed)
    if value is None:
        raise ValueError(f"{where}: answer {raw!r} is not one number to match responses "
                         f"against (answers are matched by value; leave out symbolic ones)")
    return value


class MathJSONLTask(SeededTask):
    def __init__(self, tokenizer, *, path: str,
                 prompt_template: str = "{question}\nAnswer:", seed: int = 0):
        super().__init__(seed)
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"dataset {path} is a directory; path= takes a JSONL file")
        if not path.is_file():
            raise FileNotFoundError(f"dataset {path} does not exist")
        _check_template(prompt_template)
        self.questions, self.answers = [], []
        raw = path.read_bytes()
        self.fingerprint = hashlib.sha256(raw).hexdigest()  # a resume compares it
        for magic, kind in ((b"\x1f\x8b", "gzip-compressed"), (b"PAR1", "a Parquet file")):
            if raw.startswith(magic):
                raise ValueError(f"dataset {path} is {kind}; MathJSONLTask reads plain UTF-8 "
                                 f"JSONL (one JSON object a line)")
        # JSON lines end at "\n" only: str.splitlines() also breaks at U+2028 and U+0085,
        # which json.dumps(ensure_ascii=False) leaves inside strings
        for n, line in enumerate(raw.split(b"\n"), 1):
            try:  # a byte-order mark on the first line is dropped
                line = line.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n} is not UTF-8 ({e.reason} at byte {e.start} of "
                                 f"the line)") from None
            if line.strip():
                try:  # (an integer past 4300 digits is a ValueError, deep nesting a
                    # RecursionError: each named by its line too)
                    row = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise ValueError(f"{path}:{n} is not JSON we read: {e}") from None
                if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                    raise ValueError(f"{path}:{n} needs 'question' and 'answer' fields")
                if not isinstance(row["question"], str) or not row["question"].strip():
                    raise ValueError(f"{path}:{n}: question {row['question']!r} must be a "
                                     f"non-empty string")
                self.questions.append(row["question"])
                self.answers.append(_answer_of(row["answer"], f"{path}:{n}"))
        if not self.questions:
            raise ValueError(f"dataset {path} is empty")
        self.tokenizer, self.template, self.path = tokenizer, prompt_template, path

    def state_dict(self) -> dict:
        return {**super().state_dict(), "dataset_sha256": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """The prompt order continues; a dataset whose contents changed since the checkpoint
        (same path, other lines) is said once: the order then differs from the interrupted
        run's."""
        saved = state.get("dataset_sha256")
        if saved is not None and saved != self.fingerprint:
            log.warning("the dataset %s changed since the checkpoint was written (sha256 %s..., "
                        "now %s...): the resumed run draws other prompts than the interrupted "
                        "one would have", self.path, saved[:12], self.fingerprint[:12])
        super().load_state_dict(state)

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
        width = max((len(e) for e in encoded), default=1)  # n = 0: [0, 1], as a draw's need
        tokens = torch.full((n, width), self.tokenizer.pad_id, dtype=torch.long)
        for row, e in enumerate(encoded):
            tokens[row, width - len(e):] = torch.tensor(e)
        return tokens, [self.answers[i] for i in idx]

    def rewards(self, responses: Tensor, answers: list[str]) -> Tensor:
        out = [float(final_number(self.tokenizer.decode(ids)) == answer and answer is not None)
               for ids, answer in zip(responses.tolist(), answers)]
        return torch.tensor(out)
