"""The LM head's targets: for every valid response token of a [B, L] batch, the hidden state
that predicts it (in the packed layout, or in the rows), its token id, and where its value goes
in the [B, L - prompt_len] output."""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout.packing import PackedBatch
from .gather_rows import SharedRows

__all__ = ["predictions", "row_sources", "scatter_responses"]


def predictions(tokens, mask, prompt_len, pb: PackedBatch):
    """For every valid response token: the packed index of the hidden state that predicts it
    (the previous token of its row; the prompt's last token for the first), its token id, and
    its flat index in the [B, L - prompt_len] output; and where those sources repeat (the
    prompt's last token, once per member with a response), as gather_rows takes it."""
    b, l = tokens.shape
    r = l - prompt_len
    device = tokens.device
    index = pb.on_device("_unpack_index", device).view(b, l)
    valid = mask[:, prompt_len:]
    resp = index[:, prompt_len:]  # packed index of each response token
    # previous token: the one before it in the packed response, or the prompt's last token
    group_last = torch.tensor([pe - 1 for _, pe, _ in pb.group_spans], device=device)
    group = pb.on_device("group_ids", device)
    prev = torch.cat([group_last[group][:, None], resp[:, :-1]], dim=1)
    dst = (torch.arange(b, device=device)[:, None] * r + torch.arange(r, device=device))[valid]
    # the gathered index of each row's first response token (responses are right-padded)
    counts = valid.sum(1)
    starts, has_first = counts.cumsum(0) - counts, valid[:, 0]
    shared = SharedRows(rows=group_last, members=starts[has_first], slot=group[has_first])
    return prev[valid], tokens[:, prompt_len:][valid], dst, shared


def row_sources(mask, prompt_len, device):
    """Same as predictions' sources, but as flat indices into the [B, L] rows: the previous
    valid column of each valid response token."""
    b, l = mask.shape
    cols = torch.arange(l, device=device).expand(b, l)
    last_valid = torch.where(mask, cols, torch.full_like(cols, -1)).cummax(1).values
    prev = torch.cat([torch.full_like(cols[:, :1], -1), last_valid[:, :-1]], dim=1)
    flat = torch.arange(b, device=device)[:, None] * l + prev
    return flat[:, prompt_len:][mask[:, prompt_len:]]


def scatter_responses(values: Tensor, dst: Tensor, tokens: Tensor, prompt_len: int) -> Tensor:
    """values [M] at flat positions dst of a zero [B, L - prompt_len]."""
    b, l = tokens.shape
    return values.new_zeros(b * (l - prompt_len)).index_put((dst,), values).view(b, l - prompt_len)
