"""Bounded recompiles: past Dynamo's recompile limit a compiled function silently falls back to
eager, and eager flex_attention materialises [T, T] scores. Every compiled call of this package
runs under `bounded_recompiles`, which raises the limit deliberately and makes hitting it fatal,
with advice.

Dynamo has two limits: `recompile_limit` counts the compiled variants per guarded object (a
model's forward guards on its module's id, so the count is per wrapper), and
`accumulated_recompile_limit` counts them per function over all objects. Either may be the one
hit, and the error names it."""

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
        raise RuntimeError(f"{what} {_which_limit(e, limit)}; Dynamo would now fall back to "
                           f"eager. {advice}") from e


def _which_limit(error: Exception, limit: int) -> str:
    """The limit Dynamo's error (its cause) says was exceeded, with its value; both limits
    when it does not say."""
    cause = str(error.__cause__ or "")
    accumulated = torch._dynamo.config.accumulated_recompile_limit
    if "accumulated_recompile_limit" in cause:
        return (f"was compiled {accumulated} times over all its objects "
                f"(torch._dynamo.config.accumulated_recompile_limit)")
    if "recompile_limit" in cause:
        return f"was compiled for {limit} shape classes already (its recompile limit)"
    return (f"hit Dynamo's recompile limit ({limit} compiles per object, {accumulated} per "
            f"function)")
