"""Attention rewrite: every causal SDPA node becomes shared-prefix FlexAttention.

An SDPA node is rewritten when it is causal: `is_causal=True` with no mask, or a mask that the
model computed from positions and shapes alone (transformers builds one from position_ids).
Masks that depend on token data or parameters, dropout, or a batch other than 1 are refused.
The replacement is the flex_attention higher-order op with the packed layout's BlockMask, whose
tensors (and the 1-D table its mask_mod reads) come from the layout anchor's inputs;
with a region kernel ("regions", "flash_regions"), that kernel's opaque op
(torch.ops.dualkv.regions_attention, regions.py; flash_regions_attention, flash_regions.py),
which reads the segment tables only.
The model's own mask computation becomes dead and is removed.
"""

from __future__ import annotations

import logging
import math
import operator
import weakref

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

import dualkv_compile.attention.op  # noqa: F401  (registers the region ops graph_op returns)
from dualkv_compile.attention.kernel_options import kernel_options_for
from dualkv_compile.attention.registry import attention_kernel
from dualkv_compile.layout.inputs import ANCHOR
from dualkv_compile.stats import counters, log_once

from ._common import (REWRITTEN, Refusal, eliminate_dead_code, example, may_write, op_name,
                      source_line, storage, written)
from .gqa_fold import erase_unused, fold_gqa_repeat

__all__ = ["MASK_CHECK_MAX_LEN", "rewrite_attention", "find_anchor"]

log = logging.getLogger(__name__)

# the longest packed length at which a model-built mask is computed to check it is causal: a
# [T, T] mask of 32768^2 bools is 1 GiB (at 262,144 tokens it would be 64 GiB)
MASK_CHECK_MAX_LEN = 32768

_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def find_anchor(graph: fx.Graph) -> fx.Node:
    anchors = [n for n in graph.nodes if n.op == "call_function" and n.target is ANCHOR]
    if len(anchors) != 1:
        raise Refusal(f"expected one layout anchor in the graph, found {len(anchors)}")
    return anchors[0]


def _mask_graph() -> fx.GraphModule:
    from dualkv_compile.attention.block_mask import shared_prefix_mask

    return fx.symbolic_trace(shared_prefix_mask)


def _score_graph() -> fx.GraphModule:
    def identity_score(score, b, h, q_idx, kv_idx):
        return score

    return fx.symbolic_trace(identity_score)


def _sdpa_arguments(node: fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    args.setdefault("attn_mask", None)
    args.setdefault("dropout_p", 0.0)
    args.setdefault("is_causal", False)
    args.setdefault("scale", None)
    args.setdefault("enable_gqa", False)
    return args


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


# ops that reduce over many positions, which make a mask depend on more than (q_pos, k_pos)
# (not scans: transformers finds packed sequences by a cumsum over position steps, which is
# no change for a row whose positions run 0..L-1)
_MASK_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "any", "all", "prod",
                    "logsumexp", "std", "var", "norm", "argmax", "argmin", "topk", "median",
                    "count_nonzero", "unique"}


