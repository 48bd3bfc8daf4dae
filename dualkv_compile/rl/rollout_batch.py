"""A rollout batch as a policy update takes it: N responses per prompt, sampled by a
RolloutEngine in planned calls, joined to their prompts with a padding mask.

    tokens, mask, lengths = rollout_batch(engine, prompts, group_size=16, pad_id=tok.pad_id,
                                          stop_tokens=tok.stop_tokens,
                                          max_generated_tokens=1024, rows_per_call=128)
    logprobs = dk.optimize(model).response_logprobs(tokens, prompt_len=prompts.shape[1],
                                                    padding_mask=mask)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..rollout import RolloutEngine, plan_calls, prompt_mask_of
from ..rollout.sampling import stop_mask
from ..rollout.weights import gathered_weights

__all__ = ["rollout_batch", "truncated_responses"]


@torch.no_grad()
def rollout_batch(engine: RolloutEngine, prompts: Tensor, *, group_size: int, pad_id: int,
                  max_generated_tokens: int, stop_tokens: Sequence[int] = (),
                  rows_per_call: int | None = None, **sampling) -> tuple[Tensor, Tensor, Tensor]:
    """prompts [G, P] (padded with pad_id) -> (tokens [G * group_size, P + T], padding mask of the
    same shape, response lengths [G * group_size] with the stop token counted), rows group-major.

    A response is valid up to and including its first stop token; tokens outside the mask
    are pad_id. The calls are `plan_calls(G, group_size, rows_per_call)`; `sampling` goes to each
    `engine.generate` (temperature, top_k, top_p, rng, dtype). Under FSDP2 the weights are
    gathered once for all calls, and a rank with G = 0 (no rows this round) still joins that
    gathering, returning empty tensors."""
    stops = tuple(stop_tokens)
    # the prompt is what the engine samples from: pad_id only in leading and trailing runs
    prompt_mask = prompt_mask_of(prompts, pad_id)
    if len(prompts):  # named by the caller's row here: each call's engine names its own rows
        empty = (~prompt_mask.any(1)).nonzero()[:, 0].tolist()
        if empty:
            raise ValueError(f"prompts {empty} hold only pad_id={pad_id}")
    calls = plan_calls(prompts.shape[0], group_size, rows_per_call) if len(prompts) else []
    with gathered_weights(engine.model):
        parts = [engine.generate(prompts[first:first + count], group_size=n, pad_id=pad_id,
                                 max_generated_tokens=max_generated_tokens,
                                 stop_tokens=stops or None, **sampling)
                 for first, count, n in calls]
    width = prompts.shape[1] + max_generated_tokens
    if not parts:
        empty = prompts.new_zeros(0, width)
        return empty, empty.bool(), prompts.new_zeros(0)
    response = torch.cat(parts)
    batch = prompts.repeat_interleave(group_size, 0)
    is_stop = stop_mask(response, stops)
    before_stop = (is_stop.cumsum(1) - is_stop.long()) == 0  # up to and with the first stop
    mask = torch.cat([prompt_mask.repeat_interleave(group_size, 0), before_stop], 1)
    tokens = torch.where(mask, torch.cat([batch, response], 1), pad_id)
    return tokens, mask, before_stop.sum(1)


def truncated_responses(tokens: Tensor, mask: Tensor, *, prompt_len: int,
                        stop_tokens: Sequence[int]) -> Tensor:
    """tokens, mask [B, P + T] as rollout_batch returns them -> bool [B]: the response ends
    without a stop token, cut at max_generated_tokens (with no stop tokens, every response).
    DAPO's overlong filtering keeps these out of the loss."""
    response = tokens[:, prompt_len:]
    return ~(stop_mask(response, tuple(stop_tokens)) & mask[:, prompt_len:]).any(1)
