"""The pieces of one decoder layer, read from a live model, for the rollout engine.

The engine does not call the model's forward (that would bring its KV cache, its GQA expand and
its mask handling); it runs the same modules in the same order: attention norm, q/k/v
projections, QK-norm and RoPE in the family's order, attention (the engine's), output
projection and residual, MLP norm, MLP and residual, final norm, LM head. Every weight is the
model's own parameter, read at call time, so training updates are seen without a copy. The
layer modules are listed once; `changed()` tells the engine that one was replaced, added or
removed since, and the engine then reads the model again.

Supported: torchtune `TransformerDecoder`s of `TransformerSelfAttentionLayer`s with
`MultiHeadAttention` (qwen2, llama3 builders) or our `Qwen3Attention`; transformers'
Qwen3, Qwen2, Llama, Mistral (without a sliding window) and Qwen3-MoE causal LMs
(`SUPPORTED_FAMILIES`). Anything else is refused by name in `decoder_for`.
"""

from __future__ import annotations

import inspect

import sys

import torch
from torch import Tensor, nn

from ..adapters import embedding_rows, hf_decoder, token_vocabulary, torchtune_head_weight
from ..hf_config import rope_types, sliding_window
from ..fsdp import foreign_hooks, hook_names
from ..module_checks import check_library_forward
from ..numerics import accumulation_dtype

__all__ = ["decoder_for", "SUPPORTED_FAMILIES"]

SUPPORTED_FAMILIES = ("torchtune TransformerDecoder (MultiHeadAttention or dualkv_compile's "
                      "Qwen3Attention)", "transformers Qwen3ForCausalLM", "Qwen2ForCausalLM",
                      "LlamaForCausalLM", "MistralForCausalLM (no sliding window)",
                      "Qwen3MoeForCausalLM")
_HF_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe")


def _levels(module: nn.Module) -> list[nn.Module]:
    """A layer and the modules it wraps: under torchtune/torch activation checkpointing, or
    torch.compile (an OptimizedModule, torchtitan's per-layer compile), in any order. The
    engine runs the innermost one's pieces."""
    from torch._dynamo.eval_frame import OptimizedModule

    levels = [module]
    while True:
        inner = levels[-1]._orig_mod if isinstance(levels[-1], OptimizedModule) else \
            levels[-1].__dict__.get("_modules", {}).get("_checkpoint_wrapped_module")
        if inner is None:
            return levels
        levels.append(inner)


def _unwrap(module: nn.Module) -> nn.Module:
    return _levels(module)[-1]


