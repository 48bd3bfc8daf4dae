"""How the public entry points read an integer argument: one rule for what counts as an int."""

from __future__ import annotations

import operator

__all__ = ["as_index"]


def as_index(value) -> int | None:
    """value as a Python int if it is an integer (int, numpy integer, 0-dim integer tensor),
    else None: a bool, a float (2.0 too: never truncated) or None is not a count or an id."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
