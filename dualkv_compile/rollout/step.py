"""Prefill and one decode step of the rollout engine, as functions of the model's pieces
(forward.py) and the cache's tensors (cache.py).

The decode step is three parts: embedding and rotary tables, one call per layer of a single
layer function, and the head (final norm, LM head, sampling, state update). The layer function
is compiled once and reused for every layer (Dynamo sees the layer module as an input), so a
36-layer model compiles one layer graph and one head graph, not 36 unrolled layers. Every
length is a tensor (the step counter, the prompt lengths); K/V and sampled tokens are written
in place at the step counter; nothing syncs with the host, so the whole step can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import decode_attention
from .sampling import SamplingParams, sample, stop_table

__all__ = ["make_decode_step", "prefill"]


def prefill(dec, prompts: Tensor, prompt_len: Tensor, prompt_k: list[Tensor],
            prompt_v: list[Tensor], copies: int) -> Tensor:
    """Run the G prompts [G, P] (valid tokens first, prompt_len [G] of them; P at most the
    cache's prompt capacity S x C), write their K/V into prompt_k/v[l] ([G * copies, S, Hkv, C,
    D], zeros past P; each group's `copies` times in a row: 1 shares the prompt, N replicates
    it per sample row), return the last prompt token's logits [G, vocab]."""
    g, p = prompts.shape
    x = dec.embed(prompts)
    # the padding after a prompt may reach past the model's context (the capacity is bucketed):
    # its positions are clamped, and no valid token attends to it
    positions = torch.arange(p, device=prompts.device).clamp(max=dec.max_seq_len - 1).expand(g, p)
    rope = dec.rope(x, positions)
    for layer, pk, pv in zip(dec.layers, prompt_k, prompt_v):
        q, k, v = dec.qkv(layer, x, rope)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [G, Hkv, P, D]
        _store_split(pk, k, copies)
        _store_split(pv, v, copies)
        # causal over the valid tokens; the padding after them is never a key of theirs
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                           scale=dec.scale, enable_gqa=True)
        x = dec.finish(layer, x, o.transpose(1, 2).reshape(g, p, -1))
    last = x[torch.arange(g, device=x.device), prompt_len - 1]
    return dec.logits(last)


def _store_split(cache: Tensor, kv: Tensor, copies: int) -> None:
    """kv [G, Hkv, P, D] into cache [G * copies, S, Hkv, C, D], P <= S x C, zeros after it."""
    g, hkv, p, d = kv.shape
    splits, chunk = cache.shape[1], cache.shape[3]
    kv = F.pad(kv, (0, 0, 0, splits * chunk - p))
    split = kv.view(g, hkv, splits, chunk, d).transpose(1, 2)
    cache.copy_(split.repeat_interleave(copies, 0) if copies > 1 else split)


def make_decode_step(dec, *, sampling: SamplingParams, pad_id: int, stops: tuple[int, ...],
                     implementation: str, device, compile_fn=None):
    """step(*cache.decode_tensors()): feed `tokens` (response index `step`), write their K/V at
    `step`, sample the next tokens into out[:, step + 1] (their logprobs into logprobs[:, step +
    1]), mark rows that sampled one of `stops` as done, advance `step`. compile_fn (e.g.
    torch.compile) wraps the layer and head functions."""
    temperature = sampling.temperature
    stopping = stop_table(stops, dec.vocab_size, device) if stops else None

    def decode_layer(layer, x, rope, prompt_k, prompt_v, prompt_len, resp_k, resp_v, step):
        rows = x.shape[0]
        q, k, v = dec.qkv(layer, x, rope)
        at = step.view(1)
        resp_k[:, :, at] = k.transpose(1, 2).to(resp_k.dtype)
        resp_v[:, :, at] = v.transpose(1, 2).to(resp_v.dtype)
        o = decode_attention(q[:, 0], prompt_k, prompt_v, prompt_len, resp_k, resp_v, step,
                             scale=dec.scale, implementation=implementation)
        return dec.finish(layer, x, o.reshape(rows, 1, -1))

    def decode_head(x, noise, tokens, step, done, out, logprobs):
        logits = dec.logits(x[:, 0])
        token = torch.where(done, pad_id, sample(logits, noise, sampling))
        scaled = logits / temperature
        logprob = scaled.gather(1, token[:, None])[:, 0] - torch.logsumexp(scaled, -1)
        at = step.view(1) + 1
        out[:, at] = token[:, None]
        logprobs[:, at] = torch.where(done, 0.0, logprob)[:, None]
        if stopping is not None:
            done.logical_or_(stopping[token])
        tokens.copy_(token)
        step.add_(1)

    layer_fn = compile_fn(decode_layer) if compile_fn else decode_layer
    head_fn = compile_fn(decode_head) if compile_fn else decode_head
    layers = len(dec.layers)

    def decode_step(prompt_len, row_position0, tokens, step, done, out, logprobs, noise, *kv):
        prompt_k, prompt_v = kv[:layers], kv[layers:2 * layers]
        resp_k, resp_v = kv[2 * layers:3 * layers], kv[3 * layers:]
        x = dec.embed(tokens[:, None])
        rope = dec.rope(x, (row_position0 + step)[:, None])
        for i, layer in enumerate(dec.layers):
            x = layer_fn(layer, x, rope, prompt_k[i], prompt_v[i], prompt_len, resp_k[i],
                         resp_v[i], step)
        head_fn(x, noise, tokens, step, done, out, logprobs)

    return decode_step
