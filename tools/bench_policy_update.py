"""Policy-update benchmark: one GRPO step (response logprobs forward, backward of the loss,
AdamW step) of a Qwen3-8B-shaped decoder (or, --model qwen3_30b_a3b, the Qwen3-30B-A3B mixture
of experts) with random weights, optimize(model) against the same
model run plainly (PyTorch's SDPA dispatch, which picks cuDNN on an H100). Not a test.

    python -m dualkv_compile.tools.bench_policy_update --out docs/results/policy_update_h100

Both models use transformers' gradient checkpointing by default (--plain-checkpointing /
--dualkv-checkpointing off to compare without); the optimized model's checkpointed layers are
recomputed in its backward except for the shared-prefix attention, whose inputs and outputs are
saved. --memory-budget < 1 instead lets AOTAutograd choose what to recompute. Useful FLOPs count
the packed computation (each prompt once): 6 x params per token for the layers, 12 x D x Hq per
causal pair for attention, 6 x V x d per predicted response token (rl.flops: a token's active
experts only); MFU divides by the bf16
dense peak given by --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import NamedTuple

import torch

import dualkv_compile as dk
from dualkv_compile.attention.registry import KERNELS
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, add_shapes_argument,
                                          environment, parse_ragged_case, positive_float,
                                          positive_int, ragged_only, write_results)
from dualkv_compile.tools.step_inputs import build_model, layouts, useful_flops
from dualkv_compile.tools.step_profile import print_profile

DEFAULT_SHAPES = ["16,4096,1024", "32,8192,1024", "32,2048,512"]
# step_inputs.layouts: a ragged case's aligned twins of up to 8 groups draw make_batch's
# distinct first tokens from vocab - groups - 1 ids, which must exceed groups + 1
MIN_VOCAB = 2 * 8 + 3


def _vocab(text: str) -> int:
    """An argparse type: --vocab, at least MIN_VOCAB."""
    value = positive_int(text)
    if value < MIN_VOCAB:
        raise argparse.ArgumentTypeError(f"{value} must be at least {MIN_VOCAB}")
    return value


def _memory_budget(text: str) -> float:
    """An argparse type: DualKVConfig.activation_memory_budget, in (0, 1] (the config refused
    anything else only after the model was built)."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value



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


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_shapes_argument(ap, DEFAULT_SHAPES)
    # qwen3-8b as `plan` and `inspect` spell it, or qwen3_8b as the committed commands do
    ap.add_argument("--model", type=lambda s: s.replace("-", "_"),
                    choices=["qwen3_8b", "qwen3_30b_a3b"], default="qwen3_8b",
                    help="the decoder's shape: qwen3-8b, or the qwen3-30b-a3b mixture of "
                         "experts (grouped expert op); default qwen3-8b")
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--vocab", type=_vocab, default=151936,
                    help=f"at least {MIN_VOCAB} (default 151936)")
    ap.add_argument("--steps", type=positive_int, default=3, help="timed steps (default 3)")
    ap.add_argument("--warmup", type=positive_int, default=2,
                    help="untimed steps before them, the first compiles (default 2)")
    ap.add_argument("--memory-budget", type=_memory_budget, default=1.0,
                    help="activation_memory_budget of the optimized model, in (0, 1]")
    ap.add_argument("--peak-tflops", type=positive_float, default=989.0,
                    help="bf16 dense peak for MFU (H100 SXM: 989)")
    ap.add_argument("--plain-checkpointing", choices=["on", "off"], default="on",
                    help="transformers gradient checkpointing for the plain model")
    ap.add_argument("--dualkv-checkpointing", choices=["on", "off"], default="on",
                    help="the same transformers gradient checkpointing for the optimized model "
                         "(its layers are inlined and recomputed; attention is saved)")
    ap.add_argument("--plain-micro-batch", type=positive_int, default=None, metavar="ROWS",
                    help="run the plain model's forward + backward in micro-batches of ROWS "
                         "rows with gradient accumulation (same gradient), for shapes whose "
                         "whole replicated batch does not fit; default: all rows at once")
    ap.add_argument("--adamw", choices=["fused", "compiled"], default="fused",
                    help="fused: torch.optim.AdamW(fused=True); compiled: the foreach AdamW "
                         "step under torch.compile (Inductor's fused kernels)")
    ap.add_argument("--no-optimizer", action="store_true",
                    help="time response logprobs forward + backward only, no AdamW step")
    ap.add_argument("--attention-backend", choices=list(KERNELS), default="auto",
                    help="the optimized model's attention kernel")
    ap.add_argument("--loss", choices=["fused", "separate", "both"], default="fused",
                    help="fused: response_loss (the LM head's backward in its forward); "
                         "separate: response_logprobs, then the loss; both: time the optimized "
                         "model both ways (the plain model runs the first)")
    ap.add_argument("--logprob-chunk-size", type=positive_int, nargs="+", default=[4096],
                    metavar="C",
                    help="the optimized model's LM-head chunk (DualKVConfig.logprob_chunk_size); "
                         "several: one optimized variant each, timed interleaved")
    ap.add_argument("--no-plain", action="store_true",
                    help="time only the optimized model (MFU runs; no speed-up)")
    ap.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config settings for the optimized model's compile, "
                         "e.g. max_autotune_gemm=True triton.enable_persistent_tma_matmul=True")
    ap.add_argument("--ragged", type=parse_ragged_case, nargs="+", default=[],
                    metavar="PCAP,RCAP,SEED",
                    help="also time bench_ragged's seeded layout and its aligned twin")
    ap.add_argument("--max-tokens", type=positive_int, default=262144,
                    help="replicated tokens per ragged micro-batch at most")
    add_out_argument(ap)
    ap.add_argument("--profile", action="store_true",
                    help="after the timings, profile one step of each variant at the first "
                         "shape and print the kernels that take the most GPU time")
    args = ap.parse_args(argv)
    ragged_only(ap, args)
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    inductor = _inductor_settings(ap, args.inductor)
    import transformers

    model = build_model(args.layers, args.vocab, args.model)
    opt = None if args.no_optimizer else make_adamw(model.parameters(), args.adamw)
    meta = {**environment(), "transformers": transformers.__version__, "model": args.model,
            "layers": args.layers,
            "vocab": args.vocab, "dtype": "bfloat16", "steps": args.steps,
            "warmup": args.warmup, "memory_budget": args.memory_budget,
            "params": sum(q.numel() for q in model.parameters()),
            "peak_tflops": args.peak_tflops, "plain_checkpointing": args.plain_checkpointing,
            "dualkv_checkpointing": args.dualkv_checkpointing, "optimizer": not args.no_optimizer,
            "adamw": args.adamw,
            "attention_backend": args.attention_backend,
            "plain_micro_batch": args.plain_micro_batch, "loss": args.loss,
            "logprob_chunk_size": args.logprob_chunk_size,
            "inductor": inductor}
    rows = []
    for (n, p_label, r_label), tokens, mask, p in layouts(args):
        tokens, mask, n_rows = tokens.cuda(), mask.cuda(), tokens.shape[0]
        adv = torch.randn(n_rows, generator=torch.Generator().manual_seed(0)).cuda()
        packed = dk.pack(tokens, prompt_len=p, padding_mask=mask)
        row = {"N": n, "P": p_label, "R": r_label, "rho": packed.rho, "T": packed.seq_len,
               "packed_tokens": packed.num_tokens,
               "useful_tflop": useful_flops(model, packed) / 1e12}
        losses = ["fused", "separate"] if args.loss == "both" else [args.loss]
        variants = {} if args.no_plain else {"plain": Variant(
            args.plain_checkpointing == "on", dk.optimize(model, dk.DualKVConfig(enabled=False)),
            args.plain_micro_batch, losses[0])}
        for chunk in args.logprob_chunk_size:
            dualkv = dk.optimize(model, dk.DualKVConfig(
                activation_memory_budget=args.memory_budget,
                attention_backend=args.attention_backend, logprob_chunk_size=chunk))
            for loss in losses:
                name = "dualkv" + ("" if loss == losses[0] else f"_{loss}_loss") + \
                    ("" if chunk == args.logprob_chunk_size[0] else f"_chunk{chunk}")
                variants[name] = Variant(args.dualkv_checkpointing == "on", dualkv, None, loss)
        from torch._inductor import config as inductor_config

        with inductor_config.patch(inductor):
            results = run_variants(variants, model, tokens, mask, p, adv, opt, args.steps,
                                   args.warmup)
        for name, res in results.items():
            if res["step_ms"]:
                res["tokens_per_s"] = int(mask.sum()) / (res["step_ms"] / 1e3)
                res["mfu_useful"] = row["useful_tflop"] / (res["step_ms"] / 1e3) / args.peak_tflops
            row[name] = res
            print(json.dumps({"shape": [n, p_label, r_label], name: res}), flush=True)
        if "plain" in row and row["plain"]["step_ms"] and row["dualkv"]["step_ms"]:
            row["speedup"] = row["plain"]["step_ms"] / row["dualkv"]["step_ms"]
            row["speedup_over_rho"] = row["speedup"] / row["rho"]
        rows.append(row)
        if args.profile and len(rows) == 1:
            for name, v in variants.items():
                set_checkpointing(model, v.checkpointing)
                profile_step(name, model, v, tokens, mask, p, adv, opt)
    write_results(args.out, meta, rows, markdown(meta, rows))


