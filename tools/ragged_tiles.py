"""Tile areas of other layouts of a ragged micro-batch (CPU): would padding segments to block
boundaries, or finer query blocks, let a tiled kernel beat the varlen baseline (issue #25)?

A layout places each group's prompt and then its responses in one sequence, optionally padded
so that groups start on a 128-token block, prompts fill whole blocks, or every segment starts on
one; a response sees its group's prompt and itself causally. A block-sparse kernel visits every
(query block, key block) tile holding one visible pair, and a partial tile (one a mask must be
evaluated on) costs as much as a full one. A padding key is masked like any invisible key; a
padding query's row is not used, so it makes no tile partial. Areas are in units of 128 x 128
tiles, so that finer query blocks compare with coarser ones. The bound of a layout is
(varlen area / its area) / ideal, ideal = varlen pairs / packed pairs (padding pairs are not
counted as work): what a kernel of the varlen kernel's per-tile speed would reach against it.
"""

from __future__ import annotations

import torch

KV_BLOCK = 128
LAYOUTS = {  # name: (padding policy, query block, the varlen kernel's query block)
    "packed": (None, 128, 128),
    "groups aligned": ("groups", 128, 128),
    "prompts aligned": ("prompts", 128, 128),
    "all aligned": ("all", 128, 128),
    "packed, 64-token q": (None, 64, 128),
    "packed, 32-token q": (None, 32, 128),
    "both 32-token q": (None, 32, 32),  # as FA4 packs 4 query heads of a KV head in 128 rows
}


def segments(prompts, responses, align=None):
    """[(start, end, prompt start, prompt end)] of every segment (a prompt sees no other prompt)
    and the sequence length; `align` in (None, "groups", "prompts", "all") pads to KV_BLOCK
    boundaries: "groups" before each prompt, "prompts" before and after each prompt, "all" after
    every segment too."""
    up = lambda x: -(-x // KV_BLOCK) * KV_BLOCK  # noqa: E731
    segs, pos = [], 0
    for p, rs in zip(prompts, responses):
        start = up(pos) if align else pos
        segs.append((start, start + p, start, start))
        pos = up(start + p) if align in ("prompts", "all") else start + p
        for r in rs:
            segs.append((pos, pos + r, start, start + p))
            pos = up(pos + r) if align == "all" else pos + r
    return segs, pos


def visited_area(segs, length, q_block) -> tuple[float, float, int]:
    """(area of the visited tiles, area of the partial ones, in 128 x 128 units; visible pairs)
    of a layout."""
    pairs = torch.zeros(-(-length // q_block), -(-length // KV_BLOCK), dtype=torch.int64)
    real_rows = torch.zeros(pairs.shape[0], dtype=torch.int64)
    for start, end, p_start, p_end in segs:
        q = torch.arange(start, end)
        real_rows.index_add_(0, q // q_block, torch.ones_like(q))
        for lo, hi in ((torch.full_like(q, p_start), torch.full_like(q, p_end)),
                       (torch.full_like(q, start), q + 1)):
            if not bool((hi > lo).any()):
                continue
            for kb in range(int(lo.min()) // KV_BLOCK, (int(hi.max()) - 1) // KV_BLOCK + 1):
                n = (hi.clamp(max=(kb + 1) * KV_BLOCK) - lo.clamp(min=kb * KV_BLOCK)).clamp(min=0)
                pairs[:, kb].index_add_(0, q // q_block, n)
    visited = pairs > 0
    partial = visited & (pairs < real_rows[:, None] * KV_BLOCK)
    unit = q_block / KV_BLOCK
    return int(visited.sum()) * unit, int(partial.sum()) * unit, int(pairs.sum())


def varlen_area(lengths, q_block=128) -> float:
    """Area (128 x 128 units) a causal varlen kernel visits over rows of these lengths."""
    tiles = sum(-(-min(n, (b + 1) * q_block) // KV_BLOCK)
                for n in lengths for b in range(-(-n // q_block)))
    return tiles * q_block / KV_BLOCK


def layout_bounds(prompts, responses) -> dict:
    """{layout name: {"bound", "partial" (share of the visited area), "padding" (tokens)}} for
    LAYOUTS."""
    lengths = [p + r for p, rs in zip(prompts, responses) for r in rs]
    varlen_pairs = sum(n * (n + 1) // 2 for n in lengths)
    packed_pairs = visited_area(*segments(prompts, responses), 128)[2]
    ideal = varlen_pairs / packed_pairs
    tokens = sum(p + sum(rs) for p, rs in zip(prompts, responses))
    bounds = {}
    for name, (align, q_block, varlen_q_block) in LAYOUTS.items():
        segs, length = segments(prompts, responses, align)
        area, partial, _ = visited_area(segs, length, q_block)
        bounds[name] = {"bound": varlen_area(lengths, varlen_q_block) / area / ideal,
                        "partial": partial / area, "padding": length - tokens}
    return bounds
