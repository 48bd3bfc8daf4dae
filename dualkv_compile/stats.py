"""Process-wide record of what the library did: counters (every rewrite, refusal and fallback
bumps one, and tests read them; `counters.clear()` resets) and messages logged once."""

import logging
from collections import Counter

__all__ = ["counters", "log_once"]

counters: Counter = Counter()

_logged: set[str] = set()


def log_once(logger: logging.Logger, level: int, message: str) -> None:
    """`logger.log(level, message)` the first time this process sees `message`."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)
