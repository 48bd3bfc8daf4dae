"""What one policy-update step of `bench step` times (bench_policy_update.py): the GRPO-style
loss (fused into the LM head or after the logprobs), one step of forward, backward and AdamW
with its allocator and compile events, the AdamW variants, the variants (plain, dualkv, ...)
warmed up and timed interleaved, and one step profiled.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch

from dualkv_compile.tools.step_profile import print_profile

__all__ = ["Variant", "grpo_loss", "grpo_token_loss", "make_adamw", "one_step", "profile_step",
           "run_variants", "set_checkpointing"]


def grpo_loss(lp, mask, p, adv, total_valid=None):
    """GRPO-style loss over these rows' response logprobs lp [B, R], normalised by
    `total_valid` response tokens (default: these rows' own), so micro-batches' losses sum to
    the whole batch's: grpo_token_loss summed over the valid tokens."""
    index = torch.arange(lp.numel(), device=lp.device)  # padding weighs 0; no host sync
    return grpo_token_loss(mask, p, adv, total_valid)(lp.flatten(), index).sum()


def grpo_token_loss(mask, p, adv, total_valid=None):
    """grpo_loss as response_loss's per-token function: at the first step ratio = 1, so
    -adv * exp(lp - lp.detach()) has the gradient -adv; here lp's value is its own detach."""
    valid = mask[:, p:].float()
    total = valid.sum() if total_valid is None else total_valid
    weights = (valid / total).flatten()
    adv_tok = adv[:, None].expand_as(valid).flatten()

    def token_loss(lp, index):
        a = adv_tok[index].to(lp.dtype)
        return (-a * torch.exp(lp - lp.detach()) + 0.04 * lp.pow(2)) * weights[index].to(lp.dtype)

    return token_loss


def set_checkpointing(model, on: bool) -> bool:
    """Only on a change (returned): enabling again installs a new checkpoint function object,
    which fails Dynamo's guards and retraces the optimized model (measured: +1.5 s a step; a
    whole recompile, 2-3 s with Inductor's cache, after switching it off and on again)."""
    if model.is_gradient_checkpointing == on:
        return False
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    return True


_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def _events() -> dict:
    """Allocator events (cudaMalloc retries after freeing the cache, device allocations and
    frees, memory reserved) and Dynamo graphs compiled so far; per step as differences, so a
    slow step shows which of them it paid for."""
    from torch._dynamo.utils import counters

    stats = torch.cuda.memory_stats()
    return {**{k: stats.get(k, 0) for k in _EVENTS},
            "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
            "graphs_compiled": counters["stats"]["unique_graphs"]}


def one_step(model, wrapper, tokens, mask, p, adv, opt, micro_rows=None,
             events: list | None = None, loss: str = "fused") -> tuple[float, float]:
    """(seconds, peak GiB) of one step; `opt` None: forward + backward only (`model` bench).
    `events`: the step's allocator and compile events (see _events) are appended to it.
    `micro_rows`: forward + backward in micro-batches of that many rows with the gradients
    accumulated (the same gradient), as a trainer runs a batch that does not fit at once.
    `loss`: "fused" (response_loss: the LM head's backward in its forward) or "separate"
    (response_logprobs, then the loss)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = _events()
    t0 = time.perf_counter()
    rows = micro_rows or tokens.shape[0]
    total_valid = mask[:, p:].sum()
    for s in range(0, tokens.shape[0], rows):
        sl = slice(s, s + rows)
        if loss == "fused":
            wrapper.response_loss(tokens[sl], prompt_len=p, padding_mask=mask[sl],
                                  token_loss=grpo_token_loss(mask[sl], p, adv[sl], total_valid))[0].backward()
        else:
            lp = wrapper.response_logprobs(tokens[sl], prompt_len=p, padding_mask=mask[sl])
            grpo_loss(lp, mask[sl], p, adv[sl], total_valid).backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    if events is not None:
        after = _events()
        events.append({k: after[k] - before[k] for k in after})
    return sec, torch.cuda.max_memory_allocated() / 2**30


class _CompiledStep:
    """An optimizer whose step() runs under torch.compile (the first call compiles)."""

    def __init__(self, opt):
        self.opt = opt
        self._step = torch.compile(opt.step)

    def step(self):
        self._step()


def make_adamw(params, kind: str):
    """AdamW at lr 1e-6: "fused" (PyTorch's fused CUDA kernel) or "compiled" (foreach step
    compiled by Inductor)."""
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-6, fused=True)
    return _CompiledStep(torch.optim.AdamW(params, lr=1e-6, foreach=True))


class Variant(NamedTuple):
    checkpointing: bool
    wrapper: object
    micro_rows: int | None
    loss: str  # "fused" | "separate", see one_step


def run_variants(variants, model, tokens, mask, p, adv, opt, steps, warmup) -> dict:
    """Warm every variant up (its first step compiles), then time them in interleaved steps
    (plain, dualkv, plain, ...) when both use the same checkpointing, else back to back. A
    variant that runs out of memory is reported as OOM."""
    results, live = {}, []
    for name, v in variants.items():
        set_checkpointing(model, v.checkpointing)
        torch.cuda.empty_cache()
        try:
            warm_events: list = []
            first, _ = one_step(model, v.wrapper, tokens, mask, p, adv, opt, v.micro_rows,
                                warm_events, v.loss)
            for _ in range(warmup - 1):
                one_step(model, v.wrapper, tokens, mask, p, adv, opt, v.micro_rows, warm_events,
                         v.loss)
            results[name] = {"first_step_s": first, "step_ms_all": [], "peak_gib": 0.0,
                             "warmup_events": warm_events, "events_all": []}
            live.append(name)
        except torch.OutOfMemoryError:
            results[name] = {"step_ms": None, "error": "OOM"}
            model.zero_grad(set_to_none=True)
    # interleave only when no toggle is needed: toggling checkpointing retraces the optimized
    # model every step; with differing settings each variant's steps run back to back
    same = len({variants[name].checkpointing for name in live}) <= 1
    order = [name for _ in range(steps) for name in live] if same else \
        [name for name in live for _ in range(steps)]
    for name in order:
        v = variants[name]
        if set_checkpointing(model, v.checkpointing):  # the switch retraces: not timed
            one_step(model, v.wrapper, tokens, mask, p, adv, opt, v.micro_rows, loss=v.loss)
        sec, peak = one_step(model, v.wrapper, tokens, mask, p, adv, opt, v.micro_rows,
                             results[name]["events_all"], v.loss)
        results[name]["step_ms_all"].append(sec * 1e3)
        results[name]["peak_gib"] = max(results[name]["peak_gib"], peak)
    for name in live:
        results[name]["step_ms"] = statistics.median(results[name]["step_ms_all"])
    return results


def profile_step(name, model, v: Variant, tokens, mask, p, adv, opt):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        with record_function("dualkv.step"):
            one_step(model, v.wrapper, tokens, mask, p, adv, opt, v.micro_rows, loss=v.loss)
    print_profile(prof, name, "dualkv.step")
