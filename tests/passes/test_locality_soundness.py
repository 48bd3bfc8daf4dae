"""Token-mixing code the locality proof must refuse (each case once returned wrong logprobs
without a refusal): tensor attributes that transpose, writes into buffers, a 1-D token operand
contracted by matmul, reductions whose positional arguments are not (dim, keepdim), boolean
masks over several dims, an empty dim list, and keepdims=True."""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.passes._common import Refusal
from dualkv_compile.testing import make_batch, same_dtype_numerics, tiny_model


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


@pytest.mark.parametrize("mix", [_mT, _setitem, _matvec, _norm_positional, _std_positional,
                                 _bool_mask, _empty_dims, _keepdims],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_token_mixing_is_refused(mix):
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    model.layers[0].mlp = _Wrap(model.layers[0].mlp, mix)
    tokens, mask, p = make_batch([7, 3], [[4, 2], [3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    with pytest.raises(Refusal, match="token-local"):
        dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
