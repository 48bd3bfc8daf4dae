"""The token-locality proof's rules for the packed length T used as a size: a tensor without
tokens with an axis of length T made from it (arange(T), a table cut to T) meeting token data,
which each row had with its own length. Mixed into passes/token_locality.py's proof, whose `t`,
`refuse`, `built_from_nothing` and `length_axis` they use."""

from __future__ import annotations

import torch.fx as fx
from torch import Tensor

from ._common import example, op_name

__all__ = ["LengthRules"]

# ops that cut or widen a tensor's axes (to the packed length T: note_length_axis)
_RESIZES = {"getitem", "narrow", "expand", "expand_as", "broadcast_to", "repeat", "tile",
            "repeat_interleave", "pad", "constant_pad_nd", "as_strided", "index_select",
            "new_ones", "new_zeros", "new_full", "new_empty"}
_SPLITS = {"split", "chunk", "tensor_split", "split_with_sizes", "unbind"}
# ops that keep every value of their input, in place (a prefix cut stays one through them)
_CONVERSIONS = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous",
                "clone", "detach"}


def _from_the_start(idx) -> bool:
    """Whether getitem's index only cuts axes from their start (x[:T], x[0, :T], x[..., :T])."""
    return all(i is None or i is Ellipsis or type(i) is int or (
        isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1))
        for i in (idx if isinstance(idx, tuple) else (idx,)))


class LengthRules:
    def no_length_axis(self, node, a):
        """A tensor without tokens with an axis of the packed length T made from that length
        (see note_length_axis), meeting token data: arange(T), ones(D, T), a table cut to T,
        made from the sequence length, which each row had as its own."""
        if a in self.length_axis:
            self.refuse(node, f"operand {a.name} {tuple(example(a).shape)} is built in the "
                              f"graph with an axis of the packed length T={self.t} (e.g. "
                              f"arange over the sequence); each row has its own length")

    def note_length_axis(self, node):
        """Follow the tensors without tokens that have an axis of the packed length T made from
        it: built in the graph from no input (arange(T), ones(D, T)), cut or widened to T by
        indexing, splitting, padding, repeating or expanding (pos_table[:T], c.expand(T)), and
        what is computed from those keeping such an axis (arange(T) * alpha). Not a tensor computed from weights or buffers
        alone, which may have that size by chance: RoPE's inv_freq at head dim 256, a LoRA
        product, DoRA's scale."""
        out = example(node)
        if (self.t <= 1 or node.op not in ("call_function", "call_method")
                or not isinstance(out, Tensor) or self.t not in out.shape):
            return
        inputs = node.all_input_nodes
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if first is not None and op_name(first) in _SPLITS:  # a piece of split(...): its input
            first = first.args[0] if first.args and isinstance(first.args[0], fx.Node) else None
        src = example(first) if first is not None else None
        if (all(i in self.built_from_nothing for i in inputs)
                or any(i in self.length_axis for i in inputs)
                or (op_name(node) in _RESIZES and isinstance(src, Tensor)
                    and list(out.shape).count(self.t) > list(src.shape).count(self.t))):
            self.length_axis.add(node)
            self._note_prefix_cut(node, first)

    def _note_prefix_cut(self, node, first):
        """A tensor of length_axis whose values are those of a tensor made without T, cut from
        its start (a position table's table[:T], narrow(0, 0, T), and casts of it): read at a
        row's positions, all below its length, it gives what the row's own cut gives."""
        name = op_name(node)
        if first is None or first in self.length_axis and first not in self.prefix_cuts:
            return
        if first in self.prefix_cuts:
            cut = name in _CONVERSIONS
        elif name == "getitem":
            cut = len(node.args) > 1 and _from_the_start(node.args[1])
        else:
            cut = name == "narrow" and len(node.args) > 2 and node.args[2] == 0
        if cut:
            self.prefix_cuts.add(node)

    def no_table_of_the_length(self, node, table, indices):
        """`table` read at `indices` that carry tokens (a gather by positions): a table of
        length_axis whose values may depend on T (linspace(0, 1, T), arange(T) / T), unless a
        prefix cut; and an index of length_axis meeting token data (x[..., arange(T) % D])."""
        for i in indices:
            self.no_length_axis(node, i)
        if (table in self.length_axis and table not in self.prefix_cuts
                and any(self.tok(i) is not None for i in indices)):
            self.refuse(node, f"it reads {table.name} {tuple(example(table).shape)}, built in "
                              f"the graph with an axis of the packed length T={self.t} (e.g. "
                              f"linspace over the sequence), at token positions: its values "
                              f"may depend on T, where each row has its own length")
