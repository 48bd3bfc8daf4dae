"""GPU: the grouped expert op (models/moe_experts.py) in bf16 on CUDA, where it runs
torch's grouped GEMM, against float32; and Qwen3-MoE through optimize() with it.

Criterion, as for the dense model: the bf16 error against float32 at most twice the error of
transformers' own bf16 dispatch ("batched_mm") against float32.
Run: pytest -m gpu -s tests/gpu/test_moe_gpu.py
"""

import copy
import json

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.models import use_grouped_experts
from dualkv_compile.testing import make_batch, rel_err, row_by_row_response_logprobs, tiny_model

pytestmark = pytest.mark.gpu
tf = pytest.importorskip("transformers")


def _experts(num_experts=8, dim=256, inner=128):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = tf.Qwen3MoeConfig(hidden_size=dim, moe_intermediate_size=inner,
                            num_experts=num_experts)
    cfg._experts_implementation = "batched_mm"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(cfg).cuda()
    for w in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(w, std=0.05)
    return experts


def _run(fn, experts, hidden, index, weights, grad):
    leaves = [hidden.detach().requires_grad_(), weights.detach().requires_grad_(),
              experts.gate_up_proj, experts.down_proj]
    out = fn(experts, leaves[0], index, leaves[1])
    return [out.float()] + [g.float() for g in torch.autograd.grad(out, leaves, grad)]


def test_bf16_grouped_op_matches_float32():
    from transformers.integrations.moe import batched_mm_experts_forward

    from dualkv_compile.models.moe_experts import moe_experts

    def ours(m, h, i, w):
        return moe_experts(h, i, w, m.gate_up_proj, m.down_proj)

    ref = _experts()
    g = torch.Generator(device="cuda").manual_seed(1)
    s, k = 1000, 2
    hidden = torch.randn(s, 256, device="cuda", generator=g)
    index = torch.randint(0, 7, (s, k), device="cuda", generator=g)  # expert 7 unused
    weights = torch.rand(s, k, device="cuda", generator=g)
    grad = torch.randn(s, 256, device="cuda", generator=g)
    r = _run(batched_mm_experts_forward, ref, hidden, index, weights, grad)
    low = copy.deepcopy(ref).bfloat16()
    args = (hidden.bfloat16(), index, weights.bfloat16(), grad.bfloat16())
    o = _run(ours, low, *args)
    d = _run(batched_mm_experts_forward, copy.deepcopy(ref).bfloat16(), *args)
    names = ["out", "d_hidden", "d_weights", "d_gate_up", "d_down"]
    errs = {n: {"ours": rel_err(a, b), "batched_mm_bf16": rel_err(c, b)}
            for n, a, b, c in zip(names, o, r, d)}
    print(json.dumps(errs))
    for n in names:
        assert errs[n]["ours"] <= 2 * errs[n]["batched_mm_bf16"] + 1e-6, (n, errs[n])
    assert (o[4][7] == 0).all()


def test_bf16_qwen3_moe_with_grouped_experts_matches_plain_model():
    vocab = 1024
    base = tiny_model("hf_qwen3_moe", vocab=vocab, dim=256, max_seq_len=2048).cuda()
    ref32, plain = copy.deepcopy(base).float(), copy.deepcopy(base).bfloat16()
    ours = copy.deepcopy(base).bfloat16()
    use_grouped_experts(ours)
    g = torch.Generator().manual_seed(0)
    tokens, mask, p = make_batch([300, 129, 1], [[200, 0, 57, 130], [64] * 3, [250]],
                                 shuffle=True, vocab=vocab - 2, generator=g, device="cuda")
    tokens = tokens % vocab
    adv = torch.linspace(-1, 1, tokens.shape[0], device="cuda")
    valid = mask[:, p:].float()

    def loss_and_grads(model, lp):
        (lp.float() * adv[:, None] * valid).sum().backward()
        return lp.detach().float(), torch.cat([q.grad.float().flatten()
                                               for q in model.parameters()])

    r = loss_and_grads(ref32, row_by_row_response_logprobs(ref32, tokens, mask, p))
    d = loss_and_grads(plain, row_by_row_response_logprobs(plain, tokens, mask, p))
    dk.counters.clear()
    wrapper = dk.optimize(ours)
    o = loss_and_grads(ours, wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask))
    errs = {"logprobs": {"ours": rel_err(o[0], r[0]), "dense_bf16": rel_err(d[0], r[0])},
            "grads": {"ours": rel_err(o[1], r[1]), "dense_bf16": rel_err(d[1], r[1])},
            "counters": dict(dk.counters)}
    print(json.dumps(errs))
    assert wrapper.uses_dualkv and dk.counters["attention_rewritten"] == 2
    for key in ("logprobs", "grads"):
        assert errs[key]["ours"] <= 2 * errs[key]["dense_bf16"], (key, errs[key])


def test_the_grouped_op_counts_experts_deterministically():
    # its expert counts came from CUDA's histc, which torch refuses under
    # use_deterministic_algorithms(True); warn_only names each such op instead of raising
    import warnings

    from dualkv_compile.models.moe_experts import moe_experts

    low = copy.deepcopy(_experts()).bfloat16()
    g = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(64, 256, device="cuda", generator=g).bfloat16()
    index = torch.randint(0, 8, (64, 2), device="cuda", generator=g)
    weights = torch.rand(64, 2, device="cuda", generator=g).bfloat16()
    grad = torch.randn(64, 256, device="cuda", generator=g).bfloat16()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(lambda m, h, i, w: moe_experts(h, i, w, m.gate_up_proj, m.down_proj), low,
                 hidden, index, weights, grad)
    finally:
        torch.use_deterministic_algorithms(was)
    flagged = [str(w.message).splitlines()[0] for w in caught
               if "does not have a deterministic implementation" in str(w.message)]
    print(json.dumps(flagged))
    assert not [m for m in flagged if "histc" in m or "bincount" in m], flagged
