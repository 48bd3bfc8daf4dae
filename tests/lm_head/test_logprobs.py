import pytest
import torch

from dualkv_compile.lm_head.logprobs import chunked_logprobs, chunked_token_loss
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
    from dualkv_compile.lm_head import logprobs as lp

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

    from dualkv_compile.lm_head import logprobs as lp

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
        # the loss fused into the LM head calls the same two kernels, in its forward
        loss, _ = chunked_token_loss(h, w, t, lambda lp, i: lp * (i + 1), chunk_size=2,
                                     temperature=temperature)
        ref = ((h @ w.T) / temperature).log_softmax(-1).gather(1, t[:, None])[:, 0]
        assert rel_err(torch.autograd.grad(loss, w)[0],
                       torch.autograd.grad((ref * torch.arange(1, rows + 1)).sum(), w)[0]) < 1e-13
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


def clipped_token_loss(old, adv, weights):
    """A PPO-style per-token loss: clipped ratio, a square term; gathers its constants by index."""
    def loss(lp, index):
        ratio = torch.exp(lp - old[index])
        a = adv[index]
        return (-torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.05 * lp.pow(2)) * weights[index]
    return loss


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_loss_matches_logprobs_then_loss(chunk, temperature):
    """The LM head's backward done in the forward: loss, logprobs and both gradients against
    chunked_logprobs followed by the same loss, with a backward scale != 1 and an index that is
    not 0..M-1; old logprobs near the new ones so some ratios are clipped and some are not."""
    g = torch.Generator().manual_seed(chunk)
    m = 7
    h = torch.randn(m, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (m,), generator=g)
    index = torch.randperm(12, generator=g)[:m]
    with torch.no_grad():
        exact = chunked_logprobs(h, w, t, temperature=temperature)
    old = torch.zeros(12, dtype=torch.float64)
    old[index] = exact + 0.4 * torch.randn(m, dtype=torch.float64, generator=g)
    token_loss = clipped_token_loss(old, torch.randn(12, dtype=torch.float64, generator=g),
                                    torch.rand(12, dtype=torch.float64, generator=g))

    loss, lp = chunked_token_loss(h, w, t, token_loss, index=index, temperature=temperature,
                                  chunk_size=chunk)
    dh, dw = torch.autograd.grad(loss * 2.5, (h, w))
    ref_lp = chunked_logprobs(h, w, t, temperature=temperature, chunk_size=chunk)
    ref = token_loss(ref_lp, index).sum()
    rh, rw = torch.autograd.grad(ref * 2.5, (h, w))
    ratio = torch.exp(exact - old[index])
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    assert not lp.requires_grad and loss.dtype == torch.float64
    assert rel_err(lp, ref_lp.detach()) < 1e-13 and rel_err(loss, ref.detach()) < 1e-13
    assert rel_err(dh, rh) < 1e-13 and rel_err(dw, rw) < 1e-13


def test_token_loss_without_gradients_and_inside_a_users_compiled_graph():
    # no gradient wanted, and traced by torch.compile: logprobs then the loss, same values
    g = torch.Generator().manual_seed(4)
    h = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(19, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 19, (6,), generator=g)
    token_loss = clipped_token_loss(torch.randn(6, dtype=torch.float64, generator=g) - 3,
                                    torch.randn(6, dtype=torch.float64, generator=g),
                                    torch.ones(6, dtype=torch.float64))

    def fused(h, w):
        return chunked_token_loss(h, w, t, token_loss, temperature=0.8, chunk_size=4)[0]

    ref = fused(h, w)
    rh, rw = torch.autograd.grad(ref, (h, w))
    with torch.no_grad():
        assert rel_err(fused(h, w), ref.detach()) < 1e-13
    out = torch.compile(fused, fullgraph=True, backend="aot_eager")(h, w)
    dh, dw = torch.autograd.grad(out, (h, w))
    assert rel_err(out, ref) < 1e-13 and rel_err(dh, rh) < 1e-13 and rel_err(dw, rw) < 1e-13


def test_token_loss_bad_arguments():
    h = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64)
    t = torch.tensor([0, 5, 1])
    with pytest.raises(ValueError, match=r"one loss per token, shape \(3,\); got \(\)"):
        chunked_token_loss(h, w, t, lambda lp, i: lp.sum())
    with torch.no_grad(), pytest.raises(ValueError, match="one loss per token"):
        chunked_token_loss(h, w, t, lambda lp, i: lp[:1])
    for chunk in (1, 4):  # judged over the call, not per chunk
        with pytest.raises(ValueError, match="does not depend on the logprobs"):
            chunked_token_loss(h, w, t, lambda lp, i: torch.zeros_like(lp), chunk_size=chunk)
    coef = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)  # its gradient: lost
    with pytest.raises(ValueError, match="uses a tensor that requires grad besides the logprobs"):
        chunked_token_loss(h, w, t, lambda lp, i: -coef.exp() * lp)
    with torch.no_grad():  # no backward: nothing to lose
        chunked_token_loss(h, w, t, lambda lp, i: -coef * lp)
    with pytest.raises(ValueError, match=r"index \(2,\) must both be \[M\] with M = 3"):
        chunked_token_loss(h, w, t, lambda lp, i: lp, index=torch.arange(2))
    with pytest.raises(ValueError, match="temperature=-1"):
        chunked_token_loss(h, w, t, lambda lp, i: lp, temperature=-1)
    with pytest.raises(RuntimeError):
        chunked_token_loss(h, w, torch.tensor([0, 6, 1]), lambda lp, i: lp)


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_token_loss_with_one_input_frozen(frozen):
    g = torch.Generator().manual_seed(6)
    h = torch.randn(5, 8, dtype=torch.float64, generator=g, requires_grad=frozen != "hidden")
    w = torch.randn(13, 8, dtype=torch.float64, generator=g, requires_grad=frozen != "weight")
    t = torch.randint(0, 13, (5,), generator=g)
    live = w if frozen == "hidden" else h
    loss, _ = chunked_token_loss(h, w, t, lambda lp, i: lp * (i + 1), chunk_size=2)
    ref = (chunked_logprobs(h, w, t) * torch.arange(1, 6)).sum()
    (ours,), (expect,) = torch.autograd.grad(loss, live), torch.autograd.grad(ref, live)
    assert rel_err(ours, expect) < 1e-13


