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

This module holds the command line and the report; what one step runs and how the variants are
timed is step_timing.py (make_adamw and the rest are imported from there).
"""

from __future__ import annotations

import argparse
import json

import torch

import dualkv_compile as dk
from dualkv_compile.attention.registry import KERNELS
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, add_shapes_argument,
                                          environment, parse_ragged_case, positive_float,
                                          positive_int, ragged_only, save_progress, write_results)
from dualkv_compile.tools.step_inputs import build_model, layouts, useful_flops
from dualkv_compile.tools.step_timing import (Variant, make_adamw, profile_step, run_variants,
                                              set_checkpointing)

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
                    help="also time bench_ragged's seeded layout, a tidy one of as many "
                         "groups and rows at its mean lengths, and that one rounded to the "
                         "nearest whole 128-token blocks (not bench_ragged's twin, which "
                         "rounds each length up)")
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
            "ragged": [list(case) for case in args.ragged], "max_tokens": args.max_tokens,
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
        save_progress(args.out, meta, rows, markdown(meta, rows), echo=False)
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
