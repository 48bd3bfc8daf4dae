"""Prefill and one decode step of the rollout engine, as functions of the model's pieces
(forward.py) and the cache's tensors (cache.py).

The decode step is written for `torch.compile(fullgraph=True, dynamic=False)` and CUDA-graph
capture: every length it needs is a tensor (the step counter, the prompt lengths), it writes
its K/V and its sampled token in place at the step counter, and it never syncs with the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import decode_attention
from .sampling import SamplingParams, sample

__all__ = ["make_decode_step", "prefill"]


def prefill(dec, prompts: Tensor, prompt_len: Tensor, prompt_k: list[Tensor],
            prompt_v: list[Tensor], copies: int) -> Tensor:
    """Run the G prompts [G, P] (valid tokens first, prompt_len [G] of them), write their K/V
    into prompt_k/v[l][:, :, :P] (each group's `copies` times in a row: 1 shares the prompt,
    N replicates it per sample row), return the last prompt token's logits [G, vocab]."""
    g, p = prompts.shape
    x = dec.embed(prompts)
    positions = torch.arange(p, device=prompts.device).expand(g, p)
    rope = dec.rope(x, positions)
    for layer in range(len(prompt_k)):
        q, k, v = dec.qkv(layer, x, rope)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [G, Hkv, P, D]
        prompt_k[layer][:, :, :p].copy_(k.repeat_interleave(copies, 0) if copies > 1 else k)
        prompt_v[layer][:, :, :p].copy_(v.repeat_interleave(copies, 0) if copies > 1 else v)
        # causal over the valid tokens; the padding after them is never a key of theirs
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                           scale=dec.scale, enable_gqa=True)
        x = dec.finish(layer, x, o.transpose(1, 2).reshape(g, p, -1))
    last = x[torch.arange(g, device=x.device), prompt_len - 1]
    return dec.logits(last)


def make_decode_step(dec, *, layers: int, sampling: SamplingParams, pad_id: int,
                     stop_token: int | None, implementation: str):
    """step(*cache.decode_tensors()): feed `tokens` (response index `step`), write their K/V at
    `step`, sample the next tokens into out[:, step + 1], mark stopped rows, advance `step`."""

    def decode_step(prompt_len, row_position0, tokens, step, done, out, noise, *kv):
        prompt_k, prompt_v = kv[:layers], kv[layers:2 * layers]
        resp_k, resp_v = kv[2 * layers:3 * layers], kv[3 * layers:]
        rows = tokens.shape[0]
        at = step.view(1)
        x = dec.embed(tokens[:, None])
        rope = dec.rope(x, (row_position0 + step)[:, None])
        for layer in range(layers):
            q, k, v = dec.qkv(layer, x, rope)
            resp_k[layer][:, :, at] = k.transpose(1, 2).to(resp_k[layer].dtype)
            resp_v[layer][:, :, at] = v.transpose(1, 2).to(resp_v[layer].dtype)
            o = decode_attention(q[:, 0], prompt_k[layer], prompt_v[layer], prompt_len,
                                 resp_k[layer], resp_v[layer], step, scale=dec.scale,
                                 implementation=implementation)
            x = dec.finish(layer, x, o.reshape(rows, 1, -1))
        token = sample(dec.logits(x[:, 0]), noise, sampling)
        token = torch.where(done, pad_id, token)
        out[:, at + 1] = token[:, None]
        if stop_token is not None:
            done.logical_or_(token == stop_token)
        tokens.copy_(token)
        step.add_(1)

    return decode_step
