"""The analytic BlockMask: its mask_mod against an oracle built from the rows, its full/partial
block lists against the dense mask, and eager flex_attention (forward, CPU) against the
SDPA-per-segment path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv_compile import pack
from dualkv_compile.attention.block_mask import (
    BLOCK_SIZE,
    _token_intervals,
    dense_mask,
    shared_prefix_block_mask,
    shared_prefix_mask_mod,
    visible_until,
)
from dualkv_compile.attention.sdpa_segments import sdpa_shared_prefix_attention
from dualkv_compile.testing import make_batch, random_qkv, rel_err
from dualkv_compile.tools.bench_mask_forms import interval_mask_mod, segment_mask_mod


def row_oracle_mask(pb, mask):
    """q sees kv iff some row holds both, kv not later than q; padding sees earlier padding."""
    t = pb.seq_len
    allowed = torch.zeros(t, t, dtype=torch.bool)
    index = pb._unpack_index.view(mask.shape)
    for b in range(mask.shape[0]):
        seq = index[b][mask[b]]
        n = seq.numel()
        tri = torch.ones(n, n, dtype=torch.bool).tril()
        allowed[seq[:, None], seq[None, :]] |= tri
    lo, hi = pb.padding_span
    allowed[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    return allowed


def blocks_of(num, idx):
    num, idx = num[0, 0], idx[0, 0]
    return {(i, int(j)) for i in range(num.numel()) for j in idx[i, : num[i]]}


def check_layout(tokens, mask, p):
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    dense = dense_mask(pb)
    assert torch.equal(dense, row_oracle_mask(pb, mask))
    t = pb.seq_len
    idx = torch.arange(t)
    mod = shared_prefix_mask_mod(visible_until(pb, "cpu"))
    assert torch.equal(mod(0, 0, idx[:, None], idx[None, :]), dense)
    # the forms the mask-form benchmark times against it mean the same
    segments = segment_mask_mod(pb.segment_ids[0], pb.prefix_segment_ids[0])
    assert torch.equal(segments(0, 0, idx[:, None], idx[None, :]), dense)
    intervals = interval_mask_mod(*_token_intervals(pb, "cpu"))
    assert torch.equal(intervals(0, 0, idx[:, None], idx[None, :]), dense)

    bm = shared_prefix_block_mask(pb, "cpu")
    assert bm is shared_prefix_block_mask(pb, "cpu")  # cached on the PackedBatch
    partial = blocks_of(bm.kv_num_blocks, bm.kv_indices)
    full = blocks_of(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not partial & full
    nb = t // BLOCK_SIZE
    tiles = dense.view(nb, BLOCK_SIZE, nb, BLOCK_SIZE).transpose(1, 2)
    for i in range(nb):
        for j in range(nb):
            tile = tiles[i, j]
            if (i, j) in full:
                assert tile.all(), (i, j)
            elif (i, j) in partial:
                assert tile.any() and not tile.all(), (i, j)
            else:
                assert not tile.any(), (i, j)
    return pb, bm


def test_blocks_of_a_long_shared_prompt():
    tokens, mask, p = make_batch([300], [[200, 130, 0, 77]], generator=torch.Generator().manual_seed(0))
    pb, bm = check_layout(tokens, mask, p)
    # the responses see the whole prompt: full blocks must exist below the diagonal
    assert bm.full_kv_num_blocks.sum() > 0


@settings(max_examples=25, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(1, 300), st.lists(st.integers(0, 300), min_size=1, max_size=4)),
        min_size=1, max_size=3,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_layouts(layout, seed):
    g = torch.Generator().manual_seed(seed)
    tokens, mask, p = make_batch([pl for pl, _ in layout], [rs for _, rs in layout],
                                 shuffle=True, generator=g)
    check_layout(tokens, mask, p)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_eager_flex_forward_matches_reference(hq, hkv):
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(1)
    tokens, mask, p = make_batch([150, 7], [[140, 3, 60], [200]], shuffle=True, generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, _ = random_qkv(pb, hq, hkv, 16, dtype=torch.float64, device="cpu", generator=g)
    bm = shared_prefix_block_mask(pb, "cpu")
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=hq != hkv)
    ref = sdpa_shared_prefix_attention(q, k, v, pb)
    assert rel_err(out, ref) < 1e-12


def test_block_mask_needs_t_multiple_of_block():
    tokens, mask, p = make_batch([3], [[2]])
    pb = pack(tokens, prompt_len=p, padding_mask=mask, pad_to=8)
    with pytest.raises(ValueError, match="multiple of 128, got T=8"):
        shared_prefix_block_mask(pb, "cpu")


@pytest.mark.parametrize("broken", ["segment", "group", "prompt"])
def test_visible_until_rejects_layouts_it_cannot_describe(broken):
    """The one-table mask relies on pack()'s layout (each segment and each group one run,
    prompt first); a layout without it raises instead of masking wrongly."""
    tokens, mask, p = make_batch([40, 30], [[20, 10], [15, 5]],
                                 generator=torch.Generator().manual_seed(0))
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    seg, pre = pb.segment_ids[0], pb.prefix_segment_ids[0]
    # layout: prompt 0 = tokens 0-39, responses 40-59 and 60-69; prompt 3 = 70-99, ...
    assert seg[0] == 0 and seg[45] == 1 and seg[65] == 2 and seg[75] == 3 == pre[110]
    if broken == "segment":  # the first token moved into the first response's segment
        seg[0] = 1
        match = "segment of this layout is split"
    elif broken == "group":  # a token of the first response claimed by the second group
        pre[45] = 3
        match = "group of this layout is split"
    else:  # the first group's second response claimed by the second group, before its prompt
        pre[60:70] = 3
        match = "does not start with its prompt"
    with pytest.raises(ValueError, match=match):
        visible_until(pb, "cpu")
