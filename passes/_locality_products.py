"""The token-locality proof's rules for ops that combine several operands' data: matmul
(a product must not contract or pair tokens), the token-local ops by contract (MoE experts) and
the rewritten attention. Mixed into passes/token_locality.py's proof, whose `tok`, `refuse`,
`inner_of` and `no_length_axis` they use. Each returns the output's sequence axis or refuses."""

from __future__ import annotations

import torch.fx as fx

from ._common import arg_of, example

__all__ = ["ProductRules"]


class ProductRules:
    def matmul(self, node):
        a, b = arg_of(node, 0, "input"), arg_of(node, 1, "other")
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
        if isinstance(name, fx.Node):
            self.no_length_axis(node, name)
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
