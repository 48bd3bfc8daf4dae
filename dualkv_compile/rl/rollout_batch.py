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

from ..arguments import integer_arg
from ..layout.batch_checks import as_padding_mask, checked_prompt_len, rows_with_gaps
from ..rollout import RolloutEngine, SamplingParams, plan_calls
from ..rollout.engine import check_cache_dtype
from ..rollout.prompts import check_prompt_ids, valid_prompt_tokens
from ..rollout.sampling import stop_ids, stop_mask
from ..rollout.weights import gathered_weights

__all__ = ["rollout_batch", "truncated_responses"]


@torch.no_grad()
def rollout_batch(engine: RolloutEngine, prompts: Tensor, *, group_size: int, pad_id: int,
                  max_generated_tokens: int, stop_tokens: int | Sequence[int] | None = None,
                  rows_per_call: int | None = None, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None,
                  rng: torch.Generator | None = None, dtype: torch.dtype | None = None,
                  return_logprobs: bool = False,
                  prompt_mask: Tensor | None = None) -> tuple[Tensor, ...]:
    """prompts [G, P] (padded with pad_id) -> (tokens [G * group_size, P + T], padding mask of the
    same shape, response lengths [G * group_size] with the stop token counted), rows group-major;
    with return_logprobs, also each sampled token's logprob [G * group_size, T] (0 after a stop).

    A response is valid up to and including its first stop token; tokens outside the mask
    are pad_id. stop_tokens: an id, several, or none (None or empty, as a tokenizer's
    `stop_tokens` may be). prompt_mask [G, P] bool: True at each prompt's tokens, as
    `engine.generate` takes it (default: leading and trailing pad_id stripped); give it where a
    prompt's own first or last token is pad_id. The calls are
    `plan_calls(G, group_size, rows_per_call)`; the sampling settings go to each `engine.generate`. Under FSDP2 the weights are gathered once
    for all calls, and a rank with G = 0 (no rows this round) still joins that gathering,
    returning empty tensors."""
    # checked here, before anything runs: a rank with G = 0 makes no engine call to check them
    # (it would return while the others refuse), and a bad pad_id or prompts reached
    # prompt_mask_of's bare errors first
    vocab = engine.decoder.vocab_size
    stops = stop_ids(stop_tokens, vocab)
    group_size = integer_arg("group_size", group_size, 1)
    pad_id = integer_arg("pad_id", pad_id, 0, vocab)
    max_generated_tokens = integer_arg("max_generated_tokens", max_generated_tokens, 1)
    if rows_per_call is not None:
        integer_arg("rows_per_call", rows_per_call, 1)
    SamplingParams(temperature, top_k, top_p)
    if dtype is not None:
        check_cache_dtype(dtype)
    check_prompt_ids(prompts, min_groups=0)
    # the prompt is what the engine samples from (by default pad_id only in leading and
    # trailing runs)
    given = prompt_mask is not None
    prompt_mask = valid_prompt_tokens(prompts, prompt_mask, pad_id)  # the caller's rows named
    if given:  # the batch's padding mask holds it: the update takes no hole inside a prompt
        holes = rows_with_gaps(prompt_mask)
        if holes:
            raise ValueError(f"prompt_mask rows {holes[:8]} have a False between True entries; "
                             "the policy update takes each prompt as one run of tokens: pass "
                             "the prompts with their tokens together")
    calls = plan_calls(prompts.shape[0], group_size, rows_per_call) if len(prompts) else []
    with gathered_weights(engine.model):
        parts = [engine.generate(prompts[first:first + count], group_size=n, pad_id=pad_id,
                                 max_generated_tokens=max_generated_tokens,
                                 stop_tokens=stops or None, temperature=temperature,
                                 top_k=top_k, top_p=top_p, rng=rng, dtype=dtype,
                                 return_logprobs=True,
                                 prompt_mask=prompt_mask[first:first + count])
                 for first, count, n in calls]
        # gathered: FSDP2 keeps sharded parameters in their storage dtype
        logits_dtype = engine.decoder.logits_dtype(next(engine.model.parameters()).dtype)
    width = prompts.shape[1] + max_generated_tokens
    if not parts:
        empty = prompts.new_zeros(0, width)
        none = (empty, empty.bool(), prompts.new_zeros(0))
        # logprobs in the dtype a rank with prompts gets them (float64 for a float64 model)
        logprobs = empty[:, :max_generated_tokens].to(logits_dtype)
        return (*none, logprobs) if return_logprobs else none
    response = torch.cat([tokens for tokens, _ in parts])
    batch = prompts.repeat_interleave(group_size, 0)
    is_stop = stop_mask(response, stops)
    before_stop = (is_stop.cumsum(1) - is_stop.long()) == 0  # up to and with the first stop
    mask = torch.cat([prompt_mask.repeat_interleave(group_size, 0), before_stop], 1)
    tokens = torch.where(mask, torch.cat([batch, response], 1), pad_id)
    if return_logprobs:
        return tokens, mask, before_stop.sum(1), torch.cat([lp for _, lp in parts])
    return tokens, mask, before_stop.sum(1)


def truncated_responses(tokens: Tensor, mask: Tensor, *, prompt_len: int,
                        stop_tokens: int | Sequence[int] | None) -> Tensor:
    """tokens, mask [B, P + T] as rollout_batch returns them -> bool [B]: the response ends
    without a stop token, cut at max_generated_tokens (with no stop tokens, every response).
    DAPO's overlong filtering keeps these out of the loss. stop_tokens as rollout_batch's."""
    if not (isinstance(tokens, Tensor) and isinstance(mask, Tensor) and tokens.dim() == 2
            and mask.shape == tokens.shape):  # (a narrower mask broadcast: every row cut)
        raise ValueError(f"tokens and mask must be [B, P + T] of one shape, got "
                         f"{tuple(getattr(tokens, 'shape', ()))} and "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    prompt_len = checked_prompt_len(prompt_len, tokens.shape[1])
    mask = as_padding_mask(mask)
    response = tokens[:, prompt_len:]
    return ~(stop_mask(response, stop_ids(stop_tokens)) & mask[:, prompt_len:]).any(1)

