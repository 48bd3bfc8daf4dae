"""The token-locality proof's rules for ops that index, join and split tensors (getitem, cat and
stack, chunk/split/unbind): mixed into passes/token_locality.py's proof, whose `tok`,
`refuse` and `axis` they use. Each returns the output's sequence axis or refuses."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

from ._common import arg_of, example, op_name

__all__ = ["IndexingRules"]


class IndexingRules:
    def getitem(self, node, out):
        src, idx = node.args[0], node.args[1]
        val = example(src)
        if not isinstance(val, Tensor):  # tuple or list element
            ax = self.tok(src)
            return ax[idx] if isinstance(ax, (list, tuple)) else None
        idx = idx if isinstance(idx, tuple) else (idx,)
        for i in idx:  # a list index is advanced indexing (it may add dims): no rule here
            v = example(i) if isinstance(i, fx.Node) else i
            if isinstance(v, bool) or not (v is None or v is Ellipsis or isinstance(
                    v, (int, torch.SymInt, slice, Tensor))):
                self.refuse(node, f"no rule for the index {i!r} ({type(v).__name__})")
        def width(i):  # input dims an index consumes: a boolean mask, as many as it has
            if isinstance(i, fx.Node) and isinstance(example(i), Tensor) and (
                    example(i).dtype == torch.bool):
                return example(i).dim()
            return 1

        tensors = [i for i in idx if isinstance(i, fx.Node) and isinstance(example(i), Tensor)]
        if self.tok(src) is not None or any(self.tok(i) is not None for i in tensors):
            self.no_table_of_the_length(node, src, tensors)
        consumed = sum(width(i) for i in idx if i is not None and i is not Ellipsis)
        expanded = []
        for i in idx:
            if i is Ellipsis:
                expanded += [slice(None)] * (val.dim() - consumed)
            else:
                expanded.append(i)
        expanded += [slice(None)] * (val.dim() - sum(1 for i in expanded if i is not None))
        src_ax, in_dim, out_dim, result = self.tok(src), 0, 0, None
        tensor_index_seen = False
        for i in expanded:
            if i is None:
                out_dim += 1
                continue
            if isinstance(i, fx.Node) and isinstance(example(i), Tensor):
                if tensor_index_seen:
                    self.refuse(node, "several tensor indices")
                tensor_index_seen = True
                if example(i).dtype == torch.bool:
                    if src_ax is not None and in_dim <= src_ax < in_dim + width(i):
                        self.refuse(node, "it masks along the sequence axis")
                    if self.tok(i) is not None:
                        self.refuse(node, "a mask built from token data selects a data-"
                                          "dependent set of rows")
                    in_dim += width(i)
                    out_dim += 1
                    continue
                if in_dim == src_ax:
                    self.refuse(node, "it gathers along the sequence axis")
                iax = self.tok(i)
                if iax is not None:
                    if src_ax is not None:
                        self.refuse(node, "both the indexed tensor and the index carry tokens")
                    result = out_dim + iax
                out_dim += example(i).dim()
                in_dim += 1
                continue
            if in_dim == src_ax:
                if not self.whole_axis(i):
                    self.refuse(node, f"it indexes the sequence axis with {i!r}")
                result = out_dim
            if isinstance(i, slice):
                out_dim += 1
            in_dim += 1
        return result

    def whole_axis(self, i) -> bool:
        """Whether index i keeps all T packed tokens, in order: x[:, :], x[:, 0:], x[:, :T]
        (x[:, :x.shape[1]], which each row reads as its own whole length too)."""
        return isinstance(i, slice) and i.step in (None, 1) and i.start in (None, 0) and (
            i.stop is None or (type(i.stop) is int and i.stop >= self.t))

    def cat(self, node, out):
        tensors = arg_of(node, 0, "tensors")
        name = op_name(node)
        dim = arg_of(node, 1, "dim", 0)
        axes = {self.tok(t) for t in tensors}
        if None in axes and len(axes) > 1:
            self.refuse(node, "it joins token data with a tensor that has its own sequence axis")
        if len(axes) > 1:
            self.refuse(node, "its operands carry the sequence on different axes")
        (ax,) = axes
        ndim = example(tensors[0]).dim()
        if name == "cat":
            if dim % ndim == ax:
                self.refuse(node, "it concatenates along the sequence axis")
            return ax
        dim = dim % (ndim + 1)
        return ax if ax < dim else ax + 1

    def split(self, node, ax, inp, out):
        name = op_name(node)
        pos = {"chunk": 2, "split": 2, "tensor_split": 2, "unbind": 1}[name]
        dim = arg_of(node, pos, "dim", 0) % inp.dim()
        if dim == ax:
            self.refuse(node, "it splits along the sequence axis")
        if name == "unbind":
            return [ax if ax < dim else ax - 1] * len(out)
        return [ax] * len(out)