def _inductor_settings(ap, items: list[str]) -> dict:
    """KEY=VALUE strings -> {key: value}, values parsed as Python literals (True, 3, "x") and
    kept as strings otherwise; unknown keys are an error naming them."""
    import ast

    from torch._inductor import config as inductor_config

    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            ap.error(f"--inductor {item!r} is not KEY=VALUE")
        try:
            inductor_config.get_config_copy()[key]
        except KeyError:
            ap.error(f"--inductor: torch._inductor.config has no setting {key!r}")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def profile_step(name, model, v: Variant, tokens, mask, p, adv, opt):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        with record_function("dualkv.step"):
            one_step(model, v.wrapper, tokens, mask, p, adv, opt, v.micro_rows, loss=v.loss)
    print_profile(prof, name, "dualkv.step")


class _NotRun(dict):
    """The plain model's cells under --no-plain."""

    def get(self, key, default=None):
        return "-"


_NOT_RUN = _NotRun(step_ms="-")


def _f(x, spec):
    return "OOM" if x is None else "-" if x == "-" else format(x, spec)


def markdown(meta, rows):
    what = f"response logprobs fwd + bwd + AdamW ({meta.get('adamw', 'fused')})" \
        if meta.get("optimizer", True) else \
        "response logprobs fwd + bwd, no optimizer step"
    what += {"fused": ", the loss fused into the LM head",
             "separate": ", the loss after the logprobs",
             "both": "; the loss fused into the LM head, and separately where named"
             }.get(meta.get("loss"), "")
    shape = {"qwen3_30b_a3b": "Qwen3-30B-A3B-shaped MoE (grouped expert op)"}.get(
        meta.get("model"), "Qwen3-8B-shaped decoder")
    head = (f"GRPO policy update ({what}), {shape} "
            f"with {meta['layers']} layers ({meta['params'] / 1e9:.2f}B params incl. embeddings, "
            f"vocab {meta['vocab']}), bf16, one {meta['gpu']}, torch {meta['torch']}, triton "
            f"{meta['triton']}, transformers {meta['transformers']}; median of {meta['steps']} "
            f"steps after {meta['warmup']} warm-up (interleaved when both sides checkpoint alike). Plain: SDPA, transformers gradient "
            f"checkpointing {meta.get('plain_checkpointing', 'on')}"
            + (f", micro-batches of {meta['plain_micro_batch']} rows with gradient accumulation"
               if meta.get("plain_micro_batch") else "") + ". dualkv: transformers gradient "
            f"checkpointing {meta.get('dualkv_checkpointing', 'off')}, "
            f"activation_memory_budget={meta['memory_budget']}, attention backend "
            f"{meta.get('attention_backend', 'auto')}.\n\n")
    cols = ["N", "P", "R", "rho", "plain ms", "dualkv ms", "speed-up", "speed-up/rho",
            "plain GiB", "dualkv GiB", "plain tok/s", "dualkv tok/s", "plain MFU", "dualkv MFU"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    notes = []
    for r in rows:
        a, b = r.get("plain", _NOT_RUN), r["dualkv"]
        no_ratio = a.get("speedup")  # "-" when the plain model did not run, None (OOM) otherwise
        for name in r:
            if name.startswith("dualkv_") and isinstance(r[name], dict):
                o = r[name]
                notes.append(f"- ({r['N']}, {r['P']}, {r['R']}) {name}: "
                             f"{_f(o['step_ms'], '.0f')} ms, {_f(o.get('peak_gib'), '.1f')} GiB, "
                             f"useful MFU {_f(o.get('mfu_useful'), '.1%')}")
        lines.append("| " + " | ".join([
            str(r["N"]), str(r["P"]), str(r["R"]), f"{r['rho']:.2f}",
            _f(a["step_ms"], ".0f"), _f(b["step_ms"], ".0f"), _f(r.get("speedup", no_ratio), ".2f"),
            _f(r.get("speedup_over_rho", no_ratio), ".2f"), _f(a.get("peak_gib"), ".1f"),
            _f(b.get("peak_gib"), ".1f"), _f(a.get("tokens_per_s"), ".0f"),
            _f(b.get("tokens_per_s"), ".0f"), _f(a.get("mfu_useful"), ".1%"),
            _f(b.get("mfu_useful"), ".1%")]) + " |")
    return head + "\n".join(lines + ([""] + notes if notes else [])) + "\n"


if __name__ == "__main__":
    main()
