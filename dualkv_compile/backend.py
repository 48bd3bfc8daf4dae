"""The torch.compile backend of optimize(): runs the passes on Dynamo's graph, then compiles.

Passes, in order, on a copy of the graph: checkpoint inlining (activation-checkpointed layers
become plain nodes tagged for recompute), attention rewrite (SDPA -> shared-prefix flex, the
model's mask code removed), token-locality proof, for response_logprobs the LM-head cut, and
position tables (RoPE's cos/sin) stored once instead of recomputed in every consumer kernel.
Then Inductor (CUDA), aot_eager (CPU: Inductor's CPU flex has no backward) or eager; both run
the attention-saving pass on the joint graph before the partitioner decides what to recompute.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from dualkv_compile.passes import (attention_rewrite, attention_saving, checkpoint_inline,
                                   lm_head, position_tables, token_locality)

from .attention.kernel_options import validate_kernel_options
from .stats import counters, log_once

__all__ = ["DualKVBackend"]

log = logging.getLogger(__name__)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


class DualKVBackend:
    """One per mode of a wrapper (or of wrappers sharing compiles: optimize's
    share_compiles_with). Modes: "logits" and "hidden" trace the whole model (the
    latter with the LM head cut away), "layer" one decoder layer on packed hidden states
    (compile_region="layer"). `template` (the BlockMask's as_tuple) is set before each call."""

    def __init__(self, *, compiler: str, kernel_options: dict, vocab_size: int, mode: str,
                 activation_memory_budget: float = 1.0, attention_backend: str = "auto"):
        if mode not in ("logits", "hidden", "layer"):
            raise ValueError(f"mode={mode!r} must be 'logits', 'hidden' or 'layer'")
        self.compiler = compiler
        self.kernel_options = validate_kernel_options(kernel_options)
        self.attention_backend = attention_backend
        self.vocab_size = vocab_size
        self.mode = mode
        self.activation_memory_budget = activation_memory_budget
        self.template = None
        self.last_graph: fx.GraphModule | None = None  # after the passes, for tests and the CLI
        self.last_partition = None  # (forward, backward) graphs, aot_eager only
        self.observer = None  # observer(stage, graph_module) after each pass: the CLI's view

    def __call__(self, gm: fx.GraphModule, example_inputs):
        gm = _copy(gm)  # Dynamo's graph belongs to Dynamo; edit a copy
        observe = self.observer or (lambda stage, graph_module: None)
        observe("traced", gm)
        if checkpoint_inline.inline_checkpoints(gm):
            observe("checkpoint_inline", gm)
            if self.compiler == "eager":
                log_once(log, logging.WARNING,
                         "the model's activation checkpointing has no effect with "
                         "backend='eager' (no partitioner recomputes anything); use "
                         "'aot_eager' or 'inductor'")
        anchor = attention_rewrite.find_anchor(gm.graph)
        tokens, positions, tables = anchor.args
        attention_rewrite.rewrite_attention(gm, self.template, self.kernel_options,
                                            self.attention_backend)
        observe("attention_rewrite", gm)
        token_locality.prove_token_locality(gm.graph, tokens, positions, tables)
        observe("token_locality", gm)
        if self.mode == "hidden":
            lm_head.prune_lm_head(gm.graph, self.vocab_size)
            observe("lm_head", gm)
        if position_tables.materialize_position_tables(gm.graph, tokens):
            observe("position_tables", gm)
        gm.graph.lint()
        gm.recompile()
        self.last_graph = gm
        counters["graphs_compiled"] += 1
        if self.compiler == "eager":
            return gm.forward
        with torch._functorch.config.patch(activation_memory_budget=self.activation_memory_budget):
            if self.compiler == "inductor":
                from torch._inductor import config as inductor_config
                from torch._inductor.compile_fx import compile_fx

                user_pass = inductor_config.joint_custom_post_pass
                ours = attention_saving.SaveAttentionPass(after=user_pass)
                with inductor_config.patch(joint_custom_post_pass=ours):
                    return compile_fx(gm, example_inputs)
            return _aot_eager(gm, example_inputs, self)


def _aot_eager(gm: fx.GraphModule, example_inputs, backend: DualKVBackend):
    """aot_eager with the attention-saving pass before min-cut partitioning; the partitioned
    forward and backward graphs are kept on `backend.last_partition` for tests."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        attention_saving.save_attention(joint.graph)
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        backend.last_partition = (fw, bw)
        return fw, bw

    from torch._dynamo.backends.debugging import boxed_nop

    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
                        keep_inference_input_mutations=True)(gm, example_inputs)
