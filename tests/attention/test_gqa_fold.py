"""The attention rewrite feeds grouped-query attention its un-repeated keys and values.

transformers' repeat_kv and torchtune copy each key/value head to the query heads that use it
before SDPA. The rewritten attention indexes the shared head itself, so the rewrite bypasses
the copy. These tests check which patterns fold (and which must not), and that the folded
graph is the one the fp64 equivalence tests run.
"""

import pytest
import torch

import dualkv_compile as dk
import torch.nn.functional as F

from dualkv_compile.passes.attention_rewrite import _SDPA, _sdpa_arguments
from dualkv_compile.passes.gqa_fold import _unrepeated, fold_gqa_repeat
from dualkv_compile.testing import make_batch, same_dtype_numerics, tiny_model

B, H, T, D, R = 1, 2, 16, 8, 3


def _dynamo_graph(fn, *inputs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return graphs[0]


def _dynamo_output_node(fn, *inputs):
    """The node that produces `fn`'s result in the graph Dynamo captures."""
    (out,) = _dynamo_graph(fn, *inputs).graph.output_node().args[0]
    return out


def _folds_to_input(fn) -> bool:
    x = torch.randn(B, H, T, D)
    out = _dynamo_output_node(fn, x)
    source = _unrepeated(out)
    return source is not None and source.op == "placeholder"


def test_transformers_repeat_kv_folds():
    assert _folds_to_input(lambda x: x[:, :, None, :, :].expand(B, H, R, T, D).reshape(B, H * R, T, D))


def test_torchtune_repeat_folds():
    assert _folds_to_input(lambda x: x.unsqueeze(2).expand(-1, -1, R, -1, -1).flatten(1, 2))


def test_tiled_heads_do_not_fold():
    # head h reads kv head h % H here, not h // R: not grouped-query attention
    assert not _folds_to_input(lambda x: x[:, None].expand(B, R, H, T, D).reshape(B, R * H, T, D))


def test_transposed_repeat_does_not_fold():
    assert not _folds_to_input(
        lambda x: x.unsqueeze(2).expand(B, H, R, T, D).transpose(1, 2).reshape(B, H * R, T, D))


def test_indexing_that_moves_values_does_not_fold():
    perm = torch.arange(T).flip(0)
    assert not _folds_to_input(
        lambda x: x[:, :, None, perm].expand(B, H, R, T, D).reshape(B, H * R, T, D))


def test_keyword_calls_are_left_alone():
    assert not _folds_to_input(
        lambda x: torch.flatten(input=x.unsqueeze(2).expand(B, H, R, T, D), start_dim=1, end_dim=2))
    assert not _folds_to_input(
        lambda x: torch.reshape(input=x[:, :, None].expand(B, H, R, T, D), shape=(B, H * R, T, D)))


def _repeat(x):
    return x[:, :, None].expand(B, H, R, T, D).reshape(B, H * R, T, D)


@pytest.mark.parametrize("write_in_place", [False, True])
def test_no_fold_when_an_op_writes_in_place_before_the_attention(write_in_place):
    def attend(q, k, v):
        k = k * 1.0
        kr, vr = _repeat(k), _repeat(v)
        if write_in_place:  # the copy kr holds k from before this write; k itself does not
            k.mul_(2.0)
        return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    q, k, v = torch.randn(B, H * R, T, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    gm = _dynamo_graph(attend, q, k, v)
    sdpa = next(n for n in gm.graph.nodes if n.target in _SDPA)
    args = _sdpa_arguments(sdpa)
    repeated = fold_gqa_repeat(args, sdpa)
    if write_in_place:  # refused: the attention keeps reading the copies
        assert repeated == [] and _unrepeated(args["key"]) is not None
    else:  # folded: the attention reads the repeats' sources
        assert [_unrepeated(n) for n in repeated] == [args["key"], args["value"]]


@pytest.mark.parametrize("family", ["hf_qwen3", "hf_llama", "qwen2_5", "llama3_2"])
def test_every_family_feeds_attention_unrepeated_kv(family):
    model = same_dtype_numerics(tiny_model(family)).double()
    g = torch.Generator().manual_seed(0)
    tokens, mask, p = make_batch([9, 5], [[6, 0, 11], [3, 3]], vocab=99, generator=g)
    tokens = tokens % 101  # the tiny models' vocabulary
    dk.counters.clear()
    wrapper = dk.optimize(model)
    wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert dk.counters["gqa_repeats_folded"] == 2  # both layers of the tiny model
    gm = wrapper._backends["hidden"].last_graph
    flex = [n for n in gm.graph.nodes if "flex_attention" in str(n.target)]
    assert len(flex) == 2
    for node in flex:
        q, k, v = (a.meta["example_value"] for a in node.args[:3])
        assert (q.shape[1], k.shape[1], v.shape[1]) == (4, 2, 2)  # 4 query heads, 2 kv heads
    # no KV repeat is left (a 5-D expand: [B, Hkv, rep, T, D]); a broadcast of the rotary
    # table's inv_freq ([1, D/2, 1], transformers 5.17) may stay
    repeats = [n for n in gm.graph.nodes
               if n.target == "expand" and n.meta["example_value"].dim() >= 4]
    assert not repeats, [n.format_node() for n in repeats]
