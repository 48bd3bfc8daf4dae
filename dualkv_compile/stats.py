"""Process-wide counters of what the compiler did: every rewrite, refusal and fallback bumps
one, and tests read them. `counters.clear()` resets."""

from collections import Counter

__all__ = ["counters"]

counters: Counter = Counter()
