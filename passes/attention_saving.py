"""Attention saving: a joint-graph pass that keeps shared-prefix attention out of recomputation.

Whenever the partitioner may recompute (checkpointed regions, or an activation memory budget
below 1), it would otherwise recompute the RoPE'd q/k in the backward, and Inductor then fuses
that recomputation into the flex backward template's loads, several times slower
(docs/performance.md). This pass tags the flex forward's
q, k, v and its outputs (out, logsumexp) MUST_SAVE, the choice torchtitan's selective
checkpointing policy makes for dense attention: attention is computed once, and everything else
in a checkpointed region is still recomputed.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from dualkv_compile.stats import counters

from ._common import pass_uuid, regions_ops

__all__ = ["save_attention", "SaveAttentionPass", "uuid"]


def uuid() -> str:
    return pass_uuid(__file__)


def save_attention(graph: fx.Graph) -> int:
    """Tag the inputs and outputs of every attention forward (flex, or a regions op) in the
    joint `graph`; returns the count."""
    targets = {torch.ops.higher_order.flex_attention, *regions_ops()}
    attention = [n for n in graph.nodes if n.op == "call_function" and n.target in targets]
    for node in attention:
        tagged = [a for a in node.args[:3] if isinstance(a, fx.Node) and a.op == "call_function"]
        tagged += [node] + [u for u in node.users if u.target is operator.getitem]
        for t in tagged:
            t.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    counters["attention_saved"] += len(attention)
    return len(attention)


class SaveAttentionPass(CustomGraphPass):
    """`save_attention` as Inductor's `joint_custom_post_pass` (it runs before partitioning),
    after the pass the user had set there, if any."""

    def __init__(self, after: CustomGraphPass | None = None):
        self.after = after

    def __call__(self, graph: fx.Graph) -> None:
        if self.after is not None:
            self.after(graph)
        save_attention(graph)

    def uuid(self):
        if self.after is None:
            return uuid()
        inner = self.after.uuid() if hasattr(self.after, "uuid") else None
        return None if inner is None else f"{inner}+{uuid()}"  # None: no caching, as Inductor does
