"""FSDP2 around the packed computation.

FSDP2 (`torch.distributed.fsdp.fully_shard`) all-gathers a module's parameters in a forward
pre-hook and registers its gradient reduce-scatter from there. optimize() never calls the
model's own forward (it runs the decoder's parts on the packed tokens), and inside a compiled
graph the hooks are functions Dynamo refuses to trace. So with an FSDP-sharded model the
wrapper runs the hooks itself, eagerly, exactly as `fully_shard.register_fsdp_forward_method`
does for a method: the root's around the whole packed call, each layer's around that layer's
compiled region (optimize.py, compile_region="layer").

The supported layout is torchtune's and torchtitan's: `fully_shard` on each entry of the
decoder's layer list (after activation checkpointing, if any) and on the model.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["is_sharded", "run_as_forward", "check_fsdp_layout", "foreign_hooks", "hook_names"]


def _fsdp_module_type():
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` or any submodule was passed to fully_shard."""
    fsdp = _fsdp_module_type()
    return any(isinstance(m, fsdp) for m in module.modules())


def foreign_hooks(module: nn.Module) -> list:
    """`module`'s forward hooks and pre-hooks (with_kwargs ones too) and its backward hooks
    (which module.__call__ attaches), other than its own FSDP2 state's: those that a caller of
    module.forward, or of the module's parts, skips."""
    fsdp = _fsdp_module_type()
    state = module._get_fsdp_state() if isinstance(module, fsdp) else None
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values(),
             *module._backward_pre_hooks.values(), *module._backward_hooks.values()]
    return [h for h in hooks if (state is None or getattr(h, "__self__", None) is not state)
            and getattr(h, "__name__", None) not in _INACTIVE_HOOKS]


# transformers 5 installs this on layers and attention modules at a forward that asks for
# hidden states or attentions; it does nothing outside such a forward of the model itself
_INACTIVE_HOOKS = ("output_capturing_hook",)


def hook_names(hooks) -> str:
    return ", ".join(getattr(h, "__qualname__", repr(h)) for h in hooks)


def run_as_forward(module: nn.Module, fn: Callable, *args):
    """fn(*args), between `module`'s FSDP pre- and post-forward hooks when it is an FSDP
    module (parameters all-gathered before, resharded after, gradient hooks registered on the
    inputs and outputs); plain fn(*args) otherwise."""
    if not isinstance(module, _fsdp_module_type()):
        return fn(*args)
    state = module._get_fsdp_state()  # what register_fsdp_forward_method's wrapper calls
    args, _ = state._pre_forward(module, args, {})
    out = fn(*args)
    return state._post_forward(module, args, out)


def check_fsdp_layout(model: nn.Module, layers) -> None:
    """Refuse FSDP units the layer-region path cannot drive: only the model itself and the
    entries of its layer list may be FSDP modules, and the layers must carry no forward hooks
    other than FSDP's (the compiled region calls layer.forward, so other hooks would be
    skipped)."""
    fsdp = _fsdp_module_type()
    allowed = {id(model), *(id(layer) for layer in layers)}
    for name, module in model.named_modules():
        if isinstance(module, fsdp) and id(module) not in allowed:
            raise ValueError(
                f"FSDP unit {name!r} ({type(module).__name__}) is neither the model nor an "
                f"entry of its layer list; optimize() drives FSDP2 when fully_shard is applied "
                f"to each layer (after activation checkpointing) and then to the model")
    for i, layer in enumerate(layers):
        foreign = foreign_hooks(layer)
        if foreign and all(getattr(h, "__qualname__", "").startswith("FSDPState.")
                           for h in foreign):
            raise ValueError(f"layer {i} carries the hooks of an FSDP unit that is not its "
                             f"own: the layers were sharded as one group (fully_shard of a "
                             f"list); call fully_shard on each layer separately")
        if foreign:
            raise ValueError(f"layer {i} has hooks ({hook_names(foreign)}); the "
                             f"layer-region path calls layer.forward inside the compiled "
                             f"region and would skip them")
