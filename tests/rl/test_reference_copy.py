"""rl.distributed.reference_copy: a model with dropout anywhere (an nn.Dropout module, torchtune's
attn_dropout, transformers' attention_dropout) gets a frozen eval copy as its reference, which
must not sample dropout masks; a model without dropout (p = 0 included) is mirrored."""

from torch import nn

from dualkv_compile.rl.distributed import reference_copy
from dualkv_compile.testing import tiny_model


def _is_frozen_eval(ref):
    return not ref.training and not any(q.requires_grad for q in ref.parameters())


def test_a_dropout_module_makes_the_reference_an_eval_copy():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 4)).train()
    assert _is_frozen_eval(reference_copy(model))
    plain = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)).train()  # p = 0: no dropout
    ref = reference_copy(plain)
    assert ref.training and all(q.requires_grad for q in ref.parameters())


def test_transformers_attention_dropout_makes_the_reference_an_eval_copy():
    model = tiny_model("hf_qwen3").train()
    ref = reference_copy(model)
    assert ref.training  # no dropout yet: mirrored
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1  # transformers keeps the rate as a number
    assert _is_frozen_eval(reference_copy(model))
