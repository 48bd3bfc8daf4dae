"""Position tables, computed once per call: tensors that depend only on the positions (RoPE's
cos and sin, computed from the position ids inside transformers models) are stored once
instead of being recomputed inside every kernel that reads them.

Inductor inlines cheap pointwise producers into their consumers. For RoPE that means cos and
sin of position x frequency are recomputed in each layer's q and k kernels, forward and
backward, which makes those kernels compute-bound. This pass finds the float tensors that
depend on nothing but the positions, the layout tables, constants and buffers that take no
gradient, and that feed an op which depends on more than that. It routes each of them through
`dualkv::materialize`, an opaque copy that Inductor cannot inline, so the consumers load the
values instead of recomputing them. The values are unchanged: the pass only decides where
they are computed. A tensor that the graph writes into in place, through any alias, is left
alone: a copy taken before the write would miss it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

from dualkv_compile.stats import counters

from ._common import example, may_write, op_name, storage, written

__all__ = ["materialize_position_tables"]

# tables smaller than this are cheaper to recompute than to store and load
_MIN_ELEMENTS = 256
# nor is anything larger than this many elements per token stored (a [T, T] tensor computed from
# positions would cost memory that recomputing it inline does not)
_MAX_ELEMENTS_PER_TOKEN = 4096


@torch.library.custom_op("dualkv::materialize", mutates_args=())
def materialize(x: Tensor) -> Tensor:
    """A copy of x that the compiler keeps as a stored tensor."""
    return x.clone()


@materialize.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: Tensor) -> Tensor:
    return grad


materialize.register_autograd(_backward)


def _takes_grad(node: fx.Node) -> bool:
    value = example(node)
    return isinstance(value, Tensor) and value.requires_grad


def _position_only(graph: fx.Graph, activations: fx.Node) -> set[fx.Node]:
    """Nodes whose value depends on no activation (`activations`: the tokens, or a layer's
    hidden states) and no tensor that takes a gradient."""
    only: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output" or node is activations:
            continue
        if node.op in ("placeholder", "get_attr"):
            if not _takes_grad(node):
                only.add(node)
            continue
        inputs = node.all_input_nodes
        if all(i in only for i in inputs) and not _takes_grad(node):
            only.add(node)
    return only


_VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "transpose",
          "permute", "flatten", "unflatten", "getitem", "narrow", "select"}


def _float_tensor(node) -> bool:
    value = example(node)
    return isinstance(value, Tensor) and value.is_floating_point()


# casts that return their input itself when nothing changes (x.to(x.dtype) is x)
_MAYBE_NO_OP = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous",
                "detach"}


def _aliases_input(node: fx.Node) -> bool:
    """`node` is a view of its first argument (no gather), or a cast that changes nothing
    (its input itself)."""
    if op_name(node) == "getitem":  # a tensor index gathers (a copy), others view
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return not any(isinstance(example(i), Tensor) for i in index if isinstance(i, fx.Node))
    if op_name(node) in _VIEWS:
        return True
    if op_name(node) not in _MAYBE_NO_OP:
        return False
    out, inp = example(node), example(node.args[0])
    return (isinstance(out, Tensor) and isinstance(inp, Tensor) and out.dtype == inp.dtype
            and out.device == inp.device and out.shape == inp.shape
            and out.stride() == inp.stride())


def _aliases_graph_input(node: fx.Node) -> bool:
    """`node` is a buffer or input itself, through views and no-op casts: a copy in its place
    would miss the buffer's later in-place updates (buf.to(buf.dtype), then buf.add_)."""
    while node.op not in ("placeholder", "get_attr"):
        if not (node.args and isinstance(node.args[0], fx.Node) and _aliases_input(node)):
            return False
        node = node.args[0]
    return True


def _stored_source(node: fx.Node, only: set[fx.Node]) -> fx.Node:
    """The node that computes what `node` views: up through views and indexing of
    position-only float tensors, so that one stored table serves every view of it."""
    while (op_name(node) in _VIEWS and node.args and isinstance(node.args[0], fx.Node)
           and node.args[0] in only and _float_tensor(node.args[0])):
        node = node.args[0]
    return node


def _written(node: fx.Node, written_into: set) -> bool:
    """The memory of `node` may be written in place (`written_into`: the memory the graph's
    in-place ops write into, None where unknown)."""
    memory = storage(node)
    return memory is None or None in written_into or memory in written_into


def materialize_position_tables(graph: fx.Graph, activations: fx.Node) -> int:
    """Route each position-only float tensor that feeds other work (or the tensor it is a view
    of) through dualkv::materialize. Returns how many tensors are now stored."""
    only = _position_only(graph, activations)
    # the memory written in place: a stored copy of a tensor living there would go stale
    # (alias = cos.to(cos.dtype) or cos.detach() is cos's memory; alias.mul_(2) changes cos)
    written_into = {storage(t) for node in graph.nodes if may_write(node) for t in written(node)}
    tokens = example(activations).shape[1]  # tokens [1, T] or a layer's hidden states [1, T, d]
    sources: list[fx.Node] = []
    for node in graph.nodes:
        if (node in only and _float_tensor(node)
                and any(u not in only and u.op != "output" for u in node.users)):
            source = _stored_source(node, only)
            if (source.op not in ("placeholder", "get_attr") and source not in sources
                    and not _aliases_graph_input(source) and not _written(source, written_into)):
                sources.append(source)
    routed = 0
    for source in sources:
        numel = example(source).numel()
        if not _MIN_ELEMENTS <= numel <= _MAX_ELEMENTS_PER_TOKEN * tokens:
            continue
        with graph.inserting_after(source):
            stored = graph.call_function(torch.ops.dualkv.materialize.default, (source,))
        stored.meta.update(source.meta)
        source.replace_all_uses_with(stored, delete_user_cb=lambda user: user is not stored)
        routed += 1
    counters["position_tables_materialized"] += routed
    return routed
