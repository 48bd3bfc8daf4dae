"""The torch.compile backend of optimize(): runs the passes on Dynamo's graph, then compiles.

Passes, in order, on a copy of the graph: attention rewrite (SDPA -> shared-prefix flex, the
model's mask code removed), token-locality proof, and for response_logprobs the LM-head cut.
Then Inductor (CUDA), aot_eager (CPU: Inductor's CPU flex has no backward) or eager.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from dualkv_compile.passes import attention_rewrite, lm_head, token_locality

from .kernel_options import validate_kernel_options
from .stats import counters

__all__ = ["DualKVBackend", "pass_uuids"]

log = logging.getLogger(__name__)


def pass_uuids() -> dict[str, str]:
    """Cache ids of the passes; they change whenever a pass's source changes."""
    return {m.__name__.split(".")[-1]: m.uuid()
            for m in (attention_rewrite, token_locality, lm_head)}


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


class DualKVBackend:
    """One per (wrapper, mode). `template` (the BlockMask's as_tuple) is set before each call."""

    def __init__(self, *, compiler: str, kernel_options: dict, vocab_size: int, mode: str,
                 activation_memory_budget: float = 1.0):
        if mode not in ("logits", "hidden"):
            raise ValueError(f"mode={mode!r} must be 'logits' or 'hidden'")
        self.compiler = compiler
        self.kernel_options = validate_kernel_options(kernel_options)
        self.vocab_size = vocab_size
        self.mode = mode
        self.activation_memory_budget = activation_memory_budget
        self.template = None
        self.last_graph: fx.GraphModule | None = None  # after the passes, for tests and the CLI
        self.observer = None  # observer(stage, graph_module) after each pass: the CLI's view

    def __call__(self, gm: fx.GraphModule, example_inputs):
        gm = _copy(gm)  # Dynamo's graph belongs to Dynamo; edit a copy
        observe = self.observer or (lambda stage, graph_module: None)
        observe("traced", gm)
        anchor = attention_rewrite.find_anchor(gm.graph)
        tokens, positions, tables = anchor.args
        attention_rewrite.rewrite_attention(gm, self.template, self.kernel_options)
        observe("attention_rewrite", gm)
        token_locality.prove_token_locality(gm.graph, tokens, positions, tables)
        observe("token_locality", gm)
        if self.mode == "hidden":
            lm_head.prune_lm_head(gm.graph, self.vocab_size)
            observe("lm_head", gm)
        gm.graph.lint()
        gm.recompile()
        self.last_graph = gm
        counters["graphs_compiled"] += 1
        if self.compiler == "eager":
            return gm.forward
        with torch._functorch.config.patch(activation_memory_budget=self.activation_memory_budget):
            if self.compiler == "inductor":
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs)
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
