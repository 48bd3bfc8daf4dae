"""Token-mixing code the locality proof must refuse (each case once returned wrong logprobs
without a refusal): tensor attributes that transpose, writes into buffers, a 1-D token operand
contracted by matmul, reductions whose positional arguments are not (dim, keepdim), boolean
masks over several dims, an empty dim list, keepdims=True, a norm, top-k or linear layer over
the sequence axis, writes through _foreach_ ops and
out=, dropout in training, attention keys that are not token data; and in-place statements,
which the dead-code pass once erased, kept and exact."""

import contextlib

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.passes._common import Refusal
from dualkv_compile.testing import (make_batch, row_by_row_response_logprobs,
                                    same_dtype_numerics, tiny_model)


class _Wrap(torch.nn.Module):
    def __init__(self, inner, mix):
        super().__init__()
        self.inner, self.mix = inner, mix

    def forward(self, x):
        return self.inner(self.mix(x))


def _mT(x):
    return x + x[0].mT.sum(-1)


def _setitem(x):
    buf = torch.zeros_like(x)
    buf[:] = x
    return x + buf.sum(1, keepdim=True)


def _matvec(x):
    t = x.shape[1]
    return x + (torch.ones(t, t, dtype=x.dtype) @ x[0, :, 0])[None, :, None]


def _norm_positional(x):
    b, t, d = x.shape
    n = torch.norm(x[0].transpose(0, 1).unsqueeze(-1).expand(d, t, t), 2, 1)
    return x + n.transpose(0, 1)[None]


def _std_positional(x):
    b, t, d = x.shape
    v = x[0].unsqueeze(1).expand(t, t, d).unsqueeze(0).std(0, True)
    return x + v.sum(0)[None]


def _bool_mask(x):
    b, t, d = x.shape
    z = x[0].unsqueeze(-1).expand(t, d, t).unsqueeze(0).unsqueeze(0).expand(2, 2, t, d, t)
    s = z[torch.ones(2, 2, dtype=torch.bool)].sum(1)
    return x + s.permute(0, 2, 1)[0][None]


def _empty_dims(x):
    return x + x.sum(dim=[], keepdim=False)


def _keepdims(x):  # torch's other spelling of keepdim; the axis count once missed it
    b, t, d = x.shape
    return x + x.unsqueeze(1).expand(b, t, t, d).sum(0, keepdims=True).sum(2)


def _norm_over_tokens(x):  # a layer norm whose normalised axis is the sequence
    return x + 0.1 * torch.nn.functional.layer_norm(x.transpose(1, 2), x.shape[1:2]).transpose(1, 2)


def _topk_over_tokens(x):  # ranks along the sequence axis
    values, _ = torch.topk(x, x.shape[1], dim=1)
    return x + 0.1 * values


def _linear_over_tokens(x):  # a linear layer that contracts the sequence axis
    t = x.shape[1]
    mix = torch.ones(t, t, dtype=x.dtype) / t
    return x + torch.nn.functional.linear(x.transpose(1, 2), mix).transpose(1, 2)


def _vector_right(x):  # [T, D] @ [D] -> [T]: the tokens stay on axis 0, then a sum over them
    return x + 1e-2 * (x[0] @ torch.ones(x.shape[2], dtype=x.dtype)).sum(0)


def _vector_right_softmax(x):
    w = torch.ones(x.shape[2], dtype=x.dtype)
    return x + torch.softmax(x[0] @ w, 0)[None].amax()


def _vector_left(x):  # [D] @ [D, T] -> [T]
    return x + 1e-2 * (torch.ones(x.shape[2], dtype=x.dtype) @ x[0].mT).sum(0)


def _batched_vector(x):  # [T, T, D] @ [D]: tokens on axis 1 of the product
    b, t, d = x.shape
    return x + 1e-2 * (x.expand(t, t, d) @ torch.ones(d, dtype=x.dtype)).sum(1)[None, :, None]


