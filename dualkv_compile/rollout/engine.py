"""RolloutEngine: sample N responses per prompt with the prompt's K/V stored and read once.

    engine = RolloutEngine(model)                 # torchtune decoder or transformers causal LM
    responses = engine.generate(prompts, group_size=16, max_generated_tokens=1024, pad_id=0,
                                temperature=1.0, top_p=0.95, stop_tokens=eos, rng=generator)

prompts [G, P] (left- or right-padded with pad_id) -> responses [G * group_size, T], rows
group-major. A prompt is its tokens from the first to the last that is not pad_id: a pad_id
between them (an eos inside a chat prompt, when pad_id is eos) is a token; `prompt_mask` says
exactly which tokens are the prompt where this rule cannot. Per
call: the prompts are prefilled once (padding stripped), the first tokens sampled from their
last logits, then T - 1 decode steps run in chunks of `steps_per_graph`; on CUDA each chunk is
one CUDA graph of the compiled step, and the stop tokens are checked once per chunk (the only
host sync). A row's tokens after its stop token are pad_id.

Compiles: one per (rows, groups, prompt capacity bucket, T, dtype, sampling settings); graphs
are captured per chunk length and generator, and again when the weights move to new storage.
The engine holds a workspace (cache, compiled step, graphs) for each of its last
`max_workspaces` call shapes. A call of a held shape whose prompts fit the held prompt capacity
with at most 2x padding reuses it, so the calls of a ragged batch, whose prompt buckets vary,
do not rebuild it each time; a longer prompt grows the capacity, and only prompts needing less
than half of it shrink it (a rebuild, and on CUDA a new capture).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ..arguments import flag_arg, integer_arg
from ..recompiles import bounded_recompiles
from ..stats import counters, log_once
from . import kernels
from .attention import IMPLEMENTATIONS, split_lengths
from .cache import RolloutCache, prompt_bucket
from .forward import decoder_for
from .graphs import StepGraph, warm_up, weights_fingerprint
from .prompts import checked_prompts
from .sampling import SamplingParams, draw_noise, sample, stop_ids, stop_mask
from .step import make_decode_step, prefill
from .weights import gathered_weights

__all__ = ["RolloutEngine"]

log = logging.getLogger(__name__)

# distinct compiled keys per process: call shapes x prompt buckets (8 per doubling of length)
_KEY_LIMIT = 256
# KV-cache dtypes: the attention and its log-sum-exp merge compute in floating point
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Key(NamedTuple):
    """What a workspace's buffers and compiled step are made for."""
    rows: int
    groups: int  # prompt K/V stored: groups, or rows when the prompt is replicated
    capacity: int  # prompt keys a group holds (a prompt_bucket)
    t: int
    dtype: torch.dtype
    sampling: SamplingParams
    pad_id: int
    stops: tuple
    implementation: str
    device: torch.device
    vocab: int
    logits_dtype: torch.dtype  # of the logprobs: the model's logits' (decoder.logits_dtype)


@dataclass(eq=False)
class _Workspace:
    key: _Key
    cache: RolloutCache
    step_fn: object
    graphs: dict = field(default_factory=dict)  # steps -> StepGraph
    fingerprint: tuple = ()
    pool: object = None
    use_graphs: bool = False