def _reduces(node: fx.Node) -> bool:
    """Whether `node` is one of _MASK_REDUCTIONS, an ATen overload's too (aten.amax.default:
    its name is "default"); max and min only over one tensor (torch.max(a, b) is pointwise)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = getattr(node.target, "_opname", None) or op_name(node)
    if name in ("max", "min", "maximum", "minimum"):
        return sum(isinstance(example(a), torch.Tensor) for a in node.all_input_nodes) == 1 \
            and name in ("max", "min")
    return name in _MASK_REDUCTIONS


def _check_mask_source(mask: fx.Node, positions: fx.Node, node: fx.Node) -> None:
    """A model-built mask is accepted only if it derives from positions and shapes alone, and
    is causal: evaluated for one row whose positions are 0..T-1, it must let each query see
    exactly the keys up to itself (a sliding window, an ALiBi bias or a bidirectional mask is
    refused). A mask written in place is refused: the evaluation replays only the ops it is
    computed from, so `m.logical_and_(window)` would be read as the causal `m`."""
    needed = _ancestors(mask) | {mask}
    inputs = [a for a in needed if a.op == "placeholder"]
    bad = [a for a in inputs if a is not positions]
    if bad:
        raise Refusal(
            f"attention at {source_line(node)} uses a mask computed from "
            f"{[a.name for a in bad]}, not from positions alone; only causal attention can be "
            f"rewritten to the shared-prefix layout"
        )
    reducing = [a for a in needed if _reduces(a)]
    if reducing:  # the check evaluates one row, of length T: such a mask depends on the row
        where = reducing[0]
        raise Refusal(
            f"attention at {source_line(node)} uses a mask that reduces over positions "
            f"({getattr(where.target, '_opname', None) or op_name(where)} at "
            f"{source_line(where)}); a mask must be a "
            f"function of each query's and key's position alone (a row's length or largest "
            f"position would differ between the packed batch and each row)"
        )
    writer = _writer_into(mask.graph, needed)
    if writer is not None:
        raise Refusal(
            f"attention at {source_line(node)} uses a mask written in place ({op_name(writer)} "
            f"at {source_line(writer)}); the check that it is causal replays only the ops the "
            f"mask is computed from, not writes into it, so a window or bias written in place "
            f"would be dropped; build the mask out of place (m = m & window)"
        )
    t = example(positions).shape[-1]
    if t > MASK_CHECK_MAX_LEN:
        log_once(log, logging.WARNING,
                 f"attention at {source_line(node)}: its mask built from positions is not "
                 f"checked for causality at T={t} (computing the [T, T] mask would take "
                 f"{t * t / 2 ** 30:.1f}G elements; masks are checked up to "
                 f"T={MASK_CHECK_MAX_LEN})")
        return
    if mask.meta.get("dualkv_causal") is None:  # once per mask node (layers share it)
        try:
            value = _evaluate_mask(mask, positions)
        except Exception as e:  # the model's own ops, replayed: any failure is a refusal
            raise Refusal(f"attention at {source_line(node)}: its mask could not be computed "
                          f"to check that it is causal ({type(e).__name__}: {e})") from e
        mask.meta["dualkv_causal"] = _is_causal_mask(value)
    if not mask.meta["dualkv_causal"]:
        raise Refusal(
            f"attention at {source_line(node)} uses a mask built from positions that is not "
            f"causal (for a row at positions 0..T-1 some query sees other keys than those up "
            f"to itself: a sliding window, a bias such as ALiBi, or bidirectional attention); "
            f"only causal attention can be rewritten to the shared-prefix layout"
        )


def _writer_into(graph: fx.Graph, needed: set[fx.Node]) -> fx.Node | None:
    """The first op of `graph` that may write into the memory of a value in `needed` (the mask
    and the values it is computed from; a view shares its base's memory); None if there is
    none. Such a write is a user of the value, not one of the ops the mask is computed from,
    wherever it stands in the graph. Memory that cannot be named may be any: a write into it,
    or any write while a tensor in `needed` has such memory, counts."""
    memory = {storage(n) for n in needed} | {None}  # None: memory not named, which may be any
    unknown = any(isinstance(example(n), Tensor) and storage(n) is None for n in needed)
    for n, into in _writes(graph):
        if unknown or into & memory:
            return n
    return None


# graph -> its in-place ops with the memory each writes: one scan of the graph for all its
# attention calls (may_write inspects signatures; a scan per call was quadratic in layers).
# The rewrite itself adds no in-place op, so the scan stays valid while it runs.
_WRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _writes(graph: fx.Graph) -> list[tuple[fx.Node, set]]:
    if graph not in _WRITES:
        _WRITES[graph] = [(n, {storage(t) for t in written(n)})
                          for n in graph.nodes if may_write(n)]
    return _WRITES[graph]


def _evaluate_mask(mask: fx.Node, positions: fx.Node):
    """The value of `mask` computed by the graph's own nodes for positions 0..T-1."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    needed = _ancestors(mask) | {mask}
    graph = fx.Graph()
    env = {positions: graph.placeholder("positions")}  # a mask may not read it at all
    for n in mask.graph.nodes:
        if n in needed and n is not positions:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[mask])
    module = fx.GraphModule(mask.graph.owning_module, graph)
    pos = example(positions)
    with unset_fake_temporarily(), torch.no_grad():
        value = torch.arange(pos.shape[-1], dtype=pos.dtype, device=pos.device)
        return module(value.expand(pos.shape).contiguous())


