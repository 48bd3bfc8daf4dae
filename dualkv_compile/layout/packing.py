"""Packing a replicated GRPO batch into one shared-prefix sequence.

A batch ``tokens [B, L]`` holds, per row, a prompt in columns ``[0, prompt_len)`` (padded left
or right) and a response in the remaining columns (padded right). Rows whose valid prompt
tokens are identical form a group. The packed sequence lays each group out as its prompt once,
followed by the responses of its members in row order, and pads the whole to a multiple of
``pad_to``::

    [ prompt_1 | resp_1,1 | ... | resp_1,N | prompt_2 | resp_2,1 | ... | pad ]

Positions restart at the row's valid prompt length for every response, so each token keeps the
position it had in its own row. Every prompt, every response and the padding get their own
segment id; a token may attend to an earlier token of its own segment or, for a response token,
to any token of its group's prompt (``prefix_segment_ids``).

This module holds pack() and PackedBatch; the batch's input checks are in batch_checks.py, the
packed lengths (buckets) in buckets.py, both re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..arguments import integer_arg
from .batch_checks import padding_mask_on, checked_prompt_len, checked_runs, checked_tokens
from .buckets import bucket_count, bucket_length, check_bucket_growth

__all__ = ["PackedBatch", "bucket_count", "bucket_length", "pack"]  # bucket_*: from buckets.py


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """One packed micro-batch: the [1, T] layout plus what maps it back to the [B, L] rows.

    Built by :func:`pack`; do not construct it by hand. Index tensors live on the device of the
    tokens given to :func:`pack`; copies for other devices are made on first use and cached.
    """

    tokens: Tensor  # [1, T] int64 or int32 as given, padding positions hold 0
    positions: Tensor  # [1, T] int64: prompt 0..p-1, each response p.., padding 0
    segment_ids: Tensor  # [1, T] int32: one id per prompt, per response, and for the padding
    prefix_segment_ids: Tensor  # [1, T] int32: the prompt segment a token may also see (else own)
    group_ids: Tensor  # [B] int64: group of each row, numbered by first appearance
    prompt_lengths: Tensor  # [G] int64: valid prompt tokens of each group
    response_lengths: Tensor  # [B] int64: valid response tokens of each row
    prompt_len: int  # the column where responses start in the [B, L] batch
    batch_shape: tuple[int, int]  # (B, L)
    num_tokens: int  # valid packed tokens, before padding to a multiple of pad_to
    # segments as python ints, for the CPU reference: per group (prompt_start, prompt_end,
    # ((response_start, response_end), ...)), and the padding range (start, end)
    group_spans: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    padding_span: tuple[int, int]
    _unpack_index: Tensor  # [B * L] -> packed index; T marks a padding cell
    _pack_index: Tensor  # [T] -> flat B * L index; B * L marks a padding position
    _cache: dict = field(default_factory=dict, repr=False)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """T, the packed length including padding."""
        return self.tokens.shape[1]

    @property
    def num_groups(self) -> int:
        return len(self.group_spans)

    @property
    def replicated_tokens(self) -> int:
        """Valid tokens of the [B, L] batch: what the model would process without packing."""
        rows = self.prompt_lengths[self.group_ids] + self.response_lengths
        return int(rows.sum())

    @property
    def rho(self) -> float:
        """Token reduction: replicated valid tokens / packed valid tokens (padding excluded)."""
        return self.replicated_tokens / self.num_tokens

    @property
    def attention_pairs(self) -> tuple[int, int]:
        """(replicated, packed) causal query-key pairs, counting the diagonal."""
        replicated = packed = 0
        for (ps, pe, responses) in self.group_spans:
            p = pe - ps
            packed += p * (p + 1) // 2
            for rs, re in responses:
                r = re - rs
                replicated += (p + r) * (p + r + 1) // 2
                packed += p * r + r * (r + 1) // 2
        return replicated, packed

    def token_rows(self) -> Tensor:
        """[T] int64: how many rows of the [B, L] batch each packed position stands for: a
        prompt token its group's row count, a response token 1, padding 0. A per-token
        statistic gathered inside the model (a router's expert choices, say) weighted by it
        equals the same statistic over the replicated rows' valid tokens."""
        weights = torch.zeros(self.seq_len, dtype=torch.long)
        rows = torch.bincount(self.group_ids.cpu(), minlength=self.num_groups).tolist()
        for (ps, pe, responses), n in zip(self.group_spans, rows):
            weights[ps:pe] = n
            for rs, re in responses:
                weights[rs:re] = 1
        return weights.to(self.tokens.device)

    @property
    def pair_reduction(self) -> float:
        """Ideal attention speed-up: replicated pairs / packed pairs."""
        replicated, packed = self.attention_pairs
        return replicated / packed

    # ---- moving per-token tensors between the layouts ----------------------------------------
    def on_device(self, name: str, device: torch.device) -> Tensor:
        """The batch's table `name` (e.g. "group_ids") on `device`, copied once and cached. A
        batch packed under torch.inference_mode holds inference tensors, which autograd cannot
        save: used outside the mode, the table is a copy."""
        def build():
            table = getattr(self, name).to(device)
            return table.clone() if _inference_outside_the_mode(table) else table

        return self.cached(name, build, device)

    def pack(self, x: Tensor, *, dim: int = 1) -> Tensor:
        """[B, L, ...] -> [1, T, ...] (token axis `dim`, batch axis 0): each prompt taken once,
        from its group's first row; padding positions are zero."""
        b, l = self.batch_shape
        dim = dim % x.dim()
        if dim == 0 or x.shape[0] != b or x.shape[dim] != l:
            raise ValueError(f"pack expects batch axis 0 of size {b} and token axis {dim} of "
                             f"size {l}, got shape {tuple(x.shape)}")
        rows = x.movedim(dim, 1)
        flat = rows.reshape(b * l, *rows.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        out = flat[self.on_device("_pack_index", x.device)]
        return out.unsqueeze(0).movedim(1, dim)

    def unpack(self, x: Tensor, *, dim: int = 1) -> Tensor:
        """[1, T, ...] -> [B, L, ...] (token axis `dim`): prompt values broadcast to every member
        of the group, padding cells zero. Differentiable: gradients of a prompt position sum over
        the group."""
        b, l = self.batch_shape
        dim = dim % x.dim()
        if dim == 0 or x.shape[0] != 1 or x.shape[dim] != self.seq_len:
            raise ValueError(f"unpack expects batch axis 0 of size 1 and token axis {dim} of "
                             f"size {self.seq_len}, got shape {tuple(x.shape)}")
        flat = x.movedim(dim, 1)[0]
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        out = flat[self.on_device("_unpack_index", x.device)]
        return out.reshape(b, l, *out.shape[1:]).movedim(1, dim)

    def cached(self, key, build, device=None):
        """Per-batch cache for derived objects (block masks): `build()` runs once per key and
        inference mode (what it builds inside torch.inference_mode is of no use outside)."""
        # (Dynamo cannot trace the mode's state; a traced call is not an inference-mode call)
        key = (key, device, not torch.compiler.is_compiling() and
               torch.is_inference_mode_enabled())
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def _inference_outside_the_mode(t: Tensor) -> bool:
    """An inference tensor used outside torch.inference_mode, where autograd cannot save it (a
    traced call is never one: Dynamo cannot trace the mode's state)."""
    return not torch.compiler.is_compiling() and t.is_inference() and \
        not torch.is_inference_mode_enabled()


def _row_classes(key: Tensor) -> Tensor:
    """Class id of each row of `key` [B, K] (equal rows share one). A polynomial hash per row,
    then an exact check of every row against its class's first row; torch.unique(dim=0), a
    lexicographic sort of whole rows, only if two different rows ever share a hash."""
    weights = torch.randint(1, 2**61, (key.shape[1],), generator=_HASH_GEN).to(key.device)
    h = (key.long() * weights).sum(1)  # wraps around in int64: a hash, checked below
    _, inverse = torch.unique(h, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, torch.arange(key.shape[0], device=key.device), "amin")
    if bool((key == key[first[inverse]]).all()):
        return inverse
    return torch.unique(key, dim=0, return_inverse=True)[1]


_HASH_GEN = torch.Generator().manual_seed(0x5EED)


def prompt_keys(tokens: Tensor, first: Tensor, length: Tensor, prompt_len: int) -> Tensor:
    """[B, 1 + prompt_len]: each row's valid prompt length and tokens, left-aligned, zero-filled
    (first, length: _contiguous_runs of the prompt mask). Equal keys = a shared prompt."""
    cols = torch.arange(prompt_len, device=tokens.device)
    src = (first[:, None] + cols).clamp(max=prompt_len - 1)
    aligned = tokens[:, :prompt_len].gather(1, src)
    aligned = torch.where(cols < length[:, None], aligned, torch.zeros_like(aligned))
    return torch.cat([length[:, None], aligned], dim=1)  # the length disambiguates the filler


def _detect_groups(tokens: Tensor, first: Tensor, length: Tensor, prompt_len: int) -> Tensor:
    """Group id of each row (numbered by first appearance): rows with equal valid prompts."""
    b = tokens.shape[0]
    inverse = _row_classes(prompt_keys(tokens, first, length, prompt_len))
    first_row = torch.full((b,), b, dtype=torch.long, device=tokens.device)
    first_row = first_row.scatter_reduce(0, inverse, torch.arange(b, device=tokens.device), "amin")
    order = torch.argsort(first_row[: int(inverse.max()) + 1])
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return rank[inverse]


def pack(
    tokens: Tensor,
    *,
    prompt_len: int,
    padding_mask: Tensor | None = None,
    group_size: int | None = None,
    pad_to: int = 128,
    bucket_growth: float = 1.0,
) -> PackedBatch:
    """Pack `tokens [B, L]` (prompt in columns [0, prompt_len), response after) into one
    shared-prefix sequence. `padding_mask [B, L]` (True = real token) marks left or right padding
    of prompts and right padding of responses. Rows with identical valid prompts form a group;
    `group_size`, when given, is checked against the data (a group of a multiple of it is groups
    that drew the same prompt, merged). The packed length is
    `bucket_length(valid tokens, pad_to, bucket_growth)`."""
    checked_tokens(tokens)
    b, l = tokens.shape
    if b == 0:
        raise ValueError("tokens has no rows (B=0)")
    prompt_len = checked_prompt_len(prompt_len, l)
    pad_to = integer_arg("pad_to", pad_to, 1)
    check_bucket_growth(bucket_growth)
    if group_size is not None:
        group_size = integer_arg("group_size", group_size, 1)
    if padding_mask is None:
        padding_mask = torch.ones_like(tokens, dtype=torch.bool)
    padding_mask = padding_mask_on(padding_mask, tokens)
    if padding_mask.shape != tokens.shape:
        raise ValueError(f"padding_mask shape {tuple(padding_mask.shape)} differs from tokens "
                         f"shape {(b, l)}")

    p_first, p_len, r_len = checked_runs(padding_mask, prompt_len)

    group_of_row = _detect_groups(tokens, p_first, p_len, prompt_len)
    num_groups = int(group_of_row.max()) + 1
    sizes = torch.bincount(group_of_row, minlength=num_groups)
    if group_size is not None and bool((sizes % group_size).any()):
        raise ValueError(f"group_size={group_size} but the prompts form groups of sizes "
                         f"{sizes.tolist()} (rows with identical prompts form one group, so "
                         f"each size must be a multiple of {group_size})")
    return _build(tokens, padding_mask, prompt_len, (pad_to, bucket_growth), group_of_row, p_first,
                  p_len, r_len)


def _build(tokens, mask, prompt_len, bucketing, group_of_row, p_first, p_len, r_len) -> PackedBatch:
    b, l = tokens.shape
    dev = tokens.device
    groups = group_of_row.tolist()
    p_first_l, p_len_l, r_len_l = p_first.tolist(), p_len.tolist(), r_len.tolist()
    members: list[list[int]] = [[] for _ in range(max(groups) + 1)]
    for row, g in enumerate(groups):
        members[g].append(row)

    # Segments in packed order: (source row, first source column, length, position offset,
    # segment index of the group's prompt; a prompt's is its own)
    seg_row, seg_col, seg_len, seg_pos, seg_prefix = [], [], [], [], []
    group_spans, prompt_start_of_group, response_start_of_row = [], [], [0] * b
    cursor = 0
    for rows in members:
        rep = rows[0]
        p = p_len_l[rep]
        prompt_seg = len(seg_row)
        seg_row.append(rep), seg_col.append(p_first_l[rep]), seg_len.append(p)
        seg_pos.append(0), seg_prefix.append(prompt_seg)
        prompt_start_of_group.append(cursor)
        ps, cursor = cursor, cursor + p
        responses = []
        for row in rows:
            seg_row.append(row), seg_col.append(prompt_len), seg_len.append(r_len_l[row])
            seg_pos.append(p), seg_prefix.append(prompt_seg)
            response_start_of_row[row] = cursor
            responses.append((cursor, cursor + r_len_l[row]))
            cursor += r_len_l[row]
        group_spans.append((ps, ps + p, tuple(responses)))
    num_tokens = cursor
    seq_len = bucket_length(num_tokens, *bucketing)
    num_pad = seq_len - num_tokens
    num_segs = len(seg_row)

    def t(values):
        return torch.tensor(values, dtype=torch.long, device=dev)

    lengths = t(seg_len)
    seg_of_tok = torch.repeat_interleave(torch.arange(num_segs, device=dev), lengths)
    seg_start = torch.cumsum(lengths, 0) - lengths
    offset = torch.arange(num_tokens, device=dev) - seg_start[seg_of_tok]
    src_row = t(seg_row)[seg_of_tok]
    src_col = t(seg_col)[seg_of_tok] + offset
    positions = t(seg_pos)[seg_of_tok] + offset
    prefix = t(seg_prefix)[seg_of_tok]

    pad = torch.arange(num_pad, device=dev)
    pad_seg = torch.full((num_pad,), num_segs, dtype=torch.long, device=dev)
    segment_ids = torch.cat([seg_of_tok, pad_seg]).to(torch.int32)
    prefix_segment_ids = torch.cat([prefix, pad_seg]).to(torch.int32)
    # padding sits at position 0: it is masked from every real token, and a position past the
    # model's max_seq_len (padding can be pad_to - 1 long) would overrun its RoPE cache
    positions = torch.cat([positions, torch.zeros_like(pad)])
    pack_index = torch.cat([src_row * l + src_col, torch.full_like(pad, b * l)])
    packed_tokens = torch.cat([tokens.reshape(-1), tokens.new_zeros(1)])[pack_index]

    # unpack: packed index of every valid cell of the [B, L] batch
    cols = torch.arange(l, device=dev)
    prompt_start = t(prompt_start_of_group)[group_of_row]
    from_prompt = prompt_start[:, None] + cols - p_first[:, None]
    from_response = t(response_start_of_row)[:, None] + cols - prompt_len
    unpack_index = torch.where(cols < prompt_len, from_prompt, from_response)
    unpack_index = torch.where(mask, unpack_index, torch.full_like(unpack_index, seq_len))

    return PackedBatch(
        tokens=packed_tokens.unsqueeze(0),
        positions=positions.unsqueeze(0),
        segment_ids=segment_ids.unsqueeze(0),
        prefix_segment_ids=prefix_segment_ids.unsqueeze(0),
        group_ids=group_of_row,
        prompt_lengths=t([p_len_l[rows[0]] for rows in members]),
        response_lengths=r_len.to(torch.long),
        prompt_len=prompt_len,
        batch_shape=(b, l),
        num_tokens=num_tokens,
        group_spans=tuple(group_spans),
        padding_span=(num_tokens, seq_len),
        _unpack_index=unpack_index.reshape(-1),
        _pack_index=pack_index,
    )
