import pytest
import torch

from dualkv_compile import pack
from dualkv_compile.layout.packing import bucket_length
from dualkv_compile.testing import make_batch


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_layout_of_two_interleaved_groups():
    tokens = torch.tensor([
        [0, 5, 6, 10, 11, 12],   # group A (left-padded prompt "5 6"), response 3 tokens
        [7, 8, 9, 20, 0, 0],     # group B (prompt "7 8 9"), response 1 token
        [0, 5, 6, 30, 31, 0],    # group A, response 2 tokens
    ])
    mask = torch.tensor([
        [0, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 0],
    ], dtype=torch.bool)
    pb = pack(tokens, prompt_len=3, padding_mask=mask, pad_to=16)
    assert pb.group_ids.tolist() == [0, 1, 0]
    assert pb.num_tokens == 2 + 3 + 2 + 3 + 1 and pb.seq_len == 16
    expect = [5, 6, 10, 11, 12, 30, 31, 7, 8, 9, 20] + [0] * 5
    assert pb.tokens[0].tolist() == expect
    assert pb.positions[0].tolist() == [0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 3] + [0] * 5  # padding: 0
    assert pb.segment_ids[0].tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4] + [5] * 5
    assert pb.prefix_segment_ids[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3] + [5] * 5
    assert pb.prompt_lengths.tolist() == [2, 3]
    assert pb.response_lengths.tolist() == [3, 1, 2]
    replicated = 5 + 4 + 4
    assert pb.replicated_tokens == replicated
    assert pb.rho == pytest.approx(replicated / 11)
    # unpack puts every token back where it came from; padding cells are zero
    assert torch.equal(pb.unpack(pb.tokens), torch.where(mask, tokens, 0))


def test_pair_counts():
    tokens, mask, p = make_batch([4], [[2, 3]])
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    replicated = 6 * 7 // 2 + 7 * 8 // 2
    packed = 4 * 5 // 2 + (4 * 2 + 3) + (4 * 3 + 6)
    assert pb.attention_pairs == (replicated, packed)
    assert pb.pair_reduction == pytest.approx(replicated / packed)


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_pack_unpack_round_trip(pad_side):
    g = gen(1)
    tokens, mask, p = make_batch([5, 1, 9], [[3, 0, 4], [2], [7, 7]], pad_side=pad_side,
                                 shuffle=True, generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask, group_size=None)
    assert pb.num_groups == 3
    x = torch.randn(1, pb.seq_len, 3, generator=g)
    x[:, pb.num_tokens:] = 0
    rows = pb.unpack(x)
    assert rows.shape == (*tokens.shape, 3)
    assert torch.equal(pb.pack(rows), x)
    assert torch.equal(rows[~mask], torch.zeros_like(rows[~mask]))
    # positions as the rows see them: 0.. over each row's valid tokens
    expect_pos = (mask.cumsum(1) - 1).clamp_min(0) * mask
    assert torch.equal(pb.unpack(pb.positions), expect_pos)


def test_pack_and_unpack_on_other_token_axis():
    tokens, mask, p = make_batch([3, 2], [[2, 2], [1, 4]], generator=gen(2))
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    x = torch.randn(1, 2, pb.seq_len, 5)
    x[:, :, pb.num_tokens:] = 0
    rows = pb.unpack(x, dim=2)
    assert rows.shape == (4, 2, tokens.shape[1], 5)
    assert torch.equal(pb.pack(rows, dim=2), x)


def test_unpack_gradient_sums_prompt_over_the_group():
    tokens, mask, p = make_batch([3], [[2, 1, 2]], generator=gen(3))
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    x = torch.zeros(1, pb.seq_len, requires_grad=True)
    pb.unpack(x).sum().backward()
    assert x.grad[0, :3].tolist() == [3.0, 3.0, 3.0]       # prompt used by 3 rows
    assert x.grad[0, 3:8].tolist() == [1.0] * 5              # each response token once
    assert x.grad[0, 8:].abs().sum() == 0                    # padding never


def test_groups_of_one_and_empty_responses():
    tokens, mask, p = make_batch([4, 4, 2], [[0], [0, 0], [5]], generator=gen(4))
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    assert pb.num_groups == 3
    assert pb.num_tokens == 4 + 4 + 2 + 5
    assert [len(s[2]) for s in pb.group_spans] == [1, 2, 1]


def test_group_size_is_checked():
    tokens, mask, p = make_batch([3, 3], [[2, 2], [2, 2, 2]], generator=gen(5))
    with pytest.raises(ValueError, match=r"group_size=2 .* sizes \[2, 3\]"):
        pack(tokens, prompt_len=p, padding_mask=mask, group_size=2)
    tokens, mask, p = make_batch([3, 3], [[2, 2], [2, 2]], generator=gen(5))
    assert pack(tokens, prompt_len=p, padding_mask=mask, group_size=2).num_groups == 2
    # two groups that drew the same prompt merge into one of 2N rows: a valid GRPO batch (it
    # was refused as "groups of sizes [4, 2]", as if N were wrong)
    tokens, mask, p = make_batch([6, 4, 6], [[3, 5], [2, 7], [0, 4]], generator=gen(5))
    tokens[4:6, :p] = tokens[0, :p]
    assert pack(tokens, prompt_len=p, padding_mask=mask, group_size=2).num_groups == 2
    with pytest.raises(ValueError, match=r"group_size=3 .* sizes \[4, 2\] .* multiple of 3"):
        pack(tokens, prompt_len=p, padding_mask=mask, group_size=3)


