"""Token dedup, part 1: prove every op between the inputs and the output token-local.

Running the model on the packed sequence is exact only if no op other than the (rewritten)
attention mixes tokens. The proof follows the token axis of every tensor from the packed
inputs (tokens and positions, axis 1) through the graph:

- ops with a rule here (and in _locality_indexing.py, _locality_lengths.py,
  _locality_products.py) keep the axis
  where the rule says (pointwise with broadcasting, linear,
  embedding, norms and reductions over other dims, views, transposes, indexing that leaves the
  axis whole, cat/stack/split along other dims, matmul that does not contract over tokens,
  the shared-prefix attention: flex_attention or the regions op);
- an op that reduces, slices, gathers, shifts or contracts along the token axis, or that meets
  a tensor carrying its own full-length sequence axis (positions made by arange rather than
  fed from the packed layout), or any op without a rule, is refused naming the op and line;
- so are ops that only share a rule's name (custom ops, allow_in_graph functions), results
  written through out=, and in-place shape changes (they make recorded shapes stale).

Tensors that do not depend on the packed inputs (weights, RoPE tables) pass freely.
"""

from __future__ import annotations

import math

import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch import Tensor
from torch._ops import HigherOrderOperator

from dualkv_compile.stats import counters

from ._common import (REWRITTEN, Refusal, arg_of, example, may_write, op_name, regions_ops,
                      source_line, token_local_ops)
from ._locality_indexing import IndexingRules
from ._locality_lengths import LengthRules
from ._locality_products import ProductRules

__all__ = ["prove_token_locality"]

_POINTWISE = {
    "add", "sub", "mul", "truediv", "div", "floordiv", "neg", "pow", "rsqrt", "sqrt", "exp",
    "log", "sin", "cos", "tanh", "sigmoid", "silu", "gelu", "relu", "softplus", "abs", "float",
    "half", "bfloat16", "double", "to", "type_as", "type", "contiguous", "clone", "detach",
    "where", "masked_fill", "clamp", "maximum", "minimum", "eq", "ne", "le", "lt",
    "ge", "gt", "and_", "or_", "invert", "logical_and", "logical_or", "logical_not",
    "reciprocal", "square", "erf", "iadd", "imul", "isub", "add_", "mul_", "sub_", "div_",
    "__and__", "__or__", "__invert__", "lerp", "tanh_", "sigmoid_", "gelu_", "relu_",
    "addcmul", "requires_grad_", "itruediv", "idiv",
    # casts, elementwise functions and constants of a token tensor's shape (not rand_like:
    # one draw per packed element, as dropout)
    "long", "int", "bool", "short", "byte", "log1p", "expm1", "sign", "leaky_relu",
    "clamp_min", "clamp_max", "mod", "remainder", "fmod", "floor", "ceil", "round", "trunc",
    "zeros_like", "ones_like", "full_like", "empty_like",
}
_CASTS = {"to", "type_as", "type"}
# attributes read off a tensor: metadata (no data), or a transpose of it
_METADATA_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"}
_TRANSPOSE_ATTRS = {"T", "mT", "H", "mH"}
# where a reduction's dims and keepdim sit among its positional arguments
_REDUCE_DIM_ARG = {"norm": 2}  # the positional index of `dim` where it is not 1
_REDUCE = {"mean", "sum", "amax", "amin", "var", "std", "norm", "logsumexp", "prod", "all",
           "any"}
_SAME_SHAPE_ALONG_DIM = {"softmax", "log_softmax", "cumsum", "cumprod", "_softmax"}
_VIEWS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as",
          "reshape_as"}
_EXPANDS = {"expand", "expand_as", "broadcast_to"}
_SHAPE_QUERIES = {"size", "dim", "numel", "_log_api_usage_once", "is_floating_point",
                  "get_device"}
_MATMUL = {"matmul", "bmm", "mm", "__matmul__"}
_SHAPE_IN_PLACE = {"t_", "transpose_", "swapdims_", "swapaxes_", "unsqueeze_", "squeeze_",
                   "resize_", "resize_as_", "as_strided_", "set_", "unflatten_", "flatten_"}


