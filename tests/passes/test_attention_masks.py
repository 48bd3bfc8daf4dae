"""Attention the rewrite must not take for causal: a mask the model builds from positions is
rewritten only if it is causal (a sliding window, an ALiBi bias or bidirectional attention each
once became the causal shared-prefix mask without a word), a mask written in place is refused
(the check once read it as first built, so a window or bias written in place was dropped), and
a flex_attention call of the model's own is refused (it once ran over the whole packed
sequence)."""

import pytest
import torch
import torch.nn.functional as F

import dualkv_compile as dk
from dualkv_compile import Refusal  # the public name
from dualkv_compile.testing import (make_batch, row_by_row_response_logprobs,
                                    same_dtype_numerics, tiny_model)


def _mask(kind, input_pos, s, dtype):
    """The [b, 1, s, s] mask of `kind` for queries and keys at input_pos [b, s]."""
    if kind == "window_from_arange":  # from shapes only, no positions
        input_pos = torch.arange(s)[None]
    d = input_pos[:, :, None] - input_pos[:, None, :]  # query position - key position
    if kind == "causal":
        return (d >= 0)[:, None]
    if kind == "causal_additive":
        return torch.where(d >= 0, 0.0, float("-inf")).to(dtype)[:, None]
    if kind in ("window", "window_from_arange"):
        return ((d >= 0) & (d < 3))[:, None]
    if kind == "alibi":
        return torch.where(d >= 0, -0.5 * d.to(dtype), float("-inf"))[:, None]
    if kind == "bidirectional":
        return torch.ones(s, s, dtype=torch.bool)
    if kind == "bidirectional_for_short_rows":  # causal for the packed T, not for a row
        return ((d >= 0) | (input_pos.amax() < 100))[:, None]
    if kind == "bidirectional_for_short_rows_by_aten":  # its op's name is "default"
        return ((d >= 0) | (torch.ops.aten.amax.default(input_pos, [-1]) < 100)[:, None])[:, None]
    if kind == "causal_by_elementwise_max":  # torch.max(a, b) is pointwise: no reduction
        return (torch.max(d, torch.zeros_like(d)) == d)[:, None]
    return _mask_in_place(kind, input_pos[0], s, dtype)


@torch.library.custom_op("dualkv_test::keep_band", mutates_args=("m",))
def _keep_band(m: torch.Tensor, width: int) -> None:
    i = torch.arange(m.shape[-1], device=m.device)
    m.logical_and_((i[:, None] - i[None, :]) < width)


def _mask_in_place(kind, i, s, dtype):
    """A causal [s, s] mask for the positions i [s] made non-causal by an in-place statement."""
    if kind == "setitem_from_arange":
        i = torch.arange(s)
    d = i[:, None] - i[None, :]
    if kind == "ancestor_in_place":
        d.abs_()  # d >= 0 is then True everywhere: bidirectional
    m = d >= 0
    if kind == "window_in_place":
        m.logical_and_(d < 3)
    elif kind == "window_by_dunder":  # the method form of m &= ..., once not read as a write
        m.__iand__(d < 3)
    elif kind == "tril_in_place":  # drops the first subdiagonal
        m.tril_(-2)
        m.fill_diagonal_(True)
    elif kind == "setitem_from_arange":
        m[1:, 0] = False  # later queries stop seeing the first key
    elif kind == "window_by_aten_overload":  # its name is "default": once read as no write
        torch.ops.aten.logical_and_.default(m, d < 3)
    elif kind == "window_by_custom_op":  # a user kernel declared to write its argument
        _keep_band(m, 3)
    elif kind == "alibi_in_place":
        m = torch.where(m, 0.0, float("-inf")).to(dtype)
        m.add_(-0.5 * d.to(dtype))
    else:
        assert kind == "ancestor_in_place"
    return m


