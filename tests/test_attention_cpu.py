"""shared_prefix_attention on CPU (the SDPA reference path) against causal SDPA on the
replicated rows, fp64: outputs and dq/dk/dv."""

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv_compile import pack, shared_prefix_attention
from dualkv_compile.testing import (
    make_batch,
    packed_forward_backward,
    random_qkv,
    rel_err,
    replicated_forward_backward,
)

TOL = 1e-10


def response_lengths(kind, groups, group_size, g):
    if kind == "empty":
        return [[0] * group_size for _ in range(groups)]
    if kind == "one":
        return [[1] * group_size for _ in range(groups)]
    return [torch.randint(0, 40, (group_size,), generator=g).tolist() for _ in range(groups)]


def check_equivalence(tokens, mask, prompt_len, hq, hkv, d, g, scale=None):
    pb = pack(tokens, prompt_len=prompt_len, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, hq, hkv, d, dtype=torch.float64, device="cpu", generator=g)
    ours = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot, scale=scale)
    ref = replicated_forward_backward(q, k, v, pb, mask, cot, scale=scale)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))
    return pb


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("responses", ["empty", "one", "ragged"])
@pytest.mark.parametrize("prompt", [1, 7, 129])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("group_size", [1, 2, 5])
def test_matches_replicated_causal_sdpa(group_size, groups, prompt, responses, hq, hkv, d):
    seed = zlib.crc32(repr((group_size, groups, prompt, responses, hq, hkv, d)).encode())
    g = torch.Generator().manual_seed(seed)
    # groups differ in prompt length too (prompt, prompt - 1, ...), left-padded
    prompts = [max(1, prompt - i) for i in range(groups)]
    tokens, mask, p = make_batch(prompts, response_lengths(responses, groups, group_size, g),
                                 shuffle=True, generator=g)
    pb = check_equivalence(tokens, mask, p, hq, hkv, d, g)
    assert pb.num_groups == groups


def test_custom_scale_and_right_padded_prompts():
    g = torch.Generator().manual_seed(7)
    tokens, mask, p = make_batch([5, 12], [[3, 9], [4]], pad_side="right", generator=g)
    check_equivalence(tokens, mask, p, 4, 2, 8, g, scale=0.3)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(0, 40), min_size=1, max_size=4)),
        min_size=1, max_size=4,
    ),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3)]),
    pad_side=st.sampled_from(["left", "right"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_layouts(layout, heads, pad_side, seed):
    g = torch.Generator().manual_seed(seed)
    tokens, mask, p = make_batch([pl for pl, _ in layout], [rs for _, rs in layout],
                                 pad_side=pad_side, shuffle=True, generator=g)
    check_equivalence(tokens, mask, p, heads[0], heads[1], 8, g)


def test_padding_positions_are_finite_and_get_no_gradient():
    g = torch.Generator().manual_seed(8)
    tokens, mask, p = make_batch([3], [[2, 2]], generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 2, 2, 4, dtype=torch.float64, device="cpu", generator=g)
    out, dq, dk, dv = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot)
    full = shared_prefix_attention(q, k, v, pb)
    assert torch.isfinite(full).all()
    for grad in (dq, dk, dv):
        assert grad[:, :, pb.num_tokens:].abs().sum() == 0


def test_shape_errors_name_the_shapes():
    tokens, mask, p = make_batch([3], [[2]])
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q = torch.zeros(1, 4, 128, 8)
    with pytest.raises(ValueError, match=r"q must be \[1, Hq, T=128, D\], got \(1, 4, 127, 8\)"):
        shared_prefix_attention(q[:, :, :127], q, q, pb)
    with pytest.raises(ValueError, match="Hkv=3 must divide Hq=4"):
        shared_prefix_attention(q, q[:, :3], q[:, :3], pb)
    with pytest.raises(ValueError, match="head dims differ"):
        shared_prefix_attention(q, q[..., :4], q[..., :4], pb)
    with pytest.raises(TypeError, match="PackedBatch"):
        shared_prefix_attention(q, q, q, tokens)
    with pytest.raises(ValueError, match="CUDA kernel only"):
        shared_prefix_attention(q, q, q, pb, kernel_options={"BLOCK_M": 64})
