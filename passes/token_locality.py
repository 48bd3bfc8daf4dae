"""Token dedup, part 1: prove every op between the inputs and the output token-local.

Running the model on the packed sequence is exact only if no op other than the (rewritten)
attention mixes tokens. The proof follows the token axis of every tensor from the packed
inputs (tokens and positions, axis 1) through the graph:

- ops with a rule here keep the axis where the rule says (pointwise with broadcasting, linear,
  embedding, norms and reductions over other dims, views, transposes, indexing that leaves the
  axis whole, cat/stack/split along other dims, matmul that does not contract over tokens,
  the shared-prefix attention: flex_attention or the regions op);
- an op that reduces, slices, gathers, shifts or contracts along the token axis, or that meets
  a tensor carrying its own full-length sequence axis (positions made by arange rather than
  fed from the packed layout), or any op without a rule, is refused naming the op and line.

Tensors that do not depend on the packed inputs (weights, RoPE tables) pass freely.
"""

from __future__ import annotations

import math

import torch.fx as fx
from torch import Tensor

from dualkv_compile.stats import counters

from ._common import (REWRITTEN, Refusal, arg_of, example, op_name, regions_ops,
                      source_line, token_local_ops)
from ._locality_indexing import IndexingRules

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
}
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


class _Proof(IndexingRules):
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
                    self.refuse(node, f"operand {a.name} has its own sequence axis of length "
                                      f"{v.shape[d]} (e.g. positions from arange); feed packed "
                                      f"positions instead")
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

    def matmul(self, node):
        a, b = node.args[0], node.args[1]
        ea, eb = example(a), example(b)
        ta, tb = self.tok(a), self.tok(b)
        out = example(node)
        if ta is not None and tb is not None:
            # a per-token batched product (MoE experts: each token's rows times its experts'
            # weights) pairs the operands along one batch axis; anything else mixes tokens
            ba, bb = out.dim() - (ea.dim() - ta), out.dim() - (eb.dim() - tb)
            if (ba != bb or ta >= ea.dim() - 2 or tb >= eb.dim() - 2
                    or self.inner_of(a) != self.inner_of(b)):
                self.refuse(node, "both operands carry tokens (attention written by hand?)")
            return ba
        if ta is not None:
            if ta == ea.dim() - 1:
                self.refuse(node, "it contracts over the sequence axis")
            # [..., n, k] @ [k] drops a's last dim, which lies after the tokens
            ax = ta if eb.dim() == 1 else out.dim() - (ea.dim() - ta)
            other = (b, eb)
        else:
            if (eb.dim() >= 2 and tb == eb.dim() - 2) or eb.dim() == 1:
                self.refuse(node, "it contracts over the sequence axis")
            # [k] @ [..., k, m] drops b's second-to-last dim: only a last-dim axis moves
            ax = (tb - 1 if tb == eb.dim() - 1 else tb) if ea.dim() == 1 else (
                out.dim() - (eb.dim() - tb))
            other = (a, ea)
        # a batch dim of the other operand aligned with the tokens must broadcast (size 1):
        # otherwise it is a per-position table not fed from the packed layout
        name, val = other[0], other[1]
        d = ax - (out.dim() - val.dim())
        if 0 <= d < val.dim() - 2 and val.shape[d] != 1 and self.t > 1:
            self.refuse(node, f"operand {getattr(name, 'name', name)} has its own sequence axis "
                              f"of length {val.shape[d]} (e.g. positions from arange); feed "
                              f"packed positions instead")
        return ax

    def token_local_op(self, node):
        """moe_experts(hidden [S, d], top_k_index [S, k], top_k_weights [S, k], weights...):
        row s of the output is token s's, by the op's contract, when the three token arguments
        carry the tokens on axis 0, grouped alike, and no other argument carries them."""
        tokens, rest = node.args[:3], node.args[3:]
        if any(self.tok(a) != 0 for a in tokens):
            self.refuse(node, "its hidden states and routing table must carry the tokens on "
                              "axis 0 (rows)")
        if len({self.inner_of(a) for a in tokens}) > 1:
            self.refuse(node, "its token arguments group their tokens differently")
        if any(self.tok(a) is not None for a in list(rest) + list(node.kwargs.values())):
            self.refuse(node, "token data reaches its weight arguments")
        return 0

    def attention(self, node):
        """The rewritten attention reads query, key and value by packed index: each must be
        token data with the tokens on axis 2 ([1, H, T, D]), one index a token (a key made from
        a position table, say, would be read as if it were one). Returns the axes of (out
        [1, H, T, D], logsumexp [1, H, T])."""
        qkv = node.args[:3]
        for role, arg in zip(("query", "key", "value"), qkv):
            if self.tok(arg) != 2 or self.inner_of(arg) != 1:
                self.refuse(node, f"its {role} ({getattr(arg, 'name', arg)}) is not the packed "
                                  f"tokens' data on axis 2, one index a token")
        extra = [a for a in node.all_input_nodes if a not in qkv and self.tok(a) is not None]
        if extra:
            self.refuse(node, f"token data reaches it outside query, key and value "
                              f"({', '.join(a.name for a in extra)})")
        return [2, 2]

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
        first = node.args[0] if node.args else None
        inp = example(first) if isinstance(first, fx.Node) else None
        ax = self.tok(first)
        if _is_attention(node):
            return self.attention(node)
        if name == "flex_attention":
            self.refuse(node, "the model calls flex_attention itself, over the whole packed "
                              "sequence with its own mask; only SDPA attention is rewritten to "
                              "the shared-prefix layout")
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
            ids = node.kwargs.get("input", node.args[0])
            if self.tok(node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")):
                self.refuse(node, "the embedding table carries tokens")
            return self.tok(ids)
        if node.target in token_local_ops():
            return self.token_local_op(node)
        if ax is None or any(a is not first for a in carried):
            self.refuse(node, "token data reaches it through an argument it has no rule for")
        if name == "linear":
            if ax == inp.dim() - 1:
                self.refuse(node, "it contracts over the sequence axis")
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
            self._inner_out = None
            try:
                ax = self.visit(node)
            except Refusal:
                raise
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