def test_token_loss_scaled_gradients_are_rounded_once():
    """bf16 model, backward from loss * c: both gradients are formed in float32 (the weight's
    summed over the chunks), then scaled and rounded to bf16 once, so they equal c times the
    float32 values, rounded. Rounding to bf16 first and scaling after, as before, differs on
    a fraction of the elements."""
    from dualkv_compile.lm_head import logprobs as lp

    g = torch.Generator().manual_seed(11)
    h = torch.randn(12, 16, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(40, 16, generator=g) * 0.3).bfloat16().requires_grad_()
    t = torch.randint(0, 40, (12,), generator=g)
    c = torch.tensor(0.37)

    loss, _ = chunked_token_loss(h, w, t, lambda x, i: -x, chunk_size=5)
    dh, dw = torch.autograd.grad(loss * c, (h, w))
    # the float32 gradients as the forward forms them, chunk by chunk
    acc_w, acc_h = torch.zeros(40, 16), torch.zeros(12, 16)
    for s in range(0, 12, 5):
        hs = h[s:s + 5].detach()
        logits = hs @ w.detach().T
        _, lse = lp._chunk_stats(logits, t[s:s + 5], torch.tensor(1.0))
        gr = lp._chunk_grad(logits, lse, t[s:s + 5], -torch.ones(logits.shape[0]), torch.tensor(1.0))
        acc_w.addmm_(gr.T.float(), hs.float())
        acc_h[s:s + 5] = gr.float() @ w.detach().float()
    assert dw.dtype == dh.dtype == torch.bfloat16
    assert torch.equal(dw, (acc_w * c).bfloat16()) and torch.equal(dh, (acc_h * c).bfloat16())
    # rounded twice, they would differ: the test can fail
    assert not torch.equal(dw, (acc_w.bfloat16() * c).bfloat16())
    assert not torch.equal(dh, (acc_h.bfloat16() * c).bfloat16())


@pytest.mark.parametrize("rows", [0, 5])
def test_gradient_buffers_are_written_before_they_are_read(monkeypatch, rows):
    """The weight gradient's buffer is allocated uninitialised and the first chunk writes it
    whole. Every fresh float buffer is poisoned with NaN here: a chunk that added to it, or no
    chunk at all (no rows) leaving it as allocated, would show NaN."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    g = torch.Generator().manual_seed(12)
    h = torch.randn(rows, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(13, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (rows,), generator=g)
    ref = (chunked_logprobs(h, w, t) * 2).sum()
    rh, rw = torch.autograd.grad(ref, (h, w))
    monkeypatch.setattr(torch, "empty", poisoned)
    for run in (lambda: (chunked_logprobs(h, w, t, chunk_size=2) * 2).sum(),
                lambda: chunked_token_loss(h, w, t, lambda lp, i: lp * 2, chunk_size=2)[0]):
        dh, dw = torch.autograd.grad(run(), (h, w), allow_unused=True)
        assert torch.isfinite(dw).all() and rel_err(dw, rw) < 1e-13
        assert dh.shape == h.shape and (rows == 0 or rel_err(dh, rh) < 1e-13)


def test_a_chunk_whose_loss_is_constant_gets_zero_gradient_whatever_the_chunking():
    # a token loss that returns a constant where nothing counts (an early return when every
    # token of its chunk is filtered out): refused per chunk before, so the step failed or not
    # by chunk size and data
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 5, 1, 3, 6, 2])
    keep = torch.tensor([False, False, True, True, False, True])

    def token_loss(lp, i):
        if not keep[i].any():
            return torch.zeros_like(lp)
        return torch.where(keep[i], -lp, torch.zeros_like(lp))

    want = token_loss(chunked_logprobs(h, w, t), torch.arange(6)).sum()
    grads = torch.autograd.grad(want, (h, w))
    for chunk in (1, 2, 3, 6):
        loss = chunked_token_loss(h, w, t, token_loss, chunk_size=chunk)[0]
        got = torch.autograd.grad(loss, (h, w))
        assert rel_err(loss, want) < 1e-13, chunk
        assert all(rel_err(a, b) < 1e-13 for a, b in zip(got, grads)), chunk
