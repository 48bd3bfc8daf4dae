"""A rollout call's prompts: which tokens are the prompt (`prompt_mask_of`), and the checks
and reordering the engine applies before anything runs on them (`checked_prompts`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..adapters import has_dropout

__all__ = ["check_prompt_ids", "checked_prompts", "prompt_mask_of", "valid_prompt_tokens"]


def prompt_mask_of(prompts: Tensor, pad_id: int) -> Tensor:
    """prompts [G, P] -> [G, P] bool, True at each prompt's tokens: those from its first to its
    last token that is not pad_id. Padding is a leading (left) and/or trailing (right) run of
    pad_id; a pad_id between real tokens is one of them. A row of only pad_id is all False."""
    real = prompts != pad_id
    cols = torch.arange(prompts.shape[1], device=prompts.device)
    first = real.to(torch.int8).argmax(1, keepdim=True)  # argmax: the first maximum
    last = prompts.shape[1] - 1 - real.flip(1).to(torch.int8).argmax(1, keepdim=True)
    return (cols >= first) & (cols <= last) & real.any(1, keepdim=True)


def check_prompt_ids(prompts, min_groups: int = 1) -> None:
    """Refuse prompts that are not [G, P] integer token ids with G >= min_groups (0 on a rank
    with no prompts this round) and, where G >= 1, P >= 1."""
    if not (isinstance(prompts, Tensor) and prompts.dim() == 2
            and prompts.shape[0] >= min_groups and (prompts.shape[1] >= 1 or not len(prompts))
            and prompts.dtype in (torch.long, torch.int32)):
        raise ValueError(f"prompts {describe(prompts)} must be [G, P] integer token ids, "
                         f"G >= {min_groups}, P >= 1"
                         + (" (G = 0 on a rank with no prompts this round)" if not min_groups
                            else ""))


def valid_prompt_tokens(prompts: Tensor, mask: Tensor | None, pad_id: int) -> Tensor:
    """The prompt tokens a model reads, [G, P] bool: mask where given (checked to be shaped and
    placed like the prompts), else prompt_mask_of(prompts, pad_id). Refuses a prompt with none,
    naming its row."""
    if mask is not None and not (isinstance(mask, Tensor) and mask.dtype == torch.bool and
                                 mask.shape == prompts.shape and mask.device == prompts.device):
        raise ValueError(f"prompt_mask {describe(mask)} must be a bool tensor shaped and "
                         f"placed like the prompts, {describe(prompts)}")
    valid = prompt_mask_of(prompts, pad_id) if mask is None else mask
    empty = (~valid.any(1)).nonzero()[:, 0].tolist()
    if empty:
        raise ValueError(f"prompts {empty} hold only pad_id={pad_id}" if mask is None else
                         f"prompts {empty} have no token: prompt_mask is False throughout")
    return valid


def checked_prompts(prompts: Tensor, mask: Tensor | None, t: int, pad_id: int, rng,
                    model: torch.nn.Module, decoder) -> tuple[Tensor, Tensor, int]:
    """Refuse bad prompts (and mask, rng, a model in train mode with dropout) by name before
    anything runs on them; return the prompts with their tokens first, in order, padded with
    pad_id ([G, P]), their lengths [G] and the longest."""
    check_prompt_ids(prompts)
    if rng is not None and not isinstance(rng, torch.Generator):
        raise ValueError(f"rng={rng!r} must be a torch.Generator (e.g. "
                         f"torch.Generator(device).manual_seed(seed)) or None")
    if model.training and has_dropout(model):  # as optimize() refuses it
        raise ValueError(f"{type(model).__name__} is in train mode with dropout, which the "
                         "engine does not apply: sample in eval mode (model.eval()) or with "
                         "dropout 0")
    weights = next(model.parameters()).device
    if prompts.device != weights:  # caught here, not as a device error inside the prefill
        raise ValueError(f"prompts are on {prompts.device}, the model on {weights}; move the "
                         "prompts to the model's device")
    if rng is not None and rng.device.type != prompts.device.type:
        raise ValueError(f"rng is on {rng.device}, the prompts on {prompts.device}; pass a "
                         f"generator of the prompts' device")
    valid = valid_prompt_tokens(prompts, mask, pad_id)
    plen = valid.sum(1)
    tokens = prompts[valid]  # the ones the model reads (not those under a False mask)
    lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one host read
    vocab = decoder.vocab_size
    if lo < 0 or hi >= vocab:
        raise ValueError(f"prompts hold token id {lo if lo < 0 else hi}, outside the "
                         f"model's vocabulary [0, {vocab})")
    pmax = int(plen.max())
    if pmax + t > decoder.max_seq_len:
        raise ValueError(f"a prompt of {pmax} tokens + max_generated_tokens={t} exceeds the "
                         f"model's context of {decoder.max_seq_len}")
    # valid tokens first, in order (a stable sort of the padding flags), pad_id after them
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return torch.where(valid, prompts.long(), pad_id).gather(1, order), plen, pmax


def describe(x) -> str:
    return f"{tuple(x.shape)} {x.dtype} on {x.device}" if isinstance(x, Tensor) else \
        f"({type(x).__name__})"
