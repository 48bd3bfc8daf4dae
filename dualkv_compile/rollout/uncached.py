"""The uncached sampler the engine is tested against: no cache, no sharing. Each step runs the
model's own forward over every replicated row's whole sequence (padded prompt + the tokens so
far, the padding masked out) and samples the last position with the engine's sampler and the
same draws."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..numerics import accumulation_dtype
from .sampling import SamplingParams, sample, stop_ids, stop_mask

__all__ = ["uncached_generate"]


def _last_logits(model, tokens: Tensor, valid: Tensor) -> Tensor:
    """The logits at each row's last valid token (a right-padded prompt's is not the last
    column)."""
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    # the first column where the count of valid tokens reaches its total: the last valid one
    # (positions' argmax would pick a leading padding column for a one-token prompt)
    last = valid.long().cumsum(1).argmax(1)
    try:
        from torchtune.modules import TransformerDecoder
    except ImportError:
        TransformerDecoder = ()
    if TransformerDecoder and isinstance(model, TransformerDecoder):
        l = tokens.shape[1]
        causal = torch.ones(l, l, dtype=torch.bool, device=tokens.device).tril()
        mask = (causal & valid[:, None, :]) | torch.eye(l, dtype=torch.bool, device=tokens.device)
        logits = model(tokens, mask=mask, input_pos=positions)[rows, last]
        return logits.to(accumulation_dtype(logits.dtype))
    out = model(input_ids=tokens, attention_mask=valid.long(), position_ids=positions,
                use_cache=False)
    return out.logits[rows, last].to(accumulation_dtype(out.logits.dtype))


@torch.no_grad()
def uncached_generate(model, prompts: Tensor, *, group_size: int, max_generated_tokens: int,
                       pad_id: int, temperature: float = 1.0, top_k: int | None = None,
                       top_p: float | None = None, stop_tokens: int | Sequence[int] | None = None,
                       rng: torch.Generator | None = None,
                       prompt_mask: Tensor | None = None) -> Tensor:
    """What RolloutEngine.generate returns, computed the slow, obvious way."""
    params = SamplingParams(temperature, top_k, top_p)
    stops = stop_ids(stop_tokens)
    if prompt_mask is None:
        # padding: the pad_id before a prompt's first other token and after its last one
        real = prompts != pad_id
        prompt_mask = (real.cumsum(1) > 0) & (real.flip(1).cumsum(1).flip(1) > 0)
    valid = prompt_mask.repeat_interleave(group_size, 0)
    # the ids under a False mask are never read: any value, even outside the vocabulary
    tokens = torch.where(valid, prompts.repeat_interleave(group_size, 0), pad_id)
    rows, out = tokens.shape[0], []
    done = torch.zeros(rows, dtype=torch.bool, device=prompts.device)
    for _ in range(max_generated_tokens):
        logits = _last_logits(model, tokens, valid)
        noise = torch.empty_like(logits, dtype=torch.float32).exponential_(1, generator=rng)
        token = torch.where(done, pad_id, sample(logits, noise, params))
        out.append(token)
        if stops:
            done |= stop_mask(token, stops)
        tokens = torch.cat([tokens, token[:, None]], 1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
    return torch.stack(out, 1)
