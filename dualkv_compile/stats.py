"""Process-wide record of what the library did: counters (every rewrite, refusal and fallback
bumps one, and tests read them; `counters.clear()` resets) and messages logged once."""

import logging
from collections import Counter

__all__ = ["counters", "log_once"]

counters: Counter = Counter()

_logged: set[str] = set()


def log_once(logger: logging.Logger, level: int, message: str, key: str | None = None) -> None:
    """`logger.log(level, message)` the first time this process sees `key` (default: the
    message itself; give a key where the message holds values that change between calls)."""
    key = message if key is None else key
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message)
