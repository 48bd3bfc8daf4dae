"""How the public entry points read an integer argument: one rule for what counts as an int,
one error that names the argument and its value."""

from __future__ import annotations

import operator

import torch

__all__ = ["as_index", "integer_arg"]


def as_index(value) -> int | None:
    """value as a Python int if it is an integer (int, numpy integer, one-element integer
    tensor), else None: a bool (a bool tensor too), a float (2.0 too: never truncated) or None
    is not a count or an id."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def integer_arg(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """value as an int in [low, high) (None: unbounded on that side), else a ValueError naming
    the argument and its value, raised before the value reaches a kernel."""
    i = as_index(value)
    if i is None or (low is not None and i < low) or (high is not None and i >= high):
        bound = (f" in [{low}, {high})" if low is not None and high is not None else
                 f" >= {low}" if low is not None else f" < {high}" if high is not None else "")
        raise ValueError(f"{name}={value!r} must be an integer{bound}")
    return i