class _OwnAttention(torch.nn.Module):
    """A torchtune layer's projections and RoPE, with attention the model computes itself:
    SDPA with a mask of `kind`, or (kind "flex") flex_attention with a causal BlockMask."""

    def __init__(self, inner, kind):
        super().__init__()
        self.inner, self.kind = inner, kind
        self.cache_enabled, self.kv_cache = False, None  # what torchtune's layer asks of it

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        a, (b, s, _) = self.inner, x.shape
        q = a.q_proj(x).view(b, s, a.num_heads, a.head_dim)
        k = a.k_proj(x).view(b, s, a.num_kv_heads, a.head_dim)
        v = a.v_proj(x).view(b, s, a.num_kv_heads, a.head_dim)
        q, k = a.pos_embeddings(q, input_pos=input_pos), a.pos_embeddings(k, input_pos=input_pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kind == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s,
                                           device="cpu")
            out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        else:
            pos = torch.arange(s)[None] if input_pos is None else input_pos
            attn_mask = _mask(self.kind, pos, s, q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        return a.output_proj(out.transpose(1, 2).reshape(b, s, -1))


def _run(kind, layers=(0, 1)):
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    for i in layers:
        model.layers[i].attn = _OwnAttention(model.layers[i].attn, kind)
    tokens, mask, p = make_batch([9, 5], [[6, 2, 4], [3, 3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    dk.counters.clear()
    with torch.no_grad():
        ours = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
        return ours, row_by_row_response_logprobs(model, tokens, mask, p)


@pytest.mark.parametrize("kind", ["causal", "causal_additive"])
def test_a_causal_mask_built_from_positions_is_rewritten(kind):
    ours, plain = _run(kind)
    assert dk.counters["attention_rewritten"] == 2
    assert float((ours - plain).abs().max()) < 1e-10


@pytest.mark.parametrize("kind", ["window", "window_from_arange", "alibi", "bidirectional"])
def test_a_mask_that_is_not_causal_is_refused(kind):
    with pytest.raises(Refusal, match="mask built from positions that is not causal"):
        _run(kind)


@pytest.mark.parametrize("kind, op", [("window_in_place", "logical_and_"),
                                      ("tril_in_place", "tril_"),
                                      ("setitem_from_arange", "setitem"),
                                      ("alibi_in_place", "add_"),
                                      ("ancestor_in_place", "abs_"),
                                      ("window_by_dunder", "__iand__"),
                                      ("window_by_aten_overload", "default"),
                                      ("window_by_custom_op", "default")])
def test_a_mask_written_in_place_is_refused(kind, op):
    with pytest.raises(Refusal, match=rf"mask written in place \({op} at "):
        _run(kind)


def test_the_models_own_flex_attention_is_refused():
    with pytest.raises(Refusal, match="calls flex_attention itself"):
        _run("flex", layers=(1,))  # layer 0 keeps torchtune's SDPA, which is rewritten


def test_a_mask_that_cannot_be_computed_is_refused(monkeypatch):
    from dualkv_compile.passes import attention_rewrite

    def fails(mask, positions):
        raise RuntimeError("no such device")

    monkeypatch.setattr(attention_rewrite, "_evaluate_mask", fails)
    with pytest.raises(Refusal, match="could not be computed .*RuntimeError: no such device"):
        _run("causal")


def test_past_the_check_length_an_unchecked_mask_is_logged(monkeypatch, caplog):
    from dualkv_compile import stats
    from dualkv_compile.passes import attention_rewrite

    monkeypatch.setattr(attention_rewrite, "MASK_CHECK_MAX_LEN", 64)  # the batch packs to 128
    monkeypatch.setattr(stats, "_logged", set())
    with caplog.at_level("WARNING"):
        _run("causal")
    assert "is not checked for causality at T=128" in caplog.text


@pytest.mark.parametrize("kind", ["bidirectional_for_short_rows",
                                  "bidirectional_for_short_rows_by_aten"])
def test_a_mask_that_reduces_over_positions_is_refused(kind):
    # evaluated for one row of the packed length it was causal, and rewritten: each row of
    # under 100 positions was bidirectional in the plain model (logprobs off by 0.645)
    with pytest.raises(Refusal, match=r"mask that reduces over positions \(amax at "):
        _run(kind)


def test_a_causal_mask_through_an_elementwise_max_is_rewritten():
    ours, plain = _run("causal_by_elementwise_max")
    assert dk.counters["attention_rewritten"] == 2
    assert float((ours - plain).abs().max()) < 1e-10
