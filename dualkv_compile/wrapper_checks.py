"""What optimize() checks when it wraps a model, beyond the adapter's own checks: that the
config can run where the weights are, and that a wrapper asked to share another's compiled
graphs wraps the same architecture with the same config."""

from __future__ import annotations

import torch
from torch import nn

from .attention.registry import attention_kernel
from .config import DualKVConfig

__all__ = ["check_device", "check_shareable"]


def check_device(model: nn.Module, config: DualKVConfig) -> None:
    """Refuse at construction a config that cannot run where the model's weights are."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "cuda" or not config.enabled:
        return
    if config.backend == "inductor":
        raise ValueError(f"backend='inductor' cannot run this model on {device}: Inductor's "
                         "CPU FlexAttention has no backward; use backend='auto' (aot_eager off "
                         "CUDA) or move the model to a GPU")
    if attention_kernel(config.attention_backend).cuda_only:
        raise ValueError(f"attention_backend={config.attention_backend!r} is a CUDA kernel and "
                         f"the model is on {device}; use 'auto' (flex's reference math there)")


def check_shareable(wrapper, other) -> None:
    """Refuse to share compiles with a wrapper of another architecture or config."""
    if type(other) is not type(wrapper):
        raise TypeError(f"share_compiles_with must be a DualKVModel (from optimize()), got "
                        f"{type(other).__name__}")
    if other.config != wrapper.config:
        raise ValueError(f"share_compiles_with: the configs differ ({wrapper.config} against "
                         f"{other.config})")
    mine, theirs = (next(w.model.parameters(), torch.empty(0)).device for w in (wrapper, other))
    if mine != theirs:
        raise ValueError(f"share_compiles_with: the models are on {mine} and {theirs}; the graphs "
                         "are compiled for one device")
    if type(other.model) is not type(wrapper.model):
        raise ValueError(f"share_compiles_with: a {type(wrapper.model).__name__} cannot share "
                         f"the compiled graphs of a {type(other.model).__name__}")
    mine = [(n, p.shape, p.dtype) for n, p in wrapper.model.named_parameters()]
    theirs = [(n, p.shape, p.dtype) for n, p in other.model.named_parameters()]
    for a, b in zip(mine, theirs):
        if a != b:
            raise ValueError(f"share_compiles_with: parameter {a[0]} {tuple(a[1])} {a[2]} differs "
                             f"from the other model's {b[0]} {tuple(b[1])} {b[2]}")
    if len(mine) != len(theirs):
        raise ValueError(f"share_compiles_with: {len(mine)} parameters against the other "
                         f"model's {len(theirs)}")
