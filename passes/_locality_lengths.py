"""The token-locality proof's rules for the packed length T used as a size: a tensor without
tokens with an axis of length T made from it (arange(T), a table cut to T) meeting token data,
which each row had with its own length. Mixed into passes/token_locality.py's proof, whose `t`,
`refuse`, `built_from_nothing` and `length_axis` they use."""

from __future__ import annotations

import torch.fx as fx
from torch import Tensor

from ._common import arg_of, example, may_write, op_name, written

__all__ = ["LengthRules"]

# ops that cut or widen a tensor's axes (to the packed length T: note_length_axis)
_RESIZES = {"getitem", "narrow", "expand", "expand_as", "broadcast_to", "repeat", "tile",
            "repeat_interleave", "pad", "constant_pad_nd", "as_strided", "index_select",
            "new_ones", "new_zeros", "new_full", "new_empty", "view", "reshape", "unflatten"}
# of those, the views: a table the model holds viewed with an axis of T has it by chance (a
# fused [2I, D] weight as [2, I, D]); a cut of one viewed so (table[:2T].view(2, T)) is one
_VIEW_RESIZES = {"view", "reshape", "unflatten"}
_SPLITS = {"split", "chunk", "tensor_split", "split_with_sizes", "unbind"}
# ops whose output is a view of their first argument (a write into it writes into that)
_VIEW_OF_FIRST = _SPLITS | _VIEW_RESIZES | {
    "getitem", "narrow", "expand", "expand_as", "select", "slice", "transpose", "permute",
    "unsqueeze", "squeeze", "flatten", "t", "view_as", "reshape_as", "diagonal", "as_strided",
    "movedim", "moveaxis", "swapaxes", "swapdims", "unfold", "alias", "getattr"}
# ops that keep every value of their input at its index along the T axis (a prefix cut, or a
# whole table, stays one through them)
_KEEPS_INDEX = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous",
                "clone", "detach", "squeeze", "unsqueeze"}


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
                              f"arange over the sequence), or computed from one (a sum over "
                              f"it); each row has its own length")

    def note_length_axis(self, node):
        """Follow the tensors without tokens that have an axis of the packed length T made from
        it: built in the graph from no input (arange(T), ones(D, T)), cut or widened to T by
        indexing, splitting, padding, repeating or expanding (pos_table[:T], c.expand(T)), and
        what is computed from those keeping such an axis (arange(T) * alpha), or not
        (arange(T).mean()). Not a tensor computed from weights or buffers alone, which may
        have that size by chance: RoPE's inv_freq at head dim 256, a LoRA product, DoRA's
        scale."""
        out = example(node)
        if self.t <= 1 or node.op not in ("call_function", "call_method"):
            return
        inputs = node.all_input_nodes
        if may_write(node):  # a write of such a tensor makes its target (and base) one too
            self._note_write(node, inputs)
        if not isinstance(out, Tensor):
            return
        if self.t not in out.shape:  # a value computed from one (arange(T).mean(),
            if any(i in self.length_axis for i in inputs):  # linspace(0, 1, T)[5]) depends on T
                self.length_axis.add(node)
            return
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if first is not None and op_name(first) in _SPLITS:  # a piece of split(...): its input
            first = first.args[0] if first.args and isinstance(first.args[0], fx.Node) else None
        src = example(first) if first is not None else None
        if (all(i in self.built_from_nothing for i in inputs)
                or any(i in self.length_axis for i in inputs)
                or (op_name(node) in _RESIZES and isinstance(src, Tensor)
                    and list(out.shape).count(self.t) > list(src.shape).count(self.t)
                    and not (op_name(node) in _VIEW_RESIZES and self._whole_table(first)))):
            self.length_axis.add(node)
            self._note_prefix_cut(node, first)

    def _note_write(self, node, inputs):
        """An in-place op or setitem whose written value is of length_axis (tab[:T] =
        linspace(0, 1, T), tab.mul_(...)): its target, and the tensors it is a view of, then
        hold values made from T."""
        targets = [t for t in written(node) if isinstance(t, fx.Node)]
        if not any(i in self.length_axis for i in inputs if i not in targets):
            return
        for target in targets:
            while isinstance(target, fx.Node):
                self.length_axis.add(target)
                self.prefix_cuts.discard(target)
                first = target.args[0] if target.args else None
                target = first if op_name(target) in _VIEW_OF_FIRST else None

    def _note_prefix_cut(self, node, first):
        """A tensor of length_axis whose values are those of a table held by the model (a
        buffer, a weight, an input; not one built in the graph, whose values may follow from
        T: linspace(0, 1, 2T)), cut from its start (table[:T], narrow(0, 0, T), the first piece
        of split(T), and casts of those): read at a row's positions, all below its length, it
        gives what the row's own cut gives. `first`: node's input (a split piece's: the split's)."""
        name = op_name(node)
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if src is not None and src in self.prefix_cuts:  # a cast, or a cut from the start, of one
            if name in _KEEPS_INDEX or (name == "getitem" and len(node.args) > 1
                                        and _from_the_start(node.args[1])):
                self.prefix_cuts.add(node)
            return
        if name == "arange" and self._whole_table(node):  # arange(T): index i holds i
            self.prefix_cuts.add(node)
            return
        if first is None or not self._whole_table(first):
            return
        if name == "getitem" and op_name(src) in _SPLITS:  # a piece of split(...): the first
            cut = len(node.args) > 1 and type(node.args[1]) is int and node.args[1] == 0
        elif name == "getitem":
            cut = len(node.args) > 1 and _from_the_start(node.args[1])
        else:
            cut = name == "narrow" and arg_of(node, 2, "start") == 0
        if cut:
            self.prefix_cuts.add(node)

    def _whole_table(self, node) -> bool:
        """A tensor whose value at each index does not depend on T: a table the model holds
        (an input, a buffer, a weight; not one written in place with a value made from T),
        arange from 0 by 1, and casts or (un)squeezes of those (not table[T:], a roll, a
        linspace: table[T:][:T] is no cut from the table's start)."""
        while isinstance(node, fx.Node):
            if node.op in ("placeholder", "get_attr"):
                return node not in self.length_axis
            name = op_name(node)
            if name == "arange":
                args = list(node.args) + [None] * 3
                start = node.kwargs.get("start", args[0] if len(node.args) > 1 else 0)
                step = node.kwargs.get("step", args[2] if len(node.args) > 2 else 1)
                return start == 0 and step == 1
            if name not in _KEEPS_INDEX or node in self.length_axis - self.prefix_cuts:
                return False
            node = node.args[0] if node.args else None
        return False

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
