"""Data-parallel training with FSDP2 for the recipes: process group, sharding, sums over ranks,
full-state checkpoints. Every function also works in a single process (world size 1), where the
collectives are no-ops, so the recipe has one code path."""

from __future__ import annotations

import copy
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from ..adapters import has_dropout, hf_decoder

__all__ = ["init_distributed", "checkpoint_layers", "reference_copy", "shard_decoder", "world",
           "all_sum", "all_max", "full_state_dicts", "load_full_state_dicts", "gather_objects",
           "raise_on_every_rank", "weight_shapes"]

log = logging.getLogger(__name__)


def init_distributed(device: str) -> torch.device:
    """Join the process group when launched by torchrun / `tune run --nproc_per_node`
    (WORLD_SIZE > 1): NCCL on CUDA, gloo on CPU. Returns this rank's device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device(device)
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if dev.index is not None and size > 1:
            raise ValueError(f"device={device!r}: name only the type ('cuda') when running on "
                             f"{size} processes; each rank takes cuda:LOCAL_RANK")
        dev = torch.device("cuda", dev.index if dev.index is not None else local)
        torch.cuda.set_device(dev)
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return dev


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def reference_copy(model: nn.Module) -> nn.Module:
    """GRPO's frozen reference model: a copy of `model`, taken before checkpointing and sharding
    (apply those to both). It keeps the policy's train mode and requires_grad flags, which
    Dynamo guards on, so that optimize(ref, ..., share_compiles_with=policy) reuses the
    policy's compiled graphs; it is only called under no_grad and is in no optimizer. A model
    with dropout gets an eval-mode, requires_grad=False copy instead (dropout must not touch
    the reference) when the model trains, which then compiles graphs of its own (logged)."""
    ref = copy.deepcopy(model)
    if model.training and has_dropout(model):
        log.warning("the reference model runs in eval mode (the model has dropout) and compiles "
                    "its own graphs instead of sharing the policy's")
        return ref.eval().requires_grad_(False)
    return ref


def checkpoint_layers(model: nn.Module) -> None:
    """Activation checkpointing per decoder layer (non-reentrant): torchtune's wrapper on a
    torchtune decoder; a transformers model's own (activation_checkpointing_enable, or
    gradient_checkpointing_enable, its older name); anything else refused."""
    from torchtune.modules import TransformerDecoder, TransformerSelfAttentionLayer

    if isinstance(model, TransformerDecoder):
        from torchtune.training import set_activation_checkpointing

        set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(f"enable_activation_checkpointing: no per-layer checkpointing is known "
                         f"for {type(model).__name__} (a torchtune TransformerDecoder or a "
                         f"transformers model)")


def shard_decoder(model: nn.Module, *, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 as optimize() drives it (dualkv_compile/fsdp.py): fully_shard on each decoder
    layer (after activation checkpointing), then on the model. No-op in one process."""
    if world()[1] == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    layers = model.layers if hasattr(model, "layers") else hf_decoder(model).layers
    for layer in layers:  # a torchtune decoder's, or a transformers causal LM's decoder's
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def _reduce(values, op: str) -> list[float]:
    if world()[1] == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                     device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def all_sum(*values: float) -> list[float]:
    """Each value summed over the ranks."""
    return _reduce(values, "sum")


def all_max(*values: float) -> list[float]:
    """Each value's maximum over the ranks."""
    return _reduce(values, "max")


def raise_on_every_rank(refused: Exception | None, what: str,
                        error: type[Exception] = ValueError) -> None:
    """Raise `refused` (this rank's error, or None) where it happened, and on every other rank
    an `error` saying another rank refused: a refusal on one rank alone left the others waiting
    in the next collective. Collective: every rank calls it."""
    if world()[1] > 1 and all_max(float(refused is not None))[0] and refused is None:
        raise error(f"{what}: another rank refused its inputs (its error says why); every "
                    f"rank stops, so that none waits in a collective")
    if refused is not None:
        raise refused


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order."""
    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def full_state_dicts(model: nn.Module, optimizer) -> tuple[dict, dict | None]:
    """The unsharded model state dict (on CPU, complete on rank 0) and optimizer state dict
    (None for optimizer=None). Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    if optimizer is None:
        optim_state = None
    elif not optimizer.state:  # before the first step (on every rank alike):
        # get_optimizer_state_dict would make a state by stepping at lr 0, AdamW's count 1,
        # which a resume then continued from
        optim_state = {"state": {}, "param_groups": []}
    else:
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    return model_state, optim_state


def weight_shapes(model: nn.Module) -> dict[str, tuple]:
    """{name: full shape} of the model's state, named as full_state_dicts names it (wrappers
    stripped); no communication (a sharded tensor knows its full shape)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}


def load_full_state_dicts(model: nn.Module, optimizer, model_state: dict,
                          optim_state: dict | None) -> None:
    """Inverse of full_state_dicts: every rank passes the full dicts it loaded."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer is not None and optim_state["state"]:  # (none: saved before the first step)
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)