class _Proof(IndexingRules, LengthRules, ProductRules):
    def __init__(self, graph: fx.Graph, tokens: fx.Node, positions: fx.Node, layout: set):
        self.axis: dict[fx.Node, object] = {tokens: 1, positions: 1}
        # tokens per index of the sequence axis: 1, or k where each token's rows were repeated
        # k times in a row (MoE dispatch: repeat_interleave, a [T, k] routing table flattened)
        self.inner: dict[fx.Node, int] = {}
        self._inner_out: int | None = None  # set by a rule that changes it
        self.layout = layout
        self.t = example(tokens).shape[1]
        self.checked = 0

    # ---- helpers ---------------------------------------------------------------------------
    def tok(self, x):
        return self.axis.get(x) if isinstance(x, fx.Node) else None

    def refuse(self, node, why):
        raise Refusal(f"cannot prove `{op_name(node)}` at {source_line(node)} token-local: {why}")

    def dim_arg(self, node, pos, key, ndim, default=None):
        d = arg_of(node, pos, key, default)
        if d is None:
            return None
        ds = list(d) if isinstance(d, (list, tuple)) else [d]
        return [x % ndim for x in ds]

    # ---- rules -----------------------------------------------------------------------------
    def pointwise(self, node, out):
        ndim = out.dim()
        found = None
        tensors = [a for a in node.all_input_nodes if isinstance(example(a), Tensor)]
        if op_name(node) in _CASTS:  # x.to(w), x.type_as(w): w gives a dtype and device only
            tensors = tensors[:1]
        for a in tensors:
            ax = self.tok(a)
            if ax is not None:
                aligned = ax + ndim - example(a).dim()
                if found is not None and aligned != found:
                    self.refuse(node, "its operands carry the sequence on different axes")
                found = aligned
        for a in tensors:
            if self.tok(a) is None:
                v = example(a)
                d = found - (ndim - v.dim())
                if d >= 0 and v.shape[d] != 1 and self.t > 1:
                    if may_write(node) and a is node.args[0]:  # buf.add_(x), buf += x
                        self.refuse(node, f"it writes token data in place into {a.name}, a "
                                          f"tensor made without the tokens (e.g. a fresh "
                                          f"torch.zeros(x.shape)), which the proof does not "
                                          f"follow; compute the value out of place instead")
                    self.refuse(node, f"operand {a.name} has its own sequence axis of length "
                                      f"{v.shape[d]} (e.g. positions from arange); feed packed "
                                      f"positions instead")
                self.no_length_axis(node, a)
        return found

    def dropout(self, node, out):
        """Dropout in training draws one mask per packed element: the N rows of a group would
        share their prompt's mask, where the plain model draws one per row (correlated rows,
        not the same computation). Only inactive dropout (eval, or p = 0) passes."""
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        if training is not False and p != 0:
            self.refuse(node, f"dropout (p={p}) in training draws one mask per packed token, "
                              f"which the N rows sharing a prompt would share; call model.eval()"
                              f" or set the dropout to 0 for the policy update")
        return self.pointwise(node, out)

    def embedding_options(self, node, functional):
        """scale_grad_by_freq divides each row's gradient by how often its id occurs in the
        batch, which packing changes (a prompt's tokens once instead of N times); max_norm
        renormalises, in place, the rows of the ids looked up, padding's included."""
        by_freq = arg_of(node, 5 if functional else 3, "scale_grad_by_freq", False)
        max_norm = arg_of(node, 3, "max_norm", None) if functional else None
        if by_freq:
            self.refuse(node, "an embedding with scale_grad_by_freq=True scales each row's "
                              "gradient by its id's count in the batch, which packing changes")
        if max_norm is not None:
            self.refuse(node, f"an embedding with max_norm={max_norm} renormalises the looked-up "
                              f"rows of its weight in place, a set which packing changes")

    def inner_of(self, x) -> int:
        return self.inner.get(x, 1) if isinstance(x, fx.Node) else 1

    def topk(self, node, ax, inp):
        dim = self.dim_arg(node, 2, "dim", inp.dim(), default=-1)[0]
        if dim == ax:
            self.refuse(node, "it ranks along the sequence axis")
        return [ax, ax]

    def repeat_interleave(self, node, ax, inp):
        repeats = node.kwargs.get("repeats", node.args[1] if len(node.args) > 1 else None)
        dim = arg_of(node, 2, "dim")
        if dim is None or isinstance(repeats, fx.Node) or not isinstance(repeats, int):
            self.refuse(node, "only a constant repeat count along a named dim has a rule")
        if dim % inp.dim() == ax:  # each token's rows stay together, `repeats` times as many
            self._inner_out = self.inner_of(node.args[0]) * repeats
        return ax

    def reduce(self, node, ax, inp):
        name = op_name(node)
        dim_pos = _REDUCE_DIM_ARG.get(name, 1)
        if name in ("var", "std") and len(node.args) > 1 and isinstance(node.args[1], bool):
            dims = None  # var(x, unbiased): over every dim
        else:
            dims = self.dim_arg(node, dim_pos, "dim", inp.dim())
        if not dims or ax in dims:  # None or [] reduce every dim
            self.refuse(node, "it reduces over the sequence axis")
        out = example(node)  # keepdim, keepdims or positional: the result's rank says which
        out = out[0] if isinstance(out, (tuple, list)) else out
        keep = isinstance(out, Tensor) and out.dim() == inp.dim()
        return ax if keep else ax - sum(d < ax for d in dims)

    def attribute(self, node, ax, inp, out):
        """x.T / x.mT / x.H / x.mH (transposes); shape, dtype, ... carry no data."""
        attr = node.args[1]
        if not isinstance(inp, Tensor):
            self.refuse(node, f"no rule for the attribute {attr!r} of a token-carrying value")
        if attr in _METADATA_ATTRS or not isinstance(out, Tensor):
            if isinstance(out, Tensor):
                self.refuse(node, f"no rule for the tensor attribute {attr!r}")
            return None
        if attr not in _TRANSPOSE_ATTRS:
            self.refuse(node, f"no rule for the tensor attribute {attr!r}")
        n = inp.dim()
        if attr in ("T", "H"):
            return n - 1 - ax  # reverses every dim
        return {n - 1: n - 2, n - 2: n - 1}.get(ax, ax)  # swaps the last two

    def view(self, node, ax, inp, out):
        """A row-major reshape keeps every element's token; the sequence axis of the output is
        the one whose index alone still names the token: the same elements before it, and the
        elements after it within one token's block (merging the axis with the dims after it
        groups `inner` indices per token; splitting such a group back restores 1)."""
        prefix, inner = math.prod(inp.shape[:ax]), self.inner_of(node.args[0])
        block = inner * math.prod(inp.shape[ax + 1:])  # elements of one token, from the axis on
        for j in range(out.dim()):
            after = math.prod(out.shape[j + 1:])
            if math.prod(out.shape[:j]) == prefix and block % after == 0 and (
                    out.shape[j] == self.t * (block // after)):
                self._inner_out = block // after
                return j
        self.refuse(node, f"it merges or splits the sequence axis ({tuple(inp.shape)} -> "
                          f"{tuple(out.shape)})")

    def permute(self, node, ax, inp):
        name = op_name(node)
        if name in ("transpose", "swapaxes", "swapdims"):
            d0 = arg_of(node, 1, ("dim0", "axis0"))
            d1 = arg_of(node, 2, ("dim1", "axis1"))
            d0, d1 = d0 % inp.dim(), d1 % inp.dim()
            return d1 if ax == d0 else d0 if ax == d1 else ax
        if name == "t":
            return 1 - ax
        dims = node.args[1:] or (node.kwargs.get("dims"),)
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        dims = [d % inp.dim() for d in dims]
        return dims.index(ax)

    # ---- driver ----------------------------------------------------------------------------
    def visit(self, node: fx.Node):
        if node.op in ("placeholder", "get_attr", "output"):
            return self.axis.get(node)
        inputs = node.all_input_nodes
        if any(a in self.layout for a in inputs) and not _is_attention(node):
            self.refuse(node, "it reads the packed-layout tables, which only attention may use")
        carried = [a for a in inputs if self.tok(a) is not None]
        if not carried:
            return None
        self.checked += 1
        name, out = op_name(node), example(node)
        # the data argument: first positional, or by keyword (F.layer_norm(input=x, ...))
        first = node.args[0] if node.args else node.kwargs.get(
            "input", node.kwargs.get("self"))
        inp = example(first) if isinstance(first, fx.Node) else None
        ax = self.tok(first)
        if _is_attention(node):
            return self.attention(node)
        if name == "flex_attention":
            self.refuse(node, "the model calls flex_attention itself, over the whole packed "
                              "sequence with its own mask; only SDPA attention is rewritten to "
                              "the shared-prefix layout")
        if isinstance(node.target, HigherOrderOperator):
            self.refuse(node, f"it calls PyTorch's higher-order op {name} (what a local "
                              f"autograd.Function, a tensor hook or vmap traces to), whose "
                              f"body the proof does not read")
        if node.op == "call_function" and not _library_op(node.target) and (
                node.target not in token_local_ops()):
            module = getattr(node.target, '__module__', None) or '?'
            if module.startswith("torch."):  # torch.vmap's _add_batch_dim, say
                self.refuse(node, f"it calls {module}.{name}, a PyTorch function without a "
                                  f"locality rule")
            self.refuse(node, f"it calls {module}.{name}, "
                              f"not a torch op: a rule is chosen by name, which this op only "
                              f"shares (a custom op or an allow_in_graph function)")
        if "out" in node.kwargs:
            self.refuse(node, "it writes its result into out=, a tensor the proof does not "
                              "follow")
        if name == "getattr":
            return self.attribute(node, ax, inp, out)
        if name in _SHAPE_QUERIES:
            return None
        if not isinstance(out, (Tensor, list, tuple)):
            # an op that returns nothing but reads token data writes it somewhere (setitem,
            # copy_ into a buffer): the proof cannot follow where
            if name in ("setitem", "__setitem__", "copy_", "index_put_", "index_copy_"):
                self.refuse(node, "it writes token data into another tensor in place")
            return None
        if name == "getitem":
            return self.getitem(node, out)
        if isinstance(out, (list, tuple)):
            if name in ("chunk", "split", "tensor_split", "unbind") and ax is not None:
                return self.split(node, ax, inp, out)
            if name == "topk" and ax is not None and not any(a is not first for a in carried):
                return self.topk(node, ax, inp)
            self.refuse(node, "no rule for this multi-output op")
        if name in _POINTWISE:
            return self.pointwise(node, out)
        if name in ("dropout", "alpha_dropout", "feature_alpha_dropout"):
            return self.dropout(node, out)
        if name in ("cat", "stack", "concat", "concatenate"):
            return self.cat(node, out)
        if name in _MATMUL:
            return self.matmul(node)
        if name == "embedding":
            # F.embedding(input, weight); torch.embedding(weight, indices), ATen's order
            functional = node.target is F.embedding
            ids = arg_of(node, 0 if functional else 1, "input" if functional else "indices")
            weight = arg_of(node, 1 if functional else 0, "weight")
            if self.tok(weight) is not None:
                self.refuse(node, "the embedding table carries tokens")
            self.no_table_of_the_length(node, weight, [ids])  # a table made from T, read by ids
            self.embedding_options(node, functional)
            return self.tok(ids)
        if node.target in token_local_ops():
            return self.token_local_op(node)
        if ax is None or any(a is not first for a in carried):
            self.refuse(node, "token data reaches it through an argument it has no rule for")
        if name == "linear":
            if ax == inp.dim() - 1:
                self.refuse(node, "it contracts over the sequence axis")
            for operand in node.all_input_nodes[1:]:  # weight, bias: F.linear(x, c.expand(T, D))
                self.no_length_axis(node, operand)
            return ax
        if name in ("rms_norm", "layer_norm", "group_norm_last"):
            shape = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
            if ax >= inp.dim() - len(shape):
                self.refuse(node, "it normalises over the sequence axis")
            return ax
        if name in _REDUCE:
            return self.reduce(node, ax, inp)
        if name in _SAME_SHAPE_ALONG_DIM:
            dims = self.dim_arg(node, 1, "dim", inp.dim())
            if dims is None or ax in dims:
                self.refuse(node, "it runs along the sequence axis")
            return ax
        if name in _VIEWS:
            return self.view(node, ax, inp, out)
        if name == "repeat_interleave":
            return self.repeat_interleave(node, ax, inp)
        if name in _EXPANDS:
            return ax + out.dim() - inp.dim()
        if name in ("transpose", "swapaxes", "swapdims", "permute", "t"):
            return self.permute(node, ax, inp)
        self.refuse(node, "no locality rule for this op")

    def run(self, graph: fx.Graph):
        for node in graph.nodes:
            # the rules read each value's shape as Dynamo recorded it, which a later in-place
            # shape change (c.transpose_(1, 2)) rewrites: refused wherever it is
            if node.op in ("call_method", "call_function") and op_name(node) in _SHAPE_IN_PLACE:
                self.refuse(node, "an in-place shape change makes the recorded shapes the "
                                  "proof reads stale; use the out-of-place op")
        self.built_from_nothing, self.length_axis, self.prefix_cuts = set(), set(), set()
        for node in graph.nodes:
            self._inner_out = None
            if node.op in ("call_function", "call_method") and all(
                    i in self.built_from_nothing for i in node.all_input_nodes):
                self.built_from_nothing.add(node)
            try:
                self.note_length_axis(node)
                ax = self.visit(node)
            except Refusal:
                raise
            except GuardOnDataDependentSymNode:
                self.refuse(node, "its output's shape depends on the data (boolean indexing, "
                                  "nonzero, unique): which tokens it keeps is not known when "
                                  "the graph is compiled")
            except Exception as e:  # noqa: BLE001 - a rule met a form it does not read
                self.refuse(node, f"its arguments do not have a form the rule reads "
                                  f"({type(e).__name__}: {e})")
            if ax is not None:
                self.axis[node] = ax
                inner = self._inner_out if self._inner_out is not None else self._common_inner(node)
                if inner != 1:
                    self.inner[node] = inner
                out = example(node)
                if isinstance(out, Tensor) and isinstance(ax, int) and not (
                        0 <= ax < out.dim() and out.shape[ax] == self.t * inner):
                    self.refuse(node, f"lost track of the sequence axis (axis {ax} of "
                                      f"{tuple(out.shape)} is not T={self.t} x {inner})")

    def _common_inner(self, node) -> int:
        """An op without a rule for grouped tokens keeps its operands' grouping, which must
        agree (tokens of different groupings would be paired wrongly)."""
        inners = {self.inner_of(a) for a in node.all_input_nodes if self.tok(a) is not None}
        if len(inners) > 1:
            self.refuse(node, f"its operands group their tokens differently ({sorted(inners)})")
        if inners and inners != {1} and _is_attention(node):
            self.refuse(node, "attention over grouped tokens")
        return inners.pop() if inners else 1


_LIBRARY_MODULES = ("torch", "torch.nn.functional", "torch.functional", "torch._C._nn",
                    "torch._C._linalg", "torch._C._special", "torch._C._fft",
                    "torch._ops.aten", "torch._ops.prims", "_operator", "operator", "math",
                    "builtins")


def _library_op(target) -> bool:
    """The rules are chosen by an op's name: trust it only for torch's own functions and
    ATen ops, and Python's operators, whose names mean what the rules assume."""
    return getattr(target, "__module__", None) in _LIBRARY_MODULES


def _is_attention(node: fx.Node) -> bool:
    """The rewritten attention: the flex_attention HOP that attention_rewrite inserted (marked
    in its meta), or a region kernel's op (regions.py, flash_regions.py)."""
    if node.op != "call_function":
        return False
    if getattr(node.target, "__name__", "") == "flex_attention":
        return bool(node.meta.get(REWRITTEN))
    return node.target in regions_ops()


def prove_token_locality(graph: fx.Graph, tokens: fx.Node, positions: fx.Node, layout) -> int:
    """Raise Refusal unless every op on the token path is local. Returns ops checked."""
    proof = _Proof(graph, tokens, positions, set(layout))
    proof.run(graph)
    counters["ops_proven_local"] += proof.checked
    return proof.checked