def _compiled(module: nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def _refuse(model: nn.Module, why: str) -> ValueError:
    return ValueError(f"the rollout engine cannot run {type(model).__name__}: {why}. "
                      f"Supported: {'; '.join(SUPPORTED_FAMILIES)}")


def _project(dec, h: Tensor, q_proj, k_proj, v_proj) -> tuple[Tensor, Tensor, Tensor]:
    """h [b, s, d] -> q [b, s, Hq, D], k and v [b, s, Hkv, D] (before norms and RoPE)."""
    b, s, _ = h.shape
    return (q_proj(h).view(b, s, dec.num_heads, dec.head_dim),
            k_proj(h).view(b, s, dec.num_kv_heads, dec.head_dim),
            v_proj(h).view(b, s, dec.num_kv_heads, dec.head_dim))


class _Modules:
    """The modules a decoder view was built from, to tell when the model's were replaced."""

    def _listed(self) -> tuple:
        raise NotImplementedError

    def changed(self) -> bool:
        now = self._listed()
        return len(now) != len(self._built_from) or any(
            a is not b for a, b in zip(now, self._built_from))

    def check_compiles(self) -> None:
        """Refuse, naming it, what the compiled decode step cannot trace (before compiling)."""

    def check_nothing_skipped(self) -> None:
        """The engine runs each layer's parts itself and never calls the model, its decoder, a
        layer or its attention module: a hook on one of those, or a forward one overrides (in a
        subclass, or set on the instance), would be skipped, and the rollout would sample
        another model than the one the update trains (activation steering): refuse, naming
        it. Run when the model is read and at every call."""
        for module, role in self._callers():
            _library_forward(module, self._LIBRARY, role, self.model)
        for i, layer in enumerate(self._raw_layers()):
            *_, inner = levels = _levels(layer)
            attention = getattr(inner, self._ATTENTION)
            for part, module in [(f"layer {i}", m) for m in levels] + [
                    (f"layer {i}'s attention", m) for m in _levels(attention)]:
                hooks = foreign_hooks(module)
                if hooks:
                    raise _refuse(self.model, f"{part} has hooks ({hook_names(hooks)}), which "
                                              f"the engine, running the layer's parts itself, "
                                              f"would skip")
                # (torch.compile's wrapper sets its own forward: skipping it skips compiling)
                if "forward" in vars(module) and not _compiled(module):
                    raise _refuse(self.model, f"{part} has its forward replaced on the "
                                              f"instance, which the engine, running the "
                                              f"layer's parts itself, would skip")
            _library_forward(inner, self._LIBRARY, f"layer {i}", self.model)  # a subclass's
            if self._ATTENTION_LIBRARY:  # (torchtune's attention classes are matched exactly)
                _library_forward(_unwrap(attention), self._ATTENTION_LIBRARY,
                                 f"layer {i}'s attention", self.model)


class _TorchtuneDecoder(_Modules):
    """torchtune TransformerDecoder. MultiHeadAttention applies RoPE, then q/k norms (if any);
    Qwen3Attention normalises first, then RoPE (models/qwen3.py)."""

    def __init__(self, model):
        from torchtune.modules import MultiHeadAttention, TransformerSelfAttentionLayer

        from ..models.qwen3 import Qwen3Attention

        self.model = model
        self.layers = [_unwrap(layer) for layer in model.layers]
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, TransformerSelfAttentionLayer):
                raise _refuse(model, f"layer {i} is a {type(layer).__name__}, not a "
                                     "TransformerSelfAttentionLayer")
            if not (isinstance(layer.sa_scale, nn.Identity) and isinstance(layer.mlp_scale,
                                                                           nn.Identity)):
                raise _refuse(model, f"layer {i} scales its residual branches (sa_scale/mlp_scale)")
            attn = _unwrap(layer.attn)
            if type(attn) not in (MultiHeadAttention, Qwen3Attention):
                raise _refuse(model, f"layer {i}'s attention is a {type(attn).__name__}, whose "
                                     "forward the engine does not know")
            if not attn.is_causal or attn.pos_embeddings is None:
                raise _refuse(model, f"layer {i}'s attention is not causal self-attention with RoPE")
        if not (hasattr(model.output, "tied_module") or isinstance(model.output, nn.Linear)):
            raise _refuse(model, f"its output is a {type(model.output).__name__}, not an "
                                 "nn.Linear or torchtune's TiedLinear")
        first = _unwrap(self.layers[0].attn)
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim = first.head_dim
        self.scale = self.head_dim ** -0.5  # torchtune's SDPA call passes no scale
        kinds = {type(_unwrap(layer.attn)) for layer in self.layers}
        if len(kinds) > 1:
            raise _refuse(model, f"its layers mix attention classes {sorted(k.__name__ for k in kinds)}")
        self.norm_first = kinds == {Qwen3Attention}
        self.max_seq_len = model.max_seq_len
        self._built_from = self._listed()

    def _listed(self) -> tuple:
        return (self.model.tok_embeddings, self.model.norm, self.model.output,
                *self.model.layers)

    _ATTENTION = "attn"
    _LIBRARY, _ATTENTION_LIBRARY = "torchtune", None

    def _callers(self):
        return ((self.model, "the torchtune decoder"),)

    def _raw_layers(self):
        return self.model.layers

    @property
    def vocab_size(self) -> int:
        """Read on each call: the model's embedding may be resized after the engine is built."""
        head = torchtune_head_weight(self.model)
        return token_vocabulary(embedding_rows(self.model.tok_embeddings), head.shape[0],
                                sampling=True)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.model.tok_embeddings(tokens)

    def rope(self, x: Tensor, positions: Tensor):
        return positions

    def qkv(self, layer: nn.Module, x: Tensor, positions) -> tuple[Tensor, Tensor, Tensor]:
        """The residual stream x [b, s, d] entering `layer` (one of self.layers) -> q [b, s, Hq,
        D], k and v [b, s, Hkv, D], normed and rotated."""
        attn = _unwrap(layer.attn)
        q, k, v = _project(self, layer.sa_norm(x), attn.q_proj, attn.k_proj, attn.v_proj)
        if self.norm_first:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = attn.pos_embeddings(q, input_pos=positions)
        k = attn.pos_embeddings(k, input_pos=positions)
        if not self.norm_first:
            q = attn.q_norm(q) if attn.q_norm is not None else q
            k = attn.k_norm(k) if attn.k_norm is not None else k
        return q, k, v

    def finish(self, layer: nn.Module, x: Tensor, attended: Tensor) -> Tensor:
        """The residual stream after `layer`, from its input x and the attention [b, s, Hq*D]."""
        h = x + _unwrap(layer.attn).output_proj(attended)
        return h + layer.mlp(layer.mlp_norm(h))

    def logits_dtype(self, weights: torch.dtype) -> torch.dtype:
        return torch.float32  # as TransformerDecoder's forward casts them

    def logits(self, h: Tensor) -> Tensor:
        return self.model.output(self.model.norm(h)).float()


