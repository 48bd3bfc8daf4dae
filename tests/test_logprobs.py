import pytest
import torch

from dualkv_compile.logprobs import chunked_logprobs
from dualkv_compile.testing import rel_err


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_full_log_softmax_with_gradients(chunk, temperature):
    g = torch.Generator().manual_seed(chunk)
    h = torch.randn(7, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (7,), generator=g)
    cot = torch.randn(7, dtype=torch.float64, generator=g)
    ours = chunked_logprobs(h, w, t, temperature=temperature, chunk_size=chunk)
    dh, dw = torch.autograd.grad((ours * cot).sum(), (h, w))
    ref = ((h @ w.T) / temperature).log_softmax(-1).gather(1, t[:, None])[:, 0]
    rh, rw = torch.autograd.grad((ref * cot).sum(), (h, w))
    assert ours.dtype == torch.float64
    assert rel_err(ours, ref) < 1e-13
    assert rel_err(dh, rh) < 1e-13 and rel_err(dw, rw) < 1e-13


def test_bf16_inputs_give_float32():
    h = torch.randn(4, 8).bfloat16()
    w = torch.randn(11, 8).bfloat16()
    out = chunked_logprobs(h, w, torch.tensor([0, 3, 10, 2]))
    assert out.dtype == torch.float32 and (out <= 0).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature=0"):
        chunked_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long),
                         temperature=0)
    with pytest.raises(ValueError, match=r"got \(2, 3\) and \(4, 5\)"):
        chunked_logprobs(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(2, dtype=torch.long))


def test_fused_chunk_kernels_compiled_match_eager():
    # what runs on CUDA (the chunk functions under torch.compile) against the eager functions,
    # here compiled by Inductor for the CPU in float64; ragged last chunk, temperature != 1
    from dualkv_compile import logprobs as lp

    g = torch.Generator().manual_seed(3)
    for rows in (5, 3):
        logits = torch.randn(rows, 97, dtype=torch.float64, generator=g) * 4
        targets = torch.randint(0, 97, (rows,), generator=g)
        grad_out = torch.randn(rows, dtype=torch.float64, generator=g)
        t = torch.tensor(0.7, dtype=torch.float64)
        out, lse = lp._fused(lp._chunk_stats)(logits, targets, t)
        ref_out, ref_lse = lp._chunk_stats(logits, targets, t)
        assert rel_err(out, ref_out) < 1e-13 and rel_err(lse, ref_lse) < 1e-13
        grad = lp._fused(lp._chunk_grad)(logits, lse, targets, grad_out, t)
        ref = torch.func.grad(lambda x: (lp._chunk_stats(x, targets, t)[0] * grad_out).sum())(logits)
        assert rel_err(grad, ref) < 1e-13


def test_fused_path_compiles_once_per_function(monkeypatch):
    # the CUDA path (the fused chunk functions), here compiled for the CPU, through the public
    # call: new temperatures, a one-row last chunk and the expanded gradient of out.sum() must
    # not recompile (Dynamo's limit would otherwise end the run)
    from torch._dynamo.utils import counters

    from dualkv_compile import logprobs as lp

    monkeypatch.setattr(lp, "_kernels", lambda device: (lp._fused(lp._chunk_stats),
                                                        lp._fused(lp._chunk_grad)))
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(5)
    w = torch.randn(41, 8, dtype=torch.float64, generator=g, requires_grad=True)
    for rows, temperature in ((5, 1.0), (7, 0.9), (9, 0.7)):  # chunks of 2: the last has 1 row
        h = torch.randn(rows, 8, dtype=torch.float64, generator=g, requires_grad=True)
        t = torch.randint(0, 41, (rows,), generator=g)
        out = chunked_logprobs(h, w, t, temperature=temperature, chunk_size=2)
        dh, dw = torch.autograd.grad(out.sum(), (h, w))
        ref = ((h @ w.T) / temperature).log_softmax(-1).gather(1, t[:, None])[:, 0]
        rh, rw = torch.autograd.grad(ref.sum(), (h, w))
        assert rel_err(out, ref) < 1e-13 and rel_err(dh, rh) < 1e-13 and rel_err(dw, rw) < 1e-13
    assert counters["stats"]["unique_graphs"] == 2  # one per chunk function


def test_out_of_range_target_raises():
    with pytest.raises(RuntimeError):
        chunked_logprobs(torch.randn(3, 4), torch.randn(6, 4), torch.tensor([0, 6, 1]))
    with pytest.raises(RuntimeError):
        chunked_logprobs(torch.randn(3, 4), torch.randn(6, 4), torch.tensor([0, -100, 1]))


def test_inside_a_users_compiled_graph():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(19, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 19, (6,), generator=g)

    def logprobs(h, w):
        return chunked_logprobs(h, w, t, temperature=0.8, chunk_size=4)

    out = torch.compile(logprobs, fullgraph=True, backend="aot_eager")(h, w)
    dh, dw = torch.autograd.grad(out.sum(), (h, w))
    ref = logprobs(h, w)
    rh, rw = torch.autograd.grad(ref.sum(), (h, w))
    assert rel_err(out, ref) < 1e-13 and rel_err(dh, rh) < 1e-13 and rel_err(dw, rw) < 1e-13


def test_second_derivative_is_refused():
    h = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64)
    c = torch.randn(3, dtype=torch.float64, requires_grad=True)  # grad_out depends on c
    out = chunked_logprobs(h, w, torch.tensor([0, 4, 2]))
    (dh,) = torch.autograd.grad((out * c).sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dh.sum().backward()
