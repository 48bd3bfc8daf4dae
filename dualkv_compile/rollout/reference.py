"""The reference sampler the engine is tested against: no cache, no sharing. Each step runs the
model's own forward over every replicated row's whole sequence (left-padded prompt + the
tokens so far) and samples the last position with the engine's sampler and the same draws."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .sampling import SamplingParams, sample, stop_ids, stop_mask

__all__ = ["reference_generate"]


def _last_logits(model, tokens: Tensor, valid: Tensor) -> Tensor:
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    try:
        from torchtune.modules import TransformerDecoder
    except ImportError:
        TransformerDecoder = ()
    if TransformerDecoder and isinstance(model, TransformerDecoder):
        l = tokens.shape[1]
        causal = torch.ones(l, l, dtype=torch.bool, device=tokens.device).tril()
        mask = (causal & valid[:, None, :]) | torch.eye(l, dtype=torch.bool, device=tokens.device)
        return model(tokens, mask=mask, input_pos=positions)[:, -1].float()
    out = model(input_ids=tokens, attention_mask=valid.long(), position_ids=positions,
                use_cache=False)
    return out.logits[:, -1].float()


@torch.no_grad()
def reference_generate(model, prompts: Tensor, *, samples: int, max_generated_tokens: int,
                       pad_id: int, temperature: float = 1.0, top_k: int | None = None,
                       top_p: float | None = None, stop_token: int | Sequence[int] | None = None,
                       rng: torch.Generator | None = None) -> Tensor:
    """What RolloutEngine.generate returns, computed the slow, obvious way."""
    params = SamplingParams(temperature, top_k, top_p)
    stops = stop_ids(stop_token)
    tokens = prompts.repeat_interleave(samples, 0)
    valid = tokens != pad_id
    rows, out = tokens.shape[0], []
    done = torch.zeros(rows, dtype=torch.bool, device=prompts.device)
    for _ in range(max_generated_tokens):
        logits = _last_logits(model, tokens, valid)
        noise = torch.empty_like(logits).exponential_(1, generator=rng)
        token = torch.where(done, pad_id, sample(logits, noise, params))
        out.append(token)
        if stops:
            done |= stop_mask(token, stops)
        tokens = torch.cat([tokens, token[:, None]], 1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
    return torch.stack(out, 1)