def _is_causal_mask(mask, rows: int = 2048) -> bool:
    """A boolean mask True exactly on and below the diagonal, or an additive float mask 0 there
    and -inf (or at most half the dtype's lowest value) above; leading dims broadcast."""
    if not isinstance(mask, Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    t = mask.shape[-1]
    flat = mask.reshape(-1, t, t)
    for r in range(0, t, rows):  # row blocks: no [T, T] temporaries beyond the mask itself
        block = flat[:, r:r + rows]
        q = torch.arange(r, r + block.shape[1], device=mask.device)[:, None]
        causal = torch.arange(t, device=mask.device)[None, :] <= q
        if mask.dtype == torch.bool:
            ok = bool((block == causal).all())
        else:
            blocked = block <= torch.finfo(mask.dtype).min / 2
            ok = bool(((block == 0) == causal).all()) and bool((blocked == ~causal).all())
        if not ok:
            return False
    return True


def _check_sdpa(node: fx.Node, args: dict, positions: fx.Node) -> None:
    q = example(args["query"])
    if q is None or q.dim() != 4 or q.shape[0] != 1:
        shape = None if q is None else tuple(q.shape)
        raise Refusal(f"attention at {source_line(node)} has query shape {shape}; the packed "
                      f"layout needs [1, H, T, D]")
    k, v = example(args["key"]), example(args["value"])
    heads = tuple(None if x is None or x.dim() != 4 else x.shape[1] for x in (q, k, v))
    if None in heads or heads[1] != heads[2] or heads[0] % heads[1]:
        raise Refusal(f"attention at {source_line(node)} has query, key and value heads "
                      f"{heads}; the shared-prefix kernels need keys and values of one head "
                      f"count that divides the query's (grouped-query attention)")
    if args["dropout_p"] not in (0, 0.0):
        raise Refusal(f"attention at {source_line(node)} has dropout_p={args['dropout_p']}; "
                      f"attention dropout cannot be reproduced on the packed layout")
    if args["attn_mask"] is None and not args["is_causal"]:
        raise Refusal(f"attention at {source_line(node)} is not causal (is_causal=False and no "
                      f"mask); only causal decoders can share a prompt")
    if isinstance(args["attn_mask"], fx.Node):
        _check_mask_source(args["attn_mask"], positions, node)


def _block_mask_tuple(graph: fx.Graph, template: tuple, tables: list, mask_attr: fx.Node):
    tensors = iter(tables)
    out = []
    for item in template:
        if isinstance(item, Tensor):
            out.append(next(tensors))
        elif callable(item):
            out.append(mask_attr)
        else:
            out.append(item)
    return tuple(out)


def rewrite_attention(gm: fx.GraphModule, template: tuple, kernel_options: dict,
                      attention_backend: str = "auto") -> int:
    """Rewrite every SDPA node of `gm` in place; erase the anchor. Returns the rewrite count."""
    graph = gm.graph
    anchor = find_anchor(graph)
    tokens, positions, tables = anchor.args  # layout.inputs.layout_tables
    sdpa_nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in _SDPA]
    if not sdpa_nodes:
        raise Refusal("no scaled_dot_product_attention in the traced model: its attention is "
                      "written by hand (matmul and softmax, as Gemma2's softcapped attention) "
                      "or calls another kernel; only SDPA attention is rewritten to the "
                      "shared-prefix layout (transformers: attn_implementation='sdpa')")
    if not attention_kernel(attention_backend).flex:
        segment_ids, prefix_segment_ids = tables
        _to_regions(graph, sdpa_nodes, positions, segment_ids, prefix_segment_ids,
                    attention_backend)
    else:
        _to_flex(gm, sdpa_nodes, positions, template, kernel_options, attention_backend,
                 tables[0], list(tables[1:]))

    # The anchor's output is unused; its inputs now feed the attention nodes directly.
    anchor.replace_all_uses_with(tokens)
    graph.erase_node(anchor)
    removed = eliminate_dead_code(graph)
    counters["mask_nodes_removed"] += removed
    return len(sdpa_nodes)


