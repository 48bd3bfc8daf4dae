"""How the public entry points read an integer or real argument: one rule for what counts as
an int or a number, one error that names the argument and its value."""

from __future__ import annotations

import math
import numbers
import operator

import torch

__all__ = ["MIN_TEMPERATURE", "as_index", "as_real", "flag_arg", "integer_arg", "real_arg",
           "temperature_arg"]

MIN_TEMPERATURE = 1e-5  # vLLM's sampling epsilon; far smaller ones overflow logits / T


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


def flag_arg(name: str, value, *, nullable: bool = False) -> bool | None:
    """value as a bool (None too where `nullable`: the default is chosen later), else a
    ValueError naming the argument: a string such as "no" is true."""
    if (value is None and nullable) or isinstance(value, bool):
        return value
    raise ValueError(f"{name}={value!r} must be True or False{' (or None)' if nullable else ''}")


def as_real(value) -> float | None:
    """value as a float if it is a real number (not a bool, a string or a tensor), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def real_arg(name: str, value, low: float = -math.inf, high: float = math.inf) -> float:
    """value as a finite float in [low, high], else a ValueError naming the argument."""
    x = as_real(value)
    if x is None or not (math.isfinite(x) and low <= x <= high):
        bound = (f" in [{low}, {high}]" if math.isfinite(low) and math.isfinite(high) else
                 f" >= {low}" if math.isfinite(low) else f" <= {high}" if math.isfinite(high)
                 else "")
        raise ValueError(f"{name}={value!r} must be a finite number{bound}")
    return x


def temperature_arg(value) -> float:
    """A sampling or logprob temperature: one rule for the rollout and the policy update."""
    x = as_real(value)
    if x is None or not MIN_TEMPERATURE <= x < math.inf:
        raise ValueError(f"temperature={value!r} must be a finite number >= {MIN_TEMPERATURE} "
                         f"(logits / temperature overflows float32 below that; there is no "
                         f"greedy mode)")
    return x
