"""Checks of a [B, L] batch before it is packed or planned: the tokens' dtype and shape,
`prompt_len` within the row length, the padding mask as bool, and each row's prompt and response
as one contiguous run of real tokens (the layout pack() and plan_micro_batches() accept).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..arguments import integer_arg

__all__ = ["as_padding_mask", "checked_prompt_len", "checked_runs", "checked_tokens",
           "padding_mask_on", "rows_with_gaps"]


def _contiguous_runs(valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """First index and length of the True run in each row, and whether the row is one run."""
    cols = torch.arange(valid.shape[1], device=valid.device)
    length = valid.sum(1)
    if valid.shape[1] == 0:
        return torch.zeros_like(length), length, torch.ones_like(length, dtype=torch.bool)
    first = torch.where(valid.any(1), valid.int().argmax(1), torch.zeros_like(length))
    expected = (cols >= first[:, None]) & (cols < (first + length)[:, None])
    return first, length, (valid == expected).all(1)


def checked_runs(padding_mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's prompt as one run of at least one valid token (left or right padded) and its
    response as one run from column prompt_len (right padded), else ValueError naming the row.
    Returns the prompts' first columns and lengths and the responses' lengths."""
    p_first, p_len, p_ok = _contiguous_runs(padding_mask[:, :prompt_len])
    if not bool(p_ok.all()):
        row = int((~p_ok).nonzero()[0])
        raise ValueError(f"padding_mask has a hole inside the prompt of row {row}")
    if not bool((p_len > 0).all()):
        row = int((p_len == 0).nonzero()[0])
        raise ValueError(f"row {row} has no valid prompt token (padding_mask is False there)")
    r_first, r_len, r_ok = _contiguous_runs(padding_mask[:, prompt_len:])
    r_ok &= (r_first == 0) | (r_len == 0)
    if not bool(r_ok.all()):
        row = int((~r_ok).nonzero()[0])
        raise ValueError(
            f"padding_mask has a hole inside the response of row {row}: responses must be "
            f"right-padded, their real tokens contiguous from column prompt_len={prompt_len}"
        )
    return p_first, p_len, r_len


def as_padding_mask(mask: Tensor) -> Tensor:
    """A [B, L] padding mask as bool (True = real token): bool as is, integers of 0 and 1 (the
    transformers convention) converted; other values or dtypes refused."""
    if not isinstance(mask, Tensor):
        raise ValueError(f"padding_mask must be a bool or 0/1 integer tensor, got "
                         f"{type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"padding_mask must be bool or integer 0/1 (1 = real token), got "
                         f"{mask.dtype}")
    if not ((mask == 0) | (mask == 1)).all():
        bad = mask[(mask != 0) & (mask != 1)].unique()[:5].tolist()
        raise ValueError(f"padding_mask must hold only 0 and 1 (1 = real token); it holds {bad}")
    return mask.bool()


def padding_mask_on(mask: Tensor, tokens: Tensor) -> Tensor:
    """as_padding_mask(mask) on the tokens' device: a mask built on the CPU for GPU tokens is
    moved, in the forward and in the backward's row indices alike."""
    return as_padding_mask(mask).to(tokens.device)


def rows_with_gaps(mask: Tensor) -> list[int]:
    """The rows of a [B, L] bool mask with a False between two Trues (padding inside a row's
    tokens, not only around them)."""
    before = mask.cummax(1).values
    after = mask.flip(1).cummax(1).values.flip(1)
    return (~mask & before & after).any(1).nonzero()[:, 0].tolist()


def checked_tokens(tokens) -> Tensor:
    """`tokens` if it is an int64 or int32 tensor [B, L], else ValueError naming what it is
    (uint8 or bool ids would pass the vocabulary check and fail deep inside the model)."""
    ok = isinstance(tokens, Tensor) and tokens.dim() == 2
    if not ok or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be an integer tensor [B, L] of int64 or int32, got "
                         f"{type(tokens).__name__} {tuple(getattr(tokens, 'shape', ()))} "
                         f"{getattr(tokens, 'dtype', '')}")
    return tokens


def checked_prompt_len(prompt_len, length: int) -> int:
    """`prompt_len` as an int in [1, length] (the batch's L), else ValueError naming it."""
    prompt_len = integer_arg("prompt_len", prompt_len)
    if not 1 <= prompt_len <= length:
        raise ValueError(f"prompt_len={prompt_len} is outside [1, L={length}]")
    return prompt_len