def _list_index(x):  # a list index is advanced indexing: [T, T, D], the tokens on axis 1
    return x + 1e-2 * x[[0] * x.shape[1]].sum(1)[None]


def _stack_axis(x):  # numpy's axis= for dim=
    b, t, d = x.shape
    y = x[:, :, None, :].expand(b, t, t, d)
    return x + 1e-2 * torch.stack([y, y], axis=3).sum(1)[:, :, 0]


def _cat_axis(x):
    b, t, d = x.shape
    y = x[:, :, None, :].expand(b, t, t, d)
    return x + 1e-2 * torch.cat([y, y], axis=3).sum(1)[..., :d]


def _arange_on_another_axis(x):  # arange(T) meets the tokens on a new axis, then a sum
    return x + 1e-3 * (x.unsqueeze(-1) * torch.arange(x.shape[1], dtype=x.dtype)).sum(-1)


def _ones_of_length(x):  # a [D, T] constant: a product over it sums every token's column
    return x + 1e-2 * (x @ torch.ones(x.shape[2], x.shape[1], dtype=x.dtype)).sum(-1, True)


def _embedding_of_tokens(x):  # every token reads packed token T-1 through a table of tokens
    idx = torch.full((1, 1), x.shape[1] - 1, dtype=torch.long)
    return x + torch.nn.functional.embedding(idx, x[0])


def _aten_embedding(x):  # torch.embedding(weight, indices): ATen's argument order
    t = x.shape[1]
    return x + torch.embedding(x[0], torch.full((t,), t - 1, dtype=torch.long))[None]


def _sum_into_out(x):
    buf = torch.zeros(x.shape[:2], dtype=x.dtype)
    torch.sum(x, 2, out=buf)
    return x + 0.01 * buf.sum(1)[:, None, None]


@torch.library.custom_op("dualkv_test::gelu", mutates_args=())
def _custom_gelu(x: torch.Tensor) -> torch.Tensor:  # named like a pointwise op, mixes tokens
    return x + x.mean(1, keepdim=True)


_custom_gelu.register_fake(lambda x: torch.empty_like(x))
_custom_gelu.register_autograd(lambda ctx, g: g + g.mean(1, keepdim=True))


def _custom_op_named_gelu(x):
    return torch.ops.dualkv_test.gelu(x)


def _stale_shape(x):  # an in-place transpose rewrites the shape Dynamo recorded for c
    t = x.shape[1]
    c = 0.01 * torch.arange(t, dtype=x.dtype).view(1, t, 1)
    y = x + c
    c.transpose_(1, 2)
    return y


