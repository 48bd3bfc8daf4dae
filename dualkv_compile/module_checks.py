"""What the wrapper refuses in a model's modules because it runs their parts itself and never
calls the model: a forward (or a method it calls) overridden, forward hooks it would skip, and,
outside the traced layers of compile_region="layer", modules whose locality is not proven."""

from __future__ import annotations

from torch import nn

from .fsdp import _fsdp_module_type, foreign_hooks, hook_names

__all__ = ["REQUIRE_GRADS_HOOK", "check_head_hooks", "check_library_forward",
           "check_outside_modules", "own_class"]

# the name of the hook transformers' enable_input_require_grads() registers (a local function;
# its handles cannot be read inside a traced function)
REQUIRE_GRADS_HOOK = "make_inputs_require_grads"


def own_class(module) -> type:
    """The module's class; for a module fully_shard wrapped, the class it wrapped (FSDP2 makes
    FSDP<Name>(FSDPModule, Name))."""
    cls, fsdp = type(module), _fsdp_module_type()
    if isinstance(module, fsdp):
        cls = next((b for b in cls.__bases__ if b is not fsdp), cls)
    return cls


# the methods of a library's forward that dualkv replaces by running the model's parts itself:
# torchtune's forward calls unembed (final norm and LM head), which calls chunked_output
_LIBRARY_METHODS = {"torchtune": ("forward", "unembed", "chunked_output")}


def check_library_forward(module, library: str, role: str) -> None:
    """dualkv runs `module`'s parts itself (its layers, norm and head), as `library`'s forward
    does, and never calls the module: a subclass whose forward (or a method that forward calls)
    does more, a forward set on the instance, or a forward hook on the module, would be
    silently skipped: refuse."""
    cls = own_class(module)
    for method in _LIBRARY_METHODS.get(library, ("forward",)):
        owner = next((c for c in cls.__mro__ if method in c.__dict__), None)
        if owner is not None and not owner.__module__.startswith(library + "."):
            raise ValueError(f"{role} {cls.__name__} overrides {method} "
                             f"({owner.__module__}.{owner.__qualname__}.{method}); dualkv runs "
                             f"its embedding, layers, norm and LM head itself, as {library}'s "
                             f"forward does, so that override would not run. Move the change "
                             f"into a module the forward calls (a layer, the norm), or do not "
                             f"subclass")
    if "forward" in vars(module):  # model.forward = wrapper (accelerate's autocast)
        raise ValueError(f"{role} {cls.__name__} has its forward replaced on the instance "
                         f"({_name_of(vars(module)['forward'])}); dualkv runs its embedding, layers, "
                         f"norm and LM head itself, as {library}'s forward does, so that "
                         f"forward would not run. Remove it (del model.forward), or move the "
                         f"change into a module the forward calls")
    hooks = foreign_hooks(module)  # FSDP2's own are run by the wrapper (fsdp.run_as_forward)
    if hooks:
        raise ValueError(f"{role} {cls.__name__} has hooks "
                         f"({hook_names(hooks)}); dualkv runs its embedding, layers, norm and "
                         f"LM head itself and never calls the module, so they would not run. "
                         f"Remove them, or hook a module inside the model")


# final norms the layer region may run outside the traced layers: token-local by construction
_NORMS = {"torch.nn.modules.normalization.RMSNorm", "torch.nn.modules.normalization.LayerNorm",
          "torchtune.modules.rms_norm.RMSNorm",
          "dualkv_compile.testing._RMSNormSameDtype",  # testing.same_dtype_numerics' swap
          *(f"transformers.models.{family}.modeling_{family}.{prefix}RMSNorm"
            for family, prefix in (("llama", "Llama"), ("mistral", "Mistral"),
                                   ("qwen2", "Qwen2"), ("qwen3", "Qwen3"),
                                   ("qwen3_moe", "Qwen3Moe")))}


def check_outside_modules(embedding, norm, head) -> None:
    """compile_region="layer" runs the embedding and the final norm eagerly on the packed
    tokens, outside the token-locality proof: allow only modules that are token-local as
    written (an nn.Embedding, a known norm class), not subclasses or custom modules, and no
    forward hooks on them. The LM head's hooks would run eagerly for logits and not at all for
    response_logprobs (which applies the head's weight): refused too. The one hook allowed is
    transformers' require-grads hook on the embedding, which both regions drop
    (_embed_without_require_grads_hook)."""
    from dualkv_compile.passes._common import Refusal

    for role, module, allowed in (("embedding", embedding, {"torch.nn.modules.sparse.Embedding"}),
                                  ("final norm", norm, _NORMS)):
        cls = own_class(module)
        kind = f"{cls.__module__}.{cls.__qualname__}"
        if kind not in allowed:
            raise Refusal(f"compile_region='layer' runs the model's {role} outside the traced "
                          f"layers, where its locality is not proven, and allows only "
                          f"{sorted(allowed)} there; this model's is {kind}. Use "
                          f"compile_region='model' (one graph, every op proven)")
    if getattr(embedding, "scale_grad_by_freq", False) or getattr(
            embedding, "max_norm", None) is not None:  # as the proof refuses them in a graph
        raise Refusal(f"the model's embedding has scale_grad_by_freq="
                      f"{embedding.scale_grad_by_freq} and max_norm={embedding.max_norm}: the "
                      f"first scales each row's gradient by its id's count in the batch, the "
                      f"second renormalises the looked-up rows in place, and packing changes "
                      f"both the counts and the set")
    unproven = "where their locality is not proven"
    for role, module, where in (
            ("embedding", embedding, unproven), ("final norm", norm, unproven),
            ("LM head", head, f"{unproven} for logits, and not at all for response_logprobs "
                              f"(which applies the head's weight)")):
        hooks = foreign_hooks(module) if isinstance(module, nn.Module) else []  # TiedLinear
        hooks = [h for h in hooks if not (module is embedding and getattr(
            h, "__name__", None) == REQUIRE_GRADS_HOOK)]
        if hooks:
            raise Refusal(f"compile_region='layer' runs the model's {role} "
                          f"({type(module).__name__}) eagerly outside the traced layers, so its "
                          f"hooks ({hook_names(hooks)}) would run {where}. "
                          f"Remove them, or use compile_region='model' (one graph: the hooks "
                          f"are traced and proven)")


def check_head_hooks(head) -> None:
    """The dense path of response_logprobs and response_loss (enabled=False, fallback="dense")
    applies the LM head's weight to the hidden states itself, so hooks on the head would not
    run there (the packed paths trace them or refuse them): refuse."""
    hooks = foreign_hooks(head) if isinstance(head, nn.Module) else []  # TiedLinear: none
    if hooks:
        raise ValueError(f"the LM head ({type(head).__name__}) has hooks "
                         f"({hook_names(hooks)}); the dense path of response_logprobs and "
                         f"response_loss (enabled=False, or fallback='dense') applies its "
                         f"weight itself, so they would not run. Remove them, or hook a module "
                         f"inside the model")


def _name_of(fn) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
