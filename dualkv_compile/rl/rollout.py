"""KV-cached sampling of GRPO groups with the shared prompt prefilled once.

All samples of a group continue the same prompt, so its keys and values are computed once (one
row per distinct prompt) and copied into every sample's cache row; only the decode steps run
on all rows. torchtune's `generate()` instead prefills every row and keeps its full
`[rows, P, vocab]` logits. The sampling itself is torchtune's (`generation.sample`: temperature,
top-k, the exponential trick with the caller's generator).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchtune.generation import (get_causal_mask_from_padding_mask,
                                  get_position_ids_from_padding_mask, sample)
from torchtune.modules.common_utils import local_kv_cache

__all__ = ["generate_groups", "plan_calls"]


@torch.no_grad()
def generate_groups(model, prompts: Tensor, *, samples: int, max_generated_tokens: int,
                    pad_id: int, temperature: float = 1.0, top_k: int | None = None,
                    stop_token: int | None = None, rng: torch.Generator | None = None,
                    dtype: torch.dtype | None = None) -> Tensor:
    """prompts [G, P] (left-padded with pad_id where shorter) -> responses [G * samples, T]:
    `samples` continuations of each prompt, rows in prompt order, T = max_generated_tokens.

    With `stop_token`, decoding ends early once every row has produced it (the columns after
    are pad_id; a row's tokens after its own stop token are whatever it sampled). Without it,
    all T steps run, which sharded (FSDP) models need: every step is a collective.
    """
    if prompts.dim() != 2 or samples < 1 or max_generated_tokens < 1:
        raise ValueError(f"prompts {tuple(prompts.shape)} must be [G, P], samples={samples} and "
                         f"max_generated_tokens={max_generated_tokens} at least 1")
    g, p = prompts.shape
    t = max_generated_tokens
    device, dtype = prompts.device, dtype or next(model.parameters()).dtype
    # masks and positions of the distinct prompts; every sample row uses its prompt's
    valid = torch.nn.functional.pad(prompts != pad_id, (0, t), value=True)
    masks = get_causal_mask_from_padding_mask(valid, target_seq_len=p + t)  # [G, P+T, P+T]
    positions = get_position_ids_from_padding_mask(valid)  # [G, P+T]
    row_prompt = torch.arange(g, device=device).repeat_interleave(samples)

    with local_kv_cache(model, batch_size=g, device=device, dtype=dtype,
                        decoder_max_seq_len=p + t):
        logits = model(prompts, input_pos=positions[:, :p], mask=masks[:, :p])[:, -1]
        prompt_kv = [(layer.attn.kv_cache.k_cache[:, :, :p].clone(),
                      layer.attn.kv_cache.v_cache[:, :, :p].clone()) for layer in model.layers]
    del masks  # only the rows the decode steps need are kept below
    out = torch.full((g * samples, t), pad_id, dtype=prompts.dtype, device=device)
    with local_kv_cache(model, batch_size=g * samples, device=device, dtype=dtype,
                        decoder_max_seq_len=p + t):
        for layer, (k, v) in zip(model.layers, prompt_kv):
            cache = layer.attn.kv_cache
            cache.k_cache[:, :, :p] = k[row_prompt]
            cache.v_cache[:, :, :p] = v[row_prompt]
            cache.cache_pos.add_(p)
        del prompt_kv
        # the decode steps' masks: row c of each prompt's causal mask, for every sample row
        step_masks = _decode_masks(valid, p, t)[row_prompt]  # [rows, T, P+T]
        row_positions = positions[row_prompt]
        tokens = _sample(logits[row_prompt], temperature, top_k, rng)
        stopped = torch.zeros(g * samples, dtype=torch.bool, device=device)
        for step in range(t):
            out[:, step] = tokens[:, 0]
            if stop_token is not None:
                stopped |= tokens[:, 0] == stop_token
                if bool(stopped.all()):
                    break
            if step == t - 1:
                break
            col = p + step
            logits = model(tokens, input_pos=row_positions[:, col:col + 1],
                           mask=step_masks[:, step:step + 1])[:, -1]
            tokens = _sample(logits, temperature, top_k, rng)
    return out


def _decode_masks(valid: Tensor, p: int, t: int) -> Tensor:
    """[G, T, P+T]: for the query at column p + s, the valid columns up to itself."""
    cols = torch.arange(p + t, device=valid.device)
    upto = cols[None, :] <= (p + torch.arange(t, device=valid.device))[:, None]  # [T, P+T]
    return upto[None] & valid[:, None, :]


def _sample(logits: Tensor, temperature: float, top_k: int | None,
            rng: torch.Generator | None) -> Tensor:
    q = None
    if rng is not None:
        q = torch.empty_like(logits, dtype=torch.float32).exponential_(1, generator=rng)
    return sample(logits.float(), temperature=temperature, top_k=top_k, q=q)


def plan_calls(num_groups: int, samples: int, rows_per_call: int | None) -> list[tuple[int, int, int]]:
    """Split the sampling of `num_groups` groups x `samples` into generate_groups calls of at
    most `rows_per_call` decode rows (None: one call): (first group, groups, samples) each,
    whole groups per call, or one group's samples over several equal-sized calls."""
    if rows_per_call is None:
        return [(0, num_groups, samples)]
    if rows_per_call < 1:
        raise ValueError(f"rows_per_call={rows_per_call} must be at least 1 (or None)")
    if rows_per_call >= samples:
        per = rows_per_call // samples
        return [(g, min(per, num_groups - g), samples) for g in range(0, num_groups, per)]
    splits = -(-samples // rows_per_call)
    per = -(-samples // splits)
    return [(g, 1, min(per, samples - s)) for g in range(num_groups) for s in range(0, samples, per)]
