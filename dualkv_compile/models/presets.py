"""Builders that are another builder with some arguments preset (the published Qwen3 sizes,
the tiny models of the CPU configs). Their signature is the target's with the presets as
defaults, so that help(), and the recipe's config check, see every argument: a misspelled key
is refused by name instead of being passed on as **kwargs."""

from __future__ import annotations

import inspect
from typing import Callable

__all__ = ["preset"]


def preset(target: Callable, name: str, doc: str, **presets) -> Callable:
    """`name(**overrides)` = target(**{**presets, **overrides}), documented by `doc`."""
    def build(**overrides):
        return target(**{**presets, **overrides})

    sig = inspect.signature(target)
    build.__signature__ = sig.replace(parameters=[
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY, default=presets.get(n, p.default))
        for n, p in sig.parameters.items()])
    build.__name__ = build.__qualname__ = name
    build.__doc__ = doc
    build.__module__ = target.__module__
    return build
