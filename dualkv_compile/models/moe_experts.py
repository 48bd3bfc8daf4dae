"""Grouped expert dispatch for transformers' Qwen3-MoE, as one token-local op.

transformers' "grouped_mm" dispatch sorts every (token, expert) pair by expert, runs each
expert's rows as one group of a grouped GEMM and scatters the rows back. Each token's output
depends on that token alone, but the sort, the histogram of group sizes and the scatter each
read all tokens, so a proof that follows ops one by one cannot see it. Here the whole dispatch
is one op, `torch.ops.dualkv.moe_experts`, whose contract is token-local: row s of the output
depends on rows s of `hidden`, `top_k_index` and `top_k_weights` (and on the weights). The
token-locality proof has a rule for it; inside, the rows are grouped by expert:

- CUDA, bf16: `torch.nn.functional.grouped_mm` (torch._grouped_mm on older torch) over the
  rows sorted by expert, offsets from their counts: one GEMM launch per projection, and one
  per weight gradient (its 2-D x 2-D form);
- elsewhere (the CPU reference, float64 tests): one matmul per expert that has rows.

Its backward is a second op, written out (grouped_experts_backward): it recomputes the two
projections (one more forward GEMM pair, as activation checkpointing of the experts would) and
returns the gradients of hidden, the routing weights and both expert weight tensors.

`use_grouped_experts(model)` registers the op under the name "dualkv_grouped" in transformers'
experts interface (its extension point, as attention functions are registered) and selects it
for the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..numerics import accumulation_dtype

__all__ = ["IMPLEMENTATION", "grouped_experts", "use_grouped_experts"]

IMPLEMENTATION = "dualkv_grouped"  # the name in transformers' ExpertsInterface


def _counts(flat: Tensor, order: Tensor, experts: int) -> Tensor:
    """Rows per expert, int64, from the ids sorted by `order`: without a host synchronisation
    (bincount reads the largest id first) and deterministic (CUDA's histc and bincount are
    refused under torch.use_deterministic_algorithms). An id outside [0, experts) would leave
    rows no expert computes: asserted on the device, where the router never makes one."""
    ids = flat[order]
    if ids.numel():
        torch._assert_async((ids[0] >= 0) & (ids[-1] < experts),
                            f"grouped_experts: an expert id outside [0, {experts})")
    bounds = torch.searchsorted(ids, torch.arange(experts + 1, device=ids.device,
                                                  dtype=ids.dtype))
    return bounds.diff()


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _use_grouped(x: Tensor) -> bool:
    """torch's grouped GEMM for bf16 on CUDA; the per-expert loop (the reference) elsewhere."""
    return x.is_cuda and x.dtype == torch.bfloat16 and _grouped_mm() is not None


def _grouped_linear(rows: Tensor, weight: Tensor, counts: Tensor, grouped: bool) -> Tensor:
    """rows [M, i] sorted by expert, `counts` rows per expert -> rows @ weight[e].T, [M, o]."""
    if grouped:
        return _grouped_mm()(rows, weight.transpose(-2, -1),
                             offs=counts.cumsum(0, dtype=torch.int32))
    out = rows.new_empty(rows.shape[0], weight.shape[-2])
    start = 0
    for e, n in enumerate(counts.tolist()):  # host loop: the reference path
        if n:
            out[start:start + n] = rows[start:start + n] @ weight[e].T
        start += n
    return out


def grouped_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                    gate_up_proj: Tensor, down_proj: Tensor, grouped: bool | None = None) -> Tensor:
    """The experts of a gated SiLU MoE block, differentiable: hidden [S, d], top_k_index and
    top_k_weights [S, k], gate_up_proj [E, 2I, d] (gate rows first), down_proj [E, d, I] ->
    [S, d] = sum over a token's k experts of weight * down(silu(gate) * up). `grouped`:
    torch's grouped GEMM or the per-expert loop (default: _use_grouped)."""
    grouped = _use_grouped(hidden) if grouped is None else grouped
    s, k = top_k_index.shape
    experts = gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = _counts(flat, order, experts)
    rows = hidden[order // k]
    gate, up = _grouped_linear(rows, gate_up_proj, counts, grouped).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down_proj, counts, grouped)
    out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
    unsorted = torch.empty_like(out).index_copy(0, order, out)  # back to (token, slot) order
    return unsorted.view(s, k, unsorted.shape[-1]).sum(1).to(hidden.dtype)  # s may be 0


@torch.library.custom_op("dualkv::moe_experts", mutates_args=())
def moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    return grouped_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)


@moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return hidden.new_empty(hidden.shape)  # contiguous, as the real output is