def test_same_tokens_different_padding_side_is_one_group():
    left = torch.tensor([[0, 4, 5, 9]])
    right = torch.tensor([[4, 5, 0, 8]])
    tokens = torch.cat([left, right])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1]], dtype=torch.bool)
    pb = pack(tokens, prompt_len=3, padding_mask=mask)
    assert pb.group_ids.tolist() == [0, 0]
    assert pb.tokens[0, :4].tolist() == [4, 5, 9, 8]


def test_pad_to():
    tokens, mask, p = make_batch([3], [[2]])
    assert pack(tokens, prompt_len=p, padding_mask=mask, pad_to=1).seq_len == 5
    assert pack(tokens, prompt_len=p, padding_mask=mask, pad_to=4).seq_len == 8
    assert pack(tokens, prompt_len=p, padding_mask=mask).seq_len == 128


def test_geometric_buckets():
    assert [bucket_length(n) for n in (1, 128, 129, 1000)] == [128, 128, 256, 1024]
    lengths = range(1000, 64001, 7)
    for growth in (1.1, 1.5):
        buckets = sorted({bucket_length(n, 128, growth) for n in lengths})
        assert all(b % 128 == 0 for b in buckets)
        # padding: at most about (growth - 1) x T, plus the rounding to blocks
        assert all(n <= bucket_length(n, 128, growth) <= (n + 128) * growth + 128
                   for n in lengths)
        assert all(b2 >= b1 * growth for b1, b2 in zip(buckets, buckets[1:]))
    assert len({bucket_length(n, 128, 1.1) for n in lengths}) == 41  # 493 multiples of 128
    tokens, mask, p = make_batch([30], [[100, 200]])
    assert pack(tokens, prompt_len=p, padding_mask=mask, bucket_growth=2.0).seq_len == 512
    with pytest.raises(ValueError, match="bucket_growth=5"):
        pack(tokens, prompt_len=p, padding_mask=mask, bucket_growth=5)


@pytest.mark.parametrize("prompt_len", [0, 7, -1])
def test_prompt_len_outside_range(prompt_len):
    with pytest.raises(ValueError, match=rf"prompt_len={prompt_len} is outside \[1, L=6\]"):
        pack(torch.zeros(2, 6, dtype=torch.long), prompt_len=prompt_len)


def test_bad_inputs_name_the_value():
    tokens = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"padding_mask shape \(2, 5\) differs"):
        pack(tokens, prompt_len=2, padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be bool"):
        pack(tokens, prompt_len=2, padding_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="integer tensor"):
        pack(tokens.float(), prompt_len=2)
    with pytest.raises(ValueError, match="integer tensor"):
        pack(tokens[0], prompt_len=2)
    with pytest.raises(ValueError, match="pad_to=0"):
        pack(tokens, prompt_len=2, pad_to=0)
    with pytest.raises(ValueError, match="group_size=0"):
        pack(tokens, prompt_len=2, group_size=0)


def test_hole_inside_a_response():
    tokens = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4] = False  # response columns 2..5 of row 1: True False True True
    with pytest.raises(ValueError, match="hole inside the response of row 1"):
        pack(tokens, prompt_len=2, padding_mask=mask)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 2] = False  # response starts with padding
    with pytest.raises(ValueError, match="hole inside the response of row 0"):
        pack(tokens, prompt_len=2, padding_mask=mask)


def test_hole_inside_a_prompt_and_empty_prompt():
    tokens = torch.zeros(1, 6, dtype=torch.long)
    mask = torch.tensor([[1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="hole inside the prompt of row 0"):
        pack(tokens, prompt_len=3, padding_mask=mask)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="row 0 has no valid prompt token"):
        pack(tokens, prompt_len=3, padding_mask=mask)


def test_pack_checks_shapes():
    tokens, mask, p = make_batch([3], [[2]])
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    with pytest.raises(ValueError, match="token axis 1 of size 5"):
        pb.pack(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="token axis 1 of size 128"):
        pb.unpack(torch.zeros(1, 127))


def test_group_detection_survives_hash_collisions(monkeypatch):
    from dualkv_compile.layout import packing

    tokens, mask, p = make_batch([4, 4, 6], [[2, 2], [3], [1, 1]], shuffle=True, generator=gen(9))
    expected = pack(tokens, prompt_len=p, padding_mask=mask).group_ids
    real = torch.randint
    # every row hashes to 0: the exact check must notice and fall back to comparing rows
    monkeypatch.setattr(packing.torch, "randint",
                        lambda *a, **k: real(*a, **k) * 0 if k.get("generator") is packing._HASH_GEN
                        else real(*a, **k))
    assert torch.equal(pack(tokens, prompt_len=p, padding_mask=mask).group_ids, expected)
    assert pack(tokens, prompt_len=p, padding_mask=mask).num_groups == 3


def test_make_batch_ids_lie_below_vocab():
    # the README's snippet builds a model of `vocab` ids: make_batch's first tokens told the
    # groups apart with ids past vocab before
    tokens, mask, _ = make_batch([3, 5, 2], [[2], [1, 4], [3]], vocab=6,
                                 generator=torch.Generator().manual_seed(0))
    assert int(tokens[mask].min()) >= 1 and int(tokens[mask].max()) < 6
    with pytest.raises(ValueError, match="vocab=4 holds distinct first tokens for at most 2"):
        make_batch([1, 1, 1], [[1], [1], [1]], vocab=4)
