"""The rollout reads the training weights in place; under FSDP2 they are gathered once per
rollout (one all-gather of every sharded module), not once per decode step."""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["gathered_weights"]


_gathered: set[int] = set()  # ids of the models inside a gathered_weights block


@contextlib.contextmanager
def gathered_weights(model: nn.Module):
    """Within: every FSDP2-sharded module of `model` holds its full parameters (the engine
    calls the modules' pieces, never the hooked forwards). Unsharded models pass through; a
    nested block for the same model gathers nothing more."""
    if id(model) in _gathered:
        yield
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        FSDPModule = ()
    sharded = [m for m in model.modules() if FSDPModule and isinstance(m, FSDPModule)]
    handles = [m.unshard(async_op=True) for m in sharded]
    for handle in handles:
        if handle is not None:
            handle.wait()
    _gathered.add(id(model))
    try:
        yield
    finally:
        _gathered.discard(id(model))
        for m in sharded:
            m.reshard()
