"""The passes beside the locality proof, against models that once got a wrong result without a
refusal (CPU, float64): attention whose head counts broadcast (a query head against repeated
keys, keys and values of different head counts), an in-place forward hook on the LM head,
a buffer seen through a no-op cast while the forward updates it in place, and a position table
written through an alias."""

import pytest
import torch
import torch.nn.functional as F

import dualkv_compile as dk
from dualkv_compile.passes._common import Refusal
from dualkv_compile.testing import (make_batch, row_by_row_response_logprobs,
                                    same_dtype_numerics, tiny_model)


def batch():
    return make_batch([7, 3], [[4, 2], [3]], vocab=90, generator=torch.Generator().manual_seed(0))


class _Heads(torch.nn.Module):
    """torchtune attention (4 query heads, 2 KV heads of 8) whose SDPA gets q/k/v from `pick`."""

    def __init__(self, attn, pick):
        super().__init__()
        self.a, self.pick, self.cache_enabled, self.kv_cache = attn, pick, False, None

    def forward(self, x, y=None, *, mask=None, input_pos=None, **kwargs):
        a, (b, s, _) = self.a, x.shape
        q = a.pos_embeddings(a.q_proj(x).view(b, s, 4, 8), input_pos=input_pos).transpose(1, 2)
        k = a.pos_embeddings(a.k_proj(x).view(b, s, 2, 8), input_pos=input_pos).transpose(1, 2)
        v = a.v_proj(x).view(b, s, 2, 8).transpose(1, 2)
        o = self.pick(q, k, v)
        return a.output_proj(o.transpose(1, 2).reshape(b, s, -1))


def _repeat(t, r):  # transformers' repeat_kv
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, r, s, d).reshape(b, h * r, s, d)


def _one_query_head(q, k, v):  # q [.., 1, ..] broadcast against 4 repeated KV heads
    o = F.scaled_dot_product_attention(q[:, :1], _repeat(k[:, :1], 4), _repeat(v[:, :1], 4),
                                       is_causal=True)
    return o.sum(1, keepdim=True).expand_as(q)


def _key_and_value_heads_differ(q, k, v):
    return F.scaled_dot_product_attention(q, k[:, :1], v.repeat_interleave(2, 1), is_causal=True)


@pytest.mark.parametrize("pick", [_one_query_head, _key_and_value_heads_differ],
                         ids=["one_query_head", "key_and_value_heads_differ"])
def test_head_counts_the_kernels_cannot_take_are_refused(pick):
    # the first gave 20.6 off (the folded keys left one output head where the graph had 4);
    # the second a RuntimeError from inside the compile
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    for layer in model.layers:
        layer.attn = _Heads(layer.attn, pick)
    tokens, mask, p = batch()
    with torch.no_grad(), pytest.raises(Refusal, match=r"query, key and value heads \(\d, \d, "):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


