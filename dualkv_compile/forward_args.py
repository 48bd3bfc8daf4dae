"""How the wrapper's forward reads a model's own calling convention: the tokens and padding
mask from torchtune's (tokens, mask, input_pos) or transformers' (input_ids, attention_mask,
position_ids), checked against what the packed layout assumes."""

from __future__ import annotations

import torch
from torch import Tensor

from .layout.batch_checks import padding_mask_on, rows_with_gaps

__all__ = ["padding_from_torchtune_mask", "row_positions", "split_forward_args"]


def row_positions(padding_mask: Tensor) -> Tensor:
    """[B, L] padding mask -> each token's position in its row (0.. over the valid tokens)."""
    return (padding_mask.long().cumsum(1) - 1).clamp_min(0)


def split_forward_args(adapter, args, kwargs, check_tokens) -> tuple[Tensor, Tensor | None]:
    """(tokens, padding_mask) from the model's own calling convention: torchtune's mask or
    transformers' attention_mask, or padding_mask=, or both if they agree."""
    if len(args) > 1:  # transformers' positional attention_mask was silently ignored
        raise ValueError(f"pass only the tokens positionally, got {len(args)} arguments")
    kwargs = dict(kwargs)
    tt = adapter.name == "torchtune"
    tokens = args[0] if args else kwargs.pop("tokens" if tt else "input_ids", None)
    positions = kwargs.pop("input_pos" if tt else "position_ids", None)
    name = "mask" if tt else "attention_mask"
    masks = [kwargs.pop(name, None), kwargs.pop("padding_mask", None)]
    name_given = masks[0] is not None
    if not tt:
        if kwargs.pop("use_cache", None):  # False or None: what a training forward passes
            raise ValueError("use_cache=True: the dualkv wrapper returns no KV cache (it runs "
                             "training forwards); pass use_cache=False or leave it out")
    if kwargs:  # inputs_embeds among them: packing needs the token ids
        raise ValueError(f"unsupported arguments for the dualkv wrapper: {sorted(kwargs)}")
    check_tokens(tokens)
    if positions is not None:
        _check_positions(positions, "input_pos" if tt else "position_ids", tokens)
    if tt and masks[0] is not None:
        masks[0] = padding_from_torchtune_mask(adapter, masks[0], positions)
    masks = [padding_mask_on(m, tokens) for m in masks if m is not None]
    if not tt and positions is None and name_given:
        _check_no_gaps(masks[0])
    if len(masks) == 2 and not torch.equal(*masks):
        raise ValueError(f"{name} and padding_mask describe different padding")
    padding_mask = masks[0] if masks else None
    if positions is not None:
        positions = positions.to(tokens.device)
        mask = (padding_mask if padding_mask is not None
                else torch.ones_like(tokens, dtype=torch.bool))
        expected = row_positions(mask)
        if not torch.equal(torch.where(mask, positions, 0), torch.where(mask, expected, 0)):
            raise ValueError("the given positions differ from 0.. over each row's valid "
                             "tokens, which is what the packed layout uses" + (
                                 "; with torchtune's mask, input_pos must also be 0 at padding "
                                 "(get_position_ids_from_padding_mask): a last column at "
                                 "another position is read as a token"
                                 if tt and name_given else ""))
    return tokens, padding_mask


def _check_positions(positions, name: str, tokens: Tensor) -> None:
    """[B, L] or [1, L] integers (and torchtune's input_pos [L], which its forward takes)."""
    b, length = tokens.shape
    shapes = [(b, length), (1, length)] + ([(length,)] if name == "input_pos" else [])
    if not (isinstance(positions, Tensor) and tuple(positions.shape) in shapes
            and not positions.is_floating_point() and positions.dtype != torch.bool):
        shown = (f"{tuple(positions.shape)} {positions.dtype}" if isinstance(positions, Tensor)
                 else type(positions).__name__)
        raise ValueError(f"{name} must be an integer tensor shaped "
                         f"{' or '.join(str(list(x)) for x in shapes)} for the tokens "
                         f"{(b, length)}, got {shown}")


def _check_no_gaps(attention_mask: Tensor) -> None:
    """transformers' forward numbers positions 0..L-1 when position_ids is not given, across
    any padding; the packed layout numbers each row's valid tokens from 0. The two agree up to
    a shift (RoPE sees only differences) unless padding lies between a row's tokens."""
    gaps = rows_with_gaps(attention_mask)
    if gaps:
        raise ValueError(f"attention_mask rows {gaps[:8]} have padding between their tokens: "
                         "without position_ids the model numbers positions across it and the "
                         "packed layout does not; pass position_ids "
                         "((attention_mask.cumsum(-1) - 1).clamp(min=0)) or padding_mask=")


def padding_from_torchtune_mask(adapter, mask: Tensor, positions: Tensor | None) -> Tensor:
    """torchtune's [B, L, L] mask (get_causal_mask_from_padding_mask: causal over valid keys,
    diagonal forced True) -> the [B, L] padding mask. Its last row gives every column but
    the last; whether the last column is padding only input_pos tells (padding has 0)."""
    if mask.dim() != 3 or mask.shape[1] != mask.shape[2] or mask.dtype != torch.bool:
        raise ValueError(f"mask must be torchtune's bool [B, L, L] causal mask, got "
                         f"{tuple(mask.shape)} {mask.dtype}")
    if positions is None:
        raise ValueError("with torchtune's mask, pass input_pos as well: only the positions "
                         "tell whether the last column is padding (or pass padding_mask=)")
    padding = mask[:, -1, :].clone()
    if mask.shape[1] > 1:
        padding[:, -1] = positions[..., -1] > 0  # input_pos [B, L], or [L] for every row
        lone = (~padding[:, :-1].any(1)).nonzero()[:, 0].tolist()
        if lone:  # its position is 0 whether it is a token or padding
            raise ValueError(f"rows {lone} of torchtune's mask have no token before the last "
                             "column, so mask and input_pos cannot tell whether that column "
                             "is a token or padding; pass padding_mask= instead")
    expected = adapter.replicated_mask(padding)
    if not torch.equal(mask, expected):
        raise ValueError("mask is not a causal padding mask as torchtune's "
                         "get_causal_mask_from_padding_mask builds it; only causal attention "
                         "can share a prompt")
    return padding