def _weight_grads(a: Tensor, b: Tensor, counts: Tensor, grouped: bool) -> Tensor:
    """Per expert e, a[rows of e].T @ b[rows of e]: [E, a.shape[1], b.shape[1]] (zero for an
    expert without rows)."""
    if grouped:  # the 2-D x 2-D form: offsets split a's columns and b's rows
        return _grouped_mm()(a.t(), b, offs=counts.cumsum(0, dtype=torch.int32))
    out = a.new_zeros(counts.numel(), a.shape[1], b.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[e] = a[start:start + n].T @ b[start:start + n]
        start += n
    return out


def grouped_experts_backward(grad: Tensor, hidden: Tensor, top_k_index: Tensor,
                             top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
                             grouped: bool | None = None):
    """Gradients of grouped_experts' output (given `grad` [S, d]) with respect to hidden,
    top_k_weights, gate_up_proj and down_proj; the projections are recomputed, not saved."""
    grouped = _use_grouped(hidden) if grouped is None else grouped
    s, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = _counts(flat, order, gate_up_proj.shape[0])
    token = order // k
    rows = hidden[token]
    gate, up = _grouped_linear(rows, gate_up_proj, counts, grouped).chunk(2, dim=-1)
    act = F.silu(gate)
    inner = act * up
    out = _grouped_linear(inner, down_proj, counts, grouped)
    g = grad[token]
    wide = accumulation_dtype(out.dtype)
    d_weights = (g.to(wide) * out.to(wide)).sum(-1)
    d_weights = torch.empty_like(d_weights).index_copy(0, order, d_weights)
    d_out = g * top_k_weights.reshape(-1)[order, None].to(g.dtype)
    d_inner = _grouped_linear(d_out, down_proj.transpose(-2, -1), counts, grouped)  # @ down[e]
    sig = torch.sigmoid(gate)
    d_gate_up = torch.cat([d_inner * up * sig * (1 + gate * (1 - sig)), d_inner * act], -1)
    d_rows = _grouped_linear(d_gate_up, gate_up_proj.transpose(-2, -1), counts, grouped)
    # back to (token, slot) order and summed over a token's k slots, as the forward sums (no
    # atomic adds in the output dtype)
    d_rows = torch.empty_like(d_rows).index_copy(0, order, d_rows)
    d_hidden = d_rows.view(s, k, d_rows.shape[-1]).sum(1).to(hidden.dtype)
    return (d_hidden, d_weights.view(s, k).to(top_k_weights.dtype),
            _weight_grads(d_gate_up, rows, counts, grouped),
            _weight_grads(d_out, inner, counts, grouped))


@torch.library.custom_op("dualkv::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad: Tensor, hidden: Tensor, top_k_index: Tensor,
                         top_k_weights: Tensor, gate_up_proj: Tensor,
                         down_proj: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return grouped_experts_backward(grad, hidden, top_k_index, top_k_weights, gate_up_proj,
                                    down_proj)


@moe_experts_backward.register_fake
def _(grad, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return tuple(x.new_empty(x.shape) for x in (hidden, top_k_weights, gate_up_proj, down_proj))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj = ctx.saved_tensors
    d_hidden, d_weights, d_gate_up, d_down = moe_experts_backward(
        grad, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    return d_hidden, None, d_weights, d_gate_up, d_down


moe_experts.register_autograd(_backward, setup_context=_setup_context)


def _experts_forward(self, hidden_states: Tensor, top_k_index: Tensor,
                     top_k_weights: Tensor) -> Tensor:
    """transformers' experts-interface signature, for Qwen3-MoE's experts module."""
    return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                       self.down_proj)


def _check_experts(module) -> None:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    layout = (getattr(module, "has_gate", True), getattr(module, "has_bias", False),
              getattr(module, "is_transposed", False), getattr(module, "is_concatenated", True),
              getattr(module, "has_post_expert_norm", False))
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"the grouped expert op runs every expert on every rank; "
                         f"{type(module).__name__} is set up for expert parallelism")
    if act != "silu" or layout != (True, False, False, True, False):
        raise ValueError(
            f"the grouped expert op runs gated SiLU experts with concatenated [gate; up] "
            f"weights, no bias, not transposed, no post-expert norm; {type(module).__name__} "
            f"has hidden_act={act!r}, (has_gate, has_bias, is_transposed, is_concatenated, "
            f"has_post_expert_norm)={layout}")


def check_grouped_experts(model) -> None:
    """A ValueError unless every experts module of `model` is one the grouped op computes."""
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    if not experts:
        raise ValueError(f"{type(model).__name__} has no experts modules (gate_up_proj)")
    for m in experts:
        _check_experts(m)


def use_grouped_experts(model) -> None:
    """Run `model`'s experts (transformers' Qwen3-MoE) as one grouped, token-local op."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    check_grouped_experts(model)
    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)
