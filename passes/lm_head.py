"""Token dedup, part 2: cut the LM head out of the graph for response_logprobs.

The graph then returns the final hidden states [1, T, d]. The wrapper gathers only the
positions that predict response tokens and runs the LM head there, in chunks
(dualkv_compile.lm_head.logprobs), so no [T, vocab] tensor exists.
"""

from __future__ import annotations

import torch.fx as fx
from torch import Tensor

from dualkv_compile.stats import counters

from ._common import Refusal, eliminate_dead_code, example, op_name, source_line

__all__ = ["prune_lm_head"]

_CASTS = {"float", "to", "type_as", "contiguous"}


def prune_lm_head(graph: fx.Graph, vocab_size: int) -> fx.Node:
    """Replace the graph's logits output by the LM head's input; return that input node."""
    out_node = graph.output_node()
    outputs = out_node.args[0]
    logits = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    node, chain = logits, [out_node]
    while isinstance(node, fx.Node) and op_name(node) in _CASTS:
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and op_name(node) == "linear"):
        raise Refusal(f"the model output is not produced by a linear LM head "
                      f"(found {getattr(node, 'name', node)})")
    weight = example(node.args[1] if len(node.args) > 1 else node.kwargs["weight"])
    if not isinstance(weight, Tensor) or weight.shape[0] != vocab_size:
        raise Refusal(f"the last linear at {source_line(node)} does not map to the vocabulary "
                      f"({vocab_size} entries)")
    weight_node = node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
    if not (isinstance(weight_node, fx.Node) and weight_node.op in ("placeholder", "get_attr")):
        raise Refusal(f"the LM head at {source_line(node)} computes its weight "
                      f"({getattr(weight_node, 'name', weight_node)}) from the parameter; "
                      f"response_logprobs applies the weight parameter as it is")
    for link in [node, *chain[1:]]:  # the logits feed nothing but the output: no in-place
        others = [u for u in link.users if u not in chain]  # hook (logits.add_(bias)) is lost
        if others:
            raise Refusal(f"the LM head's logits at {source_line(node)} are also used by "
                          f"{others[0].name} ({op_name(others[0])}, e.g. a forward hook on "
                          f"the head); response_logprobs applies the head's weight alone")
    hidden = node.args[0]
    if isinstance(outputs, (tuple, list)):
        out_node.args = (type(outputs)([hidden, *outputs[1:]]),)
    else:
        out_node.args = (hidden,)
    eliminate_dead_code(graph)
    counters["lm_head_pruned"] += 1
    return hidden