class RolloutEngine:
    """Shared-prompt decoding for one model (see the module docstring).

    attention: "auto" (on CUDA the Triton kernels, the fastest: docs/performance.md, else flex
        with a logged reason; math elsewhere), "triton", "flex" or "math".
    compile: torch.compile the decode step (default: on CUDA).
    cuda_graphs: replay `steps_per_graph` compiled steps as one CUDA graph (default: on CUDA
        when compiling).
    steps_per_graph: decode steps per graph (or per eager chunk), and so per check of the stops.
    share_prompt: False replicates the prompt K/V per row (the conventional decoder, for
        baselines); the tokens are the same.
    max_workspaces: call shapes whose workspaces (KV cache, compiled step, CUDA graphs) are
        held at once, the least recently used dropped first: 2 serves a rollout whose calls
        alternate between two shapes (plan_calls' unequal last call, dynamic sampling's refill
        rounds) without a new cache and capture at each change, for a second cache's memory.
    """

    def __init__(self, model: torch.nn.Module, *, attention: str = "auto",
                 compile: bool | None = None, cuda_graphs: bool | None = None,
                 steps_per_graph: int = 16, share_prompt: bool = True, max_workspaces: int = 2):
        if attention not in ("auto", *IMPLEMENTATIONS):
            raise ValueError(f"attention={attention!r} is not one of {('auto', *IMPLEMENTATIONS)}")
        steps_per_graph = integer_arg("steps_per_graph", steps_per_graph, 1)
        self.max_workspaces = integer_arg("max_workspaces", max_workspaces, 1)
        self.model = model
        self.decoder = decoder_for(model)
        self.attention = attention
        self.compile = flag_arg("compile", compile, nullable=True)
        self.cuda_graphs = flag_arg("cuda_graphs", cuda_graphs, nullable=True)
        self.steps_per_graph = steps_per_graph
        self.share_prompt = flag_arg("share_prompt", share_prompt)
        # calls, decode_steps, workspaces (caches allocated), compiled_functions, captures,
        # graph_fallbacks, model_reads (the model's modules replaced since the last call)
        self.stats = Counter()
        self._steps: dict[_Key, object] = {}  # compiled decode steps, per key
        # held workspaces by call shape (their key with capacity 0), least recently used first
        self._held: dict[_Key, _Workspace] = {}
        self._graph_gen: torch.Generator | None = None  # what captured graphs draw from

    # ---- public ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Tensor, *, group_size: int, max_generated_tokens: int, pad_id: int,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 stop_tokens: int | Sequence[int] | None = None,
                 rng: torch.Generator | None = None, dtype: torch.dtype | None = None,
                 return_logprobs: bool = False,
                 prompt_mask: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """prompts [G, P] -> responses [G * group_size, T] (and with return_logprobs, each sampled
        token's logprob [G * group_size, T] under softmax(logits / temperature), 0 after a stop).
        stop_tokens: the id, or ids (e.g. a generation config's eos_token_id list), that end a
        response. dtype: the KV cache's (a floating dtype; default the weights' as the rollout
        computes with them: under FSDP2, a MixedPrecisionPolicy's param_dtype). prompt_mask
        [G, P] bool: True at the prompt's tokens, taken in order (default: prompt_mask_of, i.e.
        leading and trailing pad_id stripped; the tokens under False are not read)."""
        sampling = SamplingParams(temperature, top_k, top_p)
        return_logprobs = flag_arg("return_logprobs", return_logprobs)
        self._read_model_again_if_changed()
        vocab = self.decoder.vocab_size
        stops = stop_ids(stop_tokens, vocab)
        group_size = integer_arg("group_size", group_size, 1)
        max_generated_tokens = integer_arg("max_generated_tokens", max_generated_tokens, 1)
        pad_id = integer_arg("pad_id", pad_id, 0, vocab)  # the fill of finished rows: a token
        if dtype is not None:
            check_cache_dtype(dtype)
        compact, plen, pmax = checked_prompts(prompts, prompt_mask, max_generated_tokens,
                                             pad_id, rng, self.model, self.decoder)
        device = prompts.device
        on_cuda = device.type == "cuda"
        compiled = self.compile if self.compile is not None else on_cuda
        if compiled:
            self.decoder.check_compiles()
        if self.cuda_graphs and not (on_cuda and compiled):  # (a graph replays compiled steps)
            raise ValueError(f"cuda_graphs=True needs CUDA and compiled steps; the prompts are "
                             f"on {device} and compile={compiled}")
        groups, t = prompts.shape[0], max_generated_tokens
        rows = groups * group_size
        bucket = prompt_bucket(pmax)  # the prefill's width; the cache may hold more
        compact = torch.nn.functional.pad(compact[:, :bucket], (0, bucket - min(
            bucket, compact.shape[1])), value=pad_id)
        with gathered_weights(self.model):
            # read once gathered: FSDP2's sharded parameters keep their storage dtype (float32
            # under a MixedPrecisionPolicy with param_dtype=bfloat16), the gathered ones are
            # the dtype the rollout computes in, which the cache and the kernels must match
            weights = next(self.model.parameters()).dtype
            if dtype is None:
                dtype = check_cache_dtype(weights)
            implementation = self._implementation(device, dtype, weights)
            if implementation == "flex" and compiled and not on_cuda:
                raise ValueError("attention='flex' compiles only on CUDA (Inductor's CPU flex "
                                 "returns no log-sum-exp); use attention='math' or compile=False")
            key = self._held_capacity(_Key(rows, groups if self.share_prompt else rows, bucket,
                                           t, dtype, sampling, pad_id, stops, implementation,
                                           device, vocab, self.decoder.logits_dtype(weights)))
            ws = self._workspace_for(key, on_cuda, compiled)
            # graphs are captured before the cache is filled (a capture warms up on it first);
            # they draw from the engine's own generator, which carries the caller's state in
            # and out, so that a capture never touches (or poisons) the caller's generator
            graph_gen = self._capture(ws, t - 1) if ws.use_graphs else None
            source = rng if rng is not None else _default_generator(device)
            gen = rng
            if graph_gen is not None:
                graph_gen.set_state(source.get_state())
                gen = graph_gen
            c = ws.cache
            self.stats["calls"] += 1
            copies = 1 if self.share_prompt else group_size
            logits = prefill(self.decoder, compact, plen, c.prompt_k, c.prompt_v, copies)
            splits, chunk = c.prompt_k[0].shape[1], c.prompt_k[0].shape[3]
            per_group = plen if self.share_prompt else plen.repeat_interleave(group_size)
            c.prompt_len.copy_(split_lengths(per_group, splits, chunk))
            c.row_position0.copy_(plen.repeat_interleave(group_size))
            c.step.zero_()
            c.done.zero_()
            c.out.fill_(pad_id)
            c.logprobs.zero_()  # columns after an early stop stay 0
            if implementation != "triton":
                # the math and flex paths meet a key past the current step with weight 0, and
                # 0 * NaN = NaN: an earlier call's non-finite values must not reach this one
                for v in c.resp_v:
                    v.zero_()
            draw_noise(c.noise, gen)
            logits = logits.repeat_interleave(group_size, 0)
            first = sample(logits, c.noise, sampling)
            c.tokens.copy_(first)
            c.out[:, 0] = first
            c.logprobs[:, 0] = (logits / sampling.temperature).log_softmax(-1).gather(
                1, first[:, None])[:, 0]
            if stops:
                c.done.copy_(stop_mask(first, stops))
            self._decode(ws, t - 1, bool(stops), gen)
            if gen is not rng:
                source.set_state(gen.get_state())
            if return_logprobs:
                return c.out.clone(), c.logprobs.clone()
            return c.out.clone()

    def release(self) -> None:
        """Drop the held workspaces (KV caches, CUDA graphs and their memory pools), so that
        their memory goes back to the caching allocator, e.g. for the policy update between
        rollouts. The next call allocates and captures again; the compiled steps are kept."""
        self._held.clear()

    def kv_bytes(self) -> int:
        """Bytes of K/V the held caches hold, every held call shape's (0 before the first call
        or after release)."""
        return sum(ws.cache.kv_bytes() for ws in self._held.values())

    @property
    def _workspace(self) -> _Workspace | None:
        """The last call's workspace."""
        return next(reversed(self._held.values()), None)

    # ---- checks ------------------------------------------------------------------------------
    def _read_model_again_if_changed(self) -> None:
        """A layer (or the embedding, norm or LM head) replaced, added or removed since the
        engine read the model: check the model again and drop what was built on the old
        modules (the compiled steps and the workspaces, whose graphs call them)."""
        if not self.decoder.changed():
            self.decoder.check_nothing_skipped()  # a hook or override since the last read
        else:
            self.decoder = decoder_for(self.model)
            self._steps.clear()
            self._held.clear()
            self.stats["model_reads"] += 1
            log.info("rollout engine: the model's modules changed since the last call; "
                     "read again (a new compile and capture)")

    def _implementation(self, device: torch.device, dtype: torch.dtype,
                        weights: torch.dtype) -> str:
        """The decode attention to run: the engine's `attention`, or for "auto" the Triton
        kernels on CUDA (flex where they cannot run, logged once with the reason), else math.
        dtype: the KV cache's; weights: the dtype the model computes in (its gathered
        parameters')."""
        if self.attention in ("math", "flex") or (self.attention == "auto"
                                                  and device.type != "cuda"):
            return "math" if self.attention == "auto" else self.attention
        runs, why = kernels.status(device, self.decoder.head_dim, dtype)
        if runs and weights != dtype:  # the kernels take q and the cache in one dtype
            runs, why = False, f"the weights are {weights} and the KV cache {dtype}"
        if not runs and self.attention == "triton":
            raise ValueError(f"attention='triton' cannot run: {why}")
        if not runs:
            log_once(log, logging.WARNING, f"rollout decode attention runs as flex calls with "
                     f"Inductor's merges, not the Triton kernels (slower): {why}")
        return "triton" if runs else "flex"

    # ---- buffers, compiles, graphs -----------------------------------------------------------
    def _held_capacity(self, key: _Key) -> _Key:
        """`key` with the held workspace's prompt capacity where it is the same call shape and
        that capacity holds the prompts with at most 2x padding (more would cost the flex and
        math decode attention, which read the whole capacity, more than a rebuild)."""
        ws = self._held.get(key._replace(capacity=0))
        if ws is not None and key.capacity <= ws.key.capacity <= 2 * key.capacity:
            return ws.key
        return key

    def _workspace_for(self, key: _Key, on_cuda: bool, compiled: bool) -> _Workspace:
        shape = key._replace(capacity=0)
        ws = self._held.pop(shape, None)
        # a cache made under torch.inference_mode() cannot be written outside it: rebuild
        stale = ws is not None and ws.cache.noise.is_inference() and \
            not torch.is_inference_mode_enabled()
        if ws is None or ws.key != key or stale:
            ws = None  # free this shape's old buffers, and the least recently used shape's
            while len(self._held) >= self.max_workspaces:
                del self._held[next(iter(self._held))]
            dec = self.decoder
            cache = RolloutCache.allocate(
                layers=len(dec.layers), groups=key.groups, rows=key.rows,
                prompt_capacity=key.capacity, response_capacity=key.t,
                kv_heads=dec.num_kv_heads, head_dim=dec.head_dim, vocab=key.vocab,
                dtype=key.dtype, logits_dtype=key.logits_dtype, device=key.device,
                splits=1 if key.implementation == "triton" else None)
            self.stats["workspaces"] += 1
            ws = _Workspace(key, cache, self._step_fn(key, compiled))
            ws.use_graphs = on_cuda and compiled and (self.cuda_graphs is not False)
            if ws.use_graphs:
                ws.pool = torch.cuda.graph_pool_handle()
        self._held[shape] = ws  # the most recently used last
        if ws.use_graphs:
            fingerprint = weights_fingerprint(self.model)
            if fingerprint != ws.fingerprint:  # weights in new storage: graphs read the old
                ws.graphs.clear()
                ws.fingerprint = fingerprint
        return ws

    def _step_fn(self, key: _Key, compiled: bool):
        if key not in self._steps:
            self._steps[key] = make_decode_step(
                self.decoder, sampling=key.sampling, pad_id=key.pad_id, stops=key.stops,
                implementation=key.implementation, device=key.device,
                compile_fn=self._compile if compiled else None)
        return self._steps[key]

    def _compile(self, fn):
        """fullgraph, static shapes; a recompile past a small limit raises (bounded_recompiles)
        instead of silently running eagerly."""
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        self.stats["compiled_functions"] += 1

        def call(*args):
            # one code object serves every engine and key of the process: one entry per key
            with bounded_recompiles(_KEY_LIMIT, "the rollout decode step",
                                    "Each key (rows, groups, prompt bucket, T, dtype, sampling "
                                    "settings) compiles once; use fewer distinct ones per "
                                    "process (e.g. equal rollout_batch_rows calls)."):
                return compiled(*args)
        return call

    def _decode(self, ws: _Workspace, steps: int, check_stop: bool, gen) -> None:
        done = 0
        while done < steps:
            if check_stop and done and bool(ws.cache.done.all()):  # one sync per chunk
                break
            n = min(self.steps_per_graph, steps - done)
            if n in ws.graphs:
                ws.graphs[n].replay()
            else:
                tensors = ws.cache.decode_tensors()
                for _ in range(n):
                    draw_noise(ws.cache.noise, gen)
                    ws.step_fn(*tensors)
            done += n
            self.stats["decode_steps"] += n
        # the steps skipped after every row stopped still draw their noise, so that a call
        # leaves the generator where the uncached sampler (and any steps_per_graph) leaves it
        for _ in range(steps - done):
            draw_noise(ws.cache.noise, gen)

    def _capture(self, ws: _Workspace, steps: int) -> torch.Generator | None:
        """Capture the chunk lengths `steps` decode steps need (K and the remainder); the
        generator they draw from, or None (and eager steps from now on) if a capture failed."""
        k = self.steps_per_graph
        needed = {n for n in (k if steps >= k else 0, steps % k) if n}
        if self._graph_gen is None:
            self._graph_gen = torch.Generator(ws.cache.noise.device)
        for n in sorted(needed - set(ws.graphs)):
            warm_up(ws.step_fn, ws.cache)  # compile and autotune before, and outside, the capture
            try:
                ws.graphs[n] = StepGraph(ws.step_fn, ws.cache.decode_tensors(), ws.cache.noise,
                                         n, self._graph_gen, ws.pool)
            except Exception as e:  # noqa: BLE001 - any capture failure falls back, logged
                for held in self._held.values():  # their graphs draw from the dropped generator
                    held.use_graphs = False
                    held.graphs.clear()
                self._graph_gen = None  # a failed capture may leave it unusable
                self.stats["graph_fallbacks"] += 1
                counters["rollout_graph_fallbacks"] += 1
                log_once(log, logging.WARNING, f"rollout: CUDA graph capture failed "
                         f"({type(e).__name__}: {e}); decoding with the compiled step, "
                         "launched eagerly")
                return None
            self.stats["captures"] += 1
        return self._graph_gen


def check_cache_dtype(dtype) -> torch.dtype:
    """dtype, if the engine can hold its KV cache in it; else a ValueError naming it."""
    if dtype not in _CACHE_DTYPES:
        raise ValueError(f"dtype={dtype!r} (the KV cache's; default the dtype the model computes "
                         f"in) must be one of {_CACHE_DTYPES}")
    return dtype


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return torch.default_generator
