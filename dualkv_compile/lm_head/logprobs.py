"""Logprobs of chosen tokens through the LM head, in chunks.

Per chunk of positions: logits = h @ W.T in the model's dtype; then, in float32 (float64 for a
float64 model), logits / temperature, logprob = logit[target] - logsumexp. The backward
recomputes each chunk's logits instead of storing them, so the peak extra memory is one or two
[chunk, vocab] blocks in the model's dtype, never [positions, vocab].

On CUDA the per-chunk elementwise work runs as two kernels that read the logits once instead of
a dozen eager passes over float32 copies: upcast, temperature, log-sum-exp and pick in a Triton
kernel (chunk_stats_kernel.py: an online log-sum-exp, one read of each logit), and in the
backward onehot - softmax, scaled and cast back, fused by Inductor with 2-D tiling (its 1-D
kernel is slower over a Qwen3-sized chunk). The weight gradient is accumulated in float32
by the GEMM itself (addmm with out_dtype, `_wide_matmul`). The eager path runs the very same
functions on CPU and is the reference the GPU test compares against.

`chunked_token_loss` fuses a per-token loss into the same loop: once a chunk's logprobs are
known, the loss's gradient with respect to each of them is known too (the loss of a token
depends on that token's logprob alone), so the chunk's gradients with respect to the hidden
states and the weight are computed right there, from the logits already in hand. The backward
then only scales the stored gradients: the LM head does three GEMMs per chunk instead of four.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import chunk_stats_kernel
from ..arguments import integer_arg, temperature_arg
from ..numerics import accumulation_dtype
from ..recompiles import bounded_recompiles

__all__ = ["chunked_logprobs", "chunked_token_loss"]


def _onehot(logits: Tensor, targets: Tensor) -> Tensor:
    vocab = torch.arange(logits.shape[1], device=logits.device)
    return vocab[None, :] == targets[:, None]


def _chunk_stats(logits: Tensor, targets: Tensor, temperature: Tensor) -> tuple[Tensor, Tensor]:
    """logits [c, V] (model dtype), temperature 0-d (wide) -> (logprob of each target,
    logsumexp), both [c], wide."""
    z = logits.to(accumulation_dtype(logits.dtype)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    picked = torch.where(_onehot(logits, targets), z, 0).sum(-1)
    return picked - lse, lse


def _chunk_grad(logits: Tensor, lse: Tensor, targets: Tensor, grad_out: Tensor,
                temperature: Tensor) -> Tensor:
    """d(sum grad_out * logprob) / d logits, [c, V] in the logits' dtype: (onehot(target) -
    softmax) * grad_out / temperature."""
    p = torch.exp(logits.to(lse.dtype) / temperature - lse[:, None])
    g = torch.where(_onehot(logits, targets), 1 - p, -p)
    return (g * (grad_out[:, None] / temperature)).to(logits.dtype)


# One graph per function and dtype: the chunk length is marked dynamic (chunks of one row, which
# Dynamo would specialise, run eagerly) while the vocabulary stays static, so Inductor sizes
# and vectorises the row reductions for it; grad_out is made contiguous (an expanded gradient
# of out.sum() would be another graph) and the temperature is a 0-d tensor. The bound makes an
# unforeseen recompile storm an error instead of a silent eager fallback.
_RECOMPILE_LIMIT = 16


def _scale_cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """x * scale (a 0-d tensor), rounded once to `dtype`."""
    return (x * scale).to(dtype)


@functools.cache
def _fused(fn, nd_tiling: bool = False):
    # once per process (module scope, never per call). nd_tiling: Inductor tiles the pointwise
    # kernel over rows and columns instead of dividing a flat index by the row length
    options = {"triton.prefer_nd_tiling": True} if nd_tiling else None
    compiled = torch.compile(fn, fullgraph=True, options=options)

    @functools.wraps(fn)
    def call(*args):
        if args[0].shape[0] < 2:
            return fn(*args)
        for a in args:
            if isinstance(a, Tensor) and a.dim() > 0:
                torch._dynamo.mark_dynamic(a, 0)
        with bounded_recompiles(_RECOMPILE_LIMIT, f"the LM-head kernel {fn.__name__}",
                                advice="Each dtype is one compile; report this with the "
                                       "shapes and dtypes used."):
            return compiled(*args)

    return call


def _cuda_stats(logits: Tensor, targets: Tensor, temperature: Tensor) -> tuple[Tensor, Tensor]:
    if chunk_stats_kernel.supports(logits) and temperature.dtype == torch.float32:
        return chunk_stats_kernel.chunk_stats(logits, targets, temperature)
    return _fused(_chunk_stats)(logits, targets, temperature)  # float64 logits


def _kernels(device: torch.device):
    """The per-chunk functions: fused on CUDA, eager on CPU and when traced into a user's own
    compiled graph (which fuses them there)."""
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return _cuda_stats, _fused(_chunk_grad, nd_tiling=True)
    return _chunk_stats, _chunk_grad


def _scaler(device: torch.device):
    """_scale_cast, fused into one kernel on CUDA (a float32 [V, d] gradient is read once)."""
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return _fused(_scale_cast)
    return _scale_cast


def _wide_matmul(out: Tensor, a: Tensor, b: Tensor, *, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b, with the product formed in out's dtype and rounded to it
    once: a 16-bit GEMM's float32 result comes from the GEMM itself on CUDA (mm/addmm's
    out_dtype form, which cannot be traced), from float32 operands on CPU. Traced on CUDA, a
    16-bit GEMM and a cast (a float32 GEMM would forgo the tensor cores)."""
    if out.dtype != a.dtype and not out.is_cuda:
        a, b = a.to(out.dtype), b.to(out.dtype)
    if out.dtype == a.dtype:
        out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    elif (a.dtype in (torch.bfloat16, torch.float16) and out.dtype == torch.float32
          and not torch.compiler.is_compiling()):
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out += (a @ b).to(out.dtype)
    else:
        out.copy_(a @ b)


