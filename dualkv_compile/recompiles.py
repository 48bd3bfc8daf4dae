"""Bounded recompiles: past Dynamo's recompile limit a compiled function silently falls back to
eager, and eager flex_attention materialises [T, T] scores. Every compiled call of this package
runs under `bounded_recompiles`, which raises the limit deliberately and makes hitting it fatal,
with advice."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["bounded_recompiles"]


@contextlib.contextmanager
def bounded_recompiles(limit: int, what: str, advice: str | None = None):
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
            yield
    except FailOnRecompileLimitHit as e:
        advice = advice or ("Eager flex_attention builds [T, T] scores. Pack with a coarser "
                            "pad_to (DualKVConfig.pad_to) so fewer distinct lengths occur.")
        raise RuntimeError(
            f"{what} was compiled for {limit} shape classes already; Dynamo would now fall back "
            f"to eager. {advice}") from e