@pytest.mark.parametrize("family", ["hf_qwen3", "qwen2_5"])
def test_an_in_place_hook_on_the_lm_head_is_refused(family):
    # the cut at the head's linear dropped the hook's in-place write: 2.5 off, silently
    model = same_dtype_numerics(tiny_model(family)).double()
    if family == "hf_qwen3":
        head = model.lm_head
    else:  # an untied head (the tiny builder ties it)
        head = model.output = torch.nn.Linear(32, 101, bias=False, dtype=torch.float64)
    bias = torch.linspace(-2, 2, 101, dtype=torch.float64)

    def logit_bias(module, inputs, out):  # returns None: the logits are changed in place
        out.add_(bias)

    head.register_forward_hook(logit_bias)
    tokens, mask, p = batch()
    with pytest.raises(Refusal, match="LM head's logits .* are also used by"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


class _BufferSeenThroughCast(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("buf", 0.05 * torch.randn(32, 32, dtype=torch.float64,
                                                       generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        t = self.buf.to(torch.float64)  # no-op cast: t is buf
        y = x + x @ t
        self.buf.add_(1.0)  # seen through t, then undone
        z = y + 0.01 * (y @ t)
        self.buf.sub_(1.0)
        return self.inner(z)


def test_a_buffer_seen_through_a_no_op_cast_keeps_its_updates():
    # the position-table pass stored t as a copy, which missed buf's in-place update (0.149)
    assert _error_with(lambda m: setattr(m.layers[0], "mlp", _BufferSeenThroughCast(
        m.layers[0].mlp))) < 1e-10


class _TableWrittenThroughAlias(torch.nn.Module):
    """torchtune attention fed x scaled by a RoPE-like cos of the positions, which the forward
    writes into through an alias (`alias`: the same memory) between two reads."""

    def __init__(self, attn, alias, write):
        super().__init__()
        self.a, self.alias, self.write, self.cache_enabled, self.kv_cache = (
            attn, alias, write, False, None)

    def forward(self, x, y=None, *, mask=None, input_pos=None, **kwargs):
        freq = torch.linspace(0.01, 1.0, x.shape[-1], dtype=x.dtype)
        cos = (input_pos[..., None].to(x.dtype) * freq).cos()  # [b, s, 32], positions only
        table = self.alias(cos)
        h = x * table
        self.write(table)  # writes into cos too
        return self.a(h + x * cos, y, mask=mask, input_pos=input_pos, **kwargs)


def _to_same_dtype(t):
    return t.to(t.dtype)


def _detach(t):  # functions, not torch.Tensor.detach itself: Dynamo 2.11 cannot call that
    return t.detach()  # as a module attribute


def _contiguous(t):
    return t.contiguous()


def _double(t):
    t.mul_(2.0)


@pytest.mark.parametrize(("alias", "write"), [(_to_same_dtype, _double), (_detach, _double),
                                              (_contiguous, _double)],
                         ids=["to", "detach", "contiguous"])
def test_a_position_table_written_through_an_alias_keeps_the_write(alias, write):
    # the position-table pass stored cos and its alias each as a copy of its own: the write
    # into the alias's copy never reached the later read of cos
    assert _error_with(lambda m: setattr(m.layers[0], "attn", _TableWrittenThroughAlias(
        m.layers[0].attn, alias, write))) < 1e-10


class _ConstantTableWrittenThroughAlias(torch.nn.Module):
    """A [32, 32] table built in the forward from no input, zeroed in part through a detached
    alias between two products with the hidden states (an assignment, which may_write once
    missed)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        d = x.shape[-1]
        table = torch.linspace(-1.0, 1.0, d * d, dtype=x.dtype).view(d, d).cos() / d
        alias = table.detach()
        y = x + x @ alias
        alias[0] = 0.0  # writes into table too
        return self.inner(y + x @ table)


def test_a_constant_table_assigned_through_an_alias_keeps_the_write():
    assert _error_with(lambda m: setattr(m.layers[0], "mlp", _ConstantTableWrittenThroughAlias(
        m.layers[0].mlp))) < 1e-10


def _error_with(change) -> float:
    """The largest logprob difference, in float64 and without gradients, between optimize()
    and the plain model row by row, for a tiny qwen2_5 that `change(model)` edited."""
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    change(model)
    tokens, mask, p = batch()
    with torch.no_grad():
        ours = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
        theirs = row_by_row_response_logprobs(model, tokens, mask, p)
    return float((ours - theirs).abs().max())


def test_may_write_reads_op_schemas_and_not_a_packets_out_overload():
    # an ATen overload's name ("Scalar") once read as no write; then every packet, such as
    # the pure aten.mul, read as one through its out= overload
    import torch.fx as fx

    from dualkv_compile.passes._common import may_write, written

    graph = fx.Graph()
    x = graph.placeholder("x")
    pure = graph.call_function(torch.ops.aten.mul, (x, 2.0))
    packet_write = graph.call_function(torch.ops.aten.mul_, (x, 2.0))
    overload_write = graph.call_function(torch.ops.aten.mul_.Scalar, (x, 2.0))
    out_write = graph.call_function(torch.ops.aten.mul, (x, 2.0), {"out": pure})
    assert not may_write(pure)
    assert may_write(packet_write) and written(packet_write) == [x]
    assert may_write(overload_write) and written(overload_write) == [x]
    assert may_write(out_write) and written(out_write) == [pure]
