"""Grouped-query attention without the repeated key/value copies: where a model repeats its
key and value heads for the query heads (transformers' repeat_kv, torchtune's expand), the
attention rewrite feeds the kernels the un-repeated tensors (they index a query head's key/value
head themselves)."""

from __future__ import annotations

import torch.fx as fx
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dualkv_compile.stats import counters

from ._common import example, may_write, op_name

__all__ = ["fold_gqa_repeat", "erase_unused"]


def _sizes_equal(a, b) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _inserts_head_axis(node: fx.Node, x: Tensor) -> bool:
    """`node` is x with a size-1 axis inserted at dim 2 and its values untouched: unsqueeze,
    a view or reshape to that shape, or indexing with full slices and one None."""
    out = example(node)
    b, h, t, d = x.shape
    if not isinstance(out, Tensor) or not _sizes_equal(out.shape, (b, h, 1, t, d)):
        return False
    name = op_name(node)
    if name in ("unsqueeze", "view", "reshape"):
        return True
    if name == "getitem" and isinstance(node.args[1], tuple):
        full = slice(None, None, None)
        return all(i is None or i is Ellipsis or i == full for i in node.args[1])
    return False


def _first_arg(node) -> fx.Node | None:
    """The tensor an op reads first, given positionally (Dynamo keeps keyword calls as written:
    those are left alone)."""
    return node.args[0] if isinstance(node, fx.Node) and node.args else None


def _unrepeated(node) -> fx.Node | None:
    """If `node` is a key or value repeated for grouped-query attention, the way transformers'
    repeat_kv and torchtune write it (x[:, :, None].expand(B, Hkv, r, T, D).reshape(B, Hkv * r,
    T, D), or unsqueeze(2) ... flatten(1, 2)), return x, whose heads are used by r query heads
    each; else None."""
    if not isinstance(node, fx.Node) or op_name(node) not in ("reshape", "view", "flatten"):
        return None
    expanded = _first_arg(node)
    if not isinstance(expanded, fx.Node) or op_name(expanded) != "expand":
        return None
    inserted = _first_arg(expanded)
    source = _first_arg(inserted)
    if not isinstance(source, fx.Node):
        return None
    x, e, out = example(source), example(expanded), example(node)
    if not all(isinstance(t, Tensor) for t in (x, e, out)) or x.dim() != 4 or e.dim() != 5:
        return None
    b, h, t, d = x.shape
    rep = e.shape[2]
    if not (isinstance(rep, int) and _inserts_head_axis(inserted, x)
            and _sizes_equal(e.shape, (b, h, rep, t, d))
            and _sizes_equal(out.shape, (b, h * rep, t, d))):
        return None
    return source


def fold_gqa_repeat(args: dict, sdpa: fx.Node) -> list[fx.Node]:
    """Feed the attention the un-repeated key and value when both were repeated alike: the
    kernels index a query head's key/value head themselves (grouped-query attention), so the
    [T, Hq, D] copies are not written, nor their gradients summed back in the backward.
    Not when any op between the repeats and the attention may write in place: the copies hold
    the values from before it. Returns the repeated nodes no longer fed (for erase_unused)."""
    k, v = _unrepeated(args["key"]), _unrepeated(args["value"])
    if k is None or v is None or example(k).shape[1] != example(v).shape[1]:
        return []
    # the nodes between the earlier source and the attention, walked back from the attention
    unseen, node = {k, v}, sdpa.prev
    while unseen and node.op != "root":
        if node in unseen:
            unseen.discard(node)
        elif may_write(node):
            return []
        node = node.prev
    repeated = [args["key"], args["value"]]
    args["key"], args["value"] = k, v
    counters["gqa_repeats_folded"] += 1
    return repeated


def erase_unused(nodes: list[fx.Node]) -> None:
    """Erase each node and then its inputs, as long as nothing else uses them (the repeat
    chains fold_gqa_repeat bypassed: pure view and expand ops)."""
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node not in erased and not node.users and node.op in ("call_method", "call_function"):
            inputs = node.all_input_nodes
            node.graph.erase_node(node)
            erased.add(node)
            stack.extend(inputs)
