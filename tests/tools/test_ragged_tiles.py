"""tools/ragged_tiles.py: the tile areas of other layouts agree with the package's BlockMask on
the packed layout, and the padded layouts put segments where they say."""

import pytest
import torch

from dualkv_compile import pack
from dualkv_compile.testing import make_batch
from dualkv_compile.tools.bench_ragged import tile_counts
from dualkv_compile.tools.ragged_tiles import layout_bounds, segments, varlen_area, visited_area


@pytest.mark.parametrize("seed", range(4))
def test_packed_area_is_the_block_masks_tile_count(seed):
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    groups, n = draw(1, 3), draw(1, 5)
    prompts = [draw(1, 300) for _ in range(groups)]
    responses = [[draw(1, 200) for _ in range(n)] for _ in range(groups)]
    tokens, mask, p = make_batch(prompts, responses, vocab=100, generator=g)
    counts = tile_counts(pack(tokens, prompt_len=p, padding_mask=mask), mask)
    area, partial, pairs = visited_area(*segments(prompts, responses), q_block=128)
    assert area == counts["ours"]
    # the library's BlockMask also masks the end padding's rows (a segment of their own), so in
    # the one query block where they meet real rows a tile may be partial there and full here
    packed = pack(tokens, prompt_len=p, padding_mask=mask)
    assert partial <= counts["partial"] <= partial + packed.seq_len // 128
    assert pairs == sum(p * (p + 1) // 2 + sum(p * r + r * (r + 1) // 2 for r in rs)
                        for p, rs in zip(prompts, responses))
    assert varlen_area([p + r for p, rs in zip(prompts, responses) for r in rs]) == counts["varlen"]


def test_aligned_layouts_start_segments_on_blocks():
    prompts, responses = [100, 130], [[30, 50], [1]]
    segs, length = segments(prompts, responses, align="all")
    assert [s[:2] for s in segs] == [(0, 100), (128, 158), (256, 306), (384, 514), (640, 641)]
    assert segs[4][2:] == (384, 514) and length == 768
    segs, length = segments(prompts, responses, align="prompts")
    assert [s[:2] for s in segs] == [(0, 100), (128, 158), (158, 208), (256, 386), (512, 513)]
    segs, length = segments(prompts, responses, align="groups")
    assert [s[:2] for s in segs] == [(0, 100), (100, 130), (130, 180), (256, 386), (386, 387)]
    # a finer query block never visits more area; padding never removes a visible pair
    bounds = {k: v["bound"] for k, v in layout_bounds(prompts, responses).items()}
    assert bounds["packed, 32-token q"] >= bounds["packed, 64-token q"] >= bounds["packed"]
    for align in ("groups", "prompts", "all"):
        assert visited_area(*segments(prompts, responses, align), 128)[2] == \
            visited_area(*segments(prompts, responses), 128)[2]


def test_padding_keys_make_tiles_partial_and_padding_rows_do_not():
    # prompt 128 then one response of 64: the response's block (64 real rows, 64 padding rows)
    # sees the full prompt block (full: padding rows do not count) and its own diagonal (partial)
    area, partial, _ = visited_area(*segments([128], [[64]]), 128)
    assert (area, partial) == (3, 2)  # the prompt's own diagonal and the response's
    # prompts aligned, prompt 100: its block holds 28 padding keys, so the response's tile on it
    # is partial although every real key there is visible
    area, partial, _ = visited_area(*segments([100], [[64]], "prompts"), 128)
    assert (area, partial) == (3, 3)
