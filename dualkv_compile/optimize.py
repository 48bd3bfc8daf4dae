"""optimize(model): a wrapper that runs a decoder on the packed shared-prefix layout.

The wrapper shares every parameter with the model (the model is untouched and stays usable;
state_dict keys are the model's) and patches nothing global. Each call packs the replicated
batch, traces `body -> head` on the packed tokens with Dynamo, and the DualKV backend rewrites
the graph (see backend.py). Compiled graphs are cached per length bucket and mode.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor, nn

from .adapters import adapter_for
from .arguments import temperature_arg
from .backend import DualKVBackend
from .attention.registry import attention_kernel
from .config import DualKVConfig
from .forward_args import row_positions, split_forward_args
from .lm_head.gather_rows import gather_rows
from .layout.inputs import layout_anchor, layout_tables
from .lm_head.logprobs import chunked_logprobs, chunked_token_loss
from .lm_head.targets import predictions, row_sources, scatter_responses
from .layout.batch_checks import padding_mask_on, checked_prompt_len, checked_tokens
from .layout.packing import PackedBatch, pack
from .numerics import accumulation_dtype
from .recompiles import bounded_recompiles
from .stats import counters
from .wrapper_checks import check_device, check_shareable

__all__ = ["optimize", "DualKVModel"]

log = logging.getLogger(__name__)

# Every length bucket, mode and grad-mode flip is a compile of the wrapper's traced function;
# past Dynamo's default limit (8) it would silently run the model eagerly on the packed batch
# with eager flex ([T, T] scores). Raised deliberately, and made fatal. Dynamo counts this limit
# per guarded object; its accumulated_recompile_limit (256 by default), per compiled function
# over all objects, binds as well, and the refusal names the one hit (recompiles.py).
RECOMPILE_LIMIT = 256


def optimize(model: nn.Module, config: DualKVConfig | None = None, *,
             share_compiles_with: "DualKVModel | None" = None) -> "DualKVModel":
    """Wrap `model` (torchtune TransformerDecoder or a transformers causal LM using SDPA) so that
    each shared prompt is computed once. See docs/api.md.

    share_compiles_with: the wrapper of another model of the same architecture and config (GRPO's
    reference model beside the policy); its compiled graphs serve this one too, since the
    weights are graph inputs: one compile per length bucket for both, not one each."""
    return DualKVModel(model, config or DualKVConfig(), share_compiles_with=share_compiles_with)


def _traced(wrapper: "DualKVModel", tokens: Tensor, positions: Tensor,
            tables: list[Tensor]):
    """What a "logits" or "hidden" graph traces (the wrapper is an input: wrappers that share
    compiles trace once)."""
    layout_anchor(tokens, positions, tables)
    hidden = wrapper._adapter.body(wrapper.model, tokens, positions)
    return wrapper._adapter.head(wrapper.model, hidden)


def _traced_layer(wrapper: "DualKVModel", layer: nn.Module, hidden: Tensor, positions: Tensor,
                  tables: list[Tensor]):
    """What a "layer" graph traces: one decoder layer on packed hidden states."""
    layout_anchor(hidden, positions, tables)
    return wrapper._adapter.layer_forward(wrapper.model, layer, hidden, positions)


def _unwrap_refusal(exc: BaseException):
    """The Refusal behind `exc`, or one for a model Dynamo cannot trace as one graph (a
    data-dependent branch, say: the packed run needs fullgraph), or None."""
    from torch._dynamo.exc import Unsupported

    from dualkv_compile.passes._common import Refusal

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, Refusal):
            return exc
        if isinstance(exc, Unsupported):
            why = "\n".join(str(exc).strip().splitlines()[:4])
            return Refusal(f"torch.compile cannot trace the model as one graph, which the "
                           f"packed run needs: {why}")
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


class DualKVModel(nn.Module):
    def __init__(self, model: nn.Module, config: DualKVConfig, *,
                 share_compiles_with: "DualKVModel | None" = None):
        super().__init__()
        if not isinstance(config, DualKVConfig):
            raise TypeError(f"config must be a DualKVConfig, got {type(config).__name__}")
        self.model = model
        self.config = config
        self._adapter = adapter_for(model)
        self._adapter.check(model)
        check_device(model, config)
        # compiled calls and their backends per mode: the same dicts as another wrapper's when
        # sharing its compiles
        self._compiled: dict[str, object] = {}
        self._backends: dict[str, DualKVBackend] = {}
        if share_compiles_with is not None:
            check_shareable(self, share_compiles_with)
            self._compiled, self._backends = share_compiles_with._compiled, \
                share_compiles_with._backends
        self.dense_reason: str | None = None  # set when fallback="dense" took over
        self._observer = None  # handed to the backends: see DualKVBackend.observer

    # ---- the model's identity -------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def uses_dualkv(self) -> bool:
        return self.config.enabled and self.dense_reason is None

    # ---- compiled packed calls ------------------------------------------------------------
    def _compiler(self, device: torch.device) -> str:
        if self.config.backend != "auto":
            return self.config.backend
        return "inductor" if device.type == "cuda" else "aot_eager"

    def compile_region(self) -> str:
        """"model" or "layer": config.compile_region, with "auto" resolved (see DualKVConfig)."""
        from .fsdp import is_sharded

        sharded = is_sharded(self.model)
        region = self.config.compile_region
        if region == "auto":
            region = "layer" if sharded else "model"
        if region == "model" and sharded:
            raise ValueError("compile_region='model' cannot drive an FSDP2-sharded model (its "
                             "hooks cannot run inside one compiled graph); use 'layer' or "
                             "'auto'")
        if region == "layer":  # at every call: a hook added since the first is named too
            from .fsdp import check_fsdp_layout

            check_fsdp_layout(self.model, self._adapter.layers(self.model))
            self._adapter.check_layer_region(self.model)
        return region

    def _compiled_call(self, mode: str, fn, device: torch.device):
        if mode not in self._compiled:
            self._backends[mode] = DualKVBackend(
                compiler=self._compiler(device), kernel_options=self.config.kernel_options,
                attention_backend=self.config.attention_backend,
                vocab_size=self._adapter.lm_head_weight(self.model).shape[0], mode=mode,
                activation_memory_budget=self.config.activation_memory_budget)
            self._compiled[mode] = torch.compile(fn, backend=self._backends[mode],
                                                 fullgraph=True, dynamic=False)
        self._backends[mode].observer = self._observer
        return self._compiled[mode]

    def _run_packed(self, packed: PackedBatch, mode: str) -> Tensor:
        """logits [1, T, V] (mode "logits") or final hidden states [1, T, d] ("hidden")."""
        device = packed.tokens.device
        tables, template = layout_tables(
            packed, device,
            block_mask=attention_kernel(self.config.attention_backend).flex)
        if self.compile_region() == "layer":
            return self._run_layers(packed, mode, tables, template)
        compiled = self._compiled_call(mode, _traced, device)
        self._backends[mode].template = template
        with bounded_recompiles(RECOMPILE_LIMIT, f"the dualkv model ({mode} mode)"):
            return compiled(self, packed.tokens, packed.positions, tables)

    def _run_layers(self, packed: PackedBatch, mode: str, tables, template) -> Tensor:
        """The layer region: one compiled graph per layer call (Dynamo reuses it for every
        layer of the same structure), each between that layer's FSDP hooks."""
        from .fsdp import run_as_forward

        compiled = self._compiled_call("layer", _traced_layer, packed.tokens.device)
        self._backends["layer"].template = template
        model, adapter = self.model, self._adapter
        hidden = adapter.embed(model, packed.tokens)
        with bounded_recompiles(RECOMPILE_LIMIT, "the dualkv layer region"):
            for layer in adapter.layers(model):
                hidden = run_as_forward(layer, functools.partial(compiled, self, layer), hidden,
                                        packed.positions, tables)
        hidden = adapter.final_norm(model, hidden)
        return adapter.head(model, hidden) if mode == "logits" else hidden

    def _packed_or_dense(self, packed_fn, dense_fn):
        """packed_fn() (or dense_fn() when disabled or refused), as the model's forward: an
        FSDP-sharded model's root hooks run around it (fsdp.py)."""
        from .fsdp import run_as_forward

        return run_as_forward(self.model, self._choose, packed_fn, dense_fn)

    def _choose(self, packed_fn, dense_fn):
        if not self.uses_dualkv:
            return dense_fn()
        # the construction's checks again: a setting changed since (the experts' dispatch, the
        # router loss, KV caches) is named as it would have been, not met inside the trace
        self._adapter.check(self.model)
        try:
            return packed_fn()
        except Exception as exc:  # noqa: BLE001 - only refusals are handled, others re-raised
            refusal = _unwrap_refusal(exc)
            if refusal is None:
                raise
            if self.config.fallback == "error":
                raise refusal from None
            self.dense_reason = str(refusal)
            counters["dense_fallback"] += 1
            log.warning("dualkv: running the unoptimised model from now on: %s", refusal)
            return dense_fn()

    # ---- inputs ---------------------------------------------------------------------------
    def token_rows(self, tokens: Tensor, *, prompt_len: int,
                   padding_mask: Tensor | None = None) -> Tensor:
        """[T]: the replicated rows each position of the packed sequence the model sees for this
        batch stands for (PackedBatch.token_rows). Per-token statistics a forward hook collects
        inside the model while `uses_dualkv` (e.g. a MoE router's expert choices, [T, k]),
        weighted by it, equal the replicated batch's: the expert load of the rows, with each
        prompt token counted once per row that shares it."""
        self._check_tokens(tokens)
        return self._pack(tokens, prompt_len, padding_mask).token_rows()

    def _check_tokens(self, tokens) -> None:
        """Every entry point's check: int64/int32 ids [B, L] of the model's vocabulary, on the
        model's device (elsewhere they would fail deep inside Dynamo, or not at all)."""
        checked_tokens(tokens)
        param = next(self.model.parameters(), None)
        if param is not None and tokens.device != param.device:
            raise ValueError(f"tokens are on {tokens.device} but the model is on {param.device}")
        vocab = self._adapter.vocab_size(self.model)
        if tokens.numel():
            lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one host read
            if lo < 0 or hi >= vocab:
                raise ValueError(f"tokens hold id {lo if lo < 0 else hi}, outside the model's "
                                 f"vocabulary [0, {vocab})")

    def _pack(self, tokens: Tensor, prompt_len: int, padding_mask: Tensor | None) -> PackedBatch:
        return pack(tokens, prompt_len=prompt_len, padding_mask=padding_mask,
                    pad_to=self.config.pad_to, bucket_growth=self.config.bucket_growth)

    # ---- public API -----------------------------------------------------------------------
    def forward(self, *args, prompt_len: int, **kwargs):
        """Drop-in for the model's forward on a replicated batch, plus `prompt_len`: torchtune's
        (tokens, mask, input_pos) or padding_mask=, transformers' (input_ids, attention_mask,
        position_ids). Returns
        logits [B, L, V] (torchtune) or the transformers output with `.logits` [B, L, V];
        padding positions hold 0."""
        tokens, padding_mask = split_forward_args(self._adapter, args, kwargs, self._check_tokens)
        mask = padding_mask if padding_mask is not None else torch.ones_like(tokens, dtype=torch.bool)

        def dense():
            self._pack(tokens, prompt_len, padding_mask)  # validates like the packed path
            hidden = self._adapter.body(self.model, tokens, row_positions(mask),
                                        self._adapter.replicated_mask(mask))
            return self._adapter.head(self.model, hidden) * mask[..., None]

        def packed():
            pb = self._pack(tokens, prompt_len, padding_mask)
            return pb.unpack(self._run_packed(pb, "logits"))

        logits = self._packed_or_dense(packed, dense)
        if self._adapter.name == "transformers":
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return CausalLMOutputWithPast(logits=logits)
        return logits

    def response_logprobs(self, tokens: Tensor, *, prompt_len: int,
                          padding_mask: Tensor | None = None, temperature: float = 1.0) -> Tensor:
        """Logprob of every response token, [B, L - prompt_len]; 0 at padding. float32, or
        float64 for a float64 model. The LM head runs only at the positions that predict
        response tokens, in chunks of config.logprob_chunk_size. Without response columns
        (prompt_len == L) the model does not run: [B, 0] without gradient."""
        temperature = temperature_arg(temperature)  # before the model runs

        def head(states, weight, targets, dst):
            lp = chunked_logprobs(states, weight, targets, temperature=temperature,
                                  chunk_size=self.config.logprob_chunk_size)
            return scatter_responses(lp, dst, tokens, prompt_len)

        return self._response_head(tokens, prompt_len, padding_mask, head,
                                   lambda empty: empty)

    def response_loss(self, tokens: Tensor, *, prompt_len: int, token_loss,
                      padding_mask: Tensor | None = None,
                      temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """A per-token loss over the response tokens, with the LM head's backward done in its
        forward (`logprobs.chunked_token_loss`: three GEMMs per chunk instead of four).

        `token_loss(logprobs [M], index [M]) -> [M]` gets the logprobs of a chunk of valid
        response tokens and their flat positions in [B, L - prompt_len] (row * (L - prompt_len)
        + column), to gather per-token constants with (old logprobs, advantages, weights), and
        returns each token's loss; a token's loss may depend on its own logprob only. Returns
        (the sum of those losses, the logprobs [B, L - prompt_len] without gradient and 0 at
        padding, as response_logprobs returns them). Without response columns the loss is a
        0 with no gradient. A token_loss with `response_shape` (GRPOLoss.token_loss's) must
        have been built for [B, L - prompt_len] of these tokens."""
        temperature = temperature_arg(temperature)  # before the model runs
        if not callable(token_loss):
            raise TypeError(f"token_loss must be a function (logprobs [M], index [M]) -> [M], "
                            f"got {type(token_loss).__name__}")

        def head(states, weight, targets, dst):
            loss, lp = chunked_token_loss(states, weight, targets, token_loss, index=dst,
                                          temperature=temperature,
                                          chunk_size=self.config.logprob_chunk_size)
            return loss, scatter_responses(lp, dst, tokens, prompt_len)

        return self._response_head(tokens, prompt_len, padding_mask, head,
                                   lambda empty: (empty.new_zeros(()), empty),
                                   getattr(token_loss, "response_shape", None),
                                   getattr(token_loss, "response_mask", None))

    def _response_head(self, tokens, prompt_len, padding_mask, head, on_empty, shape=None,
                       loss_mask=None):
        """head(states [M, d] predicting the M valid response tokens, the LM-head weight, their
        targets [M], their flat positions [M] in [B, L - prompt_len]), run inside the model's
        forward (where FSDP2 has all-gathered the weight). `shape` and `loss_mask`: what the
        token loss was built for, checked against [B, L - prompt_len] and the padding mask."""
        self._check_tokens(tokens)
        prompt_len = checked_prompt_len(prompt_len, tokens.shape[1])
        want = (tokens.shape[0], tokens.shape[1] - prompt_len)
        if shape is not None and tuple(shape) != want:
            raise ValueError(f"token_loss was built for responses of shape {tuple(shape)}, but "
                             f"these tokens have {want} ([B, L - prompt_len])")
        padding_mask = None if padding_mask is None else padding_mask_on(padding_mask, tokens)
        mask = padding_mask if padding_mask is not None else torch.ones_like(tokens, dtype=torch.bool)
        if loss_mask is not None:
            _check_loss_mask(loss_mask, mask[:, prompt_len:])
        if prompt_len == tokens.shape[1]:  # no response columns
            self._pack(tokens, prompt_len, padding_mask)  # still validates the input
            weight = self._adapter.lm_head_weight(self.model)
            wide = accumulation_dtype(weight.dtype)
            return on_empty(torch.zeros(tokens.shape[0], 0, dtype=wide, device=tokens.device))

        def dense():
            pb = self._pack(tokens, prompt_len, padding_mask)  # validates like the packed path
            self._adapter.check_head_hooks(self.model)
            hidden = self._adapter.body(self.model, tokens, row_positions(mask),
                                        self._adapter.replicated_mask(mask))
            _, targets, dst, _ = predictions(tokens, mask, prompt_len, pb)
            rows = row_sources(mask, prompt_len, hidden.device)
            return head(hidden.flatten(0, 1).index_select(0, rows),
                        self._adapter.lm_head_weight(self.model), targets, dst)

        def packed():
            pb = self._pack(tokens, prompt_len, padding_mask)
            # before the model is launched: the boolean indexing here waits for the GPU, which
            # is idle now, but after the launch would wait for the whole forward and then
            # leave the GPU idle until the LM head is launched
            src, targets, dst, shared = predictions(tokens, mask, prompt_len, pb)
            hidden = self._run_packed(pb, "hidden")[0]  # [T, d]
            return head(gather_rows(hidden, src, shared),
                        self._adapter.lm_head_weight(self.model), targets, dst)

        return self._packed_or_dense(packed, dense)


def _check_loss_mask(loss_mask: Tensor, response_mask: Tensor) -> None:
    """A token the loss's mask counts must be one the padding mask keeps: the LM head
    evaluates only those, while the loss's normaliser would count the others too."""
    outside = loss_mask.to(response_mask.device) & ~response_mask
    if outside.any():
        first = outside.nonzero()[0].tolist()
        raise ValueError(f"token_loss's mask counts {int(outside.sum())} token(s) that "
                         f"padding_mask marks as padding (the first at [row, response column] "
                         f"{first}): they would count in the loss's normaliser without a "
                         f"logprob; build the loss with mask = padding_mask[:, prompt_len:] "
                         f"or a subset of it")
