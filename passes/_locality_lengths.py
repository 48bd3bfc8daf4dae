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