@pytest.mark.parametrize("mix", [_mT, _setitem, _matvec, _norm_positional, _std_positional,
                                 _bool_mask, _empty_dims, _keepdims, _norm_over_tokens,
                                 _topk_over_tokens, _linear_over_tokens, _vector_right,
                                 _vector_right_softmax, _vector_left, _batched_vector,
                                 _list_index, _stack_axis, _cat_axis, _arange_on_another_axis,
                                 _ones_of_length, _embedding_of_tokens, _aten_embedding,
                                 _sum_into_out, _custom_op_named_gelu, _stale_shape],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_token_mixing_is_refused(mix):
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    model.layers[0].mlp = _Wrap(model.layers[0].mlp, mix)
    tokens, mask, p = make_batch([7, 3], [[4, 2], [3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    # out= with a gradient is refused by PyTorch itself; without one, it must be by the proof
    grad_mode = torch.no_grad() if mix is _sum_into_out else contextlib.nullcontext()
    with grad_mode, pytest.raises(Refusal, match="token-local"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def _mul_statement(x):  # an in-place op whose result is unused: once erased as dead code
    y = x * 1.0
    y.mul_(2.0)
    return y


def _relu_statement(x):
    y = x.clone()
    torch.relu_(y)
    return y


def _view_statement(x):  # written through a view: the write lands in y
    y = x.clone()
    y[..., :4].mul_(3.0)
    return y


def _mixed_model(mix):
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    model.layers[0].mlp = _Wrap(model.layers[0].mlp, mix)
    tokens, mask, p = make_batch([7, 3], [[4, 2], [3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    return model, tokens, mask, p


def _positional_inplace_statement(x):  # F.relu(y, True): the flag by position
    y = x - 0.3
    torch.nn.functional.relu(y, True)
    return y


def _vector_gate(x):  # a per-token gate through [T, D] @ [D]: token-local, kept
    return x * torch.sigmoid(x @ torch.linspace(-1, 1, x.shape[2], dtype=x.dtype))[..., None]


def _keyword_dims(x):  # permute(dims=...), transpose(dim0=, dim1=): token-local, kept
    return x.permute(dims=(0, 2, 1)).transpose(dim0=1, dim1=2) * 1.5


_UP = torch.randn(32, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) / 10


def _weight_of_the_packed_length(x):  # computed from a weight whose size happens to be T = 128
    return x + 0.1 * (x @ (_UP * 2.0)) @ (_UP.mT * 0.5)


def _cat_by_keyword(x):
    return torch.cat(tensors=(x, -x), dim=-1)[..., :x.shape[-1]] * 0.5 + x * 0.5


@pytest.mark.parametrize("mix", [_mul_statement, _relu_statement, _view_statement,
                                 _positional_inplace_statement, _vector_gate, _keyword_dims,
                                 _weight_of_the_packed_length, _cat_by_keyword],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_token_local_statements_are_kept_exact(mix):
    assert_exact(mix)


def assert_exact(mix):
    """Logprobs and every parameter gradient of the model with `mix` in layer 0's MLP, packed,
    equal the plain model's row by row (float64, 1e-10)."""
    model, tokens, mask, p = _mixed_model(mix)
    weights = torch.randn(tokens.shape[0], tokens.shape[1] - p, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))
    ours = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    (ours * weights).sum().backward()
    got = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    theirs = row_by_row_response_logprobs(model, tokens, mask, p)
    (theirs * weights).sum().backward()
    assert (ours - theirs).abs().max() < 1e-10
    for a, q in zip(got, model.parameters()):
        assert (a - q.grad).abs().max() < 1e-10


def _foreach_write(x):
    buf = torch.zeros_like(x)
    torch._foreach_copy_([buf], [x])
    return buf


def _out_write(x):
    buf = torch.zeros_like(x)
    torch.add(x, 0, out=buf)
    return buf


def _add_into_fresh_buffer(x):  # refused, once with a message about positions from arange
    buf = torch.zeros(x.shape, dtype=x.dtype)
    buf.add_(x)
    return x + buf.mean(1, keepdim=True)


def _iadd_into_fresh_buffer(x):
    buf = torch.zeros(x.shape, dtype=x.dtype)
    buf += x
    return buf


def _dropout_in_training(x):
    return torch.nn.functional.dropout(x, 0.1, training=True)


@pytest.mark.parametrize("mix,match", [(_foreach_write, "token-local"),
                                       (_out_write, "token-local"),
                                       (_add_into_fresh_buffer, "writes token data in place "
                                                                "into buf, a tensor made "
                                                                "without the tokens"),
                                       (_iadd_into_fresh_buffer, "writes token data in place"),
                                       (_dropout_in_training, "share")],
                         ids=["foreach_copy", "out_kwarg", "add_into_fresh_buffer",
                              "iadd_into_fresh_buffer", "dropout"])
def test_writes_and_training_dropout_are_refused(mix, match):
    model, tokens, mask, p = _mixed_model(mix)
    with torch.no_grad(), pytest.raises(Refusal, match=match):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


class _KeysFromTable(torch.nn.Module):
    """torchtune attention whose keys come from a table indexed by [0, T): a per-position
    constant the packed layout would read by packed index."""

    def __init__(self, attn):
        super().__init__()
        self.attn, self.cache_enabled, self.kv_cache = attn, False, None
        self.table = torch.nn.Parameter(torch.randn(512, attn.head_dim, dtype=torch.float64))

    def forward(self, x, y=None, *, mask=None, input_pos=None, **kwargs):
        a, (b, s, _) = self.attn, x.shape
        q = a.pos_embeddings(a.q_proj(x).view(b, s, a.num_heads, a.head_dim),
                             input_pos=input_pos).transpose(1, 2)
        v = a.v_proj(x).view(b, s, a.num_kv_heads, a.head_dim).transpose(1, 2)
        k = self.table[:s].expand(b, a.num_kv_heads, s, a.head_dim)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)
        return a.output_proj(o.transpose(1, 2).reshape(b, s, -1))


def test_attention_operands_must_be_token_data():
    model, tokens, mask, p = _mixed_model(lambda x: x)
    model.layers[0].attn = _KeysFromTable(model.layers[0].attn)
    with pytest.raises(Refusal, match="its key .* is not the packed tokens' data"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_a_data_dependent_branch_falls_back_with_its_reason():
    def branch(x):
        return x * 2 if x.sum() > 0 else x

    model, tokens, mask, p = _mixed_model(branch)
    with pytest.raises(Refusal, match="cannot trace the model as one graph"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    wrapped = dk.optimize(model, dk.DualKVConfig(fallback="dense"))
    ours = wrapped.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert "one graph" in wrapped.dense_reason
    assert (ours - row_by_row_response_logprobs(model, tokens, mask, p)).abs().max() < 1e-10


def test_a_rule_that_cannot_read_its_op_refuses(monkeypatch):
    # a rule meeting an argument form it does not read must refuse (fallback="dense" then
    # runs the plain model), not end the compile with its own exception
    from dualkv_compile.passes import token_locality

    def unreadable(self, node, ax, inp):
        raise KeyError("dims")

    monkeypatch.setattr(token_locality._Proof, "permute", unreadable)
    model, tokens, mask, p = _mixed_model(lambda x: x)
    with torch.no_grad(), pytest.raises(Refusal, match="do not have a form the rule reads"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    torch._dynamo.reset()
    with torch.no_grad():
        ours = dk.optimize(model, dk.DualKVConfig(fallback="dense")).response_logprobs(
            tokens, prompt_len=p, padding_mask=mask)
        theirs = row_by_row_response_logprobs(model, tokens, mask, p)
    assert (ours - theirs).abs().max() < 1e-10


def _overriding_subclass(model):
    """The model as an instance of a subclass whose forward adds a token-mixing cumsum."""
    base = type(model)

    def forward(self, *args, **kwargs):
        out = base.forward(self, *args, **kwargs)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return logits + logits.cumsum(1)

    model.__class__ = type(f"Cumsum{base.__name__}", (base,), {"forward": forward})
    return model


@pytest.mark.parametrize("family", ["qwen2_5", "hf_qwen3"])
def test_a_forward_override_is_refused(family):
    # optimize() and the rollout engine run the model's parts themselves: an override of the
    # model's forward would be skipped without a word
    model = _overriding_subclass(same_dtype_numerics(tiny_model(family)).double())
    tokens, mask, p = make_batch([7, 3], [[4, 2], [3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"overrides forward .*Cumsum.*would not run"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    with pytest.raises(ValueError, match=r"rollout engine cannot run .*overrides forward"):
        dk.rollout.RolloutEngine(model)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


def _vmapped(x):
    return torch.vmap(lambda r: r * 2.0, in_dims=2, out_dims=2)(x)


@pytest.mark.parametrize("mix,message", [
    (_Twice.apply, r"PyTorch's higher-order op autograd_function_apply \(what a local "
                   r"autograd.Function"),
    (_vmapped, r"torch\._functorch\.predispatch\._add_batch_dim, a PyTorch function without a "
               r"locality rule")], ids=["autograd_function", "vmap"])
def test_pytorch_wrappers_are_refused_as_such(mix, message):
    # each was refused as "not a torch op ... a custom op or an allow_in_graph function"
    model, tokens, mask, p = _mixed_model(mix)
    with pytest.raises(Refusal, match=message):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