def _scale(args: dict, q: Tensor) -> float:
    return args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])


def _replace(node: fx.Node, out: fx.Node) -> None:
    out.meta = dict(node.meta)
    node.replace_all_uses_with(out)
    node.graph.erase_node(node)
    counters["attention_rewritten"] += 1


def _to_regions(graph, sdpa_nodes, positions, segment_ids, prefix_segment_ids,
                backend: str) -> None:
    """SDPA -> the region kernel's opaque op (torch.ops.dualkv.regions_attention, regions.py;
    flash_regions_attention, flash_regions.py), fed the 1-D segment tables."""
    kernel = attention_kernel(backend)
    op = kernel.graph_op()
    for node in sdpa_nodes:
        args = _sdpa_arguments(node)
        _check_sdpa(node, args, positions)
        repeated = fold_gqa_repeat(args, node)
        q, k, v = (example(args[x]) for x in ("query", "key", "value"))
        if q.device.type == "cuda":
            ok, reason = kernel.cuda_status(q.device, q.shape[-1], q.dtype)
            if not ok:
                raise Refusal(f"attention at {source_line(node)} ({q.dtype}, head dim "
                              f"{q.shape[-1]}): attention_backend={backend!r} cannot run: "
                              f"{reason}")
        if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
            raise Refusal(f"attention at {source_line(node)} has head dims q {q.shape[-1]}, "
                          f"k {k.shape[-1]}, v {v.shape[-1]}; the regions op needs them equal")
        with graph.inserting_before(node):
            call = graph.call_function(
                op.default,
                (args["query"], args["key"], args["value"], segment_ids, prefix_segment_ids,
                 _scale(args, q)),
            )
            call.meta["stack_trace"] = node.meta.get("stack_trace")  # refusals name the SDPA's line
            out = graph.call_function(operator.getitem, (call, 0))
        _replace(node, out)
        erase_unused(repeated)


def _to_flex(gm, sdpa_nodes, positions, template, kernel_options, attention_backend,
             visible_until, block_tensors) -> None:
    """SDPA -> the flex_attention higher-order op with the layout's BlockMask."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
    from torch.nn.attention.flex_attention import _apply_kernel_options

    graph = gm.graph

    gm.add_submodule("dualkv_score_mod", _score_graph())
    gm.add_submodule("dualkv_mask_mod", _mask_graph())
    for node in sdpa_nodes:
        args = _sdpa_arguments(node)
        _check_sdpa(node, args, positions)
        repeated = fold_gqa_repeat(args, node)
        q, k, v = (example(args[x]) for x in ("query", "key", "value"))
        scale = _scale(args, q)
        options = kernel_options_for(q.device, kernel_options, head_dim=q.shape[-1],
                                     gqa=q.shape[1] // k.shape[1], dtype=q.dtype,
                                     attention_backend=attention_backend)
        options = _apply_kernel_options(q, k, v, False, options)
        with graph.inserting_before(node):
            score_attr = graph.get_attr("dualkv_score_mod")
            mask_attr = graph.get_attr("dualkv_mask_mod")
            block_mask = _block_mask_tuple(graph, template, block_tensors, mask_attr)
            hop = graph.call_function(
                flex_hop,
                (args["query"], args["key"], args["value"], score_attr, block_mask, scale,
                 options, (), (visible_until,)),
            )
            hop.meta[REWRITTEN] = True  # token_locality trusts only this flex call
            hop.meta["stack_trace"] = node.meta.get("stack_trace")  # refusals name the SDPA's line
            out = graph.call_function(operator.getitem, (hop, 0))
        _replace(node, out)
        erase_unused(repeated)
