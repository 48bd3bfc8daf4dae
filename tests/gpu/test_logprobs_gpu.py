"""GPU: the chunked LM-head logprobs with their fused CUDA kernels, in bf16.

Criterion: logprobs and both gradients (hidden, weight) compared with float64 math on the same
bf16 inputs; the fused path's error must be at most that of the same functions run eagerly on
the GPU (the path used before the kernels were fused), with 10% slack, and the two paths must
agree with each other to float32 accuracy on the logprobs. A ragged last chunk, a temperature
and a vocabulary that is no power of two are covered.
Run: pytest -m gpu -s tests/gpu/test_logprobs_gpu.py
"""

import json

import pytest
import torch

from dualkv_compile.lm_head import logprobs as lp
from dualkv_compile.testing import rel_err

pytestmark = pytest.mark.gpu


def run(h, w, targets, cot, temperature, chunk):
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    out = lp.chunked_logprobs(h, w, targets, temperature=temperature, chunk_size=chunk)
    dh, dw = torch.autograd.grad((out * cot).sum(), (h, w))
    return out.detach().double(), dh.double(), dw.double()


@pytest.mark.parametrize("rows,chunk,temperature", [(5000, 4096, 1.0), (3000, 1024, 0.7)])
def test_fused_lm_head_matches_float64(rows, chunk, temperature, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(rows)
    d, vocab = 512, 50_257
    h = (torch.randn(rows, d, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(vocab, d, device="cuda", generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    cot = torch.randn(rows, device="cuda", generator=g, dtype=torch.float32)

    fused = run(h, w, targets, cot, temperature, chunk)
    ref = run(h.double(), w.double(), targets, cot.double(), temperature, chunk)
    with monkeypatch.context() as m:  # the same functions, eager, on the GPU
        m.setattr(lp, "_kernels", lambda device: (lp._chunk_stats, lp._chunk_grad))
        eager = run(h, w, targets, cot, temperature, chunk)

    errs = {name: {"fused": rel_err(a, r), "eager": rel_err(b, r)}
            for name, a, b, r in zip(["logprobs", "d_hidden", "d_weight"], fused, eager, ref)}
    print(json.dumps({"rows": rows, "chunk": chunk, "temperature": temperature, **errs}))
    for name, e in errs.items():
        assert e["fused"] <= 1.1 * e["eager"] + 1e-7, (name, e)
        assert e["fused"] < 1e-2, (name, e)  # bf16 inputs: observed 1.6e-4 to 2.9e-3
    assert rel_err(fused[0], eager[0]) < 1e-5


def test_inside_a_users_compiled_graph():
    # traced into the user's graph, the chunk functions and the weight-gradient sum run as
    # plain ops there (addmm's out_dtype form cannot be traced)
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(700, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(5000, 256, device="cuda", generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, 5000, (700,), device="cuda", generator=g)

    def logprobs(h, w):
        return lp.chunked_logprobs(h, w, targets, temperature=0.9, chunk_size=256)

    results = []
    for fn in (logprobs, torch.compile(logprobs, fullgraph=True)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(hh, ww)
        results.append((out.detach().double(), *torch.autograd.grad(out.sum(), (hh, ww))))
    for a, b in zip(*results):
        assert rel_err(a.double(), b.double()) < 1e-2


@pytest.mark.parametrize("vocab,rows,temperature,dtype,strided", [
    (151_936, 1500, 1.0, torch.bfloat16, False),
    (50_257, 777, 0.7, torch.bfloat16, True),
    (1000, 3, 1.3, torch.float16, False),
])
def test_triton_chunk_stats_match_float64(vocab, rows, temperature, dtype, strided):
    # the online log-sum-exp kernel against float64 math on the same logits, and against the
    # Inductor-compiled reference function; rows may be a slice of a wider buffer
    from dualkv_compile.lm_head import chunk_stats_kernel

    g = torch.Generator(device="cuda").manual_seed(rows)
    width = vocab + 61 if strided else vocab
    logits = (torch.randn(rows, width, device="cuda", generator=g) * 3).to(dtype)[:, :vocab]
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    t = torch.tensor(temperature, device="cuda")
    assert chunk_stats_kernel.supports(logits)
    logprob, lse = chunk_stats_kernel.chunk_stats(logits, targets, t)
    z = logits.double() / temperature
    ref_lse = torch.logsumexp(z, -1)
    ref_logprob = z.gather(1, targets[:, None])[:, 0] - ref_lse
    inductor = lp._fused(lp._chunk_stats)(logits, targets, t)
    print(json.dumps({"vocab": vocab, "lse_err": float((lse - ref_lse).abs().max()),
                      "logprob_err": float((logprob - ref_logprob).abs().max())}))
    assert logprob.dtype == lse.dtype == torch.float32
    assert float((lse - ref_lse).abs().max()) < 2e-5  # float32 of values near log(V) + 3
    assert float((logprob - ref_logprob).abs().max()) < 2e-5
    assert float((lse - inductor[1]).abs().max()) < 2e-5
    assert float((logprob - inductor[0]).abs().max()) < 2e-5


def test_triton_chunk_stats_strided_targets_and_infinite_logits():
    # targets taken from a strided view; a row of -inf logits and a row holding a +inf logit
    # give the reference's -inf and +inf log-sum-exp (not NaN); the other rows are unaffected
    from dualkv_compile.lm_head import chunk_stats_kernel

    g = torch.Generator(device="cuda").manual_seed(3)
    vocab = 20_000  # three blocks of the kernel
    logits = (torch.randn(6, vocab, device="cuda", generator=g) * 3).half()
    logits[0] = float("-inf")
    logits[1, 12_345] = float("inf")
    logits[2, :9000] = float("-inf")  # the whole first block
    targets = torch.randint(0, vocab, (12,), device="cuda", generator=g)[::2]
    t = torch.tensor(1.0, device="cuda")
    logprob, lse = chunk_stats_kernel.chunk_stats(logits, targets, t)
    ref_logprob, ref_lse = lp._chunk_stats(logits, targets, t)
    assert lse[0] == float("-inf") and lse[1] == float("inf")
    torch.testing.assert_close(lse[:2], ref_lse[:2], equal_nan=True)
    torch.testing.assert_close(logprob[:2], ref_logprob[:2], equal_nan=True)
    assert float((lse[2:] - ref_lse[2:]).abs().max()) < 2e-5
    assert float((logprob[2:] - ref_logprob[2:]).abs().max()) < 2e-5


def run_loss(h, w, targets, cot, temperature, chunk, fused, scale=1.0):
    # the per-token loss cot * logprob, fused into the LM head or after the logprobs
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if fused:
        loss, out = lp.chunked_token_loss(h, w, targets, lambda x, i: x * cot[i].to(x.dtype),
                                          temperature=temperature, chunk_size=chunk)
    else:
        out = lp.chunked_logprobs(h, w, targets, temperature=temperature, chunk_size=chunk)
        loss = (out * cot.to(out.dtype)).sum()
    dh, dw = torch.autograd.grad(loss * scale, (h, w))
    return out.detach().double(), dh.double(), dw.double()


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_loss_fused_into_the_lm_head_matches_float64(scale):
    # chunked_token_loss (gradients in the forward, three GEMMs a chunk) against float64 math,
    # no less accurate than logprobs-then-loss on the GPU, with a ragged last chunk; a backward
    # from loss * scale scales the stored gradients (the weight's in one fused kernel)
    g = torch.Generator(device="cuda").manual_seed(7)
    rows, d, vocab, chunk = 5000, 512, 50_257, 2048
    h = torch.randn(rows, d, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, d, device="cuda", generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    cot = torch.randn(rows, device="cuda", generator=g, dtype=torch.float32)

    fused = run_loss(h, w, targets, cot, 0.8, chunk, fused=True, scale=scale)
    separate = run_loss(h, w, targets, cot, 0.8, chunk, fused=False, scale=scale)
    ref = run_loss(h.double(), w.double(), targets, cot.double(), 0.8, chunk, fused=False,
                   scale=scale)
    errs = {name: {"fused_loss": rel_err(a, r), "separate": rel_err(b, r)}
            for name, a, b, r in zip(["logprobs", "d_hidden", "d_weight"], fused, separate, ref)}
    print(json.dumps({"fused_loss": True, "rows": rows, "chunk": chunk, "scale": scale, **errs}))
    for name, e in errs.items():
        assert e["fused_loss"] <= 1.1 * e["separate"] + 1e-7, (name, e)
        assert e["fused_loss"] < 1e-2, (name, e)
    assert rel_err(fused[0], separate[0]) < 1e-6