def _grad_buffers(ctx, hidden: Tensor, weight: Tensor, wide: torch.dtype,
                  hidden_dtype: torch.dtype):
    """The hidden-state gradient [M, d] in `hidden_dtype` and the weight gradient [V, d] (wide,
    summed over chunks), each None where no gradient is wanted."""
    grad_h = torch.empty(hidden.shape, dtype=hidden_dtype, device=hidden.device) \
        if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:  # the first chunk writes it whole (no zero fill, no read)
        make = torch.empty if hidden.shape[0] else torch.zeros
        grad_w = make(weight.shape, dtype=wide, device=weight.device)
    return grad_h, grad_w


def _add_chunk_grads(grad_h, grad_w, g: Tensor, h: Tensor, weight: Tensor, start: int) -> None:
    """g = d loss / d logits of the chunk of hidden states h at `start`. The matmuls run in the
    model's dtype (tensor cores for bf16, accumulating in fp32); the weight gradient is summed
    over chunks in the wide dtype: the first chunk (start 0) writes it, the others add to it."""
    if grad_h is not None:
        _wide_matmul(grad_h[start:start + g.shape[0]], g, weight, accumulate=False)
    if grad_w is not None:
        _wide_matmul(grad_w, g.T, h, accumulate=start > 0)


def _check_target_dtype(targets: Tensor) -> None:
    # a float id matches no column of the one-hot: the logprob was -lse, without an error
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32 token ids, got {targets.dtype}")