class _HFDecoder(_Modules):
    """transformers Qwen3 / Qwen2 / Llama: q/k norms (Qwen3) before RoPE, cos/sin from the
    model's rotary embedding, the modeling module's own apply_rotary_pos_emb."""

    def __init__(self, model):
        cfg = model.config
        kind = getattr(cfg, "model_type", None)
        if kind not in _HF_TYPES:
            raise _refuse(model, f"model_type={kind!r} is not one of {list(_HF_TYPES)}")
        if getattr(model, "lm_head", None) is None:
            raise _refuse(model, "it has no LM head (load the *ForCausalLM class)")
        window = sliding_window(cfg)
        if window:
            raise _refuse(model, f"it uses sliding-window attention ({window})")
        # the cache holds keys rotated for the length at which they were written: longrope
        # switches factors past original_max_position_embeddings, within the context ("dynamic"
        # rescales only past max_position_embeddings, which prompts + responses never pass)
        if "longrope" in rope_types(cfg):
            raise _refuse(model, "its rope_type='longrope' changes every position's rotation "
                                 "once the sequence passes original_max_position_embeddings")
        self.model, self.base = model, hf_decoder(model)
        # transformers' dynamic_rope_update compares the positions with the cached length in
        # Python `if`s (two host reads per call, which a CUDA graph cannot hold); as the engine
        # stays within max_position_embeddings the rotation it would pick is fixed, so the
        # undecorated forward runs instead (_fixed_rope)
        self.fixed_rope = None
        if any("dynamic" in kind for kind in rope_types(cfg)):
            # the innermost function: some versions put torch.no_grad() over the decorator
            decorated = type(self.base.rotary_emb).forward
            self.fixed_rope = inspect.unwrap(decorated)
            if self.fixed_rope is decorated:
                raise _refuse(model, f"its rope_type is dynamic and its "
                                     f"{type(self.base.rotary_emb).__name__}.forward is not "
                                     "transformers' dynamic_rope_update over a plain forward")
        self.layers = [_unwrap(layer) for layer in self.base.layers]
        attn = _unwrap(self.layers[0].self_attn)  # its class's module has the RoPE function
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.qk_norm = hasattr(attn, "q_norm")
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.max_seq_len = cfg.max_position_embeddings
        self._built_from = self._listed()

    def _listed(self) -> tuple:
        base = hf_decoder(self.model)
        return (base, base.embed_tokens, base.norm, base.rotary_emb, self.model.lm_head,
                *base.layers)

    _ATTENTION = "self_attn"
    _LIBRARY = _ATTENTION_LIBRARY = "transformers"

    def check_nothing_skipped(self) -> None:
        super().check_nothing_skipped()
        rotary = self.base.rotary_emb
        if self.fixed_rope is None:  # called as a module: its hooks run
            return
        # _fixed_rope calls the undecorated function, skipping the module's hooks and forward
        hooks = foreign_hooks(rotary)
        if hooks or "forward" in vars(rotary):
            what = (f"hooks ({hook_names(hooks)})" if hooks
                    else "its forward replaced on the instance")
            raise _refuse(self.model, f"its dynamic RoPE's rotary_emb has {what}, which the "
                                      f"engine, running the undecorated rotary forward, would skip")

    def check_compiles(self) -> None:
        cfg = self.model.config
        dispatch = getattr(cfg, "_experts_implementation", None)
        if getattr(cfg, "num_experts", None) and dispatch in (None, "eager"):
            raise _refuse(self.model, f"_experts_implementation={dispatch!r} loops over the "
                                      "experts a batch hits, a data-dependent count the "
                                      "compiled decode step cannot trace; set "
                                      "model.config._experts_implementation = 'batched_mm' or "
                                      "'grouped_mm', call dualkv_compile.models."
                                      "use_grouped_experts(model), or pass compile=False")

    def _callers(self):
        return ((self.model, "the causal LM"), (hf_decoder(self.model), "the decoder"))

    def _raw_layers(self):
        return hf_decoder(self.model).layers

    @property
    def vocab_size(self) -> int:
        """Read on each call (resize_token_embeddings may change it)."""
        return token_vocabulary(embedding_rows(self.base.embed_tokens),
                                self.model.lm_head.weight.shape[0], sampling=True)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.base.embed_tokens(tokens)

    def rope(self, x: Tensor, positions: Tensor):
        if self.fixed_rope is not None:
            return self._fixed_rope(x, positions)
        return self.base.rotary_emb(x, positions)

    def _fixed_rope(self, x: Tensor, positions: Tensor):
        """cos/sin of a dynamic RoPE at positions within max_position_embeddings, with no host
        read: the unscaled frequencies (original_inv_freq; dynamic NTK scales only past the
        context). A forward past the context grew them; set them back as transformers' own next
        forward within the context does (dynamic_frequency_update's reset), checked in Python."""
        rotary = self.base.rotary_emb
        if rotary.max_seq_len_cached > rotary.original_max_seq_len:
            rotary.register_buffer("inv_freq", rotary.original_inv_freq.to(x.device),
                                   persistent=False)
            rotary.max_seq_len_cached = rotary.original_max_seq_len
        return self.fixed_rope(rotary, x, positions)

    def qkv(self, layer: nn.Module, x: Tensor, cos_sin) -> tuple[Tensor, Tensor, Tensor]:
        attn = layer.self_attn
        q, k, v = _project(self, layer.input_layernorm(x), attn.q_proj, attn.k_proj,
                           attn.v_proj)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = cos_sin
        # apply_rotary_pos_emb takes [b, H, s, D] with cos/sin [b, s, D] (unsqueezed at dim 1)
        q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v

    def finish(self, layer: nn.Module, x: Tensor, attended: Tensor) -> Tensor:
        h = x + layer.self_attn.o_proj(attended)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits_dtype(self, weights: torch.dtype) -> torch.dtype:
        # transformers returns the model's dtype: float64 stays float64 (the exact CPU checks)
        return accumulation_dtype(weights)

    def logits(self, h: Tensor) -> Tensor:
        return self.model.lm_head(self.base.norm(h)).to(accumulation_dtype(h.dtype))


def _library_forward(module: nn.Module, library: str, role: str, model=None) -> None:
    """The engine runs the model by layer: a forward override would not run (adapters')."""
    try:
        check_library_forward(module, library, role)
    except ValueError as e:
        raise _refuse(module if model is None else model, str(e)) from None


def decoder_for(model: nn.Module):
    """The engine's view of `model`, or a ValueError naming the model and what is missing."""
    try:
        from torchtune.modules import TransformerDecoder
    except ImportError:  # torchtune is a dependency; transformers models work without it
        TransformerDecoder = ()
    if TransformerDecoder and isinstance(model, TransformerDecoder):
        _library_forward(model, "torchtune", "the torchtune decoder")
        decoder = _TorchtuneDecoder(model)
        decoder.check_nothing_skipped()
        return decoder
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = ()
    if PreTrainedModel and isinstance(model, PreTrainedModel):
        _library_forward(model, "transformers", "the causal LM")
        _library_forward(hf_decoder(model), "transformers", "the decoder")
        decoder = _HFDecoder(model)
        decoder.check_nothing_skipped()
        return decoder
    raise _refuse(model, f"{type(model).__module__}.{type(model).__name__} is neither a torchtune "
                         "TransformerDecoder nor a transformers causal LM")
