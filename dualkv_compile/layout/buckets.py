"""Packed lengths: the bucket a packed micro-batch's valid token count is padded to (one compile
per distinct length), how many buckets a range of counts meets, and the check of
`bucket_growth`.
"""

from __future__ import annotations

import math

from ..arguments import as_real, integer_arg

__all__ = ["bucket_count", "bucket_length", "check_bucket_growth"]


def bucket_length(num_tokens: int, pad_to: int = 128, growth: float = 1.0) -> int:
    """The packed length T for `num_tokens` valid tokens, one compile per distinct T. With
    growth 1: the next multiple of `pad_to`. With growth > 1: the next length of the series
    pad_to, b1, b2, ... where each is the smallest multiple of pad_to at least `growth` times
    the one before; lengths between T_min and T_max then meet about
    log(T_max / T_min) / log(growth) buckets, at the cost of up to (growth - 1) x T + pad_to
    tokens of padding."""
    check_bucket_growth(growth)
    num_tokens = integer_arg("num_tokens", num_tokens, 0)
    pad_to = integer_arg("pad_to", pad_to, 1)
    t = max(math.ceil(num_tokens / pad_to), 1) * pad_to
    if growth == 1.0:
        return t
    b = pad_to
    while b < t:
        b = max(b + pad_to, math.ceil(b * growth / pad_to) * pad_to)
    return b


def bucket_count(max_tokens: int, pad_to: int = 128, growth: float = 1.0,
                 min_tokens: int = 1) -> int:
    """How many packed lengths (each a compile) `bucket_length` gives for min..max_tokens."""
    if integer_arg("min_tokens", min_tokens, 0) > integer_arg("max_tokens", max_tokens, 0):
        raise ValueError(f"min_tokens={min_tokens!r} exceeds max_tokens={max_tokens!r}")
    top, t, n = bucket_length(max_tokens, pad_to, growth), bucket_length(min_tokens, pad_to,
                                                                          growth), 1
    while t < top:
        t, n = bucket_length(t + 1, pad_to, growth), n + 1
    return n


def check_bucket_growth(growth) -> None:
    """Raise ValueError unless `growth` is a number in [1, 4]."""
    x = as_real(growth)  # numpy scalars too, as integer arguments take numpy integers
    if x is None or not 1 <= x <= 4:
        raise ValueError(f"bucket_growth={growth!r} must be a number in [1, 4]")