def _check_targets(targets: Tensor, vocab: int) -> None:
    # an out-of-range target would silently pick nothing (the one-hot is empty); checked on
    # the device, without a host sync, as gather's bounds check was
    torch._assert_async(((targets >= 0) & (targets < vocab)).all())


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):
        stats, _ = _kernels(hidden.device)
        wide = accumulation_dtype(hidden.dtype)
        _check_targets(targets, weight.shape[0])
        out = torch.empty(hidden.shape[0], dtype=wide, device=hidden.device)
        lse = torch.empty_like(out)
        t = torch.full((), temperature, dtype=wide, device=hidden.device)  # a fill, no sync
        for s in range(0, hidden.shape[0], chunk):
            out[s:s + chunk], lse[s:s + chunk] = stats(hidden[s:s + chunk] @ weight.T,
                                                       targets[s:s + chunk], t)
        ctx.save_for_backward(hidden, weight, targets, lse, t)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, targets, lse, t = ctx.saved_tensors
        _, grad_fn = _kernels(hidden.device)
        chunk = ctx.chunk
        grad_out = grad_out.to(lse.dtype).contiguous()
        grad_h, grad_w = _grad_buffers(ctx, hidden, weight, lse.dtype, hidden.dtype)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            g = grad_fn(h @ weight.T, lse[s:s + chunk], targets[s:s + chunk],
                        grad_out[s:s + chunk], t)
            _add_chunk_grads(grad_h, grad_w, g, h, weight, s)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                     temperature: float = 1.0, chunk_size: int = 4096) -> Tensor:
    """hidden [M, d], weight [V, d], targets [M] -> log softmax(hidden @ weight.T / t)[target],
    [M] in float32 (float64 for float64 inputs)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [M, d] and weight [V, d] expected, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    temperature, chunk_size = temperature_arg(temperature), integer_arg("chunk_size", chunk_size, 1)
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [M] with M = {hidden.shape[0]}")
    _check_target_dtype(targets)
    return _ChunkedLogprobs.apply(hidden, weight, targets, temperature, chunk_size)


def _checked(losses, logprobs: Tensor) -> Tensor:
    if not isinstance(losses, Tensor) or losses.shape != logprobs.shape:
        got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(f"token_loss must return one loss per token, shape "
                         f"{tuple(logprobs.shape)}; got {got}")
    return losses


def _token_loss_grad(token_loss, logprobs: Tensor, index: Tensor) -> tuple[Tensor, Tensor | None]:
    """(the chunk's per-token losses, detached; d sum / d logprobs [c], or None where the
    losses do not depend on the logprobs: a chunk whose tokens all count 0, say)."""
    with torch.enable_grad():
        x = logprobs.detach().requires_grad_()
        losses = _checked(token_loss(x, index), x)
        if not losses.requires_grad:
            return losses.detach(), None
        if _reaches_another_leaf(losses, x):
            raise ValueError("token_loss uses a tensor that requires grad besides the logprobs "
                             "(a learnable coefficient?): the fused LM head passes gradients "
                             "through the logprobs only, so its gradient would be lost; "
                             "compute that term from response_logprobs' output instead")
        (grad,) = torch.autograd.grad(losses.sum(), x)
    return losses.detach(), grad


def _reaches_another_leaf(losses: Tensor, x: Tensor) -> bool:
    """Whether the autograd graph of `losses` reaches a leaf that requires grad other than x."""
    stack, seen = [losses.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf's gradient
        if leaf is not None and leaf is not x:
            return True
        stack.extend(f for f, _ in fn.next_functions)
    return False


class _ChunkedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, index, temperature, chunk, token_loss):
        stats, grad_fn = _kernels(hidden.device)
        wide = accumulation_dtype(hidden.dtype)
        _check_targets(targets, weight.shape[0])
        logprobs = torch.empty(hidden.shape[0], dtype=wide, device=hidden.device)
        loss = torch.zeros((), dtype=wide, device=hidden.device)
        t = torch.full((), temperature, dtype=wide, device=hidden.device)
        # both gradients stay in the wide dtype until the backward knows their scale
        grad_h, grad_w = _grad_buffers(ctx, hidden, weight, wide, wide)
        depends = False
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            logits = h @ weight.T
            lp, lse = stats(logits, targets[s:s + chunk], t)
            logprobs[s:s + chunk] = lp
            losses, grad_lp = _token_loss_grad(token_loss, lp, index[s:s + chunk])
            loss += losses.sum()
            depends |= grad_lp is not None
            if grad_lp is None:  # a constant for this chunk: its gradient is 0
                grad_lp = torch.zeros_like(lp)
            g = grad_fn(logits, lse, targets[s:s + chunk], grad_lp.to(wide).contiguous(), t)
            del logits
            _add_chunk_grads(grad_h, grad_w, g, h, weight, s)
        if not depends and hidden.shape[0]:  # judged over the call, whatever the chunking
            raise ValueError("token_loss's result does not depend on the logprobs it was given "
                             "(in any chunk): a detached loss would train nothing")
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(logprobs)
        return loss, logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _):
        # the gradients were computed in the forward for a loss weight of 1, in the wide dtype;
        # a backward from `loss * c` scales them and rounds them once to the inputs' dtypes,
        # in one kernel each on CUDA
        grad_h, grad_w = ctx.saved_tensors
        scale = _scaler(grad_loss.device)
        hidden_dtype, weight_dtype = ctx.dtypes
        return (None if grad_h is None else scale(grad_h, grad_loss, hidden_dtype),
                None if grad_w is None else scale(grad_w, grad_loss, weight_dtype),
                None, None, None, None, None)


def chunked_token_loss(hidden: Tensor, weight: Tensor, targets: Tensor, token_loss, *,
                       index: Tensor | None = None, temperature: float = 1.0,
                       chunk_size: int = 4096) -> tuple[Tensor, Tensor]:
    """The sum over positions of token_loss(logprobs, index), with the LM head's backward done
    in the forward pass.

    hidden [M, d], weight [V, d], targets [M]; `token_loss(logprobs [c], index [c]) -> [c]` is
    called once per chunk with the chunk's logprobs (float32, float64 for float64 inputs) and
    their `index` entries (default: positions 0..M-1), and returns each token's loss. A token's
    loss must depend on its own logprob only; everything else it reads is a constant (no
    gradient flows into it). Returns (loss, logprobs [M], the latter without gradient).

    Without gradients to compute, or traced into a user's torch.compile, this is
    token_loss(chunked_logprobs(...), index).sum(): the same value, the backward recomputing
    the logits."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [M, d] and weight [V, d] expected, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    temperature, chunk_size = temperature_arg(temperature), integer_arg("chunk_size", chunk_size, 1)
    if index is None:
        index = torch.arange(hidden.shape[0], device=hidden.device)
    if index.shape != targets.shape or targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} and index {tuple(index.shape)} must "
                         f"both be [M] with M = {hidden.shape[0]}")
    _check_target_dtype(targets)
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not wants_grad or torch.compiler.is_compiling():
        logprobs = chunked_logprobs(hidden, weight, targets, temperature=temperature,
                                    chunk_size=chunk_size)
        return _checked(token_loss(logprobs, index), logprobs).sum(), logprobs.detach()
    return _ChunkedTokenLoss.apply(hidden, weight, targets, index, float(temperature),
                                   int(chunk_size), token_loss)
