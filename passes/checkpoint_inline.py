"""Checkpoint inlining: activation-checkpointed regions become plain nodes tagged for recompute.

Dynamo turns `torch.utils.checkpoint` (HF `gradient_checkpointing_enable`, torchtune
`set_activation_checkpointing`) into a `tag_activation_checkpoint` higher-order op whose body is a
subgraph, which would hide each layer's attention and token-mixing ops from the other passes.
This pass copies every body into the parent graph and tags the copied function calls as the op
itself would: `recompute=PREFER_RECOMPUTE` and one `ac_graph_id` per region. Tensor-method calls
(`x.pow(2)`, `.to(...)`) are copied untagged: the partitioner still decides whether to save or
recompute them, so a region saves somewhat more than torch.utils.checkpoint would.
Reentrant and non-reentrant checkpoints are traced alike. AOTAutograd keeps
both tags on the aten nodes it traces from them, so the partitioner recomputes the region in the
backward exactly as it does for the op. Selective checkpointing (a user `context_fn` policy) is
refused: its per-op decisions are made while tracing and cannot be carried by tags.
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dualkv_compile.stats import counters

from ._common import Refusal, source_line

__all__ = ["inline_checkpoints"]

# ac_graph_id must increase along the graph (the partitioner saves the boundary between two
# consecutive regions by comparing ids); a process-wide counter keeps ids distinct across graphs.
_region_ids = itertools.count(1)


def _is_checkpoint(node: fx.Node) -> bool:
    return (node.op == "call_function"
            and node.target is torch.ops.higher_order.tag_activation_checkpoint)


# checkpoint arguments that change no value of an inlined region: how it replays (the RNG state
# matters only for dropout, which the locality proof refuses), and its own debugging checks
_NEUTRAL_KWARGS = {"use_reentrant", "preserve_rng_state", "determinism_check", "debug"}


def inline_checkpoints(gm: fx.GraphModule) -> int:
    """Inline every checkpointed region of `gm` in place; returns how many were inlined."""
    graph = gm.graph
    count = 0
    while node := next((n for n in graph.nodes if _is_checkpoint(n)), None):  # nested: outer first
        body_attr, *inputs = node.args
        if not (isinstance(body_attr, fx.Node) and body_attr.op == "get_attr"):
            raise Refusal(f"checkpoint at {source_line(node)}: body is not a submodule")
        body = getattr(gm, body_attr.target)
        if "_checkpoint_context_fn" in body.meta:
            raise Refusal(
                f"checkpoint at {source_line(node)} passes a context_fn (selective activation "
                f"checkpointing); only plain checkpointing is supported, or set "
                f"DualKVConfig.activation_memory_budget instead"
            )
        region = next(_region_ids)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise Refusal(f"checkpoint at {source_line(node)} has {len(inputs)} inputs; its "
                          f"body takes {len(placeholders)}")
        unknown = node.kwargs.keys() - _NEUTRAL_KWARGS
        if unknown:
            raise Refusal(f"checkpoint at {source_line(node)} passes {sorted(unknown)}, which "
                          f"the inlined region cannot honour (it takes {sorted(_NEUTRAL_KWARGS)})")
        env = dict(zip(placeholders, inputs))
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op in ("placeholder", "output"):
                    continue
                if inner.op == "get_attr":  # the body's own submodules (nested bodies)
                    name = f"{body_attr.target}_{inner.target}"
                    gm.add_submodule(name, getattr(body, inner.target))
                    copied = graph.get_attr(name)
                else:
                    copied = graph.node_copy(inner, lambda a: env[a])
                copied.meta = dict(inner.meta)
                if copied.op == "call_function":
                    copied.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                    copied.meta["ac_graph_id"] = region
                env[inner] = copied
        (result,) = [n for n in body.graph.nodes if n.op == "output"]
        outputs = fx.node.map_arg(result.args[0], lambda a: env[a])
        for user in list(node.users):
            if user.target is not operator.getitem or not isinstance(outputs, (tuple, list)):
                raise Refusal(f"checkpoint at {source_line(node)}: its output is used by "
                              f"{user.format_node()}, not by indexing")
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not body_attr.users:
            graph.erase_node(body_attr)
        counters["checkpoints_inlined"] += 1
        count += 1
    if count:
        gm.delete_all_unused_submodules()  # the inlined bodies
    return count
